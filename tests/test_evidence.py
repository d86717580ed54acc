"""What a comparison over seeds supports (``gssp_jax.studies``): the per-seed rule, the exact
bootstrap interval, the three verdicts, and the claims table's cells on hand-made records."""

import json
import math
import os

import numpy as np
import pytest

from gssp_jax.studies import report
from gssp_jax.studies import claims
from gssp_jax.studies import evidence
from tests.test_fair import _trial

INF = float("inf")
Seed = evidence.Seed


def test_a_seed_that_never_reaches_the_target_counts_by_one_rule():
  reached = Seed(time=10.0, end=40.0, final=0.99)
  # Both reached: the ratio.
  assert evidence.seed_speedup(reached, Seed(25.0, 40.0, 0.99)) == 2.5
  # The baseline missed: the scheme is ahead where the baseline ran past its time or broke ...
  assert evidence.seed_speedup(reached, Seed(None, 30.0, 0.9)) == INF
  assert evidence.seed_speedup(reached, Seed(None, None, None, broken=True)) == INF
  # ... and the seed says nothing where the baseline ended sooner, healthy.
  assert evidence.seed_speedup(reached, Seed(None, 8.0, 0.9)) is None
  # The scheme missed: a speedup of 0 where it ran past the baseline's time or broke.
  assert evidence.seed_speedup(Seed(None, 30.0, 0.9), Seed(25.0, 40.0, 0.99)) == 0.0
  assert evidence.seed_speedup(Seed(None, 5.0, None, broken=True), Seed(25.0, 40.0, 0.99)) == 0
  assert evidence.seed_speedup(Seed(None, 20.0, 0.9), Seed(25.0, 40.0, 0.99)) is None
  # Neither reached it: not compared.
  assert evidence.seed_speedup(Seed(None, 30.0, 0.9), Seed(None, 30.0, 0.9)) is None
  # Accuracy: a broken run without a finite final metric is the worst.
  assert evidence.seed_gap(Seed(None, 9.0, 0.98), Seed(1.0, 9.0, 0.99), 100) == pytest.approx(-1)
  assert evidence.seed_gap(Seed(None, 9.0, float("nan"), broken=True),
                           Seed(1.0, 9.0, 0.99)) == -INF
  assert evidence.seed_gap(Seed(None, 9.0, None), Seed(1.0, 9.0, 0.99)) is None


def _bootstrap(values, draws=200_000, seed=0):
  """The percentile-bootstrap interval of the lower median, by resampling."""
  x = np.sort(np.asarray(values, dtype=float))
  k = (len(x) + 1) // 2
  medians = np.sort(np.random.default_rng(seed).choice(x, (draws, len(x))), axis=1)[:, k - 1]
  return tuple(np.quantile(medians, q, method="inverted_cdf") for q in (0.025, 0.975))


@pytest.mark.parametrize("values", [
    [1.3, 1.1, 1.6, 1.2, 1.5],                       # 5 seeds: the range
    [0.9, 1.4, 1.2, 1.25, 1.1, 1.35, 1.05, 1.3, 1.15, 1.5],   # 10 seeds: 2nd to 9th
    [2.0, 2.0, 1.0, 3.0, 2.0, 1.5, 2.5],               # ties
])
def test_the_interval_is_the_exact_bootstrap_of_the_lower_median(values):
  est = evidence.median_interval(values)
  assert est.median == sorted(values)[(len(values) + 1) // 2 - 1] and est.n == len(values)
  assert (est.lo, est.hi) == _bootstrap(values)


def test_five_seeds_give_the_range_and_infinities_are_kept():
  est = evidence.median_interval([1.2, INF, 1.5, 0.0, 1.8])
  assert (est.median, est.lo, est.hi) == (1.5, 0.0, INF)
  assert est.text() == "1.50 [0.00, inf]"
  assert json.loads(json.dumps(est.as_dict())) == {"median": 1.5, "lo": 0.0, "hi": "inf", "n": 5}
  assert evidence.median_interval([]) is None


def test_three_verdicts_and_too_few_seeds():
  holds = evidence.median_interval([1.5, 1.6, 1.7, 1.8, 2.0])
  fails = evidence.median_interval([0.7, 0.8, 0.9, 0.95, 0.99])
  unsure = evidence.median_interval([0.9, 1.1, 1.2, 1.3, 1.4])
  assert evidence.judge(holds, 1.46) == evidence.HOLDS
  assert evidence.judge(fails, 1.0) == evidence.FAILS
  assert evidence.judge(unsure, 1.0) == evidence.UNSURE
  # Lower is better (bytes): the interval's top must be under the bound.
  assert evidence.judge(evidence.median_interval([0.1] * 5), 0.13, False) == evidence.HOLDS
  assert evidence.judge(evidence.median_interval([0.5] * 5), 0.13, False) == evidence.FAILS
  # On the bound is not past it: as fast is not faster.
  assert evidence.judge(evidence.median_interval([1.0] * 5), 1.0) == evidence.FAILS
  assert evidence.judge(evidence.median_interval([1.0, 1.0, 1.1, 1.2, 1.3]), 1.0) == (
      evidence.UNSURE)
  # Four seeds clearing the bound are not enough; nor is no seed.
  assert evidence.judge(evidence.median_interval([1.5, 1.6, 1.7, 1.8]), 1.0) == evidence.UNSURE
  assert evidence.judge(None, 1.0) == evidence.UNSURE
  assert evidence.combine([evidence.HOLDS, evidence.FAILS]) == evidence.FAILS
  assert evidence.combine([evidence.HOLDS, evidence.UNSURE]) == evidence.UNSURE
  assert evidence.combine([evidence.HOLDS, evidence.HOLDS]) == evidence.HOLDS
  assert evidence.combine([]) == evidence.UNSURE


BSP_TIMES = (20.0, 40.0, 60.0, 80.0)   # BSP reaches 0.98 at 60.0 on every seed


def _study(root, gssp_times, gssp_accs=None, seeds=range(5), extra=()):
  """BSP and GSSP on ``seeds`` (untuned); GSSP's evaluations at ``gssp_times[seed]``."""
  for seed in seeds:
    _trial(root, "bsp", seed, 0.05, [0.9, 0.95, 0.98, 0.99], times=BSP_TIMES, tuned=False)
    _trial(root, "gssp", seed, 0.05, (gssp_accs or {}).get(seed, [0.9, 0.95, 0.98, 0.99]),
           times=gssp_times[seed], tuned=False)
  for scheme, times in extra:
    for seed in seeds:
      _trial(root, scheme, seed, 0.05, [0.9, 0.95, 0.98, 0.99], times=times, tuned=False)
  figs = claims.figures(str(root))
  gssp = next(c for c in claims.CLAIMS if c.name == "GSSP")
  vs = claims.against(gssp, figs)
  return (*claims.judge_claim(gssp, figs[("gssp", "none")], vs), vs)


def _times(speedup):
  """Evaluation times at which a run reaches the target at 60 / ``speedup``."""
  return tuple(t / speedup for t in BSP_TIMES)


def test_a_claim_holds_when_every_interval_clears_its_bound(tmp_path):
  asp = [("asp", _times(1.0))]
  verdict, why, vs = _study(tmp_path / "s", {s: _times(1.5 + 0.1 * s) for s in range(5)},
                            extra=asp)
  assert (verdict, why) == (evidence.HOLDS, [])
  assert vs["BSP"]["speedup"].text() == "1.70 [1.50, 1.90]"
  assert vs["BSP"]["gap"].median == 0.0 and vs["ASP"]["speedup"].lo == pytest.approx(1.5)


def test_a_claim_does_not_hold_when_an_interval_lies_below_its_bound(tmp_path):
  verdict, why, _ = _study(tmp_path / "s", {s: _times(1.1 + 0.05 * s) for s in range(5)},
                           extra=[("asp", _times(1.0))])
  assert verdict == evidence.FAILS
  assert why == ["speedup over BSP 1.20 [1.10, 1.30] lies wholly below 1.46x",
                 "speedup over ASP 1.20 [1.10, 1.30] lies wholly below 1.46x"]


def test_a_claim_is_inconclusive_across_its_bound_with_few_seeds_or_a_missing_baseline(
    tmp_path):
  speedups = (1.2, 1.5, 1.6, 1.7, 1.8)
  verdict, why, _ = _study(tmp_path / "a", {s: _times(v) for s, v in enumerate(speedups)},
                           extra=[("asp", _times(1.0))])
  assert verdict == evidence.UNSURE
  assert why == ["speedup over BSP 1.60 [1.20, 1.80] lies across 1.46x",
                 "speedup over ASP 1.60 [1.20, 1.80] lies across 1.46x"]
  verdict, why, _ = _study(tmp_path / "b", {s: _times(2.0) for s in range(3)}, seeds=range(3),
                           extra=[("asp", _times(1.0))])
  assert verdict == evidence.UNSURE and why == [
      "3 seed(s) compared, fewer than the 5 a verdict needs (every interval clears its bound)"]
  verdict, why, _ = _study(tmp_path / "c", {s: _times(2.0) for s in range(5)})
  assert verdict == evidence.UNSURE and why == ["ASP did not run in this study"]


def test_a_seed_that_never_reaches_the_target_sinks_the_interval(tmp_path):
  """GSSP misses the target on seed 4, running past BSP's time: a speedup of 0 there, so the
  interval's low end is 0 and the claim cannot hold; its final accuracy gap counts too."""
  times = {s: _times(2.0) for s in range(5)}
  times[4] = BSP_TIMES
  verdict, why, vs = _study(tmp_path / "s", times, gssp_accs={4: [0.9, 0.93, 0.95, 0.96]},
                            extra=[("asp", _times(1.0))])
  assert vs["BSP"]["speedup"].text() == "2.00 [0.00, 2.00]" and vs["BSP"]["speedup"].n == 5
  assert vs["BSP"]["gap"].lo == pytest.approx(-3.0)
  assert verdict == evidence.UNSURE
  assert why[0] == "speedup over BSP 2.00 [0.00, 2.00] lies across 1.46x"
  assert "accuracy against BSP +0.00 [-3.00, +0.00] lies across -1 pp" in why


def test_traffic_is_the_total_where_recorded_and_says_so_where_only_pushed(tmp_path):
  root = tmp_path / "s"
  _study(root, {s: _times(2.0) for s in range(5)})
  for name in root.iterdir():
    summary = json.loads((name / "summary.json").read_text())
    scheme = summary["config"]["sync"]["scheme"]
    summary["totals"].update(bytes_pushed=4, bytes_total=10 if scheme == "bsp" else 3)
    (name / "summary.json").write_text(json.dumps(summary))
  figs = claims.figures(str(root))
  comp = claims.compare(figs[("gssp", "none")], figs[("bsp", "none")])
  assert comp["bytes_measure"] == "total" and comp["bytes"].median == pytest.approx(0.3)
  assert "0.30 [0.30, 0.30]x total bytes" in claims.cell(claims.CLAIMS[0],
                                                           figs[("gssp", "none")],
                                                           {"BSP": comp})
  rows = report.collect(str(root))
  assert {r["bytes_total"] for r in rows} == {10, 3}


def test_the_footer_states_the_rules_the_code_applies():
  text = claims.footer()
  assert evidence.NEVER_REACHED in text and f"fewer than {evidence.MIN_SEEDS} seeds" in text
  assert "InHAD: against ASP" in text and "GSSP + GDTopK: against GSSP" in text
  assert "DSSP: against SSP" in text and "GSSP: against BSP and ASP" in text
  assert math.isclose(evidence.LEVEL, 0.95)


def _regime_trial(root, scheme, seed, tiers, bandwidth, speedup):
  """A trial of one cell of a regime study: BSP pushes 4,000 bytes a push, 10 pushes."""
  name = _trial(root, scheme, seed, 0.05, [0.9, 0.95, 0.98, 0.99], tuned=False,
                times=_times(speedup), extra={"cluster.tiers": tiers,
                                              "cluster.bandwidth": bandwidth})
  path = root / name / "summary.json"
  summary = json.loads(path.read_text())
  summary["config"]["cluster"] = {"jitter": 0.0, "bandwidth": bandwidth, "tiers": tiers}
  summary["cluster"] = {"base_time": 0.01, "speeds": [tiers[0], tiers[-1]]}
  summary["totals"].update(pushes=10, bytes_pushed=40_000)
  path.write_text(json.dumps(summary))


def test_the_regime_map_sets_each_scheme_against_bsp_in_its_own_cell(tmp_path):
  """Two cells: uniform workers with a fast network (GSSP no faster: 1.0 on every seed) and 4x
  tiers with a slow one (GSSP 1.5-1.9x): each compared with BSP of its own cell, the ratio read
  from BSP's pushes (4,000 bytes at 4e5 B/s = 0.01 s = 1 base time; at 4e6: 0.1)."""
  from gssp_jax.studies import regimes  # pylint: disable=g-import-not-at-top
  root = tmp_path / "runs" / "regime_map"
  for seed in range(5):
    for tiers, bandwidth, speedup in (([1.0, 1.0], 4e6, 1.0), ([1.0, 4.0], 4e5, 1.5 + 0.1 * seed)):
      _regime_trial(root, "bsp", seed, tiers, bandwidth, 1.0)
      _regime_trial(root, "gssp", seed, tiers, bandwidth, speedup)
  found = regimes.cells(str(root))
  assert [(c["scheme"], c["tier_ratio"], c["comm_ratio"], c["verdict"]) for c in found] == [
      ("GSSP", 1.0, pytest.approx(0.1), evidence.FAILS),   # as fast is not faster
      ("GSSP", 4.0, pytest.approx(1.0), evidence.HOLDS)]
  assert found[1]["speedup"].text() == "1.70 [1.50, 1.90]"
  lines = regimes.table_lines(found)
  assert lines[2] == "| 1x | 0.1 | 1.00 [1.00, 1.00]x, does not hold |"
  assert lines[3] == "| 4x | 1 | 1.70 [1.50, 1.90]x, holds |"
  paths = regimes.write(str(root), str(tmp_path / "out"))
  assert os.path.getsize(paths["png"]) > 0
  assert open(paths["csv"]).read().splitlines()[2].startswith("GSSP,4.0,0.0,1.0,1.7,1.5,1.9,5,")


def test_traffic_per_class_goes_into_the_table_and_the_report(tmp_path):
  """Records with bytes per class: the claims table's CSV has the scheme's median total and
  classes, the study's report a table of them; older records (no classes) have neither."""
  from gssp_jax.studies import reproduce  # pylint: disable=g-import-not-at-top
  root = tmp_path / "runs" / "tiny"
  _study(root, {s: _times(2.0) for s in range(5)})
  for name in root.iterdir():
    summary = json.loads((name / "summary.json").read_text())
    seed = summary["config"]["seed"]
    summary["totals"].update(bytes_total=100 + seed, bytes_by_class={
        "worker_to_server": 60, "server_to_worker": 40 + seed, "ring_allreduce": 0})
    (name / "summary.json").write_text(json.dumps(summary))
  (row,) = [r for r in reproduce.claims_rows(str(tmp_path), [reproduce.STUDIES["tiny"]])
            if r["claim"] == "GSSP"]
  assert row["bytes_total"] == 102
  assert json.loads(row["bytes_by_class"]) == {"worker_to_server": 60, "server_to_worker": 42}
  md = open(report.write_report(str(root), str(tmp_path / "out"))["md"]).read()
  assert "## Traffic per class (mean over seeds, GB)" in md
  assert "| total | worker_to_server | server_to_worker |" in md
