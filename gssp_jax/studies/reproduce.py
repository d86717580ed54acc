"""The papers' claims, from one command: the studies behind them, their reports, the claims table.

``experiments.reproduce`` runs the declared :data:`STUDIES` (each a sweep file, resumable: a
rerun skips finished trials and resumes the rest from their checkpoints; a tuned key with a
ladder is extended past a winner at the grid's edge, ``gssp_jax.studies.grid_edge``), writes
each one's report (``gssp_jax.studies.report``) and then the claims table
(:func:`write_claims`): for every claim of :data:`CLAIMS` (``gssp_jax.studies.claims``), the
figures of each study that has its scheme, each a median over the reported seeds with its 95 %
interval (``gssp_jax.studies.evidence``),
and its verdict, one of three, with the reasons; the trials' provenance
(``gssp_jax.studies.provenance``: a trial of a dirty tree or without a commit is refused
unless marked); and the regime map of a ``"regimes"`` study (``gssp_jax.studies.regimes``).

Layout of ``--out=DIR``::

  DIR/runs/<study>/<trial>/   the sweep's trials (workdirs)
  DIR/<study>/                its report: report.md, report.csv, summary.csv, tuning.csv, figures
  DIR/claims.md, claims.csv, claims.png   the claims table
  DIR/regime_map/regime_map.png, .csv     the regime map (a "regimes" study)

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

from gssp_jax.studies import grid_edge
from gssp_jax.studies import report
from gssp_jax.studies import sweep as sweep_lib
from gssp_jax.studies import claims as claims_lib
from gssp_jax.studies import provenance
from gssp_jax.studies import regimes


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
    protocol: ``"authors"`` (the papers' own settings), ``"tuned"`` (each scheme at its best
      rate of a declared grid) or ``"fixed"`` (declared rates); the claims table has one
      column of each claims study.
    kind: ``"claims"`` (a column of the claims table) or ``"regimes"`` (the regime map,
      ``studies.regimes``: the schemes over a grid of clusters, beside the table).
  """
  name: str
  sweep: str
  title: str
  minutes_per_trial: float
  protocol: str
  kind: str = "claims"


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
    # Issue 59's protocol: rates chosen on a validation split on tuning seeds 0-2, reported on
    # seeds 100-104 alone, equal server capacity (and, where no local-update scheme runs, a
    # virtual-time budget with the schedule following it); see each sweep file.
    Study("mnist", "configs/sweeps/mnist_protocol.py",
          "LeNet-5/MNIST, 16 workers in 4 speed tiers, every scheme (BSP also over a ring "
          "all-reduce) at its best rate chosen on a validation split on 3 tuning seeds, "
          "reported on 5 others; equal server capacity; 32 virtual seconds each; target 98 %",
          4.0, "tuned"),
    Study("dssync_uniform", "configs/sweeps/dssync_network.py:uniform",
          "LeNet-5/MNIST, the tiers cluster with a push costing one base iteration: BSP, BSP "
          "over a ring all-reduce and DS-Sync, tuned as `mnist`, 40 virtual seconds, target "
          "98 %", 2.0, "tuned"),
    Study("dssync_bottleneck", "configs/sweeps/dssync_network.py:bottleneck",
          "the same with one worker of each tier on a link 10x slower (a network "
          "bottleneck)", 2.0, "tuned"),
    Study("cifar10", "configs/sweeps/paper_cifar10_tuned.py:protocol",
          "ResNet-18 x1/4 on 8,192 CIFAR-10 images (1,024 held out for validation), 8 workers "
          "in 4 speed tiers, BSP, SSP, GSSP, GSSP + GDTopK and DiLoCo tuned as `mnist`, equal "
          "server capacity, 4 epochs, target 35 %", 10.0, "tuned"),
    Study("local_update_protocol", "configs/sweeps/local_update_mnist.py:tiers,long,protocol",
          "LeNet-5/MNIST, the local-update schemes beside BSP, SSP and GSSP, tuned as `mnist`, "
          "equal server capacity, 8 epochs, target 98 %", 6.1, "tuned"),
    Study("regime_map", "configs/sweeps/regime_map.py",
          "LeNet-5/MNIST, BSP, SSP, GSSP and DiLoCo at fixed rates on 12 clusters (tier ratio "
          "1x, 2x, 4x and 2x with jitter; one push = 0.1, 1 or 10 base iterations), 5 seeds, "
          "3 epochs, target 97 %", 1.3, "fixed", "regimes"),
    # Issue 62: clusters as researchers meet them (a real job's straggler trace, the HALoS
    # paper's geo network), BSP against GSSP under a smaller form of the protocol.
    Study("trace_ar", "configs/sweeps/clusters.py:trace_ar",
          "LeNet-5/MNIST, 16 workers timed by a real job's trace (trace-AR: 4 of them 2.2x "
          "stragglers), BSP and GSSP at the best of {0.05, 0.1} on a validation split over 2 "
          "tuning seeds, reported on 3 others; equal server capacity; 16 virtual seconds; "
          "target 97 %", 2.5, "tuned"),
    Study("halos_network", "configs/sweeps/clusters.py:halos",
          "LeNet-5/MNIST in the HALoS paper's setting (4 regions of 4 workers, 0.117-0.935 "
          "Gb/s between regions, its workers' speeds, 1x to 8.5x), BSP and GSSP (a group per "
          "region) tuned as `trace_ar`; 32 virtual seconds; target 97 %", 4.0, "tuned"),
    Study("tiny", "configs/sweeps/tiny_tune.py",
          "a pipeline check: 2 schemes x 2 rates x 2 seeds on 512 examples (not a result)",
          0.2, "tuned"),
)}
# In the order of the published table's columns, so that the plain command
# (``--merge_from=results/claims --plan``) rebuilds it byte for byte.
DEFAULT_STUDIES = ("mnist_tuned", "mnist_authors", "local_update", "cifar10_tuned",
                   "local_update_long")
# The rerun under issue 59's protocol (``--only=...``), to replace the default once complete.
# Issue 62's studies (``configs/sweeps/clusters.py``).
CLUSTER_STUDIES = ("trace_ar", "halos_network")
PROTOCOL_STUDIES = ("mnist", "dssync_uniform", "dssync_bottleneck", "cifar10",
                    "local_update_protocol", "regime_map")


# Disclosed in the table's header: when the claims took the form they are judged in.
CLAIMS_RESTATED = (
    "the claims were restated as their papers state them (each against the scheme its paper "
    "names: InHAD against ASP, DSSP against SSP, GDTopK by the accuracy it recovers over GSSP "
    "and its traffic; GSSP against BSP and ASP), with intervals and three-way verdicts, on "
    "2026-12-06 (issue 59), after the earlier table of 277 trials had been seen and before "
    "the rerun under this protocol")
CLAIMS = claims_lib.CLAIMS


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
                   "those tried, and each chosen rate on the reporting seeds it keeps apart "
                   "(gssp_jax.studies.grid_edge)")
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
    _merge_marks(src, dst)
  return out


def _merge_marks(src: str, dst: str) -> None:
  """Adds ``src``'s provenance marks (``studies.provenance``) that ``dst`` lacks to ``dst``'s."""
  theirs = provenance.marks(src)
  ours = provenance.marks(dst) if os.path.isdir(dst) else {}
  if set(theirs) - set(ours):
    from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    os.makedirs(dst, exist_ok=True)
    workdir_lib.write_json(os.path.join(dst, provenance.MARK_FILE),
                           {"accepted": {**theirs, **ours}})


def mark(root: str, specs: Sequence[str], why: str) -> dict[str, dict[str, str]]:
  """Marks trials (``<study>/<trial>``, under ``root/runs``) as kept despite their provenance
  (``studies.provenance.mark``); returns per study its marks."""
  by_study: dict[str, list[str]] = collections.defaultdict(list)
  for spec in specs:
    study, _, trial = spec.partition("/")
    if study not in STUDIES or not trial:
      raise ValueError(f"--mark={spec!r} is invalid; allowed: <study>/<trial>, a study of "
                       f"{', '.join(STUDIES)}")
    by_study[study].append(trial)
  return {study: provenance.mark(os.path.join(root, "runs", study), trials, why)
          for study, trials in by_study.items()}


def provenance_lines(root: str, studies: Sequence[Study]) -> list[str]:
  """The table's header on where its trials came from: per study, the commits its finished
  trials ran, the trials refused (left out of every figure) and those kept by a mark."""
  lines = []
  for study in studies:
    workdir = os.path.join(root, "runs", study.name)
    names = [n for n in report.grid(workdir) or ()
             if sweep_lib.trial_status(os.path.join(workdir, n)) in sweep_lib.FINISHED]
    if not names:
      continue
    refused, marked = provenance.check(workdir, names)
    commits = provenance.commits(workdir, names)
    text = (f"- `{study.name}`: " + ", ".join(f"{n} at `{c}`" for c, n in sorted(
        commits.items(), key=lambda cn: (-cn[1], cn[0]))))
    if refused:
      text += (f"; **refused, left out of every figure** ({len(refused)}): "
               + "; ".join(f"`{n}` ({why})" for n, why in sorted(refused.items())))
    if marked:
      text += (f"; counted by a mark in its `{provenance.MARK_FILE}` ({len(marked)}): "
               + "; ".join(f"`{n}` ({why})" for n, why in sorted(marked.items())))
    lines.append(text)
  if not lines:
    return []
  return ["", "Provenance (each finished trial's commit, from its `summary.json`; the table "
          "counts a trial only if it ran a clean, committed tree, or is marked with the reason it "
          "is kept):", "", *lines]


def _running(workdir: str, name: str) -> bool:
  """Whether the trial's ``trial.json`` says it is running here (a run in progress, or one that
  died without a word: either way not replaced under it)."""
  path = os.path.join(workdir, name, "trial.json")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return json.load(f).get("status") == "running"


# -- the claims table ---------------------------------------------------------------------------


def study_figures(root: str, studies: Sequence[Study]) -> dict[str, dict]:
  """Per claims study with finished trials, its schemes' figures (``claims.figures``)."""
  out = {}
  for study in studies:
    if study.kind != "claims":
      continue
    try:
      out[study.name] = claims_lib.figures(os.path.join(root, "runs", study.name))
    except ValueError as e:
      if "two reported trials" in str(e):
        raise
      # else nothing finished yet
  return out


def claims_rows(root: str, studies: Sequence[Study],
                figures: dict[str, dict] | None = None) -> list[dict[str, Any]]:
  """One row per claim and study: its figures, comparisons and verdict (studies with no
  finished trial: none). ``figures``: :func:`study_figures`' (read here if not given)."""
  figures = study_figures(root, studies) if figures is None else figures
  rows = []
  for study in studies:
    figs = figures.get(study.name)
    if figs is None:
      continue
    for claim in CLAIMS:
      fig = figs.get(claim.scheme)
      if fig is None:
        continue
      vs = claims_lib.against(claim, figs)
      verdict, why = claims_lib.judge_claim(claim, fig, vs)
      first = next(iter(vs.values()))
      est = lambda k: None if first is None else first[k]
      rows.append({"claim": claim.name, "paper": claim.paper, "statement": claim.statement,
                   "study": study.name, "protocol": study.protocol,
                   "against": claims_lib.name(claim.reference), "seeds": fig["n"],
                   "seeds_apart": bool(fig["apart"]), "reached": fig["reached"],
                   "unhealthy": fig["unhealthy"], "target": fig["target"],
                   **_estimate_columns("speedup", est("speedup")),
                   **_estimate_columns("gap_pp", est("gap")),
                   **_estimate_columns("equal_time_gap_pp", est("equal_time")),
                   **_estimate_columns("bytes_ratio", est("bytes")),
                   "bytes_measure": est("bytes_measure"),
                   **{k: (json.dumps(v) if isinstance(v, dict) else v)
                      for k, v in claims_lib.traffic_of(fig).items()},
                   "comparisons": claims_lib.estimates_json(vs),
                   "chosen": json.dumps(fig["chosen"]) if fig["chosen"] else "",
                   "cell": claims_lib.cell(claim, fig, vs), "verdict": verdict,
                   "why": "; ".join(why)})
  return rows


def _estimate_columns(prefix: str, estimate) -> dict[str, Any]:
  """``prefix_median``, ``_lo``, ``_hi``, ``_n`` of an ``evidence.Estimate`` (None: empty);
  an infinity as ``inf``."""
  fields = ("median", "lo", "hi", "n")
  if estimate is None:
    return {f"{prefix}_{f}": None for f in fields}
  return {f"{prefix}_{f}": v for f, v in estimate.as_dict().items()}


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


CSV_COLUMNS = ("claim", "paper", "statement", "study", "protocol", "against", "seeds",
               "seeds_apart", "reached", "unhealthy",
               *(f"{p}_{f}" for p in ("speedup", "gap_pp", "equal_time_gap_pp", "bytes_ratio")
                 for f in ("median", "lo", "hi", "n")),
               "bytes_measure", "bytes_total", "bytes_by_class", "comparisons", "chosen",
               "target", "verdict", "why")


def write_claims(root: str, studies: Sequence[Study]) -> dict[str, str]:
  """``claims.md``, ``claims.csv`` and ``claims.png`` under ``root`` from the studies' trials."""
  figures = study_figures(root, studies)
  rows = claims_rows(root, studies, figures)
  paths = {"md": os.path.join(root, "claims.md"), "csv": os.path.join(root, "claims.csv")}
  with open(paths["csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  columns = [s for s in studies if any(r["study"] == s.name for r in rows)]
  maps = [(s, m) for s in studies if s.kind == "regimes" for m in [_regime_map(root, s)] if m]
  ran = [s for s in studies if s in columns or s in [m for m, _ in maps]]   # as asked
  cost = costs(root, ran)
  paths["png"] = _plot(rows, columns, os.path.join(root, "claims.png"))
  pending = [s for s in studies if s not in ran]
  waiting = list(zip(pending, costs(root, pending)))
  partial = {c["study"] for c in cost if c["finished"] < c["trials"]}
  lines = (_head_lines(ran, cost, waiting) + provenance_lines(root, ran)
           + server_lines(figures, columns)
           + _table_lines(rows, columns, partial)
           + ["", "![speedups](claims.png)", "", "Each study's report (the tuning disclosed, "
              "every trial, the figures): "
              + ", ".join(f"[`{s.name}`]({s.name}/report.md)" for s in ran) + "."]
           + [line for s, m in maps for line in _regime_lines(s, m)]
           + _cost_lines(cost))
  paths.update({f"{s.name}_{k}": p for s, m in maps for k, p in m["paths"].items()})
  with open(paths["md"], "w") as f:
    f.write("\n".join(lines) + "\n")
  return paths


def server_lines(figures: dict[str, dict], studies: Sequence[Study]) -> list[str]:
  """The table's header on resources: per study, each scheme's servers and each one's
  interface bandwidth, as its reported trials recorded them (``figures``:
  :func:`study_figures`')."""
  lines = []
  for study in studies:
    figs = figures.get(study.name)
    if figs is None:
      continue
    texts = {claims_lib.name(key): claims_lib.servers_text(fig) for key, fig in figs.items()}
    lines.append(f"- `{study.name}`: " + (f"every scheme {next(iter(texts.values()))}"
                                         if len(set(texts.values())) == 1 else
                                         "; ".join(f"{k} {v}" for k, v in texts.items())))
  if not lines:
    return []
  return ["", "Servers (each scheme's server interfaces and each one's bandwidth, from its "
          "reported trials' `summary.json`; records before issue 59 do not state them, and gave "
          "every server the cluster's `server_bandwidth`, so a scheme with G servers had G "
          "times BSP's capacity):", "", *lines]


def _regime_map(root: str, study: Study) -> dict | None:
  """The regime map of ``study`` (``studies.regimes``) written under ``root``: its cells and
  files; None while none of its cells has both BSP and a scheme finished."""
  try:
    found = regimes.cells(os.path.join(root, "runs", study.name))
  except ValueError as e:
    if "two trials" in str(e):
      raise
    return None
  if not found:
    return None
  return {"cells": found, "paths": regimes.write(os.path.join(root, "runs", study.name),
                                                  os.path.join(root, study.name))}


def _regime_lines(study: Study, found: dict) -> list[str]:
  """``claims.md``'s section on the regime map: the figure and its table."""
  return ["", f"## Where each scheme wins (`{study.name}`)", "",
          f"{study.title}. Each cell: the scheme's median speedup over BSP in that cell, per seed, "
          "with its 95 % interval (the rule above), and whether it is faster than BSP there "
          "(holds), not faster (does not hold) or inconclusive; `regime_map.csv` has every "
          "figure.", "", f"![regime map]({study.name}/regime_map.png)", "",
          *regimes.table_lines(found["cells"])]


def _head_lines(ran: Sequence[Study], cost: list[dict],
                waiting: Sequence[tuple[Study, dict]] = ()) -> list[str]:
  """``claims.md``'s title, what a cell holds, the studies, and whether it is final
  (``waiting``: each study asked for that has no claim's figures yet, with its :func:`costs`)."""
  lines = ["# The papers' claims, measured", "",
           "Generated by `python -m experiments.reproduce` from the trials under its `--out` "
           "directory's `runs/`; nothing here is typed by hand. Each cell: how many seeds are "
           "reported (kept apart from those that chose the rates, unless it says otherwise) and "
           "how many reached the target; then, against each scheme the claim names, the median "
           "over seeds of the per-seed speedup to the study's target with its 95 % interval in "
           "brackets, and against the first of them the final accuracy gap, the gap at equal "
           "virtual time (each seed at the earlier of the two runs' ends: a scheme that "
           "finishes its epochs sooner has trained fewer virtual seconds; it informs and does "
           "not decide) and the traffic ratio, each with its interval; and the rate it ran at. "
           "Under \"tuned\" every scheme, BSP included, is at its own best rate "
           f"({report.TUNING_CRITERION}). Disclosed: {CLAIMS_RESTATED}.", "",
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
    cells = {r["study"]: f"{r['cell']}. **{_sentence(r)}.**"
             for r in rows if r["claim"] == claim.name}
    if cells:
      lines.append(f"| {claim.name} | {claim.statement} ({claim.paper}) | "
                   + " | ".join(cells.get(s.name, "no finished trial yet, or not in this study"
                                          if s.name in partial else "not in this study")
                                for s in ran) + " |")
  return lines + ["", claims_lib.footer()]


def _sentence(row: dict) -> str:
  text = claims_lib.verdict_text(row["verdict"], row["why"].split("; ") if row["why"] else [])
  return text[0].upper() + text[1:]


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
  """Median speedup per claim and study, against the scheme the claim names first, with its
  95 % interval; an infinite end drawn at the top edge, marked."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [c.name for c in CLAIMS if any(r["claim"] == c.name and r["speedup_median"]
                                         is not None for r in rows)]
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 3.8))
  finite = [float(r[k]) for r in rows for k in ("speedup_lo", "speedup_hi", "speedup_median")
            if r[k] is not None and r[k] != "inf"]
  top = max([2.0] + finite) * 1.15
  width = 0.8 / max(1, len(studies))
  for i, study in enumerate(studies):
    labelled = False
    for j, claim_name in enumerate(names):
      r = next((r for r in rows if r["claim"] == claim_name and r["study"] == study.name), None)
      if r is None or r["speedup_median"] is None:
        continue
      x = j + (i - (len(studies) - 1) / 2) * width
      median, lo, hi = (top if r[k] == "inf" else float(r[k])
                        for k in ("speedup_median", "speedup_lo", "speedup_hi"))
      ax.bar(x, median, width, color=f"C{i}", label=None if labelled else study.name)
      labelled = True
      ax.errorbar(x, median, yerr=[[median - lo], [hi - median]], color="black", capsize=2,
                  linewidth=0.8)
      if "inf" in (r["speedup_median"], r["speedup_hi"]):
        ax.annotate("inf", (x, top), ha="center", va="bottom", fontsize=6)
  needs = [(j, c.min_speedup) for j, n in enumerate(names) for c in CLAIMS
           if c.name == n and c.min_speedup is not None]
  for k, (j, need) in enumerate(needs):   # what each claim needs, where it names a speedup
    ax.hlines(need, j - 0.45, j + 0.45, colors="red", linestyles="dashed", linewidth=1.0,
              label="what the claim needs" if k == 0 else None)
  ax.axhline(1.0, color="grey", linewidth=0.8)
  ax.set_ylim(0, top * 1.08)
  ax.set_xticks(range(len(names)),
                [f"{n}\nvs {r}" for n, r in ((n, next(c for c in CLAIMS if c.name == n))
                                              for n in names)
                 for r in [claims_lib.name(r.reference)]], rotation=20, ha="right", fontsize=7)
  ax.set_ylabel("speedup to target (median, 95 % interval)")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
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
    for kept in (sweep_lib.EXTENDED_FILE, provenance.MARK_FILE):
      if os.path.exists(os.path.join(src, kept)):
        shutil.copyfile(os.path.join(src, kept), os.path.join(dst, kept))
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
