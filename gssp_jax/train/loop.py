"""``train_and_evaluate(config, workdir)``: the library entry point main.py and notebooks call.

Writes ``metrics.jsonl`` (one line per evaluation), ``summary.json`` and Orbax
checkpoints into ``workdir``; a rerun with the same workdir resumes from the
latest checkpoint and reproduces the uninterrupted run bit for bit (all metrics
but ``wall_time``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np

from gssp_jax import compress
from gssp_jax import config as config_lib
from gssp_jax.data import sharding
from gssp_jax.train import checkpoint as ckpt_lib
from gssp_jax.train import health
from gssp_jax.train import optim
from gssp_jax.train import step as step_lib
from gssp_jax.train import tasks
from gssp_jax.train import workdir as workdir_lib

class _Plan:
  """The update schedule: epochs, evaluation points and chunk boundaries, all in updates."""

  def __init__(self, config, num_train: int):
    self.num_workers = config.num_workers
    self.batch_size = config.batch_size
    self.shards = sharding.worker_shards(num_train, config.num_workers, config.seed)
    self.steps_per_epoch = self.shards.shape[1] // config.batch_size
    self.total = max(1, round(config.train.num_epochs * self.steps_per_epoch))
    self.eval_interval = max(1, round(config.train.eval_every * self.steps_per_epoch))
    self.log_every = config.train.log_every
    stop = config.train.stop_after_updates
    self.end = min(self.total, stop) if stop else self.total

  def next_boundary(self, u: int) -> int:
    epoch_end = (u // self.steps_per_epoch + 1) * self.steps_per_epoch
    next_eval = (u // self.eval_interval + 1) * self.eval_interval
    next_log = (u // self.log_every + 1) * self.log_every
    return min(epoch_end, next_eval, next_log, self.end)

  def is_eval_point(self, u: int) -> bool:
    return u % self.eval_interval == 0 or u == self.total


def make_compressor(config: ml_collections.ConfigDict):
  """The workers' gradient compressor named by ``config.compress`` (None for ``none``)."""
  c = config.compress
  kwargs = {
      "topk": dict(ratio=c.ratio, scope=c.scope, error_feedback=c.error_feedback),
      "dgc": dict(ratio=c.ratio, sample_ratio=c.sample_ratio, error_feedback=c.error_feedback,
                  seed=config.seed),
      "gdtopk": dict(scope=c.scope, error_feedback=c.error_feedback),
  }.get(c.name, {})
  return compress.make_compressor(c.name, config.num_workers, **kwargs)


def prepare_run(config: ml_collections.ConfigDict, workdir: str):
  """Checks a workdir can hold this run (same config if resuming), builds the task, records the config."""
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, "config.json")
  if os.path.exists(config_path):
    workdir_lib.check_resumable(config, config_path)
  task = tasks.make_task(config)
  config_lib.validate_sizes(config, task.num_train)
  workdir_lib.write_json(config_path, json.loads(config.to_json()))
  return task


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it holds a checkpoint); returns the summary."""
  config_lib.validate_config(config)
  if config_lib.uses_simulator(config):
    from gssp_jax.sim import simulate  # pylint: disable=g-import-not-at-top
    return simulate.simulate_and_evaluate(config, workdir)
  task = prepare_run(config, workdir)
  plan = _Plan(config, task.num_train)
  tx = optim.make_optimizer(config.optimizer, plan.steps_per_epoch, plan.total)
  compressor = make_compressor(config)
  state = step_lib.init_train_state(task, tx, config.seed, compressor)
  # Every round each worker pulls the parameters and the BatchNorm statistics.
  pull_payload = step_lib.tree_bytes(state.params) + step_lib.tree_bytes(state.model_state)
  logging.info("%s on %s: %d params, %d workers x batch %d, %d updates/epoch, %d updates",
               config.model, config.dataset, sum(x.size for x in jax.tree.leaves(state.params)),
               plan.num_workers, plan.batch_size, plan.steps_per_epoch, plan.total)

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       config.train.max_checkpoints)
  meta = {"wall_time": 0.0, "loss_sum": 0.0, "loss_steps": 0, "num_evals": 0, "bytes_pushed": 0}
  latest = checkpointer.latest_step()
  if latest is not None:
    state, meta = checkpointer.restore(latest, state)
    state = jax.device_put(state)
    logging.info("resumed from the checkpoint at update %d", latest)
  updates = int(state.step)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  history = workdir_lib.restart_metrics(metrics_path, updates)

  run_chunk = step_lib.make_chunk_runner(
      step_lib.make_bsp_step(task.loss, tx, plan.num_workers, compressor), plan.batch_size)
  arrays = jax.device_put(task.train)
  metric_name = "bleu" if isinstance(task, tasks.TranslationTask) else "test_accuracy"
  target = config.train.target_bleu if metric_name == "bleu" else config.train.target_accuracy
  order_epoch, order = -1, None
  session_start, session_updates = time.perf_counter(), 0
  wall_base = meta["wall_time"]
  status = "failed"  # until the loop says otherwise; the summary records why a run ended

  def save(u):
    meta["wall_time"] = wall_base + time.perf_counter() - session_start
    checkpointer.save(u, state, meta)

  try:
    while updates < plan.end:
      epoch = updates // plan.steps_per_epoch
      if epoch != order_epoch:
        order = jax.device_put(sharding.epoch_order(plan.shards, config.seed, epoch))
        order_epoch = epoch
      n = plan.next_boundary(updates) - updates
      state, metrics = run_chunk(state, arrays, order, updates - epoch * plan.steps_per_epoch, n)
      losses = np.asarray(metrics["loss"], np.float64)
      if not np.all(np.isfinite(losses)):
        status = "diverged"
        raise FloatingPointError(
            f"non-finite training loss in updates {updates + 1}..{updates + n} (epoch"
            f" {epoch}); the run stopped. Lower optimizer.learning_rate"
            f" ({config.optimizer.learning_rate}) or set optimizer.grad_clip")
      updates += n
      session_updates += n
      for value in losses:  # one at a time, so the sum does not depend on chunking
        meta["loss_sum"] += float(value)
      meta["loss_steps"] += n
      meta["bytes_pushed"] += int(np.asarray(metrics["push_bytes"], np.int64).sum())
      loss = float(losses.mean())
      elapsed = time.perf_counter() - session_start
      rate = session_updates / max(elapsed, 1e-9)
      eta = (plan.end - updates) / max(rate, 1e-9)
      line = (f"update {updates}/{plan.total} (epoch {updates / plan.steps_per_epoch:.2f})"
              f" loss {loss:.4f} | {rate * plan.num_workers * plan.batch_size:.0f} samples/s"
              f" | ETA {workdir_lib.format_duration(eta)}")
      if plan.is_eval_point(updates):
        results = task.evaluate(state.params, state.model_state)
        record = {
            "epoch": updates / plan.steps_per_epoch,
            "updates": updates,
            "virtual_time": None,  # comes with the cluster simulator
            "wall_time": wall_base + time.perf_counter() - session_start,
            "train_loss": meta["loss_sum"] / meta["loss_steps"],
            **results,
            **_traffic(updates, plan, meta, pull_payload),
            "blocked_time": None,  # comes with the cluster simulator
            "staleness": {"mean": 0.0, "max": 0},  # BSP applies only fresh gradients
        }
        meta["loss_sum"], meta["loss_steps"] = 0.0, 0
        meta["num_evals"] += 1
        with open(metrics_path, "a") as f:
          f.write(json.dumps(record, sort_keys=True) + "\n")
        history.append(record)
        line += f" | {metric_name} {results[metric_name]:.4f}"
        if meta["num_evals"] % config.train.checkpoint_every == 0:
          save(updates)
      logging.info(line)
    status = "done" if updates == plan.total else "stopped"
    save(updates)
  except KeyboardInterrupt:
    status = "interrupted"  # rerun the same command to resume from the last checkpoint
    raise
  finally:
    checkpointer.close()
    summary = _summary(config, history, status, metric_name, target,
                       wall_base + time.perf_counter() - session_start, updates, plan,
                       _traffic(updates, plan, meta, pull_payload))
    workdir_lib.write_json(os.path.join(workdir, "summary.json"), summary)
  return summary


def _traffic(updates: int, plan: _Plan, meta: dict, pull_payload: int) -> dict[str, int]:
  """Exact bytes so far: pushes as the workers sent them; every worker pulls every round."""
  return {"bytes_pushed": meta["bytes_pushed"],
          "bytes_pulled": updates * plan.num_workers * pull_payload}


def _summary(config, history, status, metric_name, target, wall_time, updates, plan,
             traffic) -> dict[str, Any]:
  reached = next((m for m in history if target and m.get(metric_name, 0) >= target), None)
  status, collapse = health.judge(status, history, config, metric_name)
  return {
      "config": json.loads(config.to_json()),
      "status": status,
      "collapse_reason": collapse,
      "final": history[-1] if history else None,
      "metric": metric_name,
      "target": target or None,
      "time_to_target": None,  # virtual seconds: comes with the cluster simulator
      "wall_time_to_target": reached["wall_time"] if reached else None,
      "updates_to_target": reached["updates"] if reached else None,
      "epochs_to_target": reached["epoch"] if reached else None,
      "totals": {
          "updates": updates,
          "samples": updates * plan.num_workers * plan.batch_size,
          "wall_time": wall_time,
          **traffic,
      },
  }
