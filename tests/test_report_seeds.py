"""Seeds kept apart for reporting (``sweep.report_on``): the grid's seeds choose each rate, the
runner then runs the chosen rate on the reporting seeds, and the report counts those alone."""

import json
import os
import shutil
import textwrap

import pytest

from gssp_jax.studies import grid_edge
from gssp_jax.studies import report
from gssp_jax.studies import sweep
from tests.test_fair import _trial
from tests.test_grid_edge import run_sweep

FAST, SLOW = [0.9, 0.97, 0.99, 0.99], [0.9, 0.95, 0.97, 0.985]   # at 25.0 and 36.67
REPORTING = (100, 101)


def _trials(root, reporting=REPORTING):
  """The runner's view of ``root``'s trial directories (tuned learning rate, no ladder)."""
  trials = sweep.Trials()
  trials.report_seeds = reporting
  for name in sorted(os.listdir(root)):
    with open(root / name / "trial.json") as f:
      overrides = json.load(f)["overrides"]
    trials.append(sweep.Trial(name, overrides, None, ("optimizer.learning_rate",)))
  return trials


def _tuning(root):
  """BSP is best at 0.1 on the tuning seeds 0 and 1; GSSP at 0.05."""
  for seed in (0, 1):
    _trial(root, "bsp", seed, 0.05, SLOW)
    _trial(root, "bsp", seed, 0.1, FAST)
    _trial(root, "gssp", seed, 0.05, FAST)
    _trial(root, "gssp", seed, 0.1, SLOW)


def test_the_chosen_rate_runs_on_every_reporting_seed_once_tuning_has_settled(tmp_path):
  root = tmp_path / "sweep"
  _tuning(root)
  shutil.rmtree(root / sweep.trial_name({"sync.scheme": "gssp", "optimizer.learning_rate": 0.1,
                                         "seed": 1}))
  _trial(root, "gssp", 1, 0.1, SLOW, status="interrupted")   # GSSP has not settled
  added = [(o["sync.scheme"], o["optimizer.learning_rate"], o["seed"], why)
           for o, why in grid_edge.reporting(str(root), _trials(root))]
  assert added == [("bsp", 0.1, 100, "reporting seed 100 at the chosen "
                    "optimizer.learning_rate=0.1"), ("bsp", 0.1, 101, "reporting seed 101 at "
                                                     "the chosen optimizer.learning_rate=0.1")]
  trials = _trials(root)
  assert grid_edge.possible(trials, {}, str(root)) == 2 * 2   # two configurations x two seeds


def test_reporting_seeds_never_choose_and_are_all_that_is_reported(tmp_path):
  """On the reporting seeds BSP at 0.1 is slow; were they to choose, or be reported with the
  tuning seeds, its figures would move: they do not choose, and are the only ones reported."""
  root = tmp_path / "sweep"
  _tuning(root)
  for seed in REPORTING:
    _trial(root, "bsp", seed, 0.1, SLOW)
    _trial(root, "gssp", seed, 0.05, FAST)
  assert grid_edge.reporting(str(root), _trials(root)) == []   # all ran: nothing to add
  rows = report.collect(str(root))
  selected, choices = report.select_tuned(rows, None, REPORTING)
  assert [c["chosen"]["optimizer.learning_rate"] for c in choices] == [0.1, 0.05]
  assert sorted((r["scheme"], r["seed"]) for r in selected) == [
      ("bsp", 100), ("bsp", 101), ("gssp", 100), ("gssp", 101)]
  assert all(c["reported_apart"] and c["reported_seeds"] == "100 101" for c in choices)
  # GSSP (25.0) against BSP at 0.1 on the reporting seeds (36.67): not the tuning seeds' 1.0.
  gssp = [r for r in selected if r["scheme"] == "gssp"]
  assert [round(r["speedup_vs_bsp"], 4) for r in gssp] == [1.4667, 1.4667]
  records = {"sweep": "x.py", "overrides": {}, "report_seeds": list(REPORTING), "trials": [
      {"name": n, "overrides": {}, "tuned": ["optimizer.learning_rate"]}
      for n in sorted(os.listdir(root))]}
  (root / sweep.GRID_FILE).write_text(json.dumps(records))
  md = open(report.write_report(str(root), str(tmp_path / "out"))["md"]).read()
  assert "reporting seeds 100, 101 were kept apart" in md and "| 100 101 |" in md


def test_a_grid_that_keeps_no_seed_apart_says_so(tmp_path):
  root = tmp_path / "sweep"
  _tuning(root)
  _, choices = report.select_tuned(report.collect(str(root)))
  assert not any(c["reported_apart"] for c in choices)
  lines = report.tuning_section(report.collect(str(root)), choices, "test_accuracy")
  assert "The grid keeps no seed apart from tuning" in "\n".join(lines)
  assert "| 0 1 (the seeds that chose) |" in "\n".join(lines)


_SWEEP_FILE = """
from configs.sweeps import tiny
from gssp_jax.studies.sweep import product, report_on, sweep, tune

def get_config():
  c = tiny.get_config()
  c.data.train_size = 512
  c.data.validation_size = 256
  c.train.target_accuracy = 0.3
  return c

def get_sweep():
  return report_on(product(sweep("sync.scheme", ["gssp"]),
                           tune("optimizer.learning_rate", [0.05, 0.2]),
                           sweep("seed", [0])), {REPORTING})
"""


def test_report_seeds_are_checked_where_the_grid_is_expanded(tmp_path):
  path = tmp_path / "s.py"
  for seeds, match in (("[0, 7]", r"share seed\(s\) \[0\] with the grid's"),
                       ("[]", "a list of distinct integers"), ("[3, 3]", "distinct")):
    path.write_text(textwrap.dedent(_SWEEP_FILE.replace("{REPORTING}", seeds)))
    with pytest.raises(ValueError, match=match):
      sweep.expand(str(path))
  with pytest.raises(ValueError, match="with no tuned key is invalid"):
    grid = sweep.report_on(sweep.sweep("seed", [0]), [1])
    trials = sweep.Trials()
    trials.report_seeds = grid.report_seeds
    sweep._check_report_seeds("s.py", grid, (), trials)


@pytest.mark.slow
def test_a_tiny_sweep_tunes_on_validation_then_reports_on_its_reporting_seed(tmp_path, data_dir):
  """Two rates on seed 0, chosen on the validation split; the chosen one then runs on seed 7
  (in a child process, found through extended.json), which alone is reported."""
  path = tmp_path / "apart.py"
  path.write_text(textwrap.dedent(_SWEEP_FILE.replace("{REPORTING}", "[7]")))
  workdir = tmp_path / "runs" / "apart"
  run_sweep(path, workdir, data_dir)
  with open(workdir / sweep.EXTENDED_FILE) as f:
    (added,) = json.load(f)["trials"]
  assert dict(added["overrides"])["seed"] == 7 and "reporting seed 7" in added["why"]
  rows = report.collect(str(workdir))
  selected, (choice,) = report.select_tuned(rows, None, report.report_seeds(str(workdir)))
  assert choice["chosen_on"] == "validation" and [r["seed"] for r in selected] == [7]
  assert selected[0]["optimizer.learning_rate"] == choice["chosen"]["optimizer.learning_rate"]
  again = run_sweep(path, workdir, data_dir, timeout=300)
  assert "3 finished, 0 to run" in again.stderr, again.stderr[-2000:]
