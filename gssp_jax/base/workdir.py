"""The run directory: config compatibility on resume, atomic JSON, metric lines, durations.

Shared by the plain training loop and the simulator.
"""

from __future__ import annotations

import json
import time
import os
from typing import Any

import ml_collections

from gssp_jax import defaults

# Keys that may change between a run and its resumption.
_RESUME_MUTABLE = ("train.stop_after_updates", "data_dir", "data_download", "data_url",
                   "train.checkpoint_every", "train.checkpoint_every_seconds",
                   "train.max_checkpoints", "train.log_every",
                   "levels_per_call",   # the levels executor's dispatch size, not its pieces
                   "devices")           # where a piece's jobs run, not what they compute
# Keys added after runs were recorded: a recorded config without one ran as its default does,
# so it still resumes and a sweep does not count its trials as changed.
_ADDED_KEYS = {"executor": "auto", "optimizer.args": "",   # keys added since older runs
               "level_job_slots": 0, "level_job_batch": 0, "data.validation_size": 0,
               "train.virtual_budget": 0.0, "train.eval_every_seconds": 0.0,
               "optimizer.warmup_seconds": 0.0, "cluster.server_capacity": "each",
               "cluster.server_update_time": 0.0, "compress.compute_time": 0.0,
               "train.checkpoint_every_seconds": 0.0,   # such a run saved by count only
               "devices": 1, "cluster.trace_map": "replica",
               "cluster.topology": "", "cluster.regions": [], "cluster.region_bandwidth": [],
               "cluster.region_latency": [], "cluster.uplink_bandwidth": [],
               "cluster.server_region": 0}


def _mutable(key: str) -> bool:
  """Keys that may differ between sessions: the listed ones and the per-process ``dist.*``."""
  return key in _RESUME_MUTABLE or key.startswith("dist.")


def _recorded(old: dict) -> dict:
  """A recorded config's flattened keys, with the defaults of keys added since.

  ``local.*`` (the local-update schemes, 2026-11-26) at its defaults is every earlier run.
  """
  local = flatten(json.loads(defaults.default_config().local.to_json()), "local.")
  cluster = old.get("cluster", {})
  # A trace before cluster.trace_units (2026-12-07) was read in seconds; no trace: the default.
  units = "seconds" if cluster.get("profile") == "trace" else "relative"
  return {**_ADDED_KEYS, "cluster.trace_units": units, **local, **flatten(old)}


def flatten(d: dict, prefix: str = "") -> dict:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a config's JSON as dotted keys."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def check_resumable(config: ml_collections.ConfigDict, path: str) -> None:
  """Refuses to resume a workdir written by a different configuration."""
  with open(path) as f:
    old = _recorded(json.load(f))
  new = flatten(json.loads(config.to_json()))
  diff = sorted((k for k in set(old) | set(new) if not _mutable(k) and old.get(k) != new.get(k)),
                key=lambda k: (k != "sync.scheme", k))   # every key, the scheme first
  if diff:
    details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff)
    raise ValueError(f"workdir {os.path.dirname(path)} holds a run with a different config"
                     f" ({details}); use a new --workdir or the same config to resume")


def config_changes(old: dict, config: ml_collections.ConfigDict) -> list[tuple[str, Any, Any]]:
  """``(key, recorded, new)`` for every flattened key whose value differs between the config a
  run recorded (its ``config.json``) and ``config``; keys that may change on resume left out."""
  old, new = _recorded(old), flatten(json.loads(config.to_json()))
  return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
          if not _mutable(k) and old.get(k) != new.get(k)]


def write_json(path: str, obj, default=None) -> None:
  """Writes ``obj`` to ``path`` atomically (a temporary file renamed over it).

  ``default`` is ``json.dump``'s: what to make of values JSON cannot encode
  (None: they raise).
  """
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True, default=default)
  os.replace(tmp, path)


def restart_metrics(path: str, up_to: int, key: str = "updates") -> list[dict]:
  """Keeps the metric lines with ``line[key] <= up_to`` (the checkpoint's position), drops the
  rest from the file (a resumed run redoes them) and returns the kept lines."""
  lines = []
  if os.path.exists(path):
    with open(path) as f:
      lines = [json.loads(line) for line in f if line.strip()]
  kept = [m for m in lines if m[key] <= up_to]
  with open(path, "w") as f:
    f.writelines(json.dumps(m, sort_keys=True) + "\n" for m in kept)
  return kept


class Eta:
  """A run's time left from its rate of work in this session, compilation left out.

  The session's first report divides by time that includes compiling and loading, which a
  resumed run's short remainder makes large (13 min predicted, 2.5 min taken). So the first
  report of a resumed session uses the rate of the sessions before it (their work over their
  wall time); every later report, the work since the session's first report over the time
  since. A fresh run's first report has nothing better than its own start.

  Args:
    done: the work (updates, pushes, iterations) at the session's start.
    before: ``(work, wall seconds)`` of the sessions before this one (a resume), if any.
    clock: seconds (tests).
  """

  def __init__(self, done: int, before: tuple[float, float] | None = None,
               clock=time.perf_counter):
    self.clock = clock
    self.start = (clock(), done)
    self.before = before if before and before[0] > 0 and before[1] > 0 else None
    self.first: tuple[float, int] | None = None

  def rate(self, done: int) -> float:
    """Work per second (see the class docstring)."""
    now = self.clock()
    if self.first is None:
      self.first = (now, done)
      if self.before is not None:
        return self.before[0] / self.before[1]
      t0, d0 = self.start
    else:
      t0, d0 = self.first
    return (done - d0) / max(now - t0, 1e-9)

  def seconds_left(self, done: int, end: int) -> float:
    return max(end - done, 0) / max(self.rate(done), 1e-9)


def format_duration(seconds: float) -> str:
  seconds = int(seconds)
  h, rem = divmod(seconds, 3600)
  return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
