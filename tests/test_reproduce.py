"""``experiments.reproduce`` on a tiny declared sweep: plan, run, interrupt, resume, the table.

The tiny study (``configs/sweeps/tiny_tune.py``): BSP and GSSP x 2 learning rates x 2 seeds
on 512 examples, tuned. Every figure in the claims table must be the report's own.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gssp_jax.studies import report
from gssp_jax.studies import reproduce
from gssp_jax.studies import sweep
from gssp_jax.studies import claims
from gssp_jax.studies import provenance
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def _command(out):
  return [sys.executable, "-m", "experiments.reproduce", "--only=tiny", f"--out={out}"]


def _finished(runs):
  if not os.path.isdir(runs):
    return []
  return [n for n in os.listdir(runs)
          if sweep.trial_status(os.path.join(runs, n)) in sweep.FINISHED]


@pytest.mark.slow
def test_reproduce_plans_runs_resumes_after_an_interrupt_and_writes_the_claims_table(
    tmp_path, data_dir):
  out = tmp_path / "repro"
  runs = str(out / "runs" / "tiny")
  env = {**os.environ, "GSSP_DATA_DIR": data_dir}
  # The plan alone: every trial listed, nothing run, an estimate printed.
  plan = subprocess.run(_command(out) + ["--plan"], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert plan.returncode == 0, plan.stderr
  assert "tiny                8     0" in plan.stdout and "estimated" in plan.stdout
  assert _finished(runs) == []

  # Interrupted (SIGTERM, as Ctrl-C) once two trials have finished, saving the records as it
  # goes (--save_runs): what had finished is saved on the way out.
  kept = tmp_path / "kept"
  proc = subprocess.Popen(_command(out) + [f"--save_runs={kept}"], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240
    while len(_finished(runs)) < 2:
      assert proc.poll() is None, proc.stdout.read()
      assert time.monotonic() < deadline, "no two trials finished within 240 s"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  before = {n: os.path.getmtime(os.path.join(runs, n, "summary.json")) for n in _finished(runs)}
  assert 2 <= len(before) < 8
  assert sorted(_finished(str(kept / "runs" / "tiny"))) == sorted(before)

  # The rerun resumes: the finished trials are not run again, the rest are.
  again = subprocess.run(_command(out), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"tiny                8 {len(before):>5}" in again.stdout
  assert len(_finished(runs)) == 8
  for name, mtime in before.items():
    assert os.path.getmtime(os.path.join(runs, name, "summary.json")) == mtime
    assert json.load(open(os.path.join(runs, name, "trial.json")))["attempts"] == 1
  for name in _finished(runs):
    assert sweep.trial_seconds(os.path.join(runs, name)) > 0

  # From a working tree with uncommitted changes every trial's provenance is refused, and the
  # table would count none: keep them the documented way (--mark, a reason), so the table below
  # is the same function of the trials on a developer's tree as on CI's clean checkout.
  refused, _ = provenance.check(runs, _finished(runs))
  if refused:
    marked = subprocess.run(
        _command(out) + ["--plan", *(f"--mark=tiny/{n}" for n in sorted(refused)),
                         "--why=run by the test from a tree with uncommitted changes"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert marked.returncode == 0, marked.stderr[-3000:]

  # The table: GSSP's figures are the per-seed comparison's, its verdict follows from them.
  with open(out / "claims.csv") as f:
    (row,) = [r for r in csv.DictReader(f) if r["claim"] == "GSSP"]
  assert row["study"] == "tiny" and row["seeds"] == "2" and row["against"] == "BSP"
  claim = next(c for c in reproduce.CLAIMS if c.name == "GSSP")
  figs = claims.figures(runs)
  vs = claims.against(claim, figs)
  speedup = vs["BSP"]["speedup"]
  assert (row["speedup_median"] or None) == (None if speedup is None else str(speedup.median))
  gap = vs["BSP"]["gap"]
  assert float(row["gap_pp_lo"]) == pytest.approx(gap.lo) and row["gap_pp_n"] == "2"
  verdict, why = claims.judge_claim(claim, figs[("gssp", "none")], vs)
  assert (row["verdict"], row["why"]) == (verdict, "; ".join(why))
  assert verdict == "inconclusive"   # two seeds: fewer than a verdict needs
  md = (out / "claims.md").read_text()
  assert "| GSSP | 46-120 % faster" in md and (out / "claims.png").stat().st_size > 0
  assert "Tuning (disclosed)" in (out / "tiny" / "report.md").read_text()
  assert "| `tiny` | 8 of 8 | 0 | " in md and "(some untimed)" not in md   # the cost table

  # Published into a document: the table between its markers, its links relative to it.
  doc = tmp_path / "docs" / "REPRODUCTION.md"
  doc.parent.mkdir()
  doc.write_text(
      f"# Results\n\n{reproduce.BEGIN}\nthe table of before\n{reproduce.END}\n\nAfter.\n")
  published = subprocess.run(
      _command(out) + ["--plan", f"--publish={tmp_path / 'docs' / 'results' / 'claims'}",
                       f"--doc={doc}"], cwd=REPO, env=env, capture_output=True, text=True,
      timeout=300)
  assert published.returncode == 0, published.stderr[-3000:]
  text = doc.read_text()
  assert "the table of before" not in text and text.endswith("\n\nAfter.\n")
  assert "| GSSP | 46-120 % faster" in text and "](results/claims/claims.png)" in text
  assert "[`tiny`](results/claims/tiny/report.md)" in text
  assert (tmp_path / "docs" / "results" / "claims" / "tiny" / "summary.csv").read_text() == (
      out / "tiny" / "summary.csv").read_text()

  # The records behind the published table come with it (no checkpoints, no TensorBoard), and
  # a fresh --out (a later session, another machine) rebuilds the same table from them alone.
  saved = tmp_path / "docs" / "results" / "claims" / "runs" / "tiny"
  assert sorted(_finished(str(saved))) == sorted(_finished(runs))
  for name in _finished(str(saved)):
    assert sorted(os.listdir(saved / name)) == sorted(
        set(os.listdir(os.path.join(runs, name))) - {"checkpoints", "tensorboard"})
  fresh = tmp_path / "fresh"
  rebuilt = subprocess.run(
      _command(fresh) + ["--plan", f"--merge_from={tmp_path / 'docs' / 'results' / 'claims'}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
  assert "tiny: 8 finished trial(s) taken" in rebuilt.stdout
  assert "tiny                8     8" in rebuilt.stdout
  assert (fresh / "claims.csv").read_text() == (out / "claims.csv").read_text()
  assert (fresh / "claims.md").read_text() == (out / "claims.md").read_text()

  # Merged into another --out (as from a GPU's run): finished trials taken without their
  # checkpoints, a partial run there moved aside, a trial run with another config left.
  other = tmp_path / "other"
  names = sorted(_finished(runs))
  partial = other / "runs" / "tiny" / names[0]
  partial.mkdir(parents=True)
  (partial / "summary.json").write_text(json.dumps({"status": "interrupted"}))
  config = json.loads((out / "runs" / "tiny" / names[1] / "config.json").read_text())
  config["train"]["num_epochs"] += 1
  (out / "runs" / "tiny" / names[1] / "config.json").write_text(json.dumps(config))
  got = reproduce.merge(str(out), str(other), [reproduce.STUDIES["tiny"]], str(REPO))["tiny"]
  assert got["changed"] == [names[1]] and sorted(got["taken"]) == sorted(set(names) - {names[1]})
  assert got["busy"] == []
  assert sorted(_finished(str(other / "runs" / "tiny"))) == sorted(got["taken"])
  assert not (other / "runs" / "tiny" / names[0] / "checkpoints").exists()
  assert (out / "runs" / "tiny" / names[0] / "checkpoints").exists()
  (stale,) = (other / "runs" / "tiny" / sweep.STALE_DIR).iterdir()
  assert (stale / names[0] / "summary.json").exists()


def test_a_document_without_the_markers_is_refused_before_anything_is_copied(tmp_path):
  root = tmp_path / "out"
  root.mkdir()
  (root / "claims.md").write_text("# title\n\nbody ![x](claims.png)\n")
  doc = tmp_path / "doc.md"
  doc.write_text(f"no markers here\n{reproduce.END}\n")
  with pytest.raises(ValueError, match="needs the lines"):
    reproduce.publish(str(root), [], str(tmp_path / "dest"), str(doc))
  assert not (tmp_path / "dest").exists()
  with pytest.raises(ValueError, match="no claims table"):
    reproduce.publish(str(tmp_path), [], str(tmp_path / "dest"))
  doc.write_text(f"a\n{reproduce.BEGIN}\n{reproduce.END}\nb\n")
  reproduce.publish(str(root), [], str(tmp_path / "dest"), str(doc))
  assert "body ![x](dest/claims.png)" in doc.read_text()


def test_each_claim_is_judged_against_the_scheme_its_paper_names():
  """InHAD against ASP, DSSP against SSP, GDTopK against GSSP (the accuracy it recovers and its
  traffic), GSSP against BSP and ASP, the asynchronous local-update schemes against BSP and
  DiLoCo; the table's footer says so."""
  by = {c.name: [claims.name(c.reference)] + [claims.name(b) for b in c.baselines]
        for c in reproduce.CLAIMS}
  assert by["InHAD"] == ["ASP"] and by["DSSP"] == ["SSP"] and by["GSSP + GDTopK"] == ["GSSP"]
  assert by["GSSP"] == ["BSP", "ASP"]
  assert by["Asynchronous Local-SGD"] == by["HALoS"] == ["BSP", "DiLoCo"]
  gdtopk = next(c for c in reproduce.CLAIMS if c.name == "GSSP + GDTopK")
  assert (gdtopk.min_speedup, gdtopk.min_gain_pp, gdtopk.max_bytes) == (None, 0.0, 1.0)
  lines = reproduce._table_lines([], [])   # pylint: disable=protected-access
  assert "InHAD: against ASP" in lines[-1] and "HALoS: against BSP and DiLoCo" in lines[-1]


def test_unknown_studies_are_refused_naming_the_allowed_ones():
  with pytest.raises(ValueError, match=r"'nope' is no study; allowed: mnist_tuned, "):
    reproduce.select(["tiny", "nope"])
  assert [s.name for s in reproduce.select(None)] == list(reproduce.DEFAULT_STUDIES)
  for study in reproduce.STUDIES.values():   # every declared study's sweep builds
    assert sweep.expand(os.path.join(REPO, study.sweep))


def test_a_scheme_no_bsp_trial_matches_is_set_against_bsp_seed_by_seed(tmp_path):
  """A local-update scheme's figures against BSP's, each at its best, seed by seed, where no
  BSP trial shares its other swept keys; the cell names both rates in full (their last parts
  clash)."""
  from tests.test_fair import _trial  # pylint: disable=g-import-not-at-top
  root = tmp_path / "sweep"
  for seed in (0, 1):
    _trial(root, "bsp", seed, 0.05, [0.9, 0.97, 0.99, 0.99])      # at 25.0, final 0.99
    # DiLoCo: its outer and inner optimizer settings swept; at 10 + 10 * (8/9), final 0.985.
    _trial(root, "diloco", seed, 0.7, [0.9, 0.99, 0.985, 0.985],
           extra={"local.optimizer.learning_rate": 0.003, "local.steps": 8},
           tuned_keys=("local.optimizer.learning_rate",))
  figs = claims.figures(str(root))
  claim = next(c for c in reproduce.CLAIMS if c.name == "DiLoCo")
  vs = claims.against(claim, figs)
  assert vs["BSP"]["gap"].median == pytest.approx(-0.5)
  assert vs["BSP"]["speedup"].median == pytest.approx(25.0 / (10.0 + 10.0 * 8 / 9))
  assert vs["BSP"]["speedup"].n == 2
  cell = claims.cell(claim, figs[("diloco", "none")], vs)
  assert "at optimizer.learning_rate=0.7, local.optimizer.learning_rate=0.003" in cell
  assert "2 seeds (those that chose), 2 at target" in cell


def test_a_study_asked_for_that_has_not_run_keeps_the_table_not_final(tmp_path):
  """Every study asked for counts: one with no finished trial has no column, and the table says
  it is not final because of it (it read as final while CIFAR-10 had not started)."""
  from tests.test_fair import _tuned_sweep  # pylint: disable=g-import-not-at-top
  _tuned_sweep(tmp_path / "runs" / "done")
  done = reproduce.Study("done", "none.py", "a finished study", 0.1, "tuned")
  later = reproduce.Study("later", "none.py", "a study still to run", 0.1, "tuned")
  text = open(reproduce.write_claims(str(tmp_path), [done])["md"]).read()
  assert "Not final" not in text
  text = open(reproduce.write_claims(str(tmp_path), [done, later])["md"]).read()
  assert ("**Not final**: `later` has no finished trial yet, so it has no column (a study still "
          "to run). A rerun of the command goes on.") in text
  assert "| claim | paper says | `done` |" in text
  # Trials of BSP alone (no claim's scheme yet): counted, still no column.
  from tests.test_fair import _trial  # pylint: disable=g-import-not-at-top
  names = [_trial(tmp_path / "runs" / "later", "bsp", 0, 0.05, [0.9, 0.97, 0.99, 0.99]),
           "sync.scheme=gssp,optimizer.learning_rate=0.05,seed=0"]   # the second not run yet
  (tmp_path / "runs" / "later" / report.GRID_FILE).write_text(
      json.dumps({"trials": [{"name": n} for n in names]}))
  text = open(reproduce.write_claims(str(tmp_path), [done, later])["md"]).read()
  assert ("`later` has 1 of 2 trials finished, none yet of a scheme with a claim, so it has no "
          "column (a study still to run)") in text


def _trial(runs, name, summary_status, trial_status):
  path = runs / name
  (path / "checkpoints").mkdir(parents=True)
  (path / "checkpoints" / "1").write_text("weights")
  (path / "metrics.jsonl").write_text('{"epoch": 1.0}\n')
  if summary_status:
    (path / "summary.json").write_text(json.dumps({"status": summary_status}))
  (path / "trial.json").write_text(json.dumps({"name": name, "status": trial_status}))
  return path


def test_only_trials_that_have_ended_are_saved_and_the_saver_keeps_up(tmp_path):
  runs = tmp_path / "out" / "runs" / "tiny"
  dest = tmp_path / "kept"
  studies = [reproduce.STUDIES["tiny"]]
  _trial(runs, "a", "done", "done")
  ending = _trial(runs, "b", "done", "running")   # its process has not recorded its end yet
  _trial(runs, "c", None, "running")               # still training
  _trial(runs, "d", "interrupted", "interrupted")
  got = reproduce.save_runs(str(tmp_path / "out"), studies, str(dest))
  assert got == {"tiny": ["a"]}
  assert sorted(os.listdir(dest / "runs" / "tiny")) == ["a"]
  assert sorted(os.listdir(dest / "runs" / "tiny" / "a")) == [
      "metrics.jsonl", "summary.json", "trial.json"]   # no checkpoints

  # While the studies run: a trial that ends is saved within a tick, and once more on stop.
  with reproduce.Saver(str(tmp_path / "out"), studies, str(dest), every=0.05) as saver:
    (ending / "trial.json").write_text(json.dumps({"name": "b", "status": "done"}))
    deadline = time.monotonic() + 30
    while not (dest / "runs" / "tiny" / "b" / "trial.json").exists():
      assert time.monotonic() < deadline, "the saver did not save a trial that ended"
      time.sleep(0.02)
    _trial(runs, "e", "collapsed", "collapsed")
  assert not saver._thread.is_alive()
  assert sorted(os.listdir(dest / "runs" / "tiny")) == ["a", "b", "e"]
  assert json.loads((dest / "runs" / "tiny" / "b" / "trial.json").read_text())["status"] == "done"


def test_accuracy_at_equal_virtual_time_is_read_at_the_earlier_end_and_decides_nothing(tmp_path):
  """A scheme that runs its epochs in half BSP's virtual time ends below BSP's final accuracy
  but above BSP at its own end: the cell shows both, per seed at the earlier of the two ends,
  and the verdict still follows the final accuracy (declared before the runs)."""
  from tests.test_fair import _trial  # pylint: disable=g-import-not-at-top
  root = tmp_path / "sweep"
  for seed in range(5):
    _trial(root, "bsp", seed, 0.05, [0.5, 0.7, 0.9, 0.99])                 # ends at 40
    # GSSP ends at 20, where BSP stood at 0.7; seeds 2-4 end at 15 (BSP: 0.6, interpolated).
    _trial(root, "gssp", seed, 0.05, [0.6, 0.8, 0.85, 0.9 - 0.01 * seed],
           times=(5.0, 10.0, 15.0, 20.0) if seed < 2 else (3.75, 7.5, 11.25, 15.0))
  figs = claims.figures(str(root))
  comp = claims.compare(figs[("gssp", "none")], figs[("bsp", "none")])
  # Per seed: 0.90 - 0.70, 0.89 - 0.70, then 0.88, 0.87, 0.86 - 0.60.
  assert comp["equal_time"].n == 5
  assert comp["equal_time"].median == pytest.approx(26.0)
  assert (comp["equal_time"].lo, comp["equal_time"].hi) == pytest.approx((19.0, 28.0))
  assert comp["gap"].median == pytest.approx(100 * (0.88 - 0.99))
  claim = next(c for c in reproduce.CLAIMS if c.name == "SSP")
  cell = claims.cell(claim, figs[("gssp", "none")], {"BSP": comp})
  assert "+26.00 [+19.00, +28.00] pp at equal virtual time" in cell
  ssp_like = claims.Claim("x", "p", "s", ("gssp", "none"), None, 1.0)
  verdict, why = claims.judge_claim(ssp_like, figs[("gssp", "none")], {"BSP": comp})
  assert verdict == "does not hold" and "accuracy against BSP -11.00" in why[0]

  # An unhealthy seed, or one whose evaluations do not reach the other's end, has no figure.
  metrics = [{"virtual_time": 10.0, "test_accuracy": 0.5}, {"virtual_time": 20.0,
                                                             "test_accuracy": 0.7}]
  assert claims.metric_at(metrics, "test_accuracy", 15.0) == pytest.approx(0.6)
  assert claims.metric_at(metrics, "test_accuracy", 25.0) is None
  assert claims.metric_at(metrics, "test_accuracy", 5.0) is None
  row = {"seed": 0, "status": "done", "metric": "test_accuracy", "_metrics": metrics}
  assert claims.gap_at_equal_time({**row, "status": "collapsed"}, row) is None
  assert claims.gap_at_equal_time(row, row) == 0.0
