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
from gssp_jax import report

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
             "totals": {"virtual_time": 2 * time_to_target, "bytes_pushed": 1000}}
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
