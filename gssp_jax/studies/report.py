"""A sweep's results: one row per trial, speedups against BSP, mean ± std over seeds, plots.

Numbers are read from each trial's ``summary.json`` and ``metrics.jsonl``; the
only figure derived here is the time to target, from the recorded evaluations
with the same function the runs use (``gssp_jax.base.health.time_to``:
interpolated linearly between the last evaluation below the target and the
first at or above it), so old and new runs are measured alike.

A trial is identified by its overrides: a sweep's ``trial.json`` records them;
for plain runs gathered under one directory (no ``trial.json``) they are the
config keys whose values differ between the runs, read from each
``summary.json``. Runs that differ only in ``seed`` are seeds of one setting.
Where the sweep runner recorded its current grid (``sweep.json``), only that
grid's trials are reported; other trial directories (left from an older grid)
are orphans, listed but left out.

Fairness: a ``collapsed`` or ``diverged`` trial never counts as reaching the
target; speedups are per seed (against BSP with the same seed and other swept
values) and summarised by their median and min–max over seeds; in a sweep with
tuned keys (``gssp_jax.studies.sweep.tune``) every configuration is reported at its
best tuned value (:func:`select_tuned`), disclosed in ``report.md``.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from typing import Any

from gssp_jax import defaults
from gssp_jax.studies import report_figures
from gssp_jax.sync import legs as legs_lib
from gssp_jax.studies.report_labels import column_order as _column_order
from gssp_jax.studies.report_labels import context as _context
from gssp_jax.studies.report_labels import label
from gssp_jax.studies.report_labels import short_labels  # noqa: F401  (re-exported)
from gssp_jax.studies.sweep import GRID_FILE
from gssp_jax.base import health
from gssp_jax.base import workdir as workdir_lib

UNHEALTHY = ("collapsed", "diverged")   # never count as reaching the target
# Keys that say where data comes from or how a run is checkpointed and logged, not what it
# computes: two runs differing only in them are the same setting.
_BOOKKEEPING_KEYS = ("data_dir", "data_download", "data_url", "train.checkpoint_every",
                     "train.checkpoint_every_seconds", "train.max_checkpoints",
                     "train.log_every", "train.stop_after_updates")


def _grid_record(workdir: str) -> dict | None:
  """The sweep's ``sweep.json`` (its current grid), or None without one."""
  path = os.path.join(workdir, GRID_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def grid(workdir: str) -> list[str] | None:
  """The trial names of the sweep's current grid (``sweep.json``), or None without one."""
  record = _grid_record(workdir)
  return None if record is None else [t["name"] for t in record["trials"]]


def ladders(workdir: str) -> dict[str, list]:
  """The tuned keys' ladders the sweep declared (``sweep.json``; ``gssp_jax.studies.grid_edge``)."""
  return dict((_grid_record(workdir) or {}).get("ladders", {}))


def extended(workdir: str) -> list[str]:
  """The trials of the current grid the grid-edge rule added (``sweep.json``)."""
  return [t["name"] for t in (_grid_record(workdir) or {}).get("trials", []) if t.get("extended")]


def tune_seeds(workdir: str) -> tuple[int, ...] | None:
  """The seeds the sweep declared for choosing tuned values (``sweep.json``), or None: all."""
  seeds = (_grid_record(workdir) or {}).get("tune_seeds")
  return None if seeds is None else tuple(int(s) for s in seeds)


def report_seeds(workdir: str) -> tuple[int, ...] | None:
  """The seeds the sweep kept apart for reporting (``sweep.json``; ``sweep.report_on``), or
  None."""
  seeds = (_grid_record(workdir) or {}).get("report_seeds")
  return None if seeds is None else tuple(int(s) for s in seeds)


UNFINISHED = ("interrupted", "failed", "running")   # a summary of part of a run


def unfinished(workdir: str) -> list[str]:
  """The grid's trials whose summary says they did not end (left out of the report)."""
  names = grid(workdir)
  names = sorted(os.listdir(workdir)) if names is None else names
  out = []
  for name in names:
    path = os.path.join(workdir, name, "summary.json")
    if os.path.exists(path):
      with open(path) as f:
        if json.load(f).get("status") in UNFINISHED:
          out.append(name)
  return out


def orphans(workdir: str) -> list[str]:
  """Trial directories (with a ``summary.json`` or ``trial.json``) not in the current grid."""
  names = grid(workdir)
  if names is None or not os.path.isdir(workdir):
    return []
  return [n for n in sorted(os.listdir(workdir)) if n not in names
          and any(os.path.exists(os.path.join(workdir, n, f)) for f in ("summary.json", "trial.json"))]


def differing_keys(configs: list[dict]) -> list[str]:
  """The flattened config keys whose values differ between ``configs``, in config order.

  Bookkeeping keys (data location, checkpoint and log cadence) are left out;
  ``seed`` is kept, so that a caller can tell seeds of one setting apart.
  """
  flat = [workdir_lib.flatten(c) for c in configs]
  keys = dict.fromkeys(k for f in flat for k in f)
  return [k for k in keys if k not in _BOOKKEEPING_KEYS
          and len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]


def _derive_overrides(trials: list[dict]) -> None:
  """Gives each trial without a ``trial.json`` the config values that tell it from the others."""
  plain = [t for t in trials if not t["from_sweep"]]
  if not plain:
    return
  keys = differing_keys([t["summary"]["config"] for t in trials])
  for t in plain:
    flat = workdir_lib.flatten(t["summary"]["config"])
    t["overrides"] = {k: flat.get(k) for k in keys}


def _load(trial_dir: str) -> dict | None:
  summary_path = os.path.join(trial_dir, "summary.json")
  if not os.path.exists(summary_path):
    return None
  with open(summary_path) as f:
    summary = json.load(f)
  overrides, tuned = {}, []
  trial_path = os.path.join(trial_dir, "trial.json")
  from_sweep = os.path.exists(trial_path)
  if from_sweep:
    with open(trial_path) as f:
      record = json.load(f)
    overrides, tuned = record["overrides"], record.get("tuned", [])
  metrics = []
  metrics_path = os.path.join(trial_dir, "metrics.jsonl")
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
  return {"name": os.path.basename(trial_dir), "overrides": overrides, "summary": summary,
          "metrics": metrics, "from_sweep": from_sweep, "tuned": tuned}


def time_to(metrics: list[dict], metric: str, target: float, *,
            interpolate: bool = True) -> float | None:
  """Virtual time at which ``metric`` reaches ``target`` (None if never): interpolated linearly
  between the last evaluation below it and the first at or above it, or (``interpolate=False``)
  the first evaluation's time."""
  return health.time_to(metrics, metric, target, interpolate=interpolate)


def _times_to_target(trial: dict, metric: str, target: float | None) -> tuple:
  """(interpolated, first evaluation) virtual times to ``target``; None for an unhealthy run."""
  s = trial["summary"]
  if s["status"] in UNHEALTHY:
    return None, None
  if not any(m.get("virtual_time") is not None for m in trial["metrics"]):
    return s.get("time_to_target"), s.get("time_to_target_first_eval", s.get("time_to_target"))
  return (time_to(trial["metrics"], metric, target),
          time_to(trial["metrics"], metric, target, interpolate=False))


def _held_out_time(trial: dict, held_out: str, target: float | None) -> float | None:
  """Virtual time for the validation set (``data.validation_size``) to reach ``target``: None
  for an unhealthy run, a run that scored none, or one without virtual time."""
  metrics = trial["metrics"]
  if (trial["summary"]["status"] in UNHEALTHY or not target
      or not any(held_out in m and m.get("virtual_time") is not None for m in metrics)):
    return None
  return time_to(metrics, held_out, target)


def collect(workdir: str, target: float | None = None) -> list[dict[str, Any]]:
  """One row per trial that wrote a summary: swept values and the recorded figures.

  With a ``sweep.json`` (the runner's current grid) only that grid's trials count
  (see :func:`orphans`). A trial that did not end (``interrupted``, ``failed``: its
  summary is of the epochs it ran) is left out (:func:`unfinished` names them): its
  figures are not the configuration's.

  Args:
    workdir: the sweep's directory.
    target: if given, time to target is recomputed from each trial's recorded
      evaluations for this target instead of the run's own ``train.target_*``.
  """
  if target is not None and not (isinstance(target, (int, float)) and target > 0):
    raise ValueError(f"target={target!r} is invalid; allowed: a number > 0 (an accuracy in "
                     "(0, 1] or a BLEU score)")
  if not os.path.isdir(workdir):
    raise ValueError(f"sweep directory {workdir!r} does not exist")
  names = grid(workdir)
  names = sorted(os.listdir(workdir)) if names is None else names
  trials = [t for t in (_load(os.path.join(workdir, name)) for name in names) if t is not None
            and t["summary"].get("status") not in UNFINISHED]
  _derive_overrides(trials)
  rows = []
  for trial in trials:
    s = trial["summary"]
    final = s.get("final") or {}
    totals = s.get("totals", {})
    cluster = s.get("cluster") or {}   # as the run described it (summary.json)
    metric = s.get("metric", "test_accuracy")
    row_target = target if target is not None else s.get("target")
    ttt, ttt_first = _times_to_target(trial, metric, row_target)
    held_out = defaults.validation_metric(metric)
    rows.append({
        "trial": trial["name"], **{k: v for k, v in trial["overrides"].items()},
        "scheme": s["config"]["sync"]["scheme"], "seed": s["config"]["seed"],
        "status": s["status"], "collapse_reason": s.get("collapse_reason"),
        "metric": metric, "final": final.get(metric), "target": row_target,
        "time_to_target": ttt, "time_to_target_first_eval": ttt_first,
        "val_final": final.get(held_out),
        "val_time_to_target": _held_out_time(trial, held_out, row_target),
        "virtual_time": totals.get("virtual_time"),
        "bytes_pushed": totals.get("bytes_pushed"),
        "bytes_total": _bytes_total(totals),
        "_bytes_by_class": totals.get("bytes_by_class"),   # None in records before classes
        "blocked_time": final.get("blocked_time"),
        "staleness_mean": (final.get("staleness") or {}).get("mean"),
        "staleness_data_mean": (final.get("staleness_data") or {}).get("mean"),
        "_metrics": trial["metrics"], "_overrides": trial["overrides"],
        "_named": not trial["from_sweep"],
        "_speeds": cluster.get("speeds"),   # per worker, for the figures
        "_base_time": cluster.get("base_time"),
        "_cluster_config": s["config"].get("cluster") or {},   # as the run read it
        "_servers": (cluster.get("servers"), cluster.get("server_interface_bandwidth")),
        "_pushes": totals.get("pushes"),
        "_tuned": [k for k in trial["tuned"] if k in trial["overrides"]],
    })
  rows.sort(key=lambda r: r["scheme"] != "bsp")   # BSP, the baseline, first (stable)
  _add_baselines(rows)
  return rows


# The legs a record counted before its total was (``sync.legs.traffic_fields``): their sum is
# every byte the run moved.
_LEGS = ("bytes_pushed", "bytes_pulled", "bytes_between_servers", "bytes_local")


def _bytes_total(totals: dict) -> int | None:
  """Every byte a run moved: its ``bytes_total``, or in a record made before it was counted,
  the sum of the legs it counted (:data:`_LEGS`); None where a leg is missing."""
  if totals.get("bytes_total") is not None:
    return totals["bytes_total"]
  legs = [totals.get(k) for k in _LEGS]
  return None if any(v is None for v in legs) else sum(legs)


def _add_baselines(rows: list[dict], ignore=()) -> None:
  """Speedup (BSP's time to target / the trial's) and final-metric delta vs the matching BSP.

  The seed is part of the match, so a speedup is per seed (same seed, same other keys).
  """
  bsp: dict[tuple, dict] = {}
  for r in rows:   # per context, the BSP trial (uncompressed if there are several)
    if r["scheme"] == "bsp" and (_context(r, ignore) not in bsp
                                 or r["_overrides"].get("compress.name", "none") == "none"):
      bsp[_context(r, ignore)] = r
  for row in rows:
    base = bsp.get(_context(row, ignore))
    row["speedup_vs_bsp"] = (base["time_to_target"] / row["time_to_target"]
                             if base and base["time_to_target"] and row["time_to_target"]
                             else None)
    row["delta_vs_bsp"] = (row["final"] - base["final"]
                           if base and row["final"] is not None and base["final"] is not None
                           else None)


COLUMNS = ("final", "time_to_target", "speedup_vs_bsp", "delta_vs_bsp", "virtual_time",
           "bytes_pushed", "bytes_total", "blocked_time", "staleness_mean",
           "staleness_data_mean")
# What the staleness columns count (each applied gradient, at its own server, from its worker's
# read to its application): printed under every table that has them.
STALENESS_NOTE = ("staleness_mean: in updates of the gradient's server (a GSSP delivery, an "
                  "InHAD aggregate or a BSP round counts 1); staleness_data_mean: in worker "
                  "iterations of data that server incorporated in between (a BSP round counts "
                  "W, a GSSP delivery its K pushes). Only the second compares across schemes; "
                  "'–' where a run predates it. blocked_time: virtual seconds a worker waited, "
                  "the mean over the workers (blocked_time.png shows each worker's).")


def aggregate(rows: list[dict]) -> list[dict]:
  """Mean and std over seeds of every figure, per combination of the other swept values."""
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    key = tuple(sorted((k, json.dumps(v)) for k, v in row["_overrides"].items() if k != "seed"))
    groups.setdefault(key, []).append(row)
  out = []
  for key, members in groups.items():
    agg = {k: json.loads(v) for k, v in key}
    agg["_overrides"], agg["trial"] = dict(agg), members[0]["trial"]
    agg["_named"] = members[0].get("_named", False)
    agg["scheme"] = members[0].get("scheme")
    agg["seeds"] = len(members)
    agg["target"] = members[0]["target"]
    for col in COLUMNS:
      values = [m[col] for m in members if m[col] is not None]
      agg[col + "_n"] = len(values)
      agg[col] = statistics.fmean(values) if values else None
      agg[col + "_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
    agg.update(seed_statistics(members))
    out.append(agg)
  return out


def seed_statistics(members: list[dict]) -> dict[str, Any]:
  """Over one configuration's seeds: the per-seed speedup's median and min–max (seeds where it
  or BSP never reached the target, or either run collapsed, have none), unhealthy seed counts."""
  speedups = sorted(m["speedup_vs_bsp"] for m in members if m.get("speedup_vs_bsp") is not None)
  return {
      "speedup_vs_bsp_n": len(speedups),
      "seeds_faster": sum(v > 1 for v in speedups),
      "seeds_slower": sum(v < 1 for v in speedups),
      "speedup_vs_bsp_median": statistics.median(speedups) if speedups else None,
      "speedup_vs_bsp_min": speedups[0] if speedups else None,
      "speedup_vs_bsp_max": speedups[-1] if speedups else None,
      "collapsed": sum(m["status"] == "collapsed" for m in members),
      "diverged": sum(m["status"] == "diverged" for m in members),
  }


TUNING_CRITERION = ("the fewest collapsed or diverged seeds (a value that breaks a seed is not a "
                    "usable setting), then the fewest seeds that never reached the target (a "
                    "value where any seed misses it loses to one where every seed reaches it), "
                    "then the lowest mean over seeds of the (interpolated) virtual time to "
                    "target; ties, including never reached at every value, broken by the "
                    "higher median final metric (an unhealthy seed's counting as the worst); "
                    "then the smaller value. Target and metric are the validation set's "
                    "(data.validation_size, held out of the training set) wherever every trial "
                    "of the configuration scored one; else, in records without one, the test "
                    "set's, as the table says")


def tuning_split(by_value: dict[tuple, list[dict]]) -> str:
  """``"val_"`` where every trial of one configuration scored a validation set (tuning then
  reads it, never the test set), else ``""`` (records without one: the test set)."""
  members = [m for ms in by_value.values() for m in ms]
  return "val_" if members and all(m.get("val_final") is not None for m in members) else ""


def _tuning_score(members: list[dict], split: str = "") -> tuple[int, int, float, float]:
  """Lower is better: (unhealthy seeds, seeds that missed the target, mean time to target
  (infinite if any seed missed it), -median final), on ``split``'s metric (:func:`tuning_split`)."""
  inf = float("inf")
  times = [m[split + "time_to_target"] for m in members
           if m[split + "time_to_target"] is not None]
  missed = len(members) - len(times)
  finals = [m[split + "final"] if m[split + "final"] is not None
            and m["status"] not in UNHEALTHY else -inf for m in members]
  return (sum(m["status"] in UNHEALTHY for m in members), missed,
          statistics.fmean(times) if times and not missed else inf,
          -statistics.median(finals))


def _edge(values: list[tuple], best: tuple) -> str | None:
  """``"lowest"`` or ``"highest"`` where ``best`` is an end of the compared values (one tuned
  key varying among them, numbers, at least two), else None: a winner there may lie outside
  the grid."""
  varying = [i for i in range(len(best)) if len({v[i] for v in values}) > 1]
  if len(varying) != 1:
    return None
  numbers = [json.loads(v[varying[0]]) for v in values]
  if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
    return None
  chosen = json.loads(best[varying[0]])
  return "lowest" if chosen == min(numbers) else "highest" if chosen == max(numbers) else None


def _value_order(value: tuple) -> tuple:
  """Sort key of JSON-encoded tuned values: numbers by size, anything else after, by text."""
  loaded = [json.loads(v) for v in value]
  return tuple((0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x)) for x in loaded)


def tuned_keys(rows: list[dict]) -> list[str]:
  """The tuned keys of the trials (``sweep.tune``), in order of appearance."""
  return list(dict.fromkeys(k for r in rows for k in r.get("_tuned", ())))


def configurations(rows: list[dict], tuned: list[str]) -> dict[tuple, dict[tuple, list[dict]]]:
  """The trials by configuration (every swept value but the tuned keys and the seed, as sorted
  ``(key, JSON)`` pairs), then by tuned value (a tuple of JSON texts, one per tuned key)."""
  configs: dict[tuple, dict[tuple, list[dict]]] = {}
  for r in rows:
    cfg = tuple(sorted((k, json.dumps(v)) for k, v in r["_overrides"].items()
                       if k not in tuned and k != "seed"))
    value = tuple(json.dumps(r["_overrides"].get(k)) for k in tuned)
    configs.setdefault(cfg, {}).setdefault(value, []).append(r)
  return configs


def best_value(by_value: dict[tuple, list[dict]], seeds: tuple[int, ...] | None = None,
               reporting: tuple[int, ...] | None = None) -> tuple:
  """The tuned value :data:`TUNING_CRITERION` picks among one configuration's, chosen on
  ``seeds``' trials (None: every seed's), never on a ``reporting`` seed's."""
  by_value = tuning_trials(by_value, reporting)
  split = tuning_split(by_value)
  return min(by_value, key=lambda v: (_tuning_score(_choosers(by_value[v], seeds), split),
                                      _value_order(v)))


def tuning_trials(by_value: dict[tuple, list[dict]], reporting: tuple[int, ...] | None
                  ) -> dict[tuple, list[dict]]:
  """``by_value`` without the trials of the ``reporting`` seeds (and the values left with
  none)."""
  if not reporting:
    return by_value
  kept = {v: [m for m in ms if m["_overrides"].get("seed") not in reporting]
          for v, ms in by_value.items()}
  return {v: ms for v, ms in kept.items() if ms}


def _choosers(members: list[dict], seeds: tuple[int, ...] | None) -> list[dict]:
  """The trials among ``members`` that choose the value: ``seeds``' (all of them if None or
  if none is of those seeds)."""
  return [m for m in members if seeds is None or m["_overrides"].get("seed") in seeds] or members


def reported(members: list[dict], seeds: tuple[int, ...] | None,
             reporting: tuple[int, ...] | None) -> tuple[list[dict], bool]:
  """The trials at a configuration's chosen value that its comparison reports, and whether
  they are seeds apart from those that chose it: the ``reporting`` seeds' (none until the
  runner has run them), else the seeds other than ``seeds`` (the sweep's ``tune_seeds``) where
  there are any, else every seed (a grid that keeps no seed apart: reported on the seeds
  that chose)."""
  seed = lambda m: m["_overrides"].get("seed")
  if reporting:
    return [m for m in members if seed(m) in reporting], True
  others = [m for m in members if seeds is not None and seed(m) not in seeds]
  return (others, True) if others else (members, False)


def select_tuned(rows: list[dict], seeds: tuple[int, ...] | None = None,
                 reporting: tuple[int, ...] | None = None) -> tuple[list[dict], list[dict]]:
  """Each configuration's trials at its best tuned value (criterion: :data:`TUNING_CRITERION`).

  A configuration is every swept value but the tuned keys and the seed. ``seeds``
  (the sweep's ``tune_seeds``): only these seeds' trials choose the value (the other
  seeds ran at the chosen value alone); ``reporting`` (its ``report_seeds``): these seeds'
  trials never choose. The trials reported are those of :func:`reported`: seeds apart from
  the choosing ones wherever the grid keeps any (``reported_seeds`` and ``reported_apart``
  in each choice say which).

  Returns:
    ``(selected, choices)``: the chosen trials (copies, their speedups and
    deltas recomputed against BSP at BSP's own best value, same seed), and per
    configuration a dict with its swept values, ``chosen`` (tuned key -> value),
    ``mean_time_to_target``, ``median_final``, ``unhealthy_seeds``,
    ``missed_seeds``, ``candidates`` (how many values were compared), ``values`` (them, as
    text) and ``at_edge`` (:func:`_edge`). Without tuned keys: ``(rows, [])``.
  """
  tuned = tuned_keys(rows)
  if not tuned:
    return rows, []
  selected, choices = [], []
  for cfg, every in configurations(rows, tuned).items():
    by_value = tuning_trials(every, reporting)
    if not by_value:   # only reporting seeds' trials (a grid changed under them): nothing chose
      continue
    best, split = best_value(by_value, seeds), tuning_split(by_value)
    unhealthy, missed, mean_time, final = _tuning_score(_choosers(by_value[best], seeds), split)
    shown, apart = reported(every[best], seeds, reporting)
    selected += [dict(r) for r in shown]
    choices.append({**{k: json.loads(v) for k, v in cfg},
                    "chosen": {k: json.loads(v) for k, v in zip(tuned, best)},
                    "mean_time_to_target": mean_time if mean_time != float("inf") else None,
                    "median_final": -final if final != float("inf") else None,
                    "unhealthy_seeds": unhealthy, "missed_seeds": missed,
                    "candidates": len(by_value),
                    "values": "; ".join(", ".join(v) for v in sorted(by_value, key=_value_order)),
                    "at_edge": _edge(list(by_value), best),
                    "chosen_on": "validation" if split else "test",
                    "reported_seeds": " ".join(str(r["seed"]) for r in shown),
                    "reported_apart": apart})
  _add_baselines(selected, ignore=tuned)
  return selected, choices


def _fmt(value, col: str, metric: str = "") -> str:
  """Markdown cell text; accuracies in %, their deltas in percentage points."""
  if value is None:
    return "–"
  if col in ("bytes_pushed", "bytes_total"):
    return f"{value / 1e9:.3f} GB"
  if col == "speedup_vs_bsp":
    return f"{value:.2f}×"
  if metric == "test_accuracy" and col in ("final", "target"):
    return f"{value * 100:.2f} %"
  if metric == "test_accuracy" and col == "delta_vs_bsp":
    return f"{value * 100:+.2f} pp"
  if col in ("time_to_target", "virtual_time", "blocked_time"):
    return f"{value:.2f}"
  if isinstance(value, float):
    return (f"{value:.2f}" if col in ("final", "delta_vs_bsp", "staleness_mean",
                                       "staleness_data_mean") else f"{value:.4g}")
  return str(value)


def write_report(workdir: str, out_dir: str | None = None,
                 target: float | None = None) -> dict[str, str]:
  """Writes ``report.md``, ``report.csv`` (per trial) and ``summary.csv`` (over seeds) and plots.

  ``target`` recomputes every time to target for that metric value (see :func:`collect`).
  In a sweep with tuned keys, ``summary.csv``, the headline tables and the
  plots show each configuration at its best tuned value; ``summary_all.csv``
  and ``tuning.csv`` hold every value and the choices.
  """
  out_dir = out_dir or workdir
  rows = collect(workdir, target)
  os.makedirs(out_dir, exist_ok=True)
  if not rows:
    raise ValueError(f"no finished trial (summary.json) under {workdir}")
  swept = list(dict.fromkeys(k for r in rows for k in r["_overrides"]))
  swept = [k for i, k in sorted(enumerate(swept), key=lambda ik: _column_order(ik[1], ik[0]))]
  seeds, reporting = tune_seeds(workdir), report_seeds(workdir)
  selected, choices = select_tuned(rows, seeds, reporting)
  chosen_trials = {r["trial"] for r in selected}
  for r in rows:
    r["selected_by_tuning"] = r["trial"] in chosen_trials if choices else None
  head_cols = [k for k in swept if k != "seed"] + ["seeds", "target"]
  paths = _write_csvs(out_dir, rows, selected, choices, swept, head_cols)
  lines = _markdown(workdir, rows, selected, choices, swept, head_cols, (seeds, reporting))
  notes = []
  names = plot(selected, out_dir, notes)
  lines += [f"Not drawn: {note}." for note in notes] + ([""] if notes else [])
  for name in names:
    lines.append(f"![{name}]({name})")
    paths["figure_" + os.path.splitext(name)[0]] = os.path.join(out_dir, name)
  with open(paths["md"], "w") as f:
    f.write("\n".join(lines) + "\n")
  return paths


def _write_csvs(out_dir: str, rows: list[dict], selected: list[dict], choices: list[dict],
                swept: list[str], head_cols: list[str]) -> dict[str, str]:
  """``report.csv`` (every trial), ``summary.csv`` (over seeds, at the chosen values) and, with
  tuned keys, ``summary_all.csv`` and ``tuning.csv``; returns their paths (and report.md's)."""
  cols = ["trial", *swept, "status", "metric", "target", *COLUMNS]
  csv_cols = cols + ["time_to_target_first_eval", "collapse_reason"]
  csv_cols += ["selected_by_tuning"] if choices else []
  paths = {"csv": os.path.join(out_dir, "report.csv"),
           "summary_csv": os.path.join(out_dir, "summary.csv"),
           "md": os.path.join(out_dir, "report.md")}
  _write_csv(paths["csv"], csv_cols, rows)
  agg_cols = (head_cols + [c for col in COLUMNS for c in (col, col + "_std")]
              + [*_SEED_STAT_COLUMNS])
  _write_csv(paths["summary_csv"], agg_cols, aggregate(selected))
  if choices:
    paths["summary_all_csv"] = os.path.join(out_dir, "summary_all.csv")
    _write_csv(paths["summary_all_csv"], agg_cols, aggregate(rows))
    paths["tuning_csv"] = os.path.join(out_dir, "tuning.csv")
    _write_csv(paths["tuning_csv"], list(dict.fromkeys(k for c in choices for k in c)), choices)
  return paths


def _markdown(workdir: str, rows: list[dict], selected: list[dict], choices: list[dict],
              swept: list[str], head_cols: list[str], seeds) -> list[str]:
  """``report.md``'s lines up to its figures: the headline tables, the tuning, every trial,
  what was left out and how to read the columns."""
  metric = rows[0]["metric"]
  cols = ["trial", *swept, "status", "metric", "target", *COLUMNS]
  agg = aggregate(selected)
  title = "Mean ± std over seeds" + (", each configuration at its best tuned value"
                                     if choices else "")
  lines = [f"# Sweep report: {workdir}", ""] + verdict_lines(agg, head_cols, metric) + [
      "", f"## {title}", ""]
  lines += _mean_table(agg, head_cols, metric)
  lines += traffic_table(selected, head_cols, metric)
  lines += ["", "## Speedup against BSP, per seed", ""] + speedup_table(agg, head_cols, metric)
  if choices:
    lines += ["", *tuning_section(rows, choices, metric, seeds, ladders(workdir),
                                  extended(workdir)), "",
              "## Every tuned value: mean ± std over seeds", ""]
    every = aggregate(rows)
    lines += _mean_table(every, head_cols, metric)
    lines += ["", "## Every tuned value: speedup against BSP at the same value, per seed", ""]
    lines += speedup_table(every, head_cols, metric)
  lines += ["", "## Per trial", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(_fmt(r.get(c), c, metric) for c in cols) + " |" for r in rows]
  return lines + _left_out(workdir, rows) + _reading_notes(bool(choices))


def _left_out(workdir: str, rows: list[dict]) -> list[str]:
  """The collapsed trials' reasons, and the unfinished and orphaned trials left out."""
  lines = []
  reasons = [f"- {r['trial']}: {r['collapse_reason']}" for r in rows if r.get("collapse_reason")]
  if reasons:
    lines += ["", "Collapsed trials (finished, but learned nothing after the warm-up):", *reasons]
  cut = unfinished(workdir)
  if cut:
    lines += ["", "Unfinished trials (interrupted or failed; a rerun of the sweep resumes them), "
              f"left out of this report: {', '.join(cut)}"]
  left_out = orphans(workdir)
  if left_out:
    lines += ["", f"Orphans (trial directories not in the sweep's current grid, {GRID_FILE}; "
              f"left out of this report): {', '.join(left_out)}"]
  return lines


def _reading_notes(tuned: bool) -> list[str]:
  return ["", "time_to_target: virtual (simulated-cluster) seconds until the metric reached the "
          "target, " + health.INTERPOLATION + " (report.csv also has "
          "time_to_target_first_eval, the first such evaluation's own time); – if never "
          "reached. A collapsed or diverged trial never counts as reaching it. speedup_vs_bsp: "
          "the matching BSP trial's time to target divided by this trial's (same seed, same "
          "swept values but the sync/compress keys" + (" and, in the headline tables, the "
          "tuned keys: BSP at its own best value" if tuned else "") + "); delta_vs_bsp: "
          "final metric minus BSP's.", ""]


_SEED_STAT_COLUMNS = ("speedup_vs_bsp_median", "speedup_vs_bsp_min", "speedup_vs_bsp_max",
                      "speedup_vs_bsp_n", "seeds_faster", "seeds_slower", "collapsed",
                      "diverged")


def _write_csv(path: str, columns: list[str], rows: list[dict]) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)


def _mean_table(agg: list[dict], head_cols: list[str], metric: str) -> list[str]:
  """Markdown lines: one row per configuration, every figure as mean ± std over seeds."""
  lines = ["| " + " | ".join(head_cols + list(COLUMNS)) + " |",
           "|" + "---|" * (len(head_cols) + len(COLUMNS))]
  for a in agg:
    head = [_fmt(a.get(k), k, metric) for k in head_cols]
    body = [(f"{_fmt(a[c], c, metric)} ± {_fmt(a[c + '_std'], c, metric).lstrip('+')}"
             + (f" ({a[c + '_n']}/{a['seeds']} seeds)" if a[c + "_n"] < a["seeds"] else ""))
            if a[c] is not None else "–" for c in COLUMNS]
    lines.append("| " + " | ".join(head + body) + " |")
  return lines + ["", STALENESS_NOTE]


def traffic_table(rows: list[dict], head_cols: list[str], metric: str) -> list[str]:
  """Markdown lines: per configuration, the mean over seeds of its bytes in all and in each
  class of traffic (``sync.legs.CLASSES``) that moved any; none where no record counts them."""
  counted = [r for r in rows if r.get("_bytes_by_class")]
  if not counted:
    return []
  classes = [c for c in legs_lib.CLASSES if any(r["_bytes_by_class"].get(c) for r in counted)]
  lines = ["", "## Traffic per class (mean over seeds, GB)", "",
           "| " + " | ".join(head_cols + ["total"] + classes) + " |",
           "|" + "---|" * (len(head_cols) + 1 + len(classes))]
  for a in aggregate(counted):
    members = [r for r in counted if _same_configuration(r, a)]
    mean = lambda f: statistics.fmean(f(r) for r in members) / 1e9
    lines.append("| " + " | ".join(
        [_fmt(a.get(k), k, metric) for k in head_cols] + [f"{mean(lambda r: r['bytes_total']):.3f}"]
        + [f"{mean(lambda r, c=c: r['_bytes_by_class'].get(c, 0)):.3f}" for c in classes]) + " |")
  return lines


def _same_configuration(row: dict, agg: dict) -> bool:
  return all(row["_overrides"].get(k) == v for k, v in agg["_overrides"].items())


def speedup_table(agg: list[dict], head_cols: list[str], metric: str) -> list[str]:
  """Markdown lines: per configuration the per-seed speedup's median and min–max, and how many
  seeds were faster or slower than BSP, had no speedup, collapsed or diverged."""
  cols = head_cols + ["median speedup over BSP", "speedup min–max",
                      "seeds faster / slower than BSP", "seeds not compared", "collapsed",
                      "diverged"]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for a in agg:
    lo, hi = a["speedup_vs_bsp_min"], a["speedup_vs_bsp_max"]
    lines.append("| " + " | ".join(
        [_fmt(a.get(k), k, metric) for k in head_cols]
        + [_fmt(a["speedup_vs_bsp_median"], "speedup_vs_bsp"),
           (f"{_fmt(lo, 'speedup_vs_bsp')}–{_fmt(hi, 'speedup_vs_bsp')}"
            if lo is not None else "–"),
           f"{a['seeds_faster']} / {a['seeds_slower']} of {a['seeds']}",
           f"{a['seeds'] - a['speedup_vs_bsp_n']} of {a['seeds']}",
           f"{a['collapsed']}/{a['seeds']}", f"{a['diverged']}/{a['seeds']}"]) + " |")
  lines += ["", "Speedup per seed: BSP's virtual time to target with the same seed divided by "
            "the trial's (above 1: faster than BSP); the median and the range (min–max) over "
            "the seeds where both reached the target. Such a seed is faster or slower than "
            "BSP (one with exactly BSP's time counts as neither); a seed where either never "
            "reached the target, collapsed or diverged is not compared."]
  return lines


def verdict_lines(agg: list[dict], head_cols: list[str], metric: str) -> list[str]:
  """One sentence per configuration set against BSP, as its speedup table says it:
  ``**gssp** was slower than BSP to 40 % test accuracy: a median speedup of 0.59× ...``;
  a configuration is named by its table cells (``head_cols``), as in the tables below it."""
  compared = [a for a in agg if not _is_baseline(a)]
  if not any(_is_baseline(a) for a in agg):
    return ["No BSP trial in this sweep: no configuration is set against BSP."]
  return [f"- {_verdict(a, _name(a, head_cols, metric), metric)}" for a in compared]


def _name(a: dict, head_cols: list[str], metric: str) -> str:
  """A configuration's name as its table rows read (``gssp 0.05``), 'none' left out."""
  cells = [_fmt(a.get(k), k, metric) for k in head_cols
           if k not in ("seeds", "target") and a.get(k) != "none"]
  return " ".join(cells) or label(a)


def _is_baseline(a: dict) -> bool:
  return a.get("scheme") == "bsp" and a["_overrides"].get("compress.name", "none") == "none"


def _goal(target: float | None, metric: str) -> str:
  if target is None:
    return f"its {metric} target"
  if metric == "test_accuracy":
    return f"{target * 100:g} % test accuracy"
  return f"{metric} {target:g}"


def _verdict(a: dict, name: str, metric: str) -> str:
  """The sentence for one configuration (see :func:`verdict_lines`)."""
  goal, n = _goal(a.get("target"), metric), a["seeds"]
  median, compared = a["speedup_vs_bsp_median"], a["speedup_vs_bsp_n"]
  if not compared:
    text = (f"**{name}** has no speedup over BSP to {goal}: on none of its {n} seeds did both "
            "it and BSP reach the target")
  else:
    how = "faster than" if median > 1 else "slower than" if median < 1 else "as fast as"
    text = (f"**{name}** was {how} BSP to {goal}: a median speedup of {median:.2f}× (it took "
            f"{1 / median:.2f}× BSP's virtual time); faster on {a['seeds_faster']} of {n} "
            f"seeds, slower on {a['seeds_slower']}")
    if compared < n:
      text += f", not compared on {n - compared}"
  delta = a.get("delta_vs_bsp")
  if delta is not None:
    points = 100 * delta if metric == "test_accuracy" else delta
    what = "test accuracy" if metric == "test_accuracy" else metric
    if round(points, 2) == 0:
      text += f"; its final {what} equals BSP's (mean over seeds)"
    else:
      side = "below" if points < 0 else "above"
      text += f"; its final {what} is {abs(points):.2f} points {side} BSP's (mean over seeds)"
  return text + "."


def tuning_section(rows: list[dict], choices: list[dict], metric: str,
                   seeds: tuple = (None, None), ladder: dict[str, list] | None = None,
                   added: list[str] | None = None) -> list[str]:
  """Markdown lines disclosing the tuning: the grid, the criterion, each configuration's choice.

  ``seeds``: the sweep's ``(tune_seeds, report_seeds)`` (:func:`tune_seeds`,
  :func:`report_seeds`). ``ladder`` and ``added``: the sweep's ladders and the trials the
  grid-edge rule added (:func:`ladders`, :func:`extended`); the grid shown is the declared one,
  without them.
  """
  ladder, added = ladder or {}, set(added or ())
  tuning, reporting = seeds
  tuned = list(choices[0]["chosen"])
  declared = [r for r in rows if r["trial"] not in added]
  grid = {k: sorted({json.dumps(r["_overrides"][k]) for r in declared if k in r["_overrides"]},
                    key=lambda v: _value_order((v,))) for k in tuned}
  info = ("chosen", "mean_time_to_target", "median_final", "unhealthy_seeds", "missed_seeds",
          "candidates", "values", "at_edge", "chosen_on", "reported_seeds", "reported_apart")
  cfg_cols = list(dict.fromkeys(k for c in choices for k in c if k not in info))
  cfg_cols.sort(key=lambda k: _column_order(k, 0))
  which = ("the same grid for every scheme (BSP included)" if len(tuned) == 1 else
           "each configuration's own grid (a configuration tunes the keys it sets)")
  on = _seeds_text(tuning, reporting, choices)
  lines = ["## Tuning (disclosed)", "",
           f"Tuned per configuration, over {which}: "
           + "; ".join(f"{k} in {{{', '.join(v)}}}" for k, v in grid.items()) + ". "
           "Each configuration (every other swept value but the seed) is reported at the value "
           f"with {TUNING_CRITERION}.{on}{_ladder_text(ladder, rows, added)} The full per-value "
           "table follows.", "",
           "| " + " | ".join(cfg_cols + [f"chosen {k}" for k in tuned]
                            + ["chosen on", "unhealthy seeds", "seeds that missed",
                               "mean time_to_target", "median final", "values compared",
                               "at the edge of those", "reported seeds"])
           + " |", "|" + "---|" * (len(cfg_cols) + len(tuned) + 8)]
  for c in choices:
    lines.append("| " + " | ".join(
        [_fmt(c.get(k), k, metric) for k in cfg_cols] + [str(c["chosen"].get(k)) for k in tuned]
        + [c.get("chosen_on", "test"), str(c["unhealthy_seeds"]), str(c["missed_seeds"]),
           _fmt(c["mean_time_to_target"], "time_to_target"),
           _fmt(c["median_final"], "final", metric), c.get("values") or str(c["candidates"]),
           _edge_cell(c, ladder), _reported_cell(c)]) + " |")
  edges = [c for c in choices if c["at_edge"]]
  ends = [c for c in edges if _edge_cell(c, ladder).endswith("the ladder's end")]
  if ends:
    lines += ["", f"{len(ends)} of {len(choices)} configuration(s) won at the end of the declared "
              "ladder: a better value may lie beyond it, which this sweep does not try."]
  if len(edges) > len(ends):
    lines += ["", f"{len(edges) - len(ends)} of {len(choices)} configuration(s) won at the "
              "grid's edge: a better value may lie beyond it ("
              + ("the sweep extends them along the ladder once its trials have finished)."
                 if ladder else
                 "extend the grid on that side).")]
  return lines


def _seeds_text(tuning: tuple[int, ...] | None, reporting: tuple[int, ...] | None,
                choices: list[dict]) -> str:
  """The sentence on which seeds choose and which are reported."""
  if reporting:
    return (f" The value is chosen on the grid's own seeds alone; reporting seeds "
            f"{', '.join(map(str, reporting))} were kept apart, each run at the chosen value "
            "once the configuration's tuning had settled, and the headline tables count those "
            "seeds alone (a configuration whose reporting trials have not run yet has none).")
  if tuning is not None:
    apart = all(c.get("reported_apart") for c in choices)
    return (f" The value is chosen on seed(s) {', '.join(map(str, tuning))} alone; the other "
            "seeds ran at the chosen value only, and the headline tables count "
            + ("those other seeds alone." if apart else
               "those other seeds alone where they ran, else the seeds that chose."))
  return (" The grid keeps no seed apart from tuning: the headline tables report the seeds "
          "that chose the value (sweep.report_on keeps seeds apart).")


def _reported_cell(choice: dict) -> str:
  seeds = choice.get("reported_seeds") or "none yet"
  return seeds if choice.get("reported_apart") else f"{seeds} (the seeds that chose)"


def _ladder_text(ladder: dict[str, list], rows: list[dict], added: set[str]) -> str:
  """The sentence on the ladders and the trials the grid-edge rule added ('' without ladders)."""
  if not ladder:
    return ""
  text = "; ".join(f"{k} in ({', '.join(f'{x:g}' for x in v)})" for k, v in ladder.items())
  n = sum(r["trial"] in added for r in rows)
  return (f" Declared ladder: {text}. Where a configuration's best value was an end of the "
          "values it had tried, the sweep ran it at the ladder's next value on every seed, and "
          "again, until its best lay inside them or at the ladder's end "
          "(gssp_jax.studies.grid_edge): "
          f"{n} trial(s) were added so (in `extended.json`).")


def _edge_cell(choice: dict, ladder: dict[str, list]) -> str:
  """``no``, ``lowest``/``highest``, or that with ``the ladder's end`` or ``the ladder goes on``."""
  side = choice["at_edge"]
  if not side:
    return "no"
  for key, values in ladder.items():
    value = choice["chosen"].get(key)
    if value in values:
      end = values[0] if side == "lowest" else values[-1]
      where = "the ladder's end" if value == end else "the ladder goes on"
      return f"{side}, {where}"
  return side


def plot(rows: list[dict], out_dir: str, notes: list[str] | None = None) -> list[str]:
  """PNG figures, one question each (``gssp_jax.studies.report_figures``); returns their file names.

  What could not be drawn (e.g. no trial reached the target) is appended to
  ``notes`` (and warned about); its figure says so in words.
  """
  names, more = report_figures.plot(rows, out_dir)
  if notes is not None:
    notes += more
  return names
