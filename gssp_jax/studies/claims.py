"""The papers' claims, and what a study's trials say of each: figures over seeds and a verdict.

A claim (:class:`Claim`) names its scheme, the scheme it is judged against (its
``reference``, as its paper states it: BSP, ASP, SSP or GSSP), any further baselines its
speed is set against, and its bounds. For each study, :func:`figures` gathers every scheme's
reported trials (each at its chosen rate, on the reporting seeds) by seed;
:func:`compare` sets a scheme against another seed by seed (``studies.evidence``: the
per-seed rule, the median and its exact 95 % bootstrap interval); :func:`judge_claim`
gives the three-way verdict and its reasons; :func:`cell` writes the table's cell.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any, Sequence

import numpy as np

from gssp_jax.studies import report
from gssp_jax.studies import report_figures
from gssp_jax.studies import evidence
from gssp_jax.studies import provenance

BSP = ("bsp", "none")
RING = ("bsp_allreduce", "none")
NAMES = {BSP: "BSP", ("asp", "none"): "ASP", ("ssp", "none"): "SSP",
         ("gssp", "none"): "GSSP", ("diloco", "none"): "DiLoCo", RING: "BSP (ring all-reduce)"}


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim, and the bounds that decide it.

  Attributes:
    name: the scheme as the table names it.
    paper: who claims it.
    statement: the claim, in the paper's terms.
    scheme: ``(sync.scheme, compress.name)`` of the scheme's trials.
    reference: the scheme the paper judges it against (speed, accuracy and traffic).
    min_speedup: the speedup to the target over ``reference`` (and each of ``baselines``) its
      interval must clear; None where the claim is not about speed.
    max_drop_pp: how far below ``reference``'s final accuracy (points) it may end; None: not
      about accuracy.
    min_gain_pp: how far above ``reference``'s final accuracy it must end (a recovery); None.
    max_bytes: the most bytes it may move, as a share of ``reference``'s; None: not about
      traffic.
    baselines: further schemes its speed is set against, each at its own chosen rate.
  """
  name: str
  paper: str
  statement: str
  scheme: tuple[str, str]
  min_speedup: float | None
  max_drop_pp: float | None
  max_bytes: float | None = None
  baselines: tuple[tuple[str, str], ...] = ()
  reference: tuple[str, str] = BSP
  min_gain_pp: float | None = None


_DILOCO = (("diloco", "none"),)
CLAIMS = (
    Claim("GSSP", "the GSSP paper", "46-120 % faster than the baselines, under 1 % accuracy drop",
          ("gssp", "none"), 1.46, 1.0, baselines=(("asp", "none"),)),
    Claim("GSSP + GDTopK", "the GDTopK paper",
          "recovers part of the accuracy GSSP loses, with less traffic than GSSP",
          ("gssp", "gdtopk"), None, None, 1.0, reference=("gssp", "none"), min_gain_pp=0.0),
    Claim("SSP", "Ho et al. 2013", "faster than BSP at its accuracy", ("ssp", "none"), 1.0, 1.0),
    Claim("DSSP", "Zhao et al. 2019", "faster than SSP's fixed bound, at its accuracy",
          ("dssp", "none"), 1.0, 1.0, reference=("ssp", "none")),
    Claim("DS-Sync", "the DS-Sync paper",
          "BSP's accuracy in less time, where the network has a bottleneck", ("dssync", "none"),
          1.0, 1.0, baselines=(RING,)),
    Claim("CASP (Petrel)", "the Petrel paper",
          "up to 1.87x faster convergence, with less traffic (-26.85 %)", ("casp", "none"),
          1.0, 1.0, 1.0),
    Claim("InHAD", "the InHAD paper", "faster than ASP on heterogeneous workers, at its accuracy",
          ("inhad", "none"), 1.0, 1.0, reference=("asp", "none")),
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

# What the table counts as a scheme's traffic: every byte on every leg where the trials
# recorded it (``totals.bytes_total``), else the bytes pushed to a server (older records).
TRAFFIC_NOTE = ("bytes: every byte the run moved on every leg (summary.json's bytes_total; in "
                "records made before it was counted, the sum of the legs they counted: pushed, "
                "pulled, between servers, inside a node or a community), or, where even those "
                "are missing, the bytes pushed to a server alone (the cell then says "
                "\"pushed\")")


def name(key: tuple[str, str]) -> str:
  return NAMES.get(key) or next((c.name for c in CLAIMS if c.scheme == key), "/".join(key))


def scheme_of(row: dict) -> tuple[str, str]:
  return (row["_overrides"].get("sync.scheme", row.get("sync.scheme")),
          row["_overrides"].get("compress.name", "none"))


# -- the figures of a study ---------------------------------------------------------------------


def figures(workdir: str) -> dict[tuple[str, str], dict[str, Any]]:
  """Per scheme of a study: its reported trials by seed (each at its chosen rate), and what the
  table shows beside them. A trial whose provenance the table refuses (``studies.provenance``)
  takes no part, in the choice of a rate either.

  Raises:
    ValueError: nothing finished yet, or two configurations of one scheme reported (the
      table would not know which to judge).
  """
  rows = counted(workdir)
  selected, choices = report.select_tuned(rows, report.tune_seeds(workdir),
                                          report.report_seeds(workdir))
  chosen = {scheme_of({"_overrides": c}): c for c in choices}
  by_scheme: dict[tuple, dict[int, dict]] = {}
  for row in selected:
    seeds = by_scheme.setdefault(scheme_of(row), {})
    if row["seed"] in seeds:
      raise ValueError(f"{workdir}: two reported trials of {scheme_of(row)} on seed "
                       f"{row['seed']} ({seeds[row['seed']]['trial']}, {row['trial']}); the "
                       "claims table needs one configuration per scheme")
    seeds[row["seed"]] = row
  out = {}
  for key, trials in by_scheme.items():
    choice = chosen.get(key) or {}
    out[key] = {**of_trials(trials), "chosen": choice.get("chosen"),
                "apart": choice.get("reported_apart")}
  return out


def counted(workdir: str) -> list[dict]:
  """``report.collect``'s rows of the study, without those whose provenance the table refuses
  (``studies.provenance``)."""
  rows = report.collect(workdir)
  refused, _ = provenance.check(workdir, [r["trial"] for r in rows])
  return [r for r in rows if r["trial"] not in refused]


def of_trials(trials: dict[int, dict]) -> dict[str, Any]:
  """One scheme's figures from its trials by seed (``report.collect`` rows): what
  :func:`compare` reads."""
  return {"rows": trials, "seeds": {s: _seed(r) for s, r in trials.items()},
          "n": len(trials), "reached": sum(r["time_to_target"] is not None
                                            for r in trials.values()),
          "unhealthy": sum(r["status"] in report.UNHEALTHY for r in trials.values()),
          "target": next(iter(trials.values()))["target"], "chosen": None, "apart": None}


def servers_text(fig: dict[str, Any]) -> str:
  """``4 x 2.5 Gb/s``: the scheme's servers and each one's interface (``summary.json``'s
  cluster), or what its records lack."""
  servers, bandwidth = next(iter(fig["rows"].values())).get("_servers") or (None, None)
  if servers is None:
    bandwidth = next(iter(fig["rows"].values()))["_cluster_config"].get("server_bandwidth")
    return ("not recorded (each at " + (f"{8 * bandwidth / 1e9:g} Gb/s" if bandwidth else "?")
            + ")")
  if not servers:
    return "none"
  return f"{servers} x {8 * bandwidth / 1e9:g} Gb/s"


def _seed(row: dict) -> evidence.Seed:
  return evidence.Seed(time=row["time_to_target"], end=row["virtual_time"], final=row["final"],
                       broken=row["status"] in report.UNHEALTHY)


def traffic(row: dict) -> tuple[float | None, str]:
  """A trial's bytes (:data:`TRAFFIC_NOTE`) and which measure they are (total or pushed)."""
  total = row.get("bytes_total")
  return (total, "total") if total is not None else (row.get("bytes_pushed"), "pushed")


def traffic_of(fig: dict[str, Any]) -> dict[str, Any]:
  """The scheme's bytes over its reported seeds: the median total (:func:`traffic`) and the
  median of each class of traffic its records count (``sync.legs.CLASSES``; {} before them)."""
  rows = list(fig["rows"].values())
  totals = sorted(t for t, _ in map(traffic, rows) if t is not None)
  classes = [r["_bytes_by_class"] for r in rows if r.get("_bytes_by_class")]
  by_class = ({c: statistics.median(b.get(c, 0) for b in classes) for c in classes[0]}
              if len(classes) == len(rows) else {})
  return {"bytes_total": statistics.median(totals) if totals else None,
          "bytes_by_class": {c: v for c, v in by_class.items() if v}}


def compare(fig: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
  """``fig`` against ``base``, seed by seed: speedup, final-accuracy gap (points), the gap at
  equal virtual time, and the traffic ratio, each an ``evidence.Estimate`` (None: no seed)."""
  scale = 100.0 if fig["rows"] and _metric(fig) == "test_accuracy" else 1.0
  speedups, left_out = evidence.paired(fig["seeds"], base["seeds"], evidence.seed_speedup)
  gaps, _ = evidence.paired(fig["seeds"], base["seeds"],
                            lambda a, b: evidence.seed_gap(a, b, scale))
  equal, _ = evidence.paired(fig["rows"], base["rows"], lambda a, b: gap_at_equal_time(a, b,
                                                                                       scale))
  ratios, _ = evidence.paired(fig["rows"], base["rows"], _traffic_ratio)
  measures = {traffic(r)[1] for rows in (fig["rows"], base["rows"]) for r in rows.values()}
  return {"speedup": evidence.median_interval(speedups), "not_compared": left_out,
          "gap": evidence.median_interval(gaps), "equal_time": evidence.median_interval(equal),
          "bytes": evidence.median_interval(ratios),
          "bytes_measure": "total" if measures == {"total"} else "pushed"}


def _metric(fig: dict[str, Any]) -> str:
  return next(iter(fig["rows"].values()))["metric"]


def _traffic_ratio(row: dict, base: dict) -> float | None:
  (mine, a), (theirs, b) = traffic(row), traffic(base)
  return mine / theirs if mine and theirs and a == b else None


def metric_at(metrics: list[dict], metric: str, t: float) -> float | None:
  """``metric`` at virtual time ``t``, interpolated linearly between the evaluations around it;
  None outside the evaluated span or where no evaluation has both."""
  return _value_at(report_figures.timed_series(metrics, metric), t)


def _value_at(series: np.ndarray, t: float) -> float | None:
  if not len(series) or not series[0, 0] <= t <= series[-1, 0]:
    return None
  return float(np.interp(t, series[:, 0], series[:, 1]))


def gap_at_equal_time(row: dict, base: dict, scale: float = 100.0) -> float | None:
  """The trial's metric minus the baseline's, each at the earlier of the two runs' last
  evaluations (virtual time), times ``scale``; None where either broke or has no figure there.

  A scheme that finishes its epochs sooner in virtual time ends with fewer seconds of training
  than BSP, so its final accuracy after the same epochs understates it; this compares the two
  at the same virtual time instead.
  """
  if row["status"] in report.UNHEALTHY or base["status"] in report.UNHEALTHY:
    return None
  mine, theirs = (report_figures.timed_series(r["_metrics"], r["metric"]) for r in (row, base))
  if not len(mine) or not len(theirs):
    return None
  t = min(mine[-1, 0], theirs[-1, 0])
  mine, theirs = _value_at(mine, t), _value_at(theirs, t)
  return None if mine is None or theirs is None else scale * (mine - theirs)


# -- the verdict --------------------------------------------------------------------------------


def against(claim: Claim, figs: dict[tuple, dict]) -> dict[str, dict | None]:
  """The claim's comparisons in a study: its reference's first, then each further baseline's
  (None where that scheme did not run in the study)."""
  fig = figs[claim.scheme]
  return {name(b): (compare(fig, figs[b]) if b in figs else None)
          for b in (claim.reference, *claim.baselines)}


def judge_claim(claim: Claim, fig: dict[str, Any] | None,
                vs: dict[str, dict | None]) -> tuple[str, list[str]]:
  """The claim's verdict (``evidence.VERDICTS``) and why, where it does not hold: each criterion
  whose interval does not clear its bound, and, where fewer seeds were compared than a verdict
  needs, that (the criteria then say what their intervals show)."""
  if fig is None:
    return evidence.UNSURE, ["not run in this study"]
  verdicts, why, few = [], [], []
  for what, estimate, bound, higher, unit in criteria(claim, vs):
    if estimate is None:
      verdicts.append(evidence.UNSURE)
      why.append(f"no seed to compare the {what} on" if what else unit)
      continue
    shown = evidence.judge(estimate, bound, higher, min_seeds=1)
    verdicts.append(evidence.judge(estimate, bound, higher))
    if estimate.n < evidence.MIN_SEEDS:
      few.append(estimate.n)
    if shown != evidence.HOLDS:
      side = ("below" if higher else "above") if shown == evidence.FAILS else "across"
      value = estimate.text("{:+.2f}" if unit == " pp" else "{:.2f}")
      why.append(f"{what} {value} lies {'wholly ' if side != 'across' else ''}{side} "
                 f"{bound:g}{unit}")
  if few:
    why.insert(0, f"{max(few)} seed(s) compared, fewer than the {evidence.MIN_SEEDS} a verdict "
               "needs" + (" (what the intervals show follows)" if why else
                          " (every interval clears its bound)"))
  return evidence.combine(verdicts), why


def criteria(claim: Claim, vs: dict[str, dict | None]) -> list[tuple]:
  """``(what, estimate, bound, higher_is_better, unit)`` per criterion of the claim; a scheme
  that did not run gives ``("", None, 0, True, "<who> did not run in this study")``."""
  out, ref = [], name(claim.reference)
  for i, (other, comp) in enumerate(vs.items()):
    if comp is None:
      out.append(("", None, 0.0, True, f"{other} did not run in this study"))
      continue
    if claim.min_speedup is not None:
      out.append((f"speedup over {other}", comp["speedup"], claim.min_speedup, True, "x"))
    if i == 0 and claim.max_drop_pp is not None:
      out.append((f"accuracy against {ref}", comp["gap"], -claim.max_drop_pp, True, " pp"))
    if i == 0 and claim.min_gain_pp is not None:
      out.append((f"accuracy gained over {ref}", comp["gap"], claim.min_gain_pp, True, " pp"))
    if i == 0 and claim.max_bytes is not None:
      out.append((f"bytes against {ref}'s", comp["bytes"], claim.max_bytes, False, "x"))
  return out


def verdict_text(verdict: str, why: Sequence[str]) -> str:
  return verdict if verdict == evidence.HOLDS else f"{verdict}: " + "; ".join(why)


# -- the cell -----------------------------------------------------------------------------------


def cell(claim: Claim, fig: dict[str, Any], vs: dict[str, dict | None]) -> str:
  """The table's cell: each comparison's median and 95 % interval over the reported seeds."""
  chose = "" if fig["apart"] or not fig["chosen"] else " (those that chose)"
  parts = [f"{fig['n']} seeds{chose}, {fig['reached']} at target"]
  for i, (other, comp) in enumerate(vs.items()):
    if comp is None:
      parts.append(f"vs {other}: not run")
      continue
    bits = [f"{comp['speedup'].text()}x" if comp["speedup"] else "no speedup"]
    if i == 0:
      if comp["gap"]:
        bits.append(f"{comp['gap'].text('{:+.2f}')} pp final")
      if comp["equal_time"]:
        bits.append(f"{comp['equal_time'].text('{:+.2f}')} pp at equal virtual time")
      if comp["bytes"]:
        bits.append(f"{comp['bytes'].text()}x {comp['bytes_measure']} bytes")
    parts.append(f"vs {other}: " + ", ".join(bits))
  chosen = {k: v for k, v in (fig["chosen"] or {}).items() if v is not None}
  if chosen:   # each key by its last part, unless two share it (an outer and an inner rate)
    short = [k.split(".")[-1] for k in chosen]
    parts.append("at " + ", ".join(f"{s if short.count(s) == 1 else k}={v}"
                                   for s, (k, v) in zip(short, chosen.items())))
  return "; ".join(parts)


def estimates_json(vs: dict[str, dict | None]) -> str:
  """Every comparison's estimates as JSON (an infinity as the string ``"inf"``)."""
  out = {}
  for other, comp in vs.items():
    out[other] = None if comp is None else {
        k: (v.as_dict() if isinstance(v, evidence.Estimate) else v) for k, v in comp.items()}
  return json.dumps(out, allow_nan=False)


def footer() -> str:
  """The rule behind the verdicts, from the code's own constants."""
  named = "; ".join(f"{c.name}: against {name(c.reference)}"
                    + (" and " + " and ".join(name(b) for b in c.baselines) if c.baselines
                       else "") for c in CLAIMS)
  return (f"Each figure is the lower median over the reported seeds of a per-seed comparison "
          f"(the same seed, each scheme at its own chosen rate) with its "
          f"{evidence.LEVEL:.0%} interval: the percentile bootstrap of that median over seeds, "
          f"computed exactly (with 5 seeds, the seeds' range). Speedup: the other's virtual "
          f"time to the target over the scheme's; {evidence.NEVER_REACHED}. A criterion holds "
          f"when its whole interval clears the claim's bound strictly (faster, under, less), "
          f"does not hold when the whole interval lies on the other side or on the bound, and "
          f"is inconclusive otherwise or with fewer than "
          f"{evidence.MIN_SEEDS} seeds compared; a claim does not hold if one criterion does "
          f"not, holds if every one does, and is inconclusive otherwise. Each claim is judged "
          f"against the scheme its paper names ({named}); its accuracy, gain and traffic "
          f"against the first of them; {TRAFFIC_NOTE}. These are statements about these "
          f"studies' settings only.")
