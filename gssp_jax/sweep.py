"""Ablation sweeps declared in config files, and a resumable runner.

A sweep file (``configs/sweeps/<name>.py``) defines ``get_config()`` (the base
config) and ``get_sweep()`` (the trials, built with :func:`sweep`,
:func:`product` and :func:`zipped`)::

    def get_sweep():
      return product(sweep("sync.scheme", ["bsp", "gssp"]), sweep("seed", [0, 1]))

Every trial is the base config with its overrides; each runs in its own
workdir under the sweep's workdir, so a rerun skips finished trials
(``done``, ``diverged``), retries the others (``failed``, ``interrupted``,
``stopped``) and resumes a trial from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import logging as std_logging
import os
import re
import subprocess
import sys
import time
import traceback
from typing import Any, Sequence

from absl import logging
import ml_collections

from gssp_jax import config as config_lib

FINISHED = ("done", "diverged")


def sweep(key: str, values: Sequence[Any]) -> list[dict]:
  """One axis: ``[{key: v} for v in values]``."""
  if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
    raise ValueError(f"sweep {key!r}: values={values!r} is invalid; allowed: a list of values")
  return [{key: v} for v in values]


def product(*axes: list[dict]) -> list[dict]:
  """Every combination of the axes (the first varies slowest)."""
  return [dict(itertools.chain.from_iterable(d.items() for d in combo))
          for combo in itertools.product(*axes)]


def zipped(*axes: list[dict]) -> list[dict]:
  """Axes taken together element by element; they must have the same length."""
  lengths = {len(a) for a in axes}
  if len(lengths) > 1:
    raise ValueError(f"zipped axes have different lengths {sorted(lengths)}; allowed: equal")
  return [dict(itertools.chain.from_iterable(d.items() for d in combo)) for combo in zip(*axes)]


@dataclasses.dataclass(frozen=True)
class Trial:
  name: str
  overrides: dict
  config: ml_collections.ConfigDict


def trial_name(overrides: dict) -> str:
  """A readable, filesystem-safe name from the overrides, e.g. ``sync.scheme=gssp,seed=1``."""
  parts = [f"{k}={v}" for k, v in overrides.items()]
  return re.sub(r"[^A-Za-z0-9_.=,+-]", "", ",".join(parts).replace(" ", "")) or "base"


def load_sweep(path: str):
  if not os.path.exists(path):
    raise ValueError(f"sweep file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location("gssp_sweep_" + trial_name({"p": path}), path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for fn in ("get_config", "get_sweep"):
    if not hasattr(module, fn):
      raise ValueError(f"sweep file {path} defines no {fn}(); a sweep file defines get_config() "
                       "(the base config) and get_sweep() (the trials)")
  return module


def expand(path: str) -> list[Trial]:
  """The sweep's trials, each config built and validated (nothing runs or compiles).

  Raises:
    ValueError: an empty grid, an unknown key, a value of the wrong type or an
      invalid value, naming the key; two trials with the same overrides.
  """
  module = load_sweep(path)
  grid = module.get_sweep()
  if not grid:
    raise ValueError(f"sweep file {path}: get_sweep() returned an empty grid; allowed: at least "
                     "one trial")
  trials, names = [], set()
  for overrides in grid:
    config = module.get_config()
    for key, value in overrides.items():
      try:
        config_lib.override(config, {key: value})
      except KeyError as e:
        raise ValueError(f"sweep file {path}: key {key!r} is not a config key ({e})") from None
      except TypeError as e:
        raise ValueError(f"sweep file {path}: {key}={value!r} has the wrong type: {e}") from None
    try:
      config_lib.validate_config(config)
    except ValueError as e:
      raise ValueError(f"sweep file {path}, trial {overrides}: {e}") from None
    name = trial_name(overrides)
    if name in names:
      raise ValueError(f"sweep file {path}: trial {overrides} appears twice")
    names.add(name)
    trials.append(Trial(name, dict(overrides), config))
  return trials


def trial_status(trial_dir: str) -> str | None:
  """``done``/``diverged``/``failed``/… from the trial's summary, or None if it never ran."""
  path = os.path.join(trial_dir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f).get("status")


def _record(trial_dir: str, trial: Trial, status: str, error: str | None, attempts: int):
  os.makedirs(trial_dir, exist_ok=True)
  tmp = os.path.join(trial_dir, "trial.json.tmp")
  with open(tmp, "w") as f:
    json.dump({"name": trial.name, "overrides": trial.overrides, "status": status,
               "error": error, "attempts": attempts}, f, indent=2, sort_keys=True, default=str)
  os.replace(tmp, os.path.join(trial_dir, "trial.json"))


def _attempts(trial_dir: str) -> int:
  path = os.path.join(trial_dir, "trial.json")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return int(json.load(f).get("attempts", 0))


def run_trial(trial: Trial, workdir: str) -> str:
  """Runs one trial in this process; records its status (and the error) in ``trial.json``."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top (heavy)
  trial_dir = os.path.join(workdir, trial.name)
  attempts = _attempts(trial_dir) + 1
  _record(trial_dir, trial, "running", None, attempts)
  # The trial's log goes to its workdir as well as to the console.
  handler = std_logging.FileHandler(os.path.join(trial_dir, "log.txt"))
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
  absl_logger = logging.get_absl_logger()
  absl_logger.addHandler(handler)
  old_level = absl_logger.level
  absl_logger.setLevel(min(old_level or std_logging.INFO, std_logging.INFO))
  try:
    summary = loop.train_and_evaluate(trial.config, trial_dir)
    status, error = summary["status"], None
  except KeyboardInterrupt:
    _record(trial_dir, trial, "interrupted", None, attempts)
    raise
  except Exception as e:  # pylint: disable=broad-except  (recorded, the sweep goes on)
    status = "diverged" if isinstance(e, FloatingPointError) else "failed"
    error = "".join(traceback.format_exception_only(type(e), e)).strip()
    logging.error("trial %s %s: %s", trial.name, status, error)
  finally:
    absl_logger.removeHandler(handler)
    absl_logger.setLevel(old_level)
    handler.close()
  _record(trial_dir, trial, status, error, attempts)
  return status


def run_sweep(path: str, workdir: str, *, parallel: int = 1,
              max_trials: int = 0) -> dict[str, str]:
  """Runs every unfinished trial of the sweep ``path``; returns each trial's status.

  Args:
    path: the sweep file.
    workdir: one subdirectory per trial lands here.
    parallel: trials run at once (each in its own process when > 1).
    max_trials: stop after starting this many trials (0: all); a rerun goes on.
  """
  trials = expand(path)
  os.makedirs(workdir, exist_ok=True)
  statuses = {t.name: trial_status(os.path.join(workdir, t.name)) for t in trials}
  todo = [t for t in trials if statuses[t.name] not in FINISHED]
  if max_trials:
    todo = todo[:max_trials]
  logging.info("sweep %s: %d trials, %d finished, %d to run", path, len(trials),
               sum(s in FINISHED for s in statuses.values()), len(todo))
  start = time.perf_counter()
  done_here = 0

  def progress(trial, status):
    nonlocal done_here
    done_here += 1
    statuses[trial.name] = status
    finished = sum(s in FINISHED for s in statuses.values())
    rate = (time.perf_counter() - start) / done_here
    summary = os.path.join(workdir, trial.name, "summary.json")
    final = {}
    if os.path.exists(summary):
      with open(summary) as f:
        final = json.load(f).get("final") or {}
    metric = next((f"{k} {final[k]:.4f}" for k in ("test_accuracy", "bleu") if k in final), "")
    logging.info("[%d/%d finished] %s: %s %s | ETA %.0f s", finished, len(trials), trial.name,
                 status, metric, rate * (len(todo) - done_here))

  if parallel <= 1:
    for trial in todo:
      progress(trial, run_trial(trial, workdir))
    return statuses
  running: list = []
  queue = list(todo)
  try:
    while queue or running:
      while queue and len(running) < parallel:
        trial = queue.pop(0)
        os.makedirs(os.path.join(workdir, trial.name), exist_ok=True)
        log = open(os.path.join(workdir, trial.name, "stdout.txt"), "a")
        cmd = [sys.executable, "-m", "experiments.sweep", f"--sweep={path}",
               f"--workdir={workdir}", f"--only={trial.name}"]
        running.append((trial, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
      time.sleep(0.5)
      for item in list(running):
        trial, proc, log = item
        if proc.poll() is not None:
          log.close()
          running.remove(item)
          progress(trial, trial_status(os.path.join(workdir, trial.name)) or "failed")
  finally:
    for _, proc, log in running:   # interrupted: stop the children; their checkpoints stay
      proc.terminate()
      proc.wait(timeout=60)
      log.close()
  return statuses
