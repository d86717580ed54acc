"""The papers' claims, from one command: the studies behind them, their reports, the claims table.

``experiments.reproduce`` runs the declared :data:`STUDIES` (each a sweep file, resumable: a
rerun skips finished trials and resumes the rest from their checkpoints; a tuned key with a
ladder is extended past a winner at the grid's edge, ``gssp_jax.grid_edge``), writes each one's
report (``gssp_jax.report``) and then the claims table (:func:`write_claims`): for every claim of
:data:`CLAIMS`, the figure of each study that has its scheme, the spread over seeds, and one
sentence, derived from the figures by :func:`verdict`, on whether the claim holds there.

Layout of ``--out=DIR``::

  DIR/runs/<study>/<trial>/   the sweep's trials (workdirs)
  DIR/<study>/                its report: report.md, report.csv, summary.csv, tuning.csv, figures
  DIR/claims.md, claims.csv, claims.png   the claims table

Nothing here is written by hand: every figure is read from the trials' summaries.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import re
import shutil
import statistics
import threading
from typing import Any, Sequence

from absl import logging
import numpy as np

from gssp_jax import grid_edge
from gssp_jax import report
from gssp_jax import report_figures
from gssp_jax import sweep as sweep_lib


@dataclasses.dataclass(frozen=True)
class Study:
  """A sweep behind the claims table.

  Attributes:
    name: its directory under ``DIR/runs`` and ``DIR``.
    sweep: the sweep file, relative to the repository root (``path[:arg]``).
    title: what it is, in a line of the claims table.
    minutes_per_trial: the declared wall minutes of a trial on a 2-core CPU at
      ``--parallel=2`` (the plan's estimate until trials of this study have finished; then
      their measured median). The MNIST studies' figures are the medians of their first
      complete run (2026-11-27); ``local_update_long``'s is ``local_update``'s scaled by its
      8 epochs against 3.
    protocol: ``"authors"`` (the papers' own settings) or ``"tuned"`` (each scheme at its best
      rate of a declared grid); the claims table has one column of each.
  """
  name: str
  sweep: str
  title: str
  minutes_per_trial: float
  protocol: str


STUDIES = {s.name: s for s in (
    Study("mnist_tuned", "configs/sweeps/paper_mnist.py:tune",
          "LeNet-5/MNIST, 16 workers in 4 speed tiers, each scheme at its best rate of "
          "{0.02, 0.05, 0.1}, extended along 0.005-0.5 past a best at an edge, 3 seeds, "
          "8 epochs, target 98 %", 3.0, "tuned"),
    Study("mnist_authors", "configs/sweeps/paper_mnist_authors.py",
          "LeNet-5/MNIST, the GSSP authors' settings (batch 64, SGD 0.001, constant), 3 seeds, "
          "25 epochs, target 95 %", 9.1, "authors"),
    Study("cifar10_tuned", "configs/sweeps/paper_cifar10_tuned.py",
          "ResNet-18 x1/4 on 8,192 CIFAR-10 images, 8 workers in 4 speed tiers, BSP, SSP, GSSP, "
          "GSSP + GDTopK and DiLoCo each at its best of a declared grid of 3 (extended "
          "along a ladder past a best at an edge), 3 seeds, 4 epochs, target 35 %", 10.0,
          "tuned"),
    Study("local_update", "configs/sweeps/local_update_mnist.py:tiers",
          "LeNet-5/MNIST, the local-update schemes beside BSP, SSP and GSSP, rates tuned on "
          "seed 0, 3 seeds, 3 epochs, target 98 %", 2.3, "tuned"),
    Study("local_update_long", "configs/sweeps/local_update_mnist.py:tiers,long",
          "LeNet-5/MNIST, the local-update schemes beside BSP, SSP and GSSP, every rate on "
          "every seed (extended along a ladder past a best at an edge), 3 seeds, 8 epochs, "
          "target 98 %", 6.1, "tuned"),
    Study("tiny", "configs/sweeps/tiny_tune.py",
          "a pipeline check: 2 schemes x 2 rates x 2 seeds on 512 examples (not a result)",
          0.2, "tuned"),
)}
# In the order of the published table's columns, so that the plain command
# (``--merge_from=results/claims --plan``) rebuilds it byte for byte.
DEFAULT_STUDIES = ("mnist_tuned", "mnist_authors", "local_update", "cifar10_tuned",
                   "local_update_long")


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim, and the figures that decide it.

  Attributes:
    name: the scheme as the table names it.
    paper: who claims it.
    statement: the claim, in the paper's terms.
    scheme: ``(sync.scheme, compress.name)`` of the scheme's trials.
    min_speedup: the speedup over BSP to the target that the claim needs (median over
      seeds); None where the claim is not about speed.
    max_drop_pp: how far below BSP's final accuracy (points) the claim allows; None: not about
      accuracy.
    max_bytes_vs_bsp: the most bytes pushed, as a share of BSP's, the claim allows; None: not
      about communication.
    baselines: schemes besides BSP the claim is against (``(sync.scheme, compress.name)``):
      the speedup over each, at its own best rate, must reach ``min_speedup`` too.
  """
  name: str
  paper: str
  statement: str
  scheme: tuple[str, str]
  min_speedup: float | None
  max_drop_pp: float | None
  max_bytes_vs_bsp: float | None = None
  baselines: tuple[tuple[str, str], ...] = ()


# The GSSP paper's baselines besides BSP (where a study ran them).
_ASYNC_BASELINES = (("asp", "none"), ("ssp", "none"))
# The synchronous local-update baseline that asynchronous Local-SGD and HALoS are set against.
_DILOCO = (("diloco", "none"),)
NAMES = {("bsp", "none"): "BSP", ("asp", "none"): "ASP", ("ssp", "none"): "SSP",
         ("diloco", "none"): "DiLoCo"}
# When the baselines that the claims of DSSP, asynchronous Local-SGD and HALoS name were added to
# their verdicts (the table's header discloses it).
NAMED_BASELINES_ADDED = (
    "the baselines that the claims of DSSP (SSP), asynchronous Local-SGD and HALoS (DiLoCo) "
    "name were added to their verdicts on 2026-12-03, after the lost run and the 3-epoch "
    "local-update study had been seen and before the 8-epoch one ran; a baseline can only "
    "add a reason for a verdict not to hold; with them, a seed on which the baseline ran past "
    "the scheme's time to the target without reaching it counts the scheme ahead on that seed "
    "(before, such a seed was left out, and a claim left with no seed to compare failed)")

CLAIMS = (
    Claim("GSSP", "the GSSP paper", "46-120 % faster than the baselines, under 1 % accuracy drop",
          ("gssp", "none"), 1.46, 1.0, baselines=_ASYNC_BASELINES),
    Claim("GSSP + GDTopK", "the GDTopK paper",
          "less communication at GSSP's accuracy (judged here: GSSP's speed claim, under 1 % drop)",
          ("gssp", "gdtopk"), 1.46, 1.0, baselines=_ASYNC_BASELINES),
    Claim("SSP", "Ho et al. 2013", "faster than BSP at its accuracy", ("ssp", "none"), 1.0, 1.0),
    Claim("DSSP", "Zhao et al. 2019", "faster than SSP's fixed bound, at BSP's accuracy",
          ("dssp", "none"), 1.0, 1.0, baselines=(("ssp", "none"),)),
    Claim("DS-Sync", "the DS-Sync paper", "BSP's accuracy in less time", ("dssync", "none"),
          1.0, 1.0),
    Claim("CASP (Petrel)", "the Petrel paper", "up to 1.87x faster convergence",
          ("casp", "none"), 1.0, 1.0),
    Claim("InHAD", "the InHAD paper", "faster than BSP on heterogeneous workers, at its accuracy",
          ("inhad", "none"), 1.0, 1.0),
    Claim("DiLoCo", "Douillard et al. 2023",
          "as good as synchronous training while communicating H times less (H = 8 here)",
          ("diloco", "none"), None, 1.0, 1.0 / 8 * 1.05),
    Claim("Asynchronous Local-SGD", "Liu et al. 2024",
          "matches synchronous DiLoCo in less wall time on heterogeneous workers",
          ("async_local_sgd", "none"), 1.0, 1.0, baselines=_DILOCO),
    Claim("HALoS", "the HALoS paper",
          "up to 7.5x faster than synchronous methods, at synchronous quality",
          ("halos", "none"), 1.0, 1.0, baselines=_DILOCO),
)


# -- the plan -----------------------------------------------------------------------------------


def select(only: Sequence[str] | None) -> list[Study]:
  """The studies named in ``only`` (None or empty: :data:`DEFAULT_STUDIES`), in that order."""
  names = list(only) if only else list(DEFAULT_STUDIES)
  unknown = [n for n in names if n not in STUDIES]
  if unknown:
    raise ValueError(f"--only={','.join(names)} is invalid: {', '.join(map(repr, unknown))} "
                     f"is no study; allowed: {', '.join(STUDIES)}")
  return [STUDIES[n] for n in dict.fromkeys(names)]


def _trial_minutes(trial_dir: str) -> float | None:
  """The minutes a finished trial took (``sweep.trial_seconds``: its process from start to end,
  start-up included; else its summary's training wall time), or None if neither is known."""
  seconds = sweep_lib.trial_seconds(trial_dir)
  if seconds is None:
    try:
      with open(os.path.join(trial_dir, "summary.json")) as f:
        seconds = json.load(f).get("totals", {}).get("wall_time")
    except (OSError, ValueError):
      seconds = None
  return float(seconds) / 60.0 if seconds else None


def plan(studies: Sequence[Study], root: str, repo: str, parallel: int) -> list[dict[str, Any]]:
  """Per study: its trials, how many are finished, and the estimated minutes of the rest."""
  rows = []
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    trials = sweep_lib.expand(os.path.join(repo, study.sweep), workdir=workdir)
    done = [os.path.join(workdir, t.name) for t in trials
            if sweep_lib.trial_status(os.path.join(workdir, t.name)) in sweep_lib.FINISHED]
    measured = [m for m in map(_trial_minutes, done) if m is not None]
    per_trial = statistics.median(measured) if measured else study.minutes_per_trial
    rows.append({"study": study.name, "sweep": study.sweep, "trials": len(trials),
                 "finished": len(done), "minutes_per_trial": per_trial,
                 "measured": bool(measured),
                 "extended": sum(t.extended for t in trials),
                 "may_extend": grid_edge.possible(trials, trials.ladders, workdir),
                 "minutes_left": per_trial * (len(trials) - len(done)) / parallel})
  return rows


def describe_plan(rows: list[dict[str, Any]], parallel: int) -> str:
  width = max([14] + [len(r["study"]) for r in rows])
  lines = [f"{'study':<{width}} {'trials':>6} {'done':>5}  {'min/trial':>9}  {'left':>8}  sweep"]
  for r in rows:
    left = r["minutes_left"]
    lines.append(f"{r['study']:<{width}} {r['trials']:>6} {r['finished']:>5}  "
                 f"{r['minutes_per_trial']:>8.1f}{'m' if r['measured'] else '*'}  "
                 f"{left / 60:>7.1f}h  {r['sweep']}")
  total = sum(r["minutes_left"] for r in rows)
  lines.append(f"estimated {total / 60:.1f} h with --parallel={parallel} on a machine like a "
               "2-core CPU (*: declared per-trial cost; m: measured on this machine's finished "
               "trials); a rerun resumes where this one stops")
  for r in rows:
    if r["may_extend"]:
      lines.append(f"{r['study']}: {r['extended']} of its trials were added by the grid-edge "
                   f"rule; it may add up to {r['may_extend']} more (each "
                   f"{r['minutes_per_trial']:.1f} min) where a best rate sits at the edge of "
                   "those tried (gssp_jax.grid_edge)")
    elif r["extended"]:
      lines.append(f"{r['study']}: {r['extended']} of its trials were added by the grid-edge "
                   "rule; it can add no more (every best rate lies inside the rates tried or "
                   "at its ladder's end)")
  return "\n".join(lines)


# -- running ------------------------------------------------------------------------------------


def run(studies: Sequence[Study], root: str, repo: str, parallel: int = 1) -> dict[str, dict]:
  """Runs every unfinished trial of ``studies`` (resumable) and writes each one's report.

  Returns:
    per study, its trials' statuses.
  """
  statuses = {}
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    statuses[study.name] = grid_edge.run_sweep(os.path.join(repo, study.sweep), workdir,
                                               parallel=parallel)
    report.write_report(workdir, os.path.join(root, study.name))
  return statuses


def write_reports(root: str, studies: Sequence[Study]) -> list[str]:
  """(Re)writes the report of each study with finished trials (what ``--plan`` shows so far);
  returns the studies reported."""
  done = []
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    try:
      report.write_report(workdir, os.path.join(root, study.name))
    except ValueError:   # no such directory, or no finished trial yet
      continue
    done.append(study.name)
  return done


def merge(source: str, root: str, studies: Sequence[Study], repo: str) -> dict[str, dict]:
  """Adds to ``root`` the finished trials of another ``--out`` (``source``; e.g. run on a GPU):
  virtual time does not depend on the machine, so a trial's figures are the same wherever it ran
  (its ``summary.json`` names the machine).

  A trial is taken when it is finished there and not here, and its recorded config is the one
  the sweep file builds now (else it is left, and counted); the trials the grid-edge rule added
  there come with their ``extended.json`` entries. Its directory is copied without its
  checkpoints; an unfinished run of it here is moved to ``runs/<study>/_stale/<time>/`` first
  (nothing is deleted), unless its ``trial.json`` says it is running (left, and counted: merge
  while the study does not run here, or its running trials stay). Where it took any, the
  study's grid here (``sweep.json``: its trials, tuned seeds and ladders, which the reports
  read) is written as the sweep file now expands.

  Returns:
    per study: ``{"taken": [...], "changed": [...], "busy": [...]}`` (trial names).
  """
  out = {}
  for study in studies:
    src, dst = (os.path.join(d, "runs", study.name) for d in (source, root))
    taken, changed, busy = [], [], []
    out[study.name] = {"taken": taken, "changed": changed, "busy": busy}
    if not os.path.isdir(src):
      continue
    finished = lambda d, name: sweep_lib.trial_status(os.path.join(d, name)) in sweep_lib.FINISHED
    path = os.path.join(repo, study.sweep)
    have = {sweep_lib.trial_name(o) for o in sweep_lib.extended_overrides(dst)}
    added = sweep_lib.extended_records(src)
    new = [t for t in added if t["name"] not in have and finished(src, t["name"])]
    if new:
      sweep_lib.add_extended(dst, [dict(t["overrides"]) for t in new], [t["why"] for t in new])
    trials = sweep_lib.expand(path, workdir=dst)
    differ = sweep_lib.changed_trials(trials, src)
    todo = [t for t in trials if finished(src, t.name) and not finished(dst, t.name)]
    changed += [t.name for t in todo if t.name in differ]
    busy += [t.name for t in todo if t.name not in differ and _running(dst, t.name)]
    todo = [t for t in todo if t.name not in differ and t.name not in busy]
    stale = [t.name for t in todo if os.path.exists(os.path.join(dst, t.name))]
    if stale:
      sweep_lib.move_aside(dst, stale)
    for t in todo:
      shutil.copytree(os.path.join(src, t.name), os.path.join(dst, t.name),
                      ignore=shutil.ignore_patterns("checkpoints"))
      taken.append(t.name)
    if taken:   # the grid as it stands here now (tuned seeds, ladders): what the reports read
      sweep_lib.write_grid(dst, path, trials)
  return out


def _running(workdir: str, name: str) -> bool:
  """Whether the trial's ``trial.json`` says it is running here (a run in progress, or one that
  died without a word: either way not replaced under it)."""
  path = os.path.join(workdir, name, "trial.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return json.load(f).get("status") == "running"


# -- the claims table ---------------------------------------------------------------------------


def _scheme(row: dict) -> tuple[str, str]:
  return (row["_overrides"].get("sync.scheme", row.get("sync.scheme")),
          row["_overrides"].get("compress.name", "none"))


def figures(workdir: str) -> dict[tuple[str, str], dict[str, Any]]:
  """Per scheme of a study's trials, at its best tuned value: the figures the claims use."""
  rows = report.collect(workdir)
  selected, choices = report.select_tuned(rows, report.tune_seeds(workdir))
  chosen = {_scheme({"_overrides": c}): c["chosen"] for c in choices}
  out = {}
  aggs = report.aggregate(selected)
  bsp = next((a for a in aggs if _scheme(a) == ("bsp", "none")), None)
  trials = collections.defaultdict(list)
  for r in selected:
    trials[_scheme(r)].append(r)
  for agg in aggs:
    key = _scheme(agg)
    delta = agg["delta_vs_bsp"]
    if delta is None and bsp and agg["final"] is not None and bsp["final"] is not None:
      # No BSP trial shares its other swept keys (a local-update scheme's outer and inner
      # optimizer settings): its mean final metric against BSP's, each at its best.
      delta = agg["final"] - bsp["final"]
    out[key] = {
        "seeds": agg["seeds"], "reached": agg["time_to_target_n"],
        "speedup_median": agg["speedup_vs_bsp_median"], "speedup_min": agg["speedup_vs_bsp_min"],
        "speedup_max": agg["speedup_vs_bsp_max"], "speedup_n": agg["speedup_vs_bsp_n"],
        "delta_pp": None if delta is None else 100.0 * delta,
        "final": agg["final"], "target": agg["target"],
        "bytes_vs_bsp": (agg["bytes_pushed"] / bsp["bytes_pushed"]
                         if bsp and agg["bytes_pushed"] and bsp["bytes_pushed"] else None),
        "unhealthy": agg["collapsed"] + agg["diverged"], "chosen": chosen.get(key),
        "bsp_reached": bsp["time_to_target_n"] if bsp else 0,
        "times": {r["seed"]: r["time_to_target"] for r in trials[key]},
        "ends": {r["seed"]: _end_time(r) for r in trials[key]},
        "at_equal_time": (None if key == ("bsp", "none")
                          else delta_at_equal_time(trials[key], trials[("bsp", "none")]))}
  base = out.get(("bsp", "none"))
  for key, fig in out.items():   # the same for the speedup, per seed, where no BSP trial matched
    if fig["speedup_median"] is None and fig["reached"] and base is not None and key != (
        "bsp", "none"):
      over = speedup_over(fig, base, ahead=False)   # the report's rule: seeds both reached
      if over is not None:
        fig.update(speedup_median=over["median"], speedup_min=over["min"],
                   speedup_max=over["max"], speedup_n=over["n"])
  return out


def _end_time(row: dict) -> float | None:
  """A healthy trial's virtual time at its end (its final evaluation's, ``report.collect``'s
  ``virtual_time``); None for an unhealthy one."""
  return None if row["status"] in report.UNHEALTHY else row["virtual_time"]


def speedup_over(fig: dict[str, Any], base: dict[str, Any], *, ahead: bool = True
                 ) -> dict[str, Any] | None:
  """``fig``'s per-seed speedup over ``base``: median, min, max, over how many seeds (``n``), and
  on how many of them ``fig`` is ahead (``ahead``); None where no seed compares.

  A seed compares where ``fig`` reached the target and ``base`` did too (its time to target
  over ``fig``'s), or, with ``ahead``, where ``base`` ran healthy past ``fig``'s time to target
  (its ``ends``) without reaching it: ``fig`` is ahead there, a speedup of ``inf``. A seed
  where ``base`` ended sooner without reaching the target says nothing, and is left out.
  """
  ratios, leads = [], 0
  for seed, t in fig["times"].items():
    if not t:
      continue
    theirs, end = base["times"].get(seed), base.get("ends", {}).get(seed)
    if theirs:
      ratios.append(theirs / t)
    elif ahead and end is not None and end >= t:
      leads += 1
  if not ratios and not leads:
    return None
  ratios = sorted(ratios) + [float("inf")] * leads
  # With seeds ahead, of two middle values the lower (never the mean of a finite one and inf).
  middle = statistics.median_low(ratios) if leads else statistics.median(ratios)
  return {"median": middle, "min": ratios[0], "max": ratios[-1], "n": len(ratios),
          "ahead": leads}


def metric_at(metrics: list[dict], metric: str, t: float) -> float | None:
  """``metric`` at virtual time ``t``, interpolated linearly between the evaluations around it;
  None outside the evaluated span or where no evaluation has both."""
  return _value_at(report_figures.timed_series(metrics, metric), t)


def _value_at(series: np.ndarray, t: float) -> float | None:
  """:func:`metric_at` on a :func:`report_figures.timed_series`."""
  if not len(series) or not series[0, 0] <= t <= series[-1, 0]:
    return None
  return float(np.interp(t, series[:, 0], series[:, 1]))


def delta_at_equal_time(rows: Sequence[dict], base_rows: Sequence[dict]
                        ) -> dict[str, Any] | None:
  """Per seed that both ran to the end healthy: the trial's metric minus the baseline's, each at
  the earlier of the two runs' last evaluations (virtual time), in points; median, min, max and
  how many seeds. None where no seed has both.

  A scheme that finishes its epochs sooner in virtual time ends with fewer seconds of training
  than BSP, so its final accuracy after the same epochs understates it; this compares the two
  at the same virtual time instead. It informs and does not decide: the verdicts use the final
  accuracy, as declared before the runs.
  """
  base = {r["seed"]: r for r in base_rows if r["status"] not in report.UNHEALTHY}
  deltas = []
  for row in rows:
    other = base.get(row["seed"])
    if other is None or row["status"] in report.UNHEALTHY:
      continue
    mine, theirs = (report_figures.timed_series(r["_metrics"], r["metric"]) for r in (row, other))
    if not len(mine) or not len(theirs):
      continue
    t = min(mine[-1, 0], theirs[-1, 0])   # the earlier of the two runs' last evaluations
    mine, theirs = _value_at(mine, t), _value_at(theirs, t)
    if mine is not None and theirs is not None:
      deltas.append(100.0 * (mine - theirs))
  if not deltas:
    return None
  deltas.sort()
  return {"median": statistics.median(deltas), "min": deltas[0], "max": deltas[-1],
          "n": len(deltas)}


def verdict(claim: Claim, fig: dict[str, Any] | None) -> str:
  """One sentence on whether ``claim`` holds for these figures, and why not where it does not."""
  if fig is None:
    return "not run in this study"
  if claim.scheme == ("bsp", "none"):
    return "the baseline"
  why = []
  if fig["unhealthy"]:
    why.append(f"{fig['unhealthy']} of {fig['seeds']} seeds collapsed or diverged")
  if claim.min_speedup is not None:
    if fig["speedup_median"] is None and not fig["bsp_reached"]:
      why.append("BSP never reached the target either, so there is no speedup to compare")
    elif fig["speedup_median"] is None:
      why.append("it never reached the target on a seed where BSP did (no speedup)")
    elif fig["speedup_median"] < claim.min_speedup:
      why.append(f"its median speedup {fig['speedup_median']:.2f}x is below the "
                 f"{claim.min_speedup:.2f}x the claim needs")
    if 0 < fig["reached"] < fig["seeds"]:   # its own seeds (where BSP missed, not its doing)
      why.append(f"only {fig['reached']} of {fig['seeds']} seeds reached the target")
    for name, over in fig.get("vs", {}).items():
      if over is None:
        why.append(f"no seed where both it and {name} reached the target (no speedup over "
                   f"{name})")
      elif over["median"] < claim.min_speedup:
        why.append(f"its median speedup over {name}, {over['median']:.2f}x, is below the "
                   f"{claim.min_speedup:.2f}x")
  if claim.max_drop_pp is not None:
    if fig["delta_pp"] is None:
      why.append("there is no final accuracy of it and BSP's to compare")
    elif fig["delta_pp"] < -claim.max_drop_pp:
      why.append(f"it ends {-fig['delta_pp']:.2f} points below BSP, more than the "
                 f"{claim.max_drop_pp:g} allowed")
  if claim.max_bytes_vs_bsp is not None:
    if fig["bytes_vs_bsp"] is None:
      why.append("there are no bytes of it and BSP's to compare")
    elif fig["bytes_vs_bsp"] > claim.max_bytes_vs_bsp:
      why.append(f"it pushes {fig['bytes_vs_bsp']:.3f} of BSP's bytes, more than the "
                 f"{claim.max_bytes_vs_bsp:.3f} the claim allows")
  if not why:
    return "holds here"
  return "does not hold here: " + "; ".join(why)


def _cell(fig: dict[str, Any] | None) -> str:
  if fig is None:
    return "–"
  parts = []
  if fig["speedup_median"] is not None:
    parts.append(f"{fig['speedup_median']:.2f}x ({fig['speedup_min']:.2f}-"
                 f"{fig['speedup_max']:.2f}, {fig['speedup_n']}/{fig['seeds']} seeds)")
  else:
    parts.append(f"never at target ({fig['reached']}/{fig['seeds']} seeds reached it)")
  for name, over in fig.get("vs", {}).items():
    parts.append(_over_text(name, over))
  if fig["delta_pp"] is not None:
    parts.append(f"{fig['delta_pp']:+.2f} pp")
  equal = fig.get("at_equal_time")
  if equal is not None:
    parts.append(f"{equal['median']:+.2f} pp at equal virtual time ({equal['min']:+.2f} to "
                 f"{equal['max']:+.2f})")
  if fig["bytes_vs_bsp"] is not None:
    parts.append(f"{fig['bytes_vs_bsp']:.2f}x bytes")
  chosen = {k: v for k, v in (fig["chosen"] or {}).items() if v is not None}
  if chosen:   # each key by its last part, unless two share it (an outer and an inner rate)
    short = [k.split(".")[-1] for k in chosen]
    parts.append("at " + ", ".join(f"{s if short.count(s) == 1 else k}={v}"
                                   for s, (k, v) in zip(short, chosen.items())))
  return "; ".join(parts)


def _over_text(name: str, over: dict[str, Any] | None) -> str:
  """A cell's speedup over another baseline (:func:`speedup_over`)."""
  if over is None:
    return f"over {name} –"
  x = lambda v: "inf" if v == float("inf") else f"{v:.2f}"
  text = f"over {name} {x(over['median'])}x ({x(over['min'])}-{x(over['max'])})"
  if over.get("ahead"):
    text += (f", ahead on {over['ahead']} of {over['n']} seeds where {name} ran past its time "
             "without reaching the target")
  return text


def claims_rows(root: str, studies: Sequence[Study]) -> list[dict[str, Any]]:
  """One row per claim and study: its figures and the verdict (studies with no report: none)."""
  rows = []
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    try:
      figs = figures(workdir)
    except ValueError:   # nothing finished yet
      continue
    for claim in CLAIMS:
      fig = figs.get(claim.scheme)
      if fig is None:
        continue
      fig = {**fig, "vs": {NAMES[b]: speedup_over(fig, figs[b]) for b in claim.baselines
                           if b in figs}}
      rows.append({"claim": claim.name, "paper": claim.paper, "statement": claim.statement,
                   "study": study.name, "protocol": study.protocol, "cell": _cell(fig),
                   "verdict": verdict(claim, fig), **{k: v for k, v in fig.items()
                                                      if k not in ("chosen", "bsp_reached",
                                                                   "times", "ends", "vs",
                                                                   "at_equal_time")},
                   "speedup_over_others": _json(fig["vs"]) if fig["vs"] else "",
                   "delta_equal_time_pp": (None if fig["at_equal_time"] is None
                                           else fig["at_equal_time"]["median"]),
                   "chosen": json.dumps(fig["chosen"]) if fig["chosen"] else ""})
  return rows


def _json(value) -> str:
  """``value`` as standard JSON: an infinite speedup (a seed ahead) as the string "inf"."""
  finite = lambda v: "inf" if isinstance(v, float) and v == float("inf") else v
  return json.dumps({k: None if o is None else {f: finite(v) for f, v in o.items()}
                     for k, o in value.items()}, allow_nan=False)


def _machine(trial_dir: str) -> str:
  """Where a finished trial ran, from its ``summary.json``: ``CPU (AMD EPYC)``, the GPU's name."""
  try:
    with open(os.path.join(trial_dir, "summary.json")) as f:
      env = json.load(f).get("environment") or {}
  except (OSError, ValueError):
    env = {}
  if env.get("backend") == "cpu":
    return f"CPU ({env.get('cpu') or 'unknown'})"
  return str((env.get("devices") or [env.get("backend") or "an unrecorded machine"])[0])


def costs(root: str, studies: Sequence[Study]) -> list[dict[str, Any]]:
  """Per study: its finished trials and the hours they took (each trial's own wall time, start-up
  included, as ``trial.json`` records it, summed over every attempt; with ``--parallel=N`` the
  study's wall time is about that over N)."""
  rows = []
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    names = report.grid(workdir) if os.path.isdir(workdir) else None
    done = [os.path.join(workdir, n) for n in names or ()
            if sweep_lib.trial_status(os.path.join(workdir, n)) in sweep_lib.FINISHED]
    minutes = [m for m in map(_trial_minutes, done) if m is not None]
    machines = collections.Counter(map(_machine, done))
    rows.append({"study": study.name, "trials": len(names or ()), "finished": len(done),
                 "ran_on": ", ".join(f"{n} on {m}" for m, n in sorted(machines.items())),
                 "extended": len(report.extended(workdir)) if names is not None else 0,
                 "hours": sum(minutes) / 60.0, "timed": len(minutes),
                 "median_minutes": statistics.median(minutes) if minutes else None})
  return rows


CSV_COLUMNS = ("claim", "paper", "statement", "study", "protocol", "seeds", "reached",
               "speedup_median", "speedup_min", "speedup_max", "speedup_n",
               "speedup_over_others", "delta_pp", "delta_equal_time_pp",
               "bytes_vs_bsp", "unhealthy", "chosen", "target", "verdict")


def write_claims(root: str, studies: Sequence[Study]) -> dict[str, str]:
  """``claims.md``, ``claims.csv`` and ``claims.png`` under ``root`` from the studies' trials."""
  rows = claims_rows(root, studies)
  paths = {"md": os.path.join(root, "claims.md"), "csv": os.path.join(root, "claims.csv")}
  with open(paths["csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  ran = [s for s in studies if any(r["study"] == s.name for r in rows)]
  cost = costs(root, ran)
  paths["png"] = _plot(rows, ran, os.path.join(root, "claims.png"))
  pending = [s for s in studies if s not in ran]
  waiting = list(zip(pending, costs(root, pending)))
  partial = {c["study"] for c in cost if c["finished"] < c["trials"]}
  lines = (_head_lines(ran, cost, waiting) + _table_lines(rows, ran, partial)
           + ["", "![speedups](claims.png)", "", "Each study's report (the tuning disclosed, "
              "every trial, the figures): "
              + ", ".join(f"[`{s.name}`]({s.name}/report.md)" for s in ran) + "."]
           + _cost_lines(cost))
  with open(paths["md"], "w") as f:
    f.write("\n".join(lines) + "\n")
  return paths


def _head_lines(ran: Sequence[Study], cost: list[dict],
                waiting: Sequence[tuple[Study, dict]] = ()) -> list[str]:
  """``claims.md``'s title, what a cell holds, the studies, and whether it is final
  (``waiting``: each study asked for that has no claim's figures yet, with its :func:`costs`)."""
  lines = ["# The papers' claims, measured", "",
           "Generated by `python -m experiments.reproduce` from the trials under its `--out` "
           "directory's `runs/`; nothing here is typed by hand. Each cell: the median speedup "
           "over BSP to the study's target (min-max over seeds, and how many seeds it is over), "
           "the final accuracy against BSP's in points, the accuracy against BSP's at equal "
           "virtual time (median and min to max over seeds, each seed at the earlier of the two "
           "runs' ends: a scheme that finishes its epochs sooner has trained fewer virtual "
           "seconds; this figure informs and does not decide, added on 2026-11-28 after the "
           "CIFAR-10 study had been seen), bytes pushed against BSP's, and the "
           "rate it ran at. Under \"tuned\" every scheme, BSP included, is at its own best "
           f"rate ({report.TUNING_CRITERION}). Disclosed: {NAMED_BASELINES_ADDED}.", "",
           "Studies:", ""]
  lines += [f"- `{s.name}` ({s.protocol}): {s.title}; `{s.sweep}`" for s in ran]
  partial = [c for c in cost if c["finished"] < c["trials"]]
  said = [f"`{c['study']}` has {c['finished']} of {c['trials']} trials finished; its figures "
          "are of those, and its grid may still be extended" for c in partial]
  for study, c in waiting:
    said.append(f"`{study.name}` has no finished trial yet, so it has no column ({study.title})"
                if not c["finished"] else
                f"`{study.name}` has {c['finished']} of {c['trials']} trials finished, none yet "
                f"of a scheme with a claim, so it has no column ({study.title})")
  if said:
    lines += ["", "**Not final**: " + "; ".join(said) + ". A rerun of the command goes on."]
  return lines


def _table_lines(rows: list[dict], ran: Sequence[Study], partial: set = frozenset()
                 ) -> list[str]:
  """The claims table (a row per claim, a column per study) and the rule behind its verdicts
  (``partial``: the names of the studies with trials still to run)."""
  lines = ["", "| claim | paper says | " + " | ".join(f"`{s.name}`" for s in ran) + " |",
           "|---|---|" + "---|" * len(ran)]
  for claim in CLAIMS:
    cells = {r["study"]: f"{r['cell']}. **{r['verdict'][0].upper()}{r['verdict'][1:]}.**"
             for r in rows if r["claim"] == claim.name}
    if cells:
      lines.append(f"| {claim.name} | {claim.statement} ({claim.paper}) | "
                   + " | ".join(cells.get(s.name, "no finished trial yet, or not in this study"
                                          if s.name in partial else "not in this study")
                                for s in ran) + " |")
  return lines + [
      "", "A claim holds here when its median speedup over BSP reaches what it needs (GSSP's "
      "lower end, 1.46x; otherwise faster than BSP), and so does its median speedup over each "
      f"other baseline the claim names ({_named_baselines()}; each at its own best rate, per "
      "seed, a seed on which the baseline ran past the scheme's time to the target without "
      "reaching it counting the scheme ahead), no seed collapsed, every seed reached the "
      "target, and it ends at most the allowed points below BSP (1 unless the claim says "
      "otherwise). These are statements about these studies' settings only."]


def _named_baselines() -> str:
  """``GSSP's: ASP and SSP; ...``: the baselines besides BSP that each claim names."""
  by = collections.defaultdict(list)
  for claim in CLAIMS:
    if claim.baselines:
      by[" and ".join(NAMES[b] for b in claim.baselines)].append(claim.name)
  return "; ".join(" and ".join(f"{n}'s" for n in names) + ": " + against
                   for against, names in by.items())


def _cost_lines(cost: list[dict]) -> list[str]:
  """What the studies cost (:func:`costs`), as a table."""
  lines = ["", "Cost, from each trial's own wall time (start-up included, every attempt; "
           "`trial.json`): the median trial, and the sum, which also holds any time a trial "
           "shared the cores or was paused. With `--parallel=N` on a machine like the one that "
           "ran it, a study takes about its trials times the median, over N.", "",
           "| study | trials finished | of them added at the grid's edge | ran on | median "
           "minutes per trial | summed trial-hours |", "|---|---|---|---|---|---|"]
  for c in cost:
    median = "–" if c["median_minutes"] is None else f"{c['median_minutes']:.1f}"
    untimed = "" if c["timed"] == c["finished"] else " (some untimed)"
    lines.append(f"| `{c['study']}` | {c['finished']} of {c['trials']} | {c['extended']} | "
                 f"{c['ran_on'] or '–'} | {median} | {c['hours']:.1f}{untimed} |")
  return lines


def _plot(rows: list[dict], studies: Sequence[Study], path: str) -> str:
  """Median speedup over BSP per claim and study, with the seeds' range."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [c.name for c in CLAIMS if any(r["claim"] == c.name for r in rows)]
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 3.6))
  width = 0.8 / max(1, len(studies))
  for i, study in enumerate(studies):
    labelled = False
    for j, name in enumerate(names):
      r = next((r for r in rows if r["claim"] == name and r["study"] == study.name), None)
      if r is None or r["speedup_median"] is None:
        continue
      x = j + (i - (len(studies) - 1) / 2) * width
      ax.bar(x, r["speedup_median"], width, color=f"C{i}",
             label=None if labelled else study.name)
      labelled = True
      ax.errorbar(x, r["speedup_median"], yerr=[[r["speedup_median"] - r["speedup_min"]],
                                                [r["speedup_max"] - r["speedup_median"]]],
                  color="black", capsize=2, linewidth=0.8)
  needs = [(j, c.min_speedup) for j, name in enumerate(names) for c in CLAIMS
           if c.name == name and c.min_speedup is not None and c.min_speedup > 1.0]
  for k, (j, need) in enumerate(needs):   # what each claim needs, where it names a speedup
    ax.hlines(need, j - 0.45, j + 0.45, colors="red", linestyles="dashed", linewidth=1.0,
              label="what the claim needs" if k == 0 else None)
  ax.axhline(1.0, color="grey", linewidth=0.8)
  ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
  ax.set_ylabel("speedup over BSP to target")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# -- publishing ---------------------------------------------------------------------------------

BEGIN = "<!-- claims table: written by `python -m experiments.reproduce --publish`; do not edit -->"
END = "<!-- end of the claims table -->"
_PUBLISHED = (".md", ".csv", ".png")


def check_doc(doc: str) -> str:
  """``doc``'s text, if it holds :data:`BEGIN` and :data:`END` once each, in that order."""
  try:
    with open(doc) as f:
      text = f.read()
  except OSError as e:
    raise ValueError(f"--doc={doc!r} cannot be read ({e.strerror}); allowed: a Markdown file "
                     "with the claims-table markers") from None
  if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
    raise ValueError(f"--doc={doc!r} is invalid: it needs the lines {BEGIN!r} and {END!r}, once "
                     "each and in that order, around the place of the table")
  return text


# What a trial's saved record leaves out: its checkpoints (a finished trial never resumes), its
# TensorBoard events (the same evaluations as ``metrics.jsonl``) and any half-written file.
_NOT_SAVED = ("checkpoints", "tensorboard", "*.tmp")
_RECORD_FILES = ("summary.json", "trial.json")   # a saved trial whose two are the same is kept


def _ended(trial_dir: str) -> bool:
  """Whether a trial has finished and its process has recorded so: ``summary.json`` says
  finished and ``trial.json`` (where the sweep keeps one) no longer says ``running``. Neither
  changes after that: a rerun never retries a finished trial."""
  if sweep_lib.trial_status(trial_dir) not in sweep_lib.FINISHED:
    return False
  path = os.path.join(trial_dir, "trial.json")
  if not os.path.exists(path):
    return True
  try:
    with open(path) as f:
      return json.load(f).get("status") != "running"
  except ValueError:   # being written by hand or by another tool: not yet
    return False


def _same_files(a: str, b: str, names: Sequence[str]) -> bool:
  for name in names:
    try:
      with open(os.path.join(a, name), "rb") as f, open(os.path.join(b, name), "rb") as g:
        if f.read() != g.read():
          return False
    except FileNotFoundError:
      if os.path.exists(os.path.join(a, name)) or os.path.exists(os.path.join(b, name)):
        return False
  return True


def save_runs(root: str, studies: Sequence[Study], dest: str) -> dict[str, list[str]]:
  """Copies each study's finished trials from ``root/runs/<study>/`` into ``dest/runs/<study>/``
  (their records: config, summary, evaluations, log; not :data:`_NOT_SAVED`), with the trials
  the grid-edge rule added (``extended.json``), so that the table can be rebuilt, and the studies
  go on, from ``dest`` on another machine or in a later session:
  ``--merge_from=dest`` takes them into a fresh ``--out``.

  Only trials that have ended are copied (:func:`_ended`: a trial still being recorded is
  left for the next save); a finished trial's record does not change, so one already in
  ``dest`` with the same summary and ``trial.json`` is not copied again; nothing in ``dest`` is
  deleted.

  Returns:
    per study, the trials in ``dest`` that ended here (copied now or before).
  """
  saved = {}
  for study in studies:
    src, dst = (os.path.join(d, "runs", study.name) for d in (root, dest))
    names = [] if not os.path.isdir(src) else sorted(
        n for n in os.listdir(src) if _ended(os.path.join(src, n)))
    saved[study.name] = names
    if not names:
      continue
    os.makedirs(dst, exist_ok=True)
    extended = os.path.join(src, sweep_lib.EXTENDED_FILE)
    if os.path.exists(extended):
      shutil.copyfile(extended, os.path.join(dst, sweep_lib.EXTENDED_FILE))
    for name in names:
      if not _same_files(os.path.join(src, name), os.path.join(dst, name), _RECORD_FILES):
        shutil.copytree(os.path.join(src, name), os.path.join(dst, name), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*_NOT_SAVED))
  return saved


class Saver:
  """Saves the finished trials' records (:func:`save_runs`) every ``every`` seconds while the
  studies run, so that a machine that goes away mid-study loses at most that much of what has
  finished (the records land in ``dest``, inside the repository: a checkout's uncommitted files
  can be recovered, a scratch directory's cannot).

  Concurrency: one daemon thread, started and stopped by the thread that runs the studies. It
  only reads ``root/runs/`` (written by the trials' processes and the sweep) and only writes
  under ``dest``, copying a trial once it has ended (:func:`_ended`), after which nothing
  writes to it. :meth:`stop` joins the thread, then saves once more, so at most one save runs at
  a time and the last one sees every trial that ended. A save that fails is logged and tried
  again at the next tick; it never stops the studies.
  """

  def __init__(self, root: str, studies: Sequence[Study], dest: str, every: float = 60.0):
    self._args = (root, list(studies), dest)
    self._every = every
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="reproduce-saver", daemon=True)

  def _save(self) -> dict[str, list[str]] | None:
    try:
      return save_runs(*self._args)
    except (OSError, ValueError) as e:   # a full disk, a file gone or half-written under it
      logging.warning("saving the finished trials to %s failed (%s); trying again later",
                      self._args[2], e)
      return None

  def _loop(self) -> None:
    while not self._stop.wait(self._every):
      self._save()

  def __enter__(self) -> "Saver":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

  def stop(self) -> dict[str, list[str]] | None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    return self._save()


def publish(root: str, studies: Sequence[Study], dest: str, doc: str | None = None) -> list[str]:
  """Copies the claims table and each study's report from ``root`` into ``dest`` (e.g.
  ``results/claims``), with the finished trials' records behind them (:func:`save_runs`:
  ``--merge_from=dest`` rebuilds the table from them), and, with ``doc``, puts the table between
  :data:`BEGIN` and :data:`END` in it (its links made relative to ``doc``). Returns the files
  written (the table's, the reports', the doc; not the records).

  Raises:
    ValueError: nothing to publish (no claims table under ``root``), or ``doc`` lacks the
      markers (checked before anything is copied).
  """
  claims = os.path.join(root, "claims.md")
  if not os.path.exists(claims):
    raise ValueError(f"no claims table in {root!r} to publish; run experiments.reproduce "
                     "with this --out first")
  text = None if doc is None else check_doc(doc)
  written = []
  os.makedirs(dest, exist_ok=True)
  for name in ("claims.md", "claims.csv", "claims.png"):
    if os.path.exists(os.path.join(root, name)):
      shutil.copyfile(os.path.join(root, name), os.path.join(dest, name))
      written.append(os.path.join(dest, name))
  for study in studies:
    source = os.path.join(root, study.name)
    if not os.path.isdir(source):
      continue
    os.makedirs(os.path.join(dest, study.name), exist_ok=True)
    for name in sorted(os.listdir(source)):
      if name.endswith(_PUBLISHED):
        shutil.copyfile(os.path.join(source, name), os.path.join(dest, study.name, name))
        written.append(os.path.join(dest, study.name, name))
  save_runs(root, studies, dest)
  if doc is not None:
    prefix = os.path.relpath(dest, os.path.dirname(os.path.abspath(doc)))
    with open(claims) as f:
      body = f.read().split("\n", 1)[1].strip()   # without its title: the doc has its own
    body = re.sub(r"\]\((?![a-z]+:|/|#)([^)]+)\)",
                  lambda m: f"]({prefix}/{m.group(1)})", body)
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    with open(doc, "w") as f:
      f.write(f"{head}{BEGIN}\n\n{body}\n\n{END}{tail}")
    written.append(doc)
  return written
