"""Traces of real jobs as a cluster's iteration times: ``cluster.profile='trace'``.

Two formats, told apart by the file's extension:

* **CSV** (any other extension): one row per iteration, one column per replica, seconds; a
  header row and ``#`` comment lines are skipped.
* **Parquet** (``.parquet``): the per-operation traces of the straggler-analysis format (the
  ByteDance-Seed StragglerAnalysis artifact, Apache-2.0): one row per operation with at least
  the columns ``dp_rank, rank, step, optype, duration``. **The iteration time of data-parallel
  replica d at step k is the largest, over the ranks of that replica, of that rank's summed
  ``forward-compute`` and ``backward-compute`` durations in step k**; the steps are renumbered
  in order (0, 1, ...). A synchronous job's replicas all end a step together, so a replica's own
  pace is in its compute operations, not its step's span; communication, the optimizer and
  garbage collection are left to the simulator's own model.

Then (:func:`worker_times`) the ``[T, R]`` table of T iterations and R replicas becomes the run's
``[T, W]``: worker w is replica w (the first W replicas when W <= R). More workers than replicas
are refused unless ``cluster.trace_map='cycle'``: worker w follows replica ``w mod R``, its
iterations starting ``(w // R) * (T // copies)`` into the trace (cycled), where ``copies =
ceil(W / R)``, so the copies of one replica keep its pace without straggling in lockstep.
By default (``cluster.trace_units='relative'``) the times are divided by the trace's median
iteration time and multiplied by ``cluster.base_time``, so a trace of a large job shapes a small
one; ``'seconds'`` takes them as they are. The cluster model cycles the ``[T, W]`` table.

A relative ``cluster.trace_file`` that is not a file from the current directory is looked up in
the data directory (``config.data_dir``, else ``$GSSP_DATA_DIR``): ``stragglers/trace-AR.parquet``
names the sample trace shipped with the data. Every refusal is one line naming
``config.cluster.trace_file`` and what is wrong with it.
"""

from __future__ import annotations

import csv
import os

import numpy as np

from gssp_jax import checks
from gssp_jax.data import paths

UNITS = ("relative", "seconds")   # cluster.trace_units
MAPS = ("replica", "cycle")       # cluster.trace_map
PARQUET_COLUMNS = ("dp_rank", "rank", "step", "optype", "duration")
COMPUTE_OPS = ("forward-compute", "backward-compute")


def _bad(path: str, what: str, allowed: str) -> None:
  raise ValueError(f"config.cluster.trace_file={path!r} is invalid: {what}; allowed: {allowed}")


def resolve(path: str, data_dir: str = "") -> str:
  """``path`` if it is a file; else, when relative, the data directory's file of that name."""
  if os.path.isfile(path) or not path or os.path.isabs(path):
    return path
  try:
    root = paths.resolve_data_dir(data_dir)
  except paths.DataError:
    return path   # the data directory's own error comes where the data is read
  if root is not None and (root / path).is_file():
    return str(root / path)
  return path


def read_table(path: str) -> np.ndarray:
  """``[T, R]`` iteration times (seconds as recorded) of the trace at ``path``, checked."""
  if not os.path.isfile(path):
    checks.fail("cluster.trace_file", path, "an existing CSV file of per-replica iteration times "
                "or a Parquet trace (.parquet) of per-operation times (a relative path is also "
                "looked up in the data directory: config.data_dir, else $GSSP_DATA_DIR)")
  table = _read_parquet(path) if path.endswith(".parquet") else _read_csv(path)
  if not np.all(np.isfinite(table)) or np.any(table <= 0):
    rows, cols = np.nonzero(~(np.isfinite(table) & (table > 0)))
    _bad(path, f"a non-positive or non-finite iteration time {float(table[rows[0], cols[0]])!r} "
         f"(iteration {rows[0]}, replica {cols[0]})", "positive finite times")
  return table


def _read_csv(path: str) -> np.ndarray:
  with open(path) as f:
    rows = [r for r in csv.reader(f) if r and not r[0].lstrip().startswith("#")]
  try:
    table = np.array([[float(x) for x in r] for r in rows], np.float64)
  except ValueError:
    try:
      table = np.array([[float(x) for x in r] for r in rows[1:]], np.float64)   # a header row
    except ValueError as e:
      _bad(path, f"a value that is not a number ({e})", "a CSV of numbers, one column per replica")
  if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] == 0:
    _bad(path, f"a table of shape {tuple(table.shape)}",
         "a CSV with one row per iteration and the same number of columns (replicas) in each")
  return table


def _read_parquet(path: str) -> np.ndarray:
  import pyarrow as pa   # only a Parquet trace needs it
  import pyarrow.compute as pc
  import pyarrow.parquet as pq
  try:
    names = pq.read_schema(path).names
  except (pa.ArrowInvalid, OSError) as e:
    _bad(path, f"not a Parquet file ({e})", "a Parquet trace of per-operation times")
  missing = [c for c in PARQUET_COLUMNS if c not in names]
  if missing:
    _bad(path, f"missing column(s) {', '.join(missing)}",
         f"a Parquet trace with the columns {', '.join(PARQUET_COLUMNS)}")
  t = pq.read_table(path, columns=list(PARQUET_COLUMNS))
  # A null optype is not in the set (is_in gives False for it, not null).
  compute = pc.is_in(pc.cast(t["optype"], pa.string()), pa.array(COMPUTE_OPS)).to_numpy(
      zero_copy_only=False)
  if not compute.any():
    _bad(path, f"no {' or '.join(COMPUTE_OPS)} rows",
         "a trace with the compute operations of every replica at every step")
  column = lambda name: t[name].to_numpy(zero_copy_only=False)[compute]
  return iteration_times(column("dp_rank"), column("rank"), column("step"),
                         column("duration").astype(np.float64), path)


def iteration_times(replica, rank, step, duration, path: str = "<trace>") -> np.ndarray:
  """``[T, R]``: replica d's time at step k (renumbered), the largest of its ranks' summed
  compute durations in that step (the module's rule), from the compute rows' columns."""
  if not np.all(np.isfinite(duration)) or np.any(duration <= 0):
    bad = duration[~(np.isfinite(duration) & (duration > 0))][0]
    _bad(path, f"a compute operation of non-positive or non-finite duration {float(bad)!r}",
         "positive finite durations")
  steps, k = np.unique(step, return_inverse=True)
  replicas, d = np.unique(replica, return_inverse=True)
  ranks, r = np.unique(rank, return_inverse=True)
  summed = np.zeros([steps.size, replicas.size, ranks.size])
  np.add.at(summed, (k, d, r), duration)
  times = summed.max(axis=2)
  absent = np.argwhere(times == 0)
  if absent.size:
    i, j = absent[0]
    _bad(path, f"replica (dp_rank) {replicas[j]} has no compute rows at step {steps[i]} "
         f"({len(absent)} replica-step pair(s) missing)",
         "every replica's compute operations at every step the trace has")
  return times


def worker_times(table: np.ndarray, num_workers: int, trace_map: str, path: str) -> np.ndarray:
  """``[T, W]`` each worker's iteration times from the ``[T, R]`` replicas' (module's rule)."""
  T, R = table.shape
  if num_workers <= R:
    return table[:, :num_workers].copy()
  if trace_map != "cycle":
    _bad(path, f"{R} replica(s) for num_workers={num_workers}",
         f"num_workers <= {R}, or cluster.trace_map='cycle' (worker w follows replica w mod {R},"
         " started later in the trace for each further copy)")
  copies = -(-num_workers // R)
  shift = T // copies
  return np.stack([np.roll(table[:, w % R], -(w // R) * shift) for w in range(num_workers)], 1)


def scaled(table: np.ndarray, units: str, base_time: float) -> tuple[np.ndarray, float]:
  """The times in seconds and the factor applied: ``base_time / median`` ('relative') or 1."""
  scale = base_time / float(np.median(table)) if units == "relative" else 1.0
  return table * scale, scale


def load(path: str, num_workers: int, *, units: str, trace_map: str, base_time: float,
         data_dir: str = "") -> tuple[np.ndarray, float]:
  """``[T, W]`` seconds a worker's iteration takes, and the scale applied to the trace's times."""
  path = resolve(path, data_dir)
  if units not in UNITS:
    checks.fail("cluster.trace_units", units, ", ".join(map(repr, UNITS)))
  if trace_map not in MAPS:
    checks.fail("cluster.trace_map", trace_map, ", ".join(map(repr, MAPS)))
  table = read_table(path)
  times, scale = scaled(table, units, base_time)
  return worker_times(times, num_workers, trace_map, path), scale
