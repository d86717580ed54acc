"""``train_and_evaluate(config, workdir)``: THE training loop, for every scheme and executor.

Writes ``metrics.jsonl`` (one line per evaluation), ``summary.json`` and Orbax
checkpoints into ``workdir``; a rerun with the same workdir resumes from the
latest checkpoint and reproduces the uninterrupted run bit for bit (all metrics
but ``wall_time``). The executor (``executors.py``) is picked by
``config.executor``; the loop only reads as its steps: build the run, advance
to the next evaluation, evaluate, write the metrics, checkpoint when due
(``should_checkpoint``: by wall time and by evaluation count; always at the end
and on a signal).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Collection

from absl import logging
import ml_collections

from gssp_jax import config as config_lib
from gssp_jax.sim import hosts
from gssp_jax.sync import legs
from gssp_jax.base import environment
from gssp_jax import executors as executors_lib
from gssp_jax.base import health
from gssp_jax.base import interrupt
from gssp_jax.train import observe
from gssp_jax.base import run as run_lib
from gssp_jax.base import workdir as workdir_lib

# Re-exported: callers (tests, notebooks) used them from here.
make_compressor = run_lib.make_compressor
prepare_run = run_lib.prepare_run


def build_run(config: ml_collections.ConfigDict, workdir: str, *,
              allow_unread: Collection[str] = ()) -> executors_lib.Executor:
  """Validates ``config``, checks the workdir, builds the task and the executor the config picks.

  ``allow_unread``: see ``config.validate_config`` (a sweep's base-config keys).
  """
  config_lib.ensure_valid(config, allow_unread=allow_unread)
  return _build_valid_run(config, workdir)


def _build_valid_run(config: ml_collections.ConfigDict, workdir: str) -> executors_lib.Executor:
  """``build_run`` of a config validated already (``train_and_evaluate`` checked it)."""
  task = run_lib.prepare_run(config, workdir)
  return executors_lib.make_executor(config, task, workdir)


def should_checkpoint(evaluations: int, every: int, seconds_since_save: float,
                      every_seconds: float) -> bool:
  """Whether the loop saves after its ``evaluations``-th evaluation (the end and signals always do).

  Args:
    evaluations: evaluations so far, this one included (counted across resumes).
    every: ``train.checkpoint_every``: save at its multiples (0 = not by count).
    seconds_since_save: wall seconds since the last save, or since the session started.
    every_seconds: ``train.checkpoint_every_seconds``: save once this many have passed (0 = not
      by time).
  """
  by_count = every > 0 and evaluations % every == 0
  by_time = every_seconds > 0 and seconds_since_save >= every_seconds
  return by_count or by_time


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       allow_unread: Collection[str] = (), progress: bool = True,
                       clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds a checkpoint); returns the summary.

  Progress lines (one per evaluation, with the metric and an ETA) are logged,
  appended to ``workdir/log.txt`` and written as TensorBoard scalars to
  ``workdir/tensorboard`` (``train/observe.py``); from a notebook or a script
  they are printed too. ``load_trained(workdir)`` gives the trained model back.

  Across processes (``jax.distributed``, ``sim/hosts.py``) every process calls it with the
  same arguments; process ``i`` > 0 writes its copy to ``workdir/process_<i>``.

  Args:
    config: the run's config (``config.ensure_valid`` checks it first, unless this process
      accepted it already).
    workdir: where metrics, summary, logs and checkpoints go.
    allow_unread: sync keys a sweep's base config sets for its other trials
      (``config.validate_config``); empty for a single run.
    progress: False keeps the console quiet (``log.txt`` is written anyway).
    clock: wall seconds, for ``train.checkpoint_every_seconds`` (tests pass their own).
  """
  config_lib.ensure_valid(config, allow_unread=allow_unread)   # no workdir for a bad config
  workdir = hosts.process_workdir(workdir)
  with observe.run_output(workdir, progress), interrupt.deferred():
    return _train_and_evaluate(config, workdir, clock)


def _train_and_evaluate(config, workdir, clock) -> dict[str, Any]:
  env = environment.describe()
  logging.info(environment.one_line(env))
  executor = _build_valid_run(config, workdir)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  position = executor.restore()
  history = workdir_lib.restart_metrics(metrics_path, position, key=executor.position_key)
  board = observe.MetricWriter(workdir, executor.position_key, history)
  every_seconds = config.train.get("checkpoint_every_seconds", 0.0)   # absent: recorded before it
  saved_at = clock()   # the session's start: what it restored is on disk
  status = "failed"  # until the loop says otherwise; the summary records why a run ended
  # Across processes, a signal or a save any process's clock asks for is every process's, at
  # an evaluation (hosts.agree_any: one process alone would leave the others in a collective).
  stop = lambda: hosts.agree_any(bool(interrupt.requested()))
  try:
    while not executor.finished() and not stop():
      if not executor.advance():
        continue   # stopped between evaluations (train.stop_after_updates, or a signal)
      record = executor.evaluate()
      _append_metrics(metrics_path, record)
      board.write(record)
      history.append(record)
      logging.info(executor.progress(record))
      if hosts.agree_any(should_checkpoint(executor.evaluations, config.train.checkpoint_every,
                                           clock() - saved_at, every_seconds)):
        executor.save()
        saved_at = clock()
    executor.save()
    if not executor.finished() and stop():   # else the signal came as it ended
      _interrupted(executor, workdir, interrupt.requested() or "another process's signal")
    status = "done" if executor.completed() else "stopped"
  except KeyboardInterrupt:
    status = "interrupted"  # rerun the same command to resume from the last checkpoint
    raise
  except FloatingPointError:
    status = "diverged"
    raise
  finally:
    executor.close()
    board.close()
    summary = {**summarize(config, history, status, executor), "environment": env}
    workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
    if "bytes_by_class" in summary.get("totals", {}):
      logging.info(legs.traffic_line(summary["totals"]))
  return summary


def _interrupted(executor, workdir: str, signal_name: str) -> None:
  """Logs where the run stopped and how to resume (into ``log.txt`` too), then raises."""
  logging.warning("interrupted by %s at %s %d; a checkpoint was saved there. To resume, run the"
                  " same command again with --workdir=%s (train_and_evaluate: the same workdir)",
                  signal_name, executor.position_key, executor.position, workdir)
  raise interrupt.Interrupted(signal_name, os.path.join(workdir, "checkpoints"),
                              f"{executor.position_key} {executor.position}")


def _append_metrics(path: str, record: dict[str, Any]) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")


def summarize(config: ml_collections.ConfigDict, history: list[dict], status: str,
              executor) -> dict[str, Any]:
  """``summary.json``: the config, the judged status, the final metrics, time to target, totals."""
  metric, target = executor.metric_name, executor.target
  reached = next((m for m in history if target and m.get(metric, 0) >= target), None)
  status, collapse = health.judge(status, history, config, metric)
  fields = executor.summary_fields(history, reached)
  warnings = health.learning_warnings(history, metric=metric,
                                      num_classes=health.num_classes(config),
                                      updates=fields.get("totals", {}).get("updates"))
  for warning in warnings:
    logging.warning("this run did not learn: %s", warning)
  return {
      "config": json.loads(config.to_json()),
      "status": status,
      "collapse_reason": collapse,
      "warnings": warnings,
      "final": history[-1] if history else None,
      "metric": metric,
      "target": target or None,
      "wall_time_to_target": reached["wall_time"] if reached else None,
      "epochs_to_target": reached["epoch"] if reached else None,
      **fields,
  }
