"""The grid-edge rule (``gssp_jax.studies.grid_edge``): a winner at the end of the values tried is tried
beyond it, along the declared ladder, until it lies inside them or the ladder ends."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gssp_jax.studies import grid_edge
from gssp_jax.studies import report
from gssp_jax.studies import reproduce
from gssp_jax.studies import sweep
from tests.conftest import REPO
from tests.test_fair import _trial

LADDER = (0.01, 0.02, 0.05, 0.1, 0.2)
FAST, SLOW = [0.9, 0.97, 0.99, 0.99], [0.9, 0.95, 0.97, 0.985]   # at 25.0 and 36.67


def _trials(root, ladder=LADDER):
  """The runner's view of ``root``'s trial directories (sweep.Trial, tuned learning rate)."""
  trials = sweep.Trials()
  trials.ladders = {"optimizer.learning_rate": ladder}
  for name in sorted(os.listdir(root)):
    with open(root / name / "trial.json") as f:
      overrides = json.load(f)["overrides"]
    trials.append(sweep.Trial(name, overrides, None, ("optimizer.learning_rate",)))
  return trials


def _added(root, ladder=LADDER):
  return [(o["sync.scheme"], o["optimizer.learning_rate"], o["seed"])
          for o, _ in grid_edge.extensions(str(root), _trials(root, ladder),
                                           {"optimizer.learning_rate": ladder})]


def test_a_winner_at_either_edge_gets_the_ladders_next_value_on_every_seed(tmp_path):
  root = tmp_path / "sweep"
  for seed in (0, 1):
    _trial(root, "bsp", seed, 0.05, SLOW)
    _trial(root, "bsp", seed, 0.1, FAST)        # BSP best at the highest: 0.2 next
    _trial(root, "gssp", seed, 0.05, FAST)      # GSSP best at the lowest: 0.02 next
    _trial(root, "gssp", seed, 0.1, SLOW)
  assert sorted(_added(root)) == [("bsp", 0.2, 0), ("bsp", 0.2, 1), ("gssp", 0.02, 0),
                                  ("gssp", 0.02, 1)]
  (overrides, why), *_ = grid_edge.extensions(str(root), _trials(root),
                                              {"optimizer.learning_rate": LADDER})
  assert list(overrides) == ["sync.scheme", "optimizer.learning_rate", "seed"]   # grid's order
  assert "won as the highest value tried (0.05, 0.1)" in why
  # The plan's bound: beyond each finished best, on its side only (BSP: 0.2; GSSP: 0.01 and
  # 0.02), on both seeds; without the directory, every untried ladder value (3 per scheme).
  trials = _trials(root)
  assert grid_edge.possible(trials, trials.ladders, str(root)) == (1 + 2) * 2
  assert grid_edge.possible(trials, trials.ladders) == (3 + 3) * 2


def test_nothing_is_added_inside_the_values_at_the_ladders_end_or_before_all_finished(tmp_path):
  root = tmp_path / "sweep"
  for lr, accs in ((0.02, SLOW), (0.05, FAST), (0.1, SLOW)):
    _trial(root, "bsp", 0, lr, accs)           # best inside: nothing
  for lr, accs in ((0.1, SLOW), (0.2, FAST)):
    _trial(root, "ssp", 0, lr, accs)           # best at 0.2, the ladder's end: nothing
  _trial(root, "gssp", 0, 0.05, FAST)
  _trial(root, "gssp", 1, 0.05, FAST, status="interrupted")   # unfinished: wait
  _trial(root, "gssp", 0, 0.1, SLOW)
  _trial(root, "gssp", 1, 0.1, SLOW)
  assert _added(root) == []
  # Once GSSP's seed 1 finishes, its winner at the lowest value moves.
  (root / sweep.trial_name({"sync.scheme": "gssp", "optimizer.learning_rate": 0.05,
                            "seed": 1}) / "summary.json").write_text(json.dumps({
      "config": {"sync": {"scheme": "gssp"}, "seed": 1}, "status": "done",
      "final": {"test_accuracy": 0.99}, "metric": "test_accuracy", "target": 0.98,
      "totals": {"virtual_time": 40.0, "bytes_pushed": 1}}))
  assert _added(root) == [("gssp", 0.02, 0), ("gssp", 0.02, 1)]
  # A value off the ladder (or no ladder for the key): the rule does not guess.
  assert _added(root, ladder=(0.02, 0.1, 0.2)) == []


def test_the_report_says_where_a_winner_sits_at_the_ladders_end(tmp_path):
  root = tmp_path / "sweep"
  for lr, accs in ((0.1, SLOW), (0.2, FAST)):
    _trial(root, "bsp", 0, lr, accs)
  trials = _trials(root)
  sweep.write_grid(str(root), "x.py", trials)
  md = open(report.write_report(str(root), str(tmp_path / "out"))["md"]).read()
  assert "Declared ladder: optimizer.learning_rate in (0.01, 0.02, 0.05, 0.1, 0.2)" in md
  assert "| highest, the ladder's end |" in md
  assert "1 of 1 configuration(s) won at the end of the declared ladder" in md


def test_ladders_are_checked_where_they_are_declared():
  with pytest.raises(ValueError, match=r"values \[0.3\] are not on ladder"):
    sweep.tune("optimizer.learning_rate", [0.1, 0.3], ladder=(0.05, 0.1, 0.2))
  with pytest.raises(ValueError, match="strictly increasing"):
    sweep.tune("optimizer.learning_rate", [0.1], ladder=(0.2, 0.1))
  with pytest.raises(ValueError, match="numbers only"):
    sweep.tune("optimizer.name", ["sgd"], ladder=("sgd", "adam"))
  with pytest.raises(ValueError, match="two ladders"):
    sweep.product(sweep.tune("optimizer.learning_rate", [0.1], ladder=(0.1, 0.2)),
                  sweep.tune("optimizer.learning_rate", [0.1], ladder=(0.05, 0.1)))
  with pytest.raises(ValueError, match="is not tuned"):
    sweep.Grid([{"seed": 0}], tuned=(), ladders={"seed": (0, 1)})
  grid = sweep.product(sweep.sweep("sync.scheme", ["bsp"]),
                       sweep.tune("optimizer.learning_rate", [0.1, 0.2], ladder=(0.1, 0.2, 0.4)))
  assert grid.ladders == {"optimizer.learning_rate": (0.1, 0.2, 0.4)}


_SWEEP_FILE = """
from configs.sweeps import tiny
from gssp_jax.studies.sweep import Grid, product, sweep, tune

def get_config():
  c = tiny.get_config()
  c.data.train_size = 512
  c.train.target_accuracy = 0.3
  return c

def get_sweep():
  grid = product(sweep("sync.scheme", ["gssp"]),
                 tune("optimizer.learning_rate", [0.1, 0.2], ladder=(0.05, 0.1, 0.2, 0.4)),
                 sweep("seed", [0]))
  return Grid(grid, grid.tuned, {TUNE_SEEDS}, grid.ladders)
"""


def run_sweep(path, workdir, data_dir, timeout=600):
  """``experiments.sweep`` of ``path`` into ``workdir`` with --parallel=2, in a child process
  (each trial in its own); asserts that it succeeded and returns it (its stderr: the log)."""
  command = [sys.executable, "-m", "experiments.sweep", f"--sweep={path}",
             f"--workdir={workdir}", "--parallel=2"]
  run = subprocess.run(command, cwd=REPO, env={**os.environ, "GSSP_DATA_DIR": data_dir},
                       capture_output=True, text=True, timeout=timeout)
  assert run.returncode == 0, run.stderr[-3000:]
  return run


@pytest.mark.slow
def test_a_sweep_extends_its_grid_until_no_winner_sits_at_an_edge_and_a_rerun_adds_nothing(
    tmp_path, data_dir):
  """Two rates on a ladder of four: the winner is at an edge of two values, so the sweep runs
  at least one more; each added trial runs in a child process (--parallel=2), which finds it
  through extended.json; the report shows the declared grid and the added trials."""
  path = tmp_path / "edge.py"
  path.write_text(textwrap.dedent(_SWEEP_FILE.replace("{TUNE_SEEDS}", "None")))
  workdir = tmp_path / "runs" / "edge"   # where experiments.reproduce keeps a study "edge"
  run_sweep(path, workdir, data_dir)
  with open(workdir / sweep.EXTENDED_FILE) as f:
    added = json.load(f)["trials"]
  assert added and all("next on the ladder" in t["why"] for t in added)
  trials = sweep.expand(str(path), workdir=str(workdir))
  assert [t.extended for t in trials] == [False, False] + [True] * len(added)
  rates = sorted(t.overrides["optimizer.learning_rate"] for t in trials)
  assert set(rates) - {0.1, 0.2} == {dict(t["overrides"])["optimizer.learning_rate"]
                                     for t in added}
  assert all(t.name.startswith("sync.scheme=gssp,optimizer.learning_rate=") for t in trials)
  assert all(sweep.trial_status(str(workdir / t.name)) in sweep.FINISHED for t in trials)
  _, (choice,) = report.select_tuned(report.collect(str(workdir)))
  best = choice["chosen"]["optimizer.learning_rate"]
  assert best not in (rates[0], rates[-1]) or best in (0.05, 0.4), (best, rates)
  md = open(report.write_report(str(workdir), str(tmp_path / "out"))["md"]).read()
  assert "optimizer.learning_rate in {0.1, 0.2}" in md   # the declared grid
  assert f"{len(added)} trial(s) were added so" in md
  # experiments.reproduce's plan counts them, and what the ladder may still add.
  (row,) = reproduce.plan([reproduce.Study("edge", str(path), "a test", 0.1, "tuned")],
                          str(tmp_path), str(REPO), 1)
  assert (row["trials"], row["finished"], row["extended"]) == (len(trials),) * 2 + (len(added),)
  assert row["may_extend"] == 0   # the rule settled every best: nothing more to add
  assert f"{len(added)} of its trials were added by the grid-edge rule; it can add no more" in (
      reproduce.describe_plan([row], 1))
  # A rerun: nothing to run, nothing added, no "changed sweep".
  again = run_sweep(path, workdir, data_dir, timeout=300)
  assert f"{len(trials)} finished, 0 to run" in again.stderr
  with open(workdir / sweep.EXTENDED_FILE) as f:
    assert len(json.load(f)["trials"]) == len(added)


def test_a_ladder_with_tune_seeds_is_refused_naming_both(tmp_path):
  path = tmp_path / "edge.py"
  path.write_text(textwrap.dedent(_SWEEP_FILE.replace("{TUNE_SEEDS}", "(0,)")))
  with pytest.raises(ValueError, match="ladders with tune_seeds are invalid"):
    sweep.expand(str(path))


def test_nothing_is_extended_with_max_trials_or_while_a_trial_is_unfinished(monkeypatch, tmp_path):
  """The rule waits for every trial (a failed or interrupted one is rerun first) and leaves a
  --max_trials run as asked; with everything finished it adds, reruns, and stops when it adds
  nothing."""
  calls, added = [], []
  statuses = {"a": "done", "b": "failed"}
  trials = sweep.Trials()
  trials.ladders = {"optimizer.learning_rate": LADDER}
  monkeypatch.setattr(sweep, "run_sweep", lambda path, workdir, **kw: calls.append(kw) or statuses)
  monkeypatch.setattr(sweep, "expand", lambda *a, **k: trials)
  monkeypatch.setattr(sweep, "add_extended", lambda workdir, o, why: added.append(o))
  monkeypatch.setattr(grid_edge, "extensions", lambda *a: [] if added else [({"x": 1}, "why")])
  grid_edge.run_sweep("s.py", str(tmp_path), max_trials=3)
  assert len(calls) == 1 and not added
  grid_edge.run_sweep("s.py", str(tmp_path))
  assert len(calls) == 2 and not added   # "b" failed: nothing is extended
  statuses["b"] = "collapsed"
  grid_edge.run_sweep("s.py", str(tmp_path))
  assert added == [[{"x": 1}]] and len(calls) == 4   # added once, run, then nothing to add
