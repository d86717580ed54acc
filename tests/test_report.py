"""The report groups runs by what differs between them; a sweep's report keeps to its grid.

The report reads files only, so these tests write the run directories by hand.
"""

import csv
import json
import os
import pathlib
import subprocess
import sys

import pytest

from configs import mnist_lenet5
from gssp_jax.studies import report
from gssp_jax.studies import report_figures

REPO = pathlib.Path(__file__).resolve().parent.parent


def _write_run(run_dir, *, scheme="bsp", seed=0, final=0.9, time_to_target=10.0,
               data_dir="", trial_overrides=None, **flat_overrides):
  """A finished run's ``summary.json`` (and ``trial.json`` if from a sweep), as the loop writes."""
  config = mnist_lenet5.get_config()
  config.sync.scheme, config.seed, config.data_dir = scheme, seed, data_dir
  for key, value in flat_overrides.items():
    section, name = key.split("__")
    config[section][name] = value
  os.makedirs(run_dir)
  summary = {"config": json.loads(config.to_json()), "status": "done",
             "metric": "test_accuracy", "target": 0.5,
             "final": {"test_accuracy": final, "epoch": 1.0},
             "time_to_target": time_to_target,
             "totals": {"virtual_time": 2 * (time_to_target or 30.0), "bytes_pushed": 1000}}
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f)
  if trial_overrides is not None:
    with open(os.path.join(run_dir, "trial.json"), "w") as f:
      json.dump({"name": os.path.basename(run_dir), "overrides": trial_overrides,
                 "status": "done", "error": None, "attempts": 1}, f)


def test_plain_runs_of_different_schemes_are_separate_rows(tmp_path):
  # The README's loop: one plain run per scheme under one directory, no trial.json.
  _write_run(tmp_path / "bsp", scheme="bsp", final=0.60, time_to_target=20.0,
             data_dir="/data/a")
  _write_run(tmp_path / "gssp", scheme="gssp", final=0.466, time_to_target=10.0,
             data_dir="/data/b")   # a bookkeeping key that differs does not tell runs apart
  rows = report.collect(str(tmp_path))
  assert [r["_overrides"] for r in rows] == [{"sync.scheme": "bsp"}, {"sync.scheme": "gssp"}]
  assert [report.label(r) for r in rows] == ["sync.scheme=bsp", "sync.scheme=gssp"]
  assert rows[1]["speedup_vs_bsp"] == pytest.approx(2.0)
  agg = report.aggregate(rows)
  assert [(a["sync.scheme"], a["seeds"], a["final"], a["final_std"]) for a in agg] == [
      ("bsp", 1, 0.60, 0.0), ("gssp", 1, 0.466, 0.0)]
  assert [report.label(a) for a in agg] == ["sync.scheme=bsp", "sync.scheme=gssp"]

  paths = report.write_report(str(tmp_path), str(tmp_path / "out"))
  with open(paths["summary_csv"]) as f:
    summary_rows = list(csv.DictReader(f))
  assert [r["sync.scheme"] for r in summary_rows] == ["bsp", "gssp"]
  md = open(paths["md"]).read()
  assert "| bsp | 1 |" in md and "| gssp | 1 |" in md
  assert "60.00 % ± 0.00 %" in md and "46.60 % ± 0.00 %" in md


def test_plain_runs_that_differ_only_in_seed_are_one_setting(tmp_path):
  for seed, final in ((0, 0.90), (1, 0.80)):
    _write_run(tmp_path / f"bsp{seed}", scheme="bsp", seed=seed, final=final)
  for seed, final in ((0, 0.70), (1, 0.50)):
    _write_run(tmp_path / f"gssp{seed}", scheme="gssp", seed=seed, final=final)
  rows = report.collect(str(tmp_path))
  assert {r["trial"]: r["_overrides"] for r in rows} == {
      "bsp0": {"seed": 0, "sync.scheme": "bsp"}, "bsp1": {"seed": 1, "sync.scheme": "bsp"},
      "gssp0": {"seed": 0, "sync.scheme": "gssp"}, "gssp1": {"seed": 1, "sync.scheme": "gssp"}}
  agg = {a["sync.scheme"]: a for a in report.aggregate(rows)}
  assert set(agg) == {"bsp", "gssp"}
  assert agg["bsp"]["seeds"] == agg["gssp"]["seeds"] == 2
  assert agg["gssp"]["final"] == pytest.approx(0.60)
  assert agg["gssp"]["final_std"] == pytest.approx(0.1414213, abs=1e-6)


def test_plain_runs_differing_in_two_keys_name_both(tmp_path):
  _write_run(tmp_path / "a", scheme="ssp", sync__staleness=1)
  _write_run(tmp_path / "b", scheme="ssp", sync__staleness=3)
  _write_run(tmp_path / "c", scheme="bsp", sync__staleness=3)
  labels = {r["trial"]: report.label(r) for r in report.collect(str(tmp_path))}
  assert labels == {"a": "sync.scheme=ssp sync.staleness=1",
                    "b": "sync.scheme=ssp sync.staleness=3",
                    "c": "sync.scheme=bsp sync.staleness=3"}


def test_sweep_trials_keep_their_recorded_overrides(tmp_path):
  _write_run(tmp_path / "sync.scheme=bsp", scheme="bsp", trial_overrides={"sync.scheme": "bsp"})
  _write_run(tmp_path / "sync.scheme=gssp", scheme="gssp",
             trial_overrides={"sync.scheme": "gssp"})
  rows = report.collect(str(tmp_path))
  assert [report.label(r) for r in rows] == ["bsp", "gssp"]


def test_sweep_report_keeps_to_the_current_grid_and_lists_orphans(tmp_path):
  # An older grid left `sync.scheme=ssp`; the current grid (sweep.json) is bsp and gssp.
  for scheme, final in (("bsp", 0.9), ("gssp", 0.8), ("ssp", 0.1)):
    _write_run(tmp_path / f"sync.scheme={scheme}", scheme=scheme, final=final,
               trial_overrides={"sync.scheme": scheme})
  os.makedirs(tmp_path / "_stale" / "20250101-000000")
  with open(tmp_path / "sweep.json", "w") as f:
    json.dump({"sweep": "s.py", "trials": [
        {"name": "sync.scheme=bsp", "overrides": {"sync.scheme": "bsp"}},
        {"name": "sync.scheme=gssp", "overrides": {"sync.scheme": "gssp"}}]}, f)
  assert report.orphans(str(tmp_path)) == ["sync.scheme=ssp"]
  assert [r["trial"] for r in report.collect(str(tmp_path))] == ["sync.scheme=bsp",
                                                                  "sync.scheme=gssp"]
  paths = report.write_report(str(tmp_path), str(tmp_path / "out"))
  with open(paths["csv"]) as f:
    assert [r["trial"] for r in csv.DictReader(f)] == ["sync.scheme=bsp", "sync.scheme=gssp"]
  md = open(paths["md"]).read()
  assert "Orphans" in md and "sync.scheme=ssp" in md and "10.00 %" not in md

  # The command line prints them too.
  out = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path),
                        f"--out={tmp_path / 'out2'}"], cwd=REPO, capture_output=True, text=True,
                       check=True).stdout
  assert "orphans (not in the sweep's current grid, left out): sync.scheme=ssp" in out


def test_without_a_grid_file_every_trial_is_reported(tmp_path):
  for scheme in ("bsp", "ssp"):
    _write_run(tmp_path / f"sync.scheme={scheme}", scheme=scheme,
               trial_overrides={"sync.scheme": scheme})
  assert report.orphans(str(tmp_path)) == []
  assert len(report.collect(str(tmp_path))) == 2


# --- Figures -----------------------------------------------------------------------------------

_SPEEDS = [1.0, 1.0, 3.0, 3.0]


def _write_timed_run(run_dir, scheme, *, seed=0, accuracies=(0.2, 0.4, 0.6), step=1.0,
                     hist=(10,), compress="none", target=0.5):
  """A sweep trial with ``metrics.jsonl`` (accuracy at ``step``-second evaluations, staleness,
  per-worker blocked time and bytes) and the cluster's per-worker speeds in ``summary.json``."""
  overrides = {"sync.scheme": scheme, "compress.name": compress, "seed": seed}
  _write_run(run_dir, scheme=scheme, seed=seed, final=accuracies[-1], trial_overrides=overrides)
  metrics = [{"epoch": i + 1.0, "virtual_time": step * (i + 1), "test_accuracy": acc,
              "staleness": {"hist": list(hist)},
              "blocked_time_per_worker": [2.0, 2.0, 0.0, 0.0],
              "bytes_pushed_per_worker": [100, 100, 50, 50]}
             for i, acc in enumerate(accuracies)]
  with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(m) + "\n" for m in metrics)
  with open(os.path.join(run_dir, "summary.json")) as f:
    summary = json.load(f)
  summary["target"] = target
  summary["cluster"] = {"speeds": _SPEEDS, "base_time": 0.01}
  with open(os.path.join(run_dir, "summary.json"), "w") as f:
    json.dump(summary, f)


def test_staleness_figure_has_every_scheme_even_at_zero_staleness(tmp_path):
  # BSP and DS-Sync apply every gradient at staleness 0 (hist [N]); they used to vanish.
  for scheme, hist in (("bsp", (16,)), ("ssp", (4, 8, 4)), ("dssync", (16,)),
                       ("asp", (0, 0, 0, 16))):
    _write_timed_run(tmp_path / scheme, scheme, hist=hist)
  _write_timed_run(tmp_path / "bsp1", "bsp", seed=1, hist=(8,))   # a second seed pools in
  table = {t["label"]: t for t in report_figures.staleness_table(report.collect(str(tmp_path)))}
  assert set(table) == {"bsp", "ssp", "dssync", "asp"}
  assert table["bsp"]["fractions"].tolist() == [1.0] and table["bsp"]["applied"] == 24
  assert table["dssync"]["mean"] == 0.0
  assert table["ssp"]["fractions"].tolist() == [0.25, 0.5, 0.25]
  assert table["asp"]["mean"] == 3.0


def test_time_to_target_labels_are_the_tables_median_speedup_and_count_seeds(tmp_path):
  # Target 0.5: BSP reaches it at 2.5 s (both seeds), GSSP at 1.25 s and 2.5 s, ASP never.
  for seed in (0, 1):
    _write_timed_run(tmp_path / f"bsp{seed}", "bsp", seed=seed)
    _write_timed_run(tmp_path / f"asp{seed}", "asp", seed=seed, accuracies=(0.1, 0.2, 0.3))
  _write_timed_run(tmp_path / "gssp0", "gssp", seed=0, accuracies=(0.4, 0.6, 0.7))
  _write_timed_run(tmp_path / "gssp1", "gssp", seed=1)
  table = {t["label"]: t
           for t in report_figures.time_to_target_table(report.collect(str(tmp_path)))}
  assert table["bsp"]["times"] == [2.5, 2.5] and table["bsp"]["mean"] == 2.5
  assert (table["gssp"]["reached"], table["gssp"]["seeds"]) == (2, 2)
  assert table["gssp"]["mean"] == pytest.approx(2.0)   # (1.5 + 2.5) / 2
  assert (table["gssp"]["lo"], table["gssp"]["hi"]) == (pytest.approx(1.5), 2.5)
  # Speedup: the median over seeds of BSP's time / this trial's (same seed), report.md's
  # statistic, not the ratio of the bars (2.5 / 2.0 = 1.25).
  assert table["gssp"]["speedup"] == pytest.approx((2.5 / 1.5 + 1.0) / 2)
  agg = {a["sync.scheme"]: a for a in report.aggregate(report.collect(str(tmp_path)))}
  assert table["gssp"]["speedup"] == pytest.approx(agg["gssp"]["speedup_vs_bsp_median"])
  assert report_figures.speedup_text(table["gssp"]["speedup"], seeds=2) == (
      "1.33× vs BSP\n(faster; median, 2 seeds)")
  assert report_figures.speedup_text(0.8) == "0.80× vs BSP\n(slower)"   # the table's 0.80×
  assert report_figures.speedup_text(0.999) == "1.00× vs BSP\n(as fast)"
  assert report_figures.speedup_text(0.8, seeds=3, compact=True) == "0.80×\nslower"
  assert (table["asp"]["reached"], table["asp"]["mean"], table["asp"]["speedup"]) == (0, None,
                                                                                     None)
  assert table["bsp"]["baseline"] == table["gssp"]["baseline"] == "bsp"


def test_a_speedup_label_agrees_with_the_table_when_the_seeds_differ(tmp_path):
  """BSP with 2 seeds (2.5 s and 5.0 s), GSSP with 1 (seed 0, 3.0 s): the bars' ratio would say
  1.25× faster (3.75 / 3.0); per seed it is 2.5 / 3.0, slower, and the label says what the table
  says."""
  _write_timed_run(tmp_path / "bsp0", "bsp", seed=0)
  _write_timed_run(tmp_path / "bsp1", "bsp", seed=1, step=2.0)
  _write_timed_run(tmp_path / "gssp0", "gssp", seed=0, step=1.2)
  rows = report.collect(str(tmp_path))
  table = {t["label"]: t for t in report_figures.time_to_target_table(rows)}
  agg = {a["sync.scheme"]: a for a in report.aggregate(rows)}
  assert table["bsp"]["mean"] / table["gssp"]["mean"] == pytest.approx(1.25)
  assert table["gssp"]["speedup"] == agg["gssp"]["speedup_vs_bsp_median"] == pytest.approx(
      2.5 / 3.0)
  assert report_figures.speedup_text(table["gssp"]["speedup"], seeds=table["gssp"][
      "speedup_n"]) == "0.83× vs BSP\n(slower)"


def test_metric_curves_are_the_mean_over_seeds_with_a_min_max_band(tmp_path):
  _write_timed_run(tmp_path / "s0", "ssp", seed=0, accuracies=(0.2, 0.4, 0.6))
  _write_timed_run(tmp_path / "s1", "ssp", seed=1, accuracies=(0.4, 0.6, 0.6, 0.9), step=0.5)
  (curve,) = report_figures.metric_curves(report.collect(str(tmp_path)), "test_accuracy")
  # Seed 1 is evaluated every 0.5 s up to 2 s: the shared span is [1, 2] s, seed 0 interpolated.
  assert curve["seeds"] == 2 and curve["time"].tolist() == [1.0, 1.5, 2.0]
  assert curve["mean"].tolist() == pytest.approx([0.4, 0.45, 0.65])
  assert curve["lo"].tolist() == pytest.approx([0.2, 0.3, 0.4])
  assert curve["hi"].tolist() == pytest.approx([0.6, 0.6, 0.9])


def test_per_worker_table_carries_each_workers_speed_tier(tmp_path):
  _write_timed_run(tmp_path / "bsp", "bsp")
  (row,) = report_figures.per_worker_table(report.collect(str(tmp_path)),
                                           "blocked_time_per_worker")
  assert row["values"].tolist() == [2.0, 2.0, 0.0, 0.0]
  assert row["speeds"].tolist() == _SPEEDS


def test_report_figures_for_a_sweep_with_a_never_reached_target(tmp_path, capsys):
  for scheme in ("bsp", "gssp"):
    _write_timed_run(tmp_path / scheme, scheme, accuracies=(0.1, 0.2, 0.3), target=0.9)
  out = tmp_path / "out"
  with pytest.warns(UserWarning, match="no trial reached the target 0.9"):
    paths = report.write_report(str(tmp_path), str(out))
  # The time-to-target figure exists and says why it is empty; report.md says so too.
  assert os.path.exists(out / "time_to_target.png")
  md = open(paths["md"]).read()
  assert "Not drawn: no trial reached the target 0.9 (test accuracy)" in md
  names = ("metric_vs_virtual_time", "time_to_target", "staleness", "blocked_time",
           "bytes_per_link")
  for name in names:
    assert paths[f"figure_{name}"] == str(out / f"{name}.png")
    assert os.path.getsize(paths[f"figure_{name}"]) > 0
    assert f"![{name}.png]({name}.png)" in md

  # The command line prints every path it wrote, figures included.
  printed = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path),
                            f"--out={out}"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout
  for kind in ("csv", "summary_csv", "md", *(f"figure_{n}" for n in names)):
    assert f"{kind}: {paths[kind]}" in printed


def test_an_interrupted_trial_is_left_out_of_the_report_and_named(tmp_path):
  """A trial stopped part-way has a summary of the epochs it ran: averaging it with finished
  seeds would mix a shorter run into the configuration's figures."""
  for seed in (0, 1):
    _write_timed_run(tmp_path / f"bsp{seed}", "bsp", seed=seed)
  _write_timed_run(tmp_path / "gssp0", "gssp", seed=0)
  _write_timed_run(tmp_path / "gssp1", "gssp", seed=1, accuracies=(0.1,))
  path = tmp_path / "gssp1" / "summary.json"
  summary = json.loads(path.read_text())
  summary["status"] = "interrupted"
  path.write_text(json.dumps(summary))
  rows = report.collect(str(tmp_path))
  assert sorted((r["scheme"], r["seed"]) for r in rows) == [("bsp", 0), ("bsp", 1), ("gssp", 0)]
  assert report.unfinished(str(tmp_path)) == ["gssp1"]
  md = open(report.write_report(str(tmp_path), str(tmp_path / "out"))["md"]).read()
  assert "Unfinished trials (interrupted or failed" in md and "gssp1" in md


def test_figure_labels_show_only_what_differs_within_a_scheme():
  def row(**o):
    return {"_overrides": {k.replace("__", "."): v for k, v in o.items()}, "trial": str(o)}
  local = {"local__steps": 8, "local__optimizer__name": "adamw"}
  rows = [row(sync__scheme="bsp", compress__name="none", seed=0),
          row(sync__scheme="bsp", compress__name="none", seed=1),
          row(sync__scheme="gssp", compress__name="gdtopk", seed=0),
          row(sync__scheme="diloco", compress__name="none", **local, seed=0),
          row(sync__scheme="halos", compress__name="none", **local, local__dylu=True, seed=0),
          row(sync__scheme="ssp", compress__name="none", sync__staleness=1, seed=0),
          row(sync__scheme="ssp", compress__name="none", sync__staleness=3, seed=0)]
  assert report.short_labels(rows) == [
      "bsp", "bsp", "gssp gdtopk", "diloco", "halos", "ssp sync.staleness=1",
      "ssp sync.staleness=3"]
  # Each configuration keeps one label of its own (what the figures group by).
  assert len(set(report.short_labels(rows))) == len({report.label(r) for r in rows})


def _speedup_rows(md: str) -> dict[str, list[str]]:
  """The report's "Speedup against BSP" table: label -> its cells."""
  table = md.split("## Speedup against BSP, per seed", 1)[1].split("\n\n", 2)[1]
  rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
  return {row[0]: row for row in rows}


def test_the_report_opens_with_a_verdict_per_scheme_that_its_table_bears_out(tmp_path):
  root = tmp_path / "runs"
  # BSP reaches the target in 10 s on every seed; GSSP in 20, 25 and never (no comparison);
  # SSP in 5 and 8; ASP never.
  for seed, (gssp, ssp) in enumerate(((20.0, 5.0), (25.0, 8.0), (None, None))):
    _write_run(root / f"bsp{seed}", scheme="bsp", seed=seed, final=0.9, time_to_target=10.0)
    _write_run(root / f"gssp{seed}", scheme="gssp", seed=seed, final=0.85, time_to_target=gssp)
    if ssp is not None:
      _write_run(root / f"ssp{seed}", scheme="ssp", seed=seed, final=0.9, time_to_target=ssp)
    _write_run(root / f"asp{seed}", scheme="asp", seed=seed, final=0.4, time_to_target=None)
  md = open(report.write_report(str(root))["md"]).read()
  lines = md.split("\n")
  verdicts = {l.split("**")[1]: l for l in lines[2:lines.index("", 2)]}
  assert set(verdicts) == {"gssp", "ssp", "asp"}   # as the tables name them
  assert verdicts["gssp"] == (
      "- **gssp** was slower than BSP to 50 % test accuracy: a median speedup of "
      "0.45× (it took 2.22× BSP's virtual time); faster on 0 of 3 seeds, slower on 2, not "
      "compared on 1; its final test accuracy is 5.00 points below BSP's (mean over seeds).")
  assert verdicts["asp"].startswith(
      "- **asp** has no speedup over BSP to 50 % test accuracy: on none of its 3 "
      "seeds did both it and BSP reach the target; its final test accuracy is 50.00 points below")
  # Every figure in a sentence is its table's.
  table = _speedup_rows(md)
  for name, sentence in verdicts.items():
    row = table[name]
    median, faster_slower, not_compared = row[3], row[5], row[6]
    if median != "–":
      assert f"a median speedup of {median} " in sentence
      counts, seeds = faster_slower.split(" of ")
      faster, slower = counts.split(" / ")
      assert f"faster on {faster} of {seeds} seeds, slower on {slower}" in sentence
    assert (f"not compared on {not_compared.split(' of ')[0]}" in sentence) == (
        not not_compared.startswith("0 of") and median != "–")
  assert table["ssp"][3:7] == ["1.62×", "1.25×–2.00×", "2 / 0 of 2", "0 of 2"]


def test_a_sweep_without_bsp_says_there_is_nothing_to_compare(tmp_path):
  _write_run(tmp_path / "runs" / "gssp", scheme="gssp")
  md = open(report.write_report(str(tmp_path / "runs"))["md"]).read()
  assert md.split("\n")[2] == "No BSP trial in this sweep: no configuration is set against BSP."
