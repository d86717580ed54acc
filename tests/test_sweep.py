"""Config-file sweeps: expansion and validation, the resumable runner, failures recorded."""

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gssp_jax import cli
from gssp_jax.studies import report
from gssp_jax.studies import sweep

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "sweeps" / "tiny.py")


def test_product_and_zipped():
  grid = sweep.product(sweep.sweep("a", [1, 2]), sweep.zipped(sweep.sweep("b", ["x", "y"]),
                                                              sweep.sweep("c", [0.1, 0.2])))
  assert grid == [{"a": 1, "b": "x", "c": 0.1}, {"a": 1, "b": "y", "c": 0.2},
                  {"a": 2, "b": "x", "c": 0.1}, {"a": 2, "b": "y", "c": 0.2}]
  with pytest.raises(ValueError, match="different lengths"):
    sweep.zipped(sweep.sweep("a", [1]), sweep.sweep("b", [1, 2]))


def _sweep_file(tmp_path, grid: str, name="s.py"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(f"""
      from configs import mnist_lenet5
      from gssp_jax.studies.sweep import product, sweep, zipped
      def get_config():
        return mnist_lenet5.get_config("smoke")
      def get_sweep():
        return {grid}
      """))
  return str(path)


@pytest.mark.parametrize("grid,match", [
    ('product(sweep("sync.stalenes", [1, 2]))', r"key 'sync.stalenes' is not a config key"),
    ("[]", r"empty grid"),
    ('product(sweep("num_workers", ["four"]))', r"num_workers='four' has the wrong type"),
    ('product(sweep("sync.scheme", ["gsp"]))', r"config.sync.scheme='gsp' is invalid"),
    ('product(sweep("seed", [1, 1]))', r"appears twice"),
])
def test_broken_sweep_files_name_the_key(tmp_path, grid, match):
  with pytest.raises(ValueError, match=match):
    sweep.expand(_sweep_file(tmp_path, grid))


def test_tiny_sweep_resumes_without_redoing_finished_trials(tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  workdir = str(tmp_path / "sweep")
  short = {"train.num_epochs": 1.0, "train.eval_every": 0.5}   # the machinery, not the tour
  first = sweep.run_sweep(TINY, workdir, max_trials=2, overrides=short)   # stops after two
  assert list(first.values()) == ["done", "done", None, None]
  stamps = {n: os.path.getmtime(os.path.join(workdir, n, "summary.json"))
            for n, s in first.items() if s == "done"}
  second = sweep.run_sweep(TINY, workdir, overrides=short)
  assert set(second.values()) == {"done"} and len(second) == 4
  for name, stamp in stamps.items():   # finished trials were not run again
    assert os.path.getmtime(os.path.join(workdir, name, "summary.json")) == stamp
    assert json.load(open(os.path.join(workdir, name, "trial.json")))["attempts"] == 1
  for name in second:
    summary = json.load(open(os.path.join(workdir, name, "summary.json")))
    trial = json.load(open(os.path.join(workdir, name, "trial.json")))
    assert summary["config"]["sync"]["scheme"] == trial["overrides"]["sync.scheme"]
    assert summary["config"]["seed"] == trial["overrides"]["seed"]
    assert os.path.getsize(os.path.join(workdir, name, "log.txt")) > 0

  # The report's numbers are each trial's summary.json, and its plots exist.
  paths = report.write_report(workdir, str(tmp_path / "report"))
  with open(paths["csv"]) as f:
    rows = {r["trial"]: r for r in csv.DictReader(f)}
  assert set(rows) == set(second)
  for name, row in rows.items():
    summary = json.load(open(os.path.join(workdir, name, "summary.json")))
    assert float(row["final"]) == summary["final"]["test_accuracy"]
    assert float(row["virtual_time"]) == summary["totals"]["virtual_time"]
    assert int(row["bytes_pushed"]) == summary["totals"]["bytes_pushed"]
  bsp0 = rows["sync.scheme=bsp,seed=0"]
  gssp0 = rows["sync.scheme=gssp,seed=0"]
  assert float(gssp0["delta_vs_bsp"]) == pytest.approx(float(gssp0["final"]) - float(bsp0["final"]))
  with open(paths["summary_csv"]) as f:
    agg = {r["sync.scheme"]: r for r in csv.DictReader(f)}
  finals = [float(rows[f"sync.scheme=gssp,seed={s}"]["final"]) for s in (0, 1)]
  assert float(agg["gssp"]["final"]) == pytest.approx(sum(finals) / 2)
  assert int(agg["gssp"]["seeds"]) == 2
  for png in ("metric_vs_virtual_time.png", "staleness.png", "blocked_time.png",
              "bytes_per_link.png"):
    assert (tmp_path / "report" / png).stat().st_size > 1000
    assert png in open(paths["md"]).read()

  # Time to a target chosen after the fact: interpolated between the recorded evaluations
  # around it (the first evaluation reaching it kept as time_to_target_first_eval).
  for name in second:
    summary = json.load(open(os.path.join(workdir, name, "summary.json")))
    metrics = [json.loads(line) for line in open(os.path.join(workdir, name, "metrics.jsonl"))]
    accs = [m["test_accuracy"] for m in metrics]
    mid = sorted(accs)[len(accs) // 2]
    i = next(i for i, m in enumerate(metrics) if m["test_accuracy"] >= mid)
    expected = metrics[i]["virtual_time"]
    if i:
      (a0, t0), (a1, t1) = ((metrics[j]["test_accuracy"], metrics[j]["virtual_time"])
                            for j in (i - 1, i))
      expected = t0 + (mid - a0) / (a1 - a0) * (t1 - t0)
    row = next(r for r in report.collect(workdir, target=mid) if r["trial"] == name)
    assert row["time_to_target"] == pytest.approx(expected) and row["target"] == mid
    assert row["time_to_target_first_eval"] == metrics[i]["virtual_time"]
    assert summary["time_to_target_first_eval"] == next(
        (m["virtual_time"] for m in metrics if m["test_accuracy"] >= summary["target"]), None)
    never = next(r for r in report.collect(workdir, target=0.999) if r["trial"] == name)
    assert never["time_to_target"] is None and never["speedup_vs_bsp"] is None
    assert row["final"] == summary["final"]["test_accuracy"]
  with pytest.raises(ValueError, match=r"target=-1 is invalid"):
    report.collect(workdir, target=-1)

  # The sweep's own progress lines went to its workdir.
  log = open(os.path.join(workdir, "sweep.log")).read()
  assert "[2/4 finished]" in log and "[4/4 finished]" in log and "ETA" in log


def test_sweep_file_args_and_the_paper_sweeps(tmp_path):
  path = tmp_path / "arg.py"
  path.write_text(textwrap.dedent("""
      from configs import mnist_lenet5
      from gssp_jax.studies.sweep import sweep
      def get_config(arg=None):
        c = mnist_lenet5.get_config("smoke")
        c.num_workers = 8 if arg == "big" else 2
        return c
      def get_sweep(arg=None):
        return sweep("seed", [0, 1, 2] if arg == "big" else [0])
      """))
  small, big = sweep.expand(str(path)), sweep.expand(f"{path}:big")
  assert [t.config.num_workers for t in small] == [2]
  assert [t.config.num_workers for t in big] == [8, 8, 8]
  with pytest.raises(ValueError, match=r"takes no argument, but ':x' was given"):
    sweep.expand(_sweep_file(tmp_path, 'sweep("seed", [0])') + ":x")

  mnist = sweep.expand(str(REPO / "configs" / "sweeps" / "paper_mnist.py"))
  assert len(mnist) == 27 and {t.config.seed for t in mnist} == {0, 1, 2}
  tuned = sweep.expand(str(REPO / "configs" / "sweeps" / "paper_mnist.py") + ":tune")
  assert len(tuned) == 81 and {t.tuned for t in tuned} == {("optimizer.learning_rate",)}
  assert {t.config.optimizer.learning_rate for t in tuned} == {0.02, 0.05, 0.1}
  assert {(t.config.sync.scheme, t.config.compress.name) for t in mnist} == {
      ("bsp", "none"), ("asp", "none"), ("ssp", "none"), ("dssp", "none"), ("gssp", "none"),
      ("gssp", "gdtopk"), ("inhad", "none"), ("dssync", "none"), ("casp", "none")}
  for t in mnist:   # the documented preset
    assert t.config.num_workers == 16 and t.config.cluster.profile == "tiers"
    assert tuple(t.config.cluster.tiers) == (1.0, 1.5, 2.0, 3.0)
    assert t.config.optimizer.warmup_epochs == 1.0 and t.config.train.target_accuracy == 0.98
    assert t.config.train.eval_every == 0.25
  for name, reduced, full in (("paper_cifar10_resnet18", 4, 27), ("paper_cifar10_vgg19", 4, 27),
                              ("paper_multi30k_seq2seq", 3, 27)):
    spec = str(REPO / "configs" / "sweeps" / f"{name}.py")
    small, big = sweep.expand(spec), sweep.expand(spec + ":full")
    assert (len(small), len(big)) == (reduced, full)
    assert all(t.config.num_workers == 8 and t.config.data.train_size == 8192 for t in small)
    assert all(t.config.num_workers == 16 and t.config.data.train_size == 0 for t in big)
    assert all("width" not in t.config.model_args for t in big)
    with pytest.raises(ValueError, match=r"sweep arg 'huge' is invalid"):
      sweep.expand(spec + ":huge")


def test_the_authors_protocol_sweep_has_their_settings():
  """``paper_mnist_authors.py``: the GSSP authors' MNIST settings (issue 35), declared target."""
  trials = sweep.expand(str(REPO / "configs" / "sweeps" / "paper_mnist_authors.py"))
  assert len(trials) == 15 and {t.config.seed for t in trials} == {0, 1, 2}
  assert {(t.config.sync.scheme, t.config.compress.name) for t in trials} == {
      ("bsp", "none"), ("asp", "none"), ("ssp", "none"), ("gssp", "none"), ("gssp", "gdtopk")}
  for t in trials:
    c = t.config
    assert (c.num_workers, c.batch_size, c.sync.num_groups, c.sync.staleness) == (16, 64, 4, 3)
    o = c.optimizer
    assert (o.name, o.learning_rate, o.momentum, o.weight_decay) == ("sgd", 0.001, 0.9, 5e-4)
    assert (o.schedule, o.warmup_epochs, o.weight_decay_mode) == ("constant", 0.0, "per_step")
    assert c.train.target_accuracy == 0.95 and c.train.num_epochs == 25.0 and not t.tuned
  with pytest.raises(ValueError, match=r"sweep arg 'tune' is invalid"):
    sweep.expand(str(REPO / "configs" / "sweeps" / "paper_mnist_authors.py") + ":tune")


def test_the_tuned_cifar10_sweep_gives_every_scheme_its_declared_grid_on_every_seed():
  trials = sweep.expand(str(REPO / "configs" / "sweeps" / "paper_cifar10_tuned.py"))
  assert len(trials) == 45 and {t.config.seed for t in trials} == {0, 1, 2}
  grids = {}
  for t in trials:
    c = t.config
    assert c.model_args.width == 0.25 and c.data.train_size == 8192 and c.num_workers == 8
    assert c.train.num_epochs == 4.0 and c.train.target_accuracy == 0.35
    label = c.sync.scheme + ("+" + c.compress.name if c.compress.name != "none" else "")
    rate = (c.local.optimizer.learning_rate if c.sync.scheme == "diloco"
            else c.optimizer.learning_rate)
    grids.setdefault(label, set()).add(rate)
  assert grids == {"bsp": {0.01, 0.03, 0.1}, "ssp": {0.01, 0.03, 0.1}, "gssp": {0.01, 0.03, 0.1},
                   "gssp+gdtopk": {0.01, 0.03, 0.1}, "diloco": {3e-4, 1e-3, 3e-3}}


def test_the_local_update_sweep_builds_both_clusters_with_each_familys_rate_grid(monkeypatch):
  spec = str(REPO / "configs" / "sweeps" / "local_update_mnist.py")
  from configs.sweeps import local_update_mnist  # pylint: disable=g-import-not-at-top
  for cluster in ("tiers", "straggler"):
    trials = sweep.expand(f"{spec}:{cluster}")
    chosen = local_update_mnist.CHOSEN[cluster]
    # Seed 0 over each grid (14 trials), seeds 1 and 2 at each chosen rate.
    assert len(trials) == 14 + 2 * len(chosen) and trials.tune_seeds == (0,)
    assert [t.config.seed for t in trials[:14]] == [0] * 14   # seed by seed
    assert len({t.name for t in trials}) == len(trials)
    assert all(len(t.name) <= sweep.MAX_NAME for t in trials)
    for t in trials:
      c = t.config
      assert c.num_workers == 16 and c.train.num_epochs == 3.0 and c.train.eval_every == 0.25
      if c.sync.scheme in ("diloco", "async_local_sgd", "halos"):
        assert c.local.steps == 8 and c.local.optimizer.name == "adamw"
        assert c.local.optimizer.learning_rate in (1e-3, 3e-3)
        assert t.tuned == ("optimizer.learning_rate", "local.optimizer.learning_rate")
      else:
        assert c.local.steps == 1 and c.optimizer.learning_rate in (0.02, 0.05)
        assert t.tuned == ("optimizer.learning_rate",)
      if cluster == "straggler":
        assert c.cluster.profile == "lognormal" and c.cluster.jitter == 0.2
        assert len(c.cluster.speeds) == 16 and max(c.cluster.speeds) == 8.0
      else:
        assert tuple(c.cluster.tiers) == (1.0, 1.5, 2.0, 3.0) and not len(c.cluster.speeds)
  for bad in ("", "smoke", "tiers,straggler", "huge"):
    with pytest.raises(ValueError, match="is invalid|unknown config arg"):
      sweep.expand(f"{spec}:{bad}")
  # A choice off the grid, or of a scheme the sweep does not have, is refused.
  for bad in ({"gssp": 0.3}, {"gsp": 0.05}):
    monkeypatch.setattr(local_update_mnist, "CHOSEN", {"tiers": bad, "straggler": {}})
    with pytest.raises(ValueError, match=r"CHOSEN\['tiers'\]"):
      local_update_mnist.get_sweep("tiers")


def test_the_long_local_update_sweep_runs_every_rate_on_every_seed_with_ladders():
  spec = str(REPO / "configs" / "sweeps" / "local_update_mnist.py")
  from configs.sweeps import local_update_mnist  # pylint: disable=g-import-not-at-top
  trials = sweep.expand(f"{spec}:tiers,long")
  assert len(trials) == 7 * 2 * 3 and trials.tune_seeds is None   # every rate, every seed
  assert [t.config.seed for t in trials] == [0] * 14 + [1] * 14 + [2] * 14
  assert trials.ladders == {"optimizer.learning_rate": local_update_mnist.SGD_LADDER,
                            "local.optimizer.learning_rate": local_update_mnist.INNER_LADDER}
  assert len({t.name for t in trials}) == len(trials)
  for t in trials:
    c = t.config
    assert c.train.num_epochs == 8.0 and c.num_workers == 16
    if c.sync.scheme in local_update_mnist.LOCAL:
      assert c.local.optimizer.learning_rate in (1e-3, 3e-3)
    else:
      assert c.optimizer.learning_rate in (0.02, 0.05)
  with pytest.raises(ValueError, match="is invalid"):
    sweep.expand(f"{spec}:long")


def test_long_trial_names_keep_their_head_and_stay_apart():
  short = {"sync.scheme": "gssp", "seed": 1}
  assert sweep.trial_name(short) == "sync.scheme=gssp,seed=1"
  head = {"sync.scheme": "diloco", "seed": 0, **{f"local.key{i}": "x" * 20 for i in range(10)}}
  a, b = sweep.trial_name({**head, "z": 1}), sweep.trial_name({**head, "z": 2})
  assert len(a) == len(b) == sweep.MAX_NAME and a != b
  assert a.startswith("sync.scheme=diloco,seed=0,local.key0=") and ",~" in a


def test_failed_trials_are_recorded_and_retried(tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  path = _sweep_file(tmp_path, 'zipped(sweep("data_dir", ["/nonexistent/data"]), '
                               'sweep("data_download", [False]))')
  workdir = str(tmp_path / "sweep")
  statuses = sweep.run_sweep(path, workdir)
  (name,) = statuses
  trial = json.load(open(os.path.join(workdir, name, "trial.json")))
  assert trial["status"] == "failed" and "nonexistent" in trial["error"]
  sweep.run_sweep(path, workdir)
  assert json.load(open(os.path.join(workdir, name, "trial.json")))["attempts"] == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"parallel": 0}, r"parallel=0 is invalid; allowed: an int >= 1"),
    ({"parallel": True}, r"parallel=True is invalid"),
    ({"max_trials": -1}, r"max_trials=-1 is invalid; allowed: an int >= 0"),
    ({"rerun_changed": "yes"}, r"rerun_changed='yes' is invalid; allowed: True or False"),
])
def test_bad_runner_arguments_name_the_value(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    sweep.run_sweep(TINY, str(tmp_path / "sweep"), **kwargs)
  assert not (tmp_path / "sweep").exists()   # rejected before anything ran


def test_report_of_an_empty_directory_says_so(tmp_path):
  with pytest.raises(ValueError, match="no finished trial"):
    report.write_report(str(tmp_path))


def test_parallel_trials_run_in_their_own_processes(tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  monkeypatch.chdir(REPO)   # the children run `python -m experiments.sweep`
  path = tmp_path / "two.py"
  path.write_text(textwrap.dedent("""
      from configs.sweeps import tiny
      from gssp_jax.studies.sweep import sweep
      def get_config():
        return tiny.get_config()
      def get_sweep():
        return sweep("sync.scheme", ["bsp", "gssp"])
      """))
  workdir = str(tmp_path / "sweep")
  statuses = sweep.run_sweep(str(path), workdir, parallel=2, report_every=1.0)
  assert statuses == {"sync.scheme=bsp": "done", "sync.scheme=gssp": "done"}
  log = open(os.path.join(workdir, "sweep.log")).read()
  assert "running: sync.scheme=bsp" in log and "[2/2 finished]" in log
  for name in statuses:
    trial = json.load(open(os.path.join(workdir, name, "trial.json")))
    assert trial["status"] == "done" and trial["attempts"] == 1
    assert os.path.getsize(os.path.join(workdir, name, "log.txt")) > 0


@pytest.mark.parametrize("user", [None, ("XLA_CLIENT_MEM_FRACTION", "0.2")])
def test_parallel_children_share_the_gpu_memory_and_get_the_determinism_flag(
    tmp_path, monkeypatch, user):
  monkeypatch.chdir(REPO)   # the children run `python -m experiments.sweep`
  for name in ("XLA_FLAGS", "GSSP_DETERMINISTIC", "XLA_PYTHON_CLIENT_MEM_FRACTION",
               "XLA_CLIENT_MEM_FRACTION"):
    monkeypatch.delenv(name, raising=False)
  if user:
    monkeypatch.setenv(*user)
  seen = tmp_path / "seen"
  seen.mkdir()
  path = tmp_path / "env.py"
  # In a child (it has `--only`) the sweep file records what it sees and stops the trial:
  # the test is about the environment, not the training.
  path.write_text(textwrap.dedent(f"""
      import json, os, sys
      from configs.sweeps import tiny
      from gssp_jax.studies.sweep import sweep
      def get_config():
        if any(a.startswith("--only") for a in sys.argv):
          keys = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
          with open(os.path.join({str(seen)!r}, str(os.getpid())), "w") as f:
            json.dump({{k: os.environ.get(k) for k in keys}}, f)
          raise SystemExit("recorded")
        c = tiny.get_config()
        c.sync.num_groups = 4   # tiny's GSSP setting, unread by this BSP-only sweep: the default
        return c
      def get_sweep():
        return sweep("seed", [0, 1, 2])
      """))
  statuses = sweep.run_sweep(str(path), str(tmp_path / "sweep"), parallel=4)
  assert set(statuses.values()) == {"failed"}   # each child stopped after recording
  envs = [json.loads(p.read_text()) for p in seen.iterdir()]
  assert len(envs) == 3
  for env in envs:
    assert env["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=true"
    if user:   # the user's own fraction, and not a second name (jaxlib refuses both)
      assert env["XLA_CLIENT_MEM_FRACTION"] == "0.2"
      assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] is None
    else:      # 3 trials, so 3 shares of 0.9 (not 4: no more shares than children)
      assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.300"
      assert env["XLA_CLIENT_MEM_FRACTION"] is None


def test_sigterm_raises_keyboard_interrupt_inside_and_not_after():
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(KeyboardInterrupt):
    with cli.sigterm_as_interrupt():
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(5)   # the handler runs at the next bytecode; never reached
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_as_a_trial_ends_stops_a_serial_sweep_before_the_next_trial(
    tmp_path, monkeypatch):
  """A signal that arrives as a trial ends comes too late for the trial to act on; it must still
  stop the sweep (it was lost once: every trial of a tiny study then ran to the end)."""
  from gssp_jax.base import interrupt  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  path = _sweep_file(tmp_path, 'sweep("seed", [0, 1, 2])')
  workdir = tmp_path / "sweep"
  ran = []

  def finishes_as_the_signal_comes(config, trial_dir, allow_unread=()):
    del allow_unread
    with interrupt.deferred():   # as the loop does
      ran.append(config.seed)
      os.kill(os.getpid(), signal.SIGTERM)   # the handler records it: the run acts on it no more
      time.sleep(0.1)
      with open(os.path.join(trial_dir, "summary.json"), "w") as f:
        json.dump({"status": "done"}, f)
    return {"status": "done"}

  monkeypatch.setattr(loop, "train_and_evaluate", finishes_as_the_signal_comes)
  with pytest.raises(KeyboardInterrupt, match="SIGTERM: the sweep stops before trial seed=1"):
    sweep.run_sweep(path, str(workdir))
  assert ran == [0]
  assert json.load(open(workdir / "seed=0" / "trial.json"))["status"] == "done"
  assert not (workdir / "seed=1").exists()
  assert interrupt.requested() is None   # cleared once the outermost one is left

  # Nested: only the outermost sets the handlers and clears the request.
  before = signal.getsignal(signal.SIGTERM)
  with interrupt.deferred():
    with interrupt.deferred():
      interrupt.request("SIGINT")
    assert interrupt.requested() == "SIGINT"
  assert interrupt.requested() is None and signal.getsignal(signal.SIGTERM) is before


def _processes_mentioning(text: str) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit() and int(entry) != os.getpid():
      try:
        cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace")
      except OSError:   # exited meanwhile
        continue
      if text in cmdline:
        pids.append(int(entry))
  return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the child trials through /proc")
@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_kill_of_a_parallel_sweep_stops_its_trials(tmp_path, data_dir, how):
  """``kill`` (SIGTERM to the sweep) or a terminal's Ctrl-C (SIGINT to its whole process group):
  each trial saves a checkpoint where it is and stops (a trial that took the group's SIGINT and
  then the sweep's SIGTERM as a second signal would stop at once, without it).

  The trials must still be running when the signal comes. With 100 epochs they were not always:
  a tiny trial trains 100 epochs in about 110 s here (BSP; GSSP 131 s, quiet machine), and on a
  machine at load 20 a trial once ended ``done`` before the test sent its signal. A run that has
  not completed its epochs is never ``done`` (``loop._train_and_evaluate``: ``completed()``), so
  the trials now have 100,000 epochs (days), and the test checks they are running when it signals.
  """
  path = tmp_path / "long.py"
  path.write_text(textwrap.dedent("""
      from configs.sweeps import tiny
      from gssp_jax.studies.sweep import sweep
      def get_config():
        c = tiny.get_config()
        c.train.num_epochs = 100000.0   # runs until killed
        return c
      def get_sweep():
        return sweep("sync.scheme", ["bsp", "gssp"])
      """))
  workdir = str(tmp_path / "sweep")
  names = ["sync.scheme=bsp", "sync.scheme=gssp"]
  cmd = [sys.executable, "-m", "experiments.sweep", f"--sweep={path}", f"--workdir={workdir}",
         "--parallel=2"]
  stderr = open(tmp_path / "stderr.txt", "w")   # a file: a pipe nobody reads could fill up
  parent = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "GSSP_DATA_DIR": data_dir},
                            stdout=subprocess.DEVNULL, stderr=stderr,
                            start_new_session=True)   # its own process group, as in a terminal
  try:
    deadline = time.monotonic() + 240
    # Both trials are training once each has logged its first evaluation.
    while not all(sweep._latest(os.path.join(workdir, n)) for n in names):
      assert parent.poll() is None, "the sweep exited before its trials started"
      assert time.monotonic() < deadline, "the trials did not start within 240 s"
      time.sleep(0.5)
    assert len(_processes_mentioning(workdir)) == 3   # the parent and its two trials
    assert [json.load(open(os.path.join(workdir, n, "trial.json")))["status"]
            for n in names] == ["running"] * 2
    if how == "kill":
      parent.send_signal(signal.SIGTERM)
    else:   # what a terminal does on Ctrl-C: SIGINT to every process of the foreground group
      os.killpg(parent.pid, signal.SIGINT)
    parent.wait(timeout=120)
    deadline = time.monotonic() + 10
    while _processes_mentioning(workdir) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert _processes_mentioning(workdir) == []
  finally:
    for pid in _processes_mentioning(workdir):   # a failing test leaves nothing behind
      os.kill(pid, signal.SIGKILL)
    if parent.poll() is None:
      parent.kill()
      parent.wait()
    stderr.close()
  # The sweep ends with one line (no traceback): what happened and the command that resumes.
  err = (tmp_path / "stderr.txt").read_text()
  assert parent.returncode == 130 and "Traceback" not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("interrupted") and last.endswith(
      f"To resume, run the same command: python -m experiments.sweep --sweep={path}"
      f" --workdir={workdir} --parallel=2"), last
  for name in names:
    trial = json.load(open(os.path.join(workdir, name, "trial.json")))
    summary = json.load(open(os.path.join(workdir, name, "summary.json")))
    assert trial["status"] == summary["status"] == "interrupted"
    assert sweep.trial_status(os.path.join(workdir, name)) not in sweep.FINISHED  # rerun retries
    log = open(os.path.join(workdir, name, "log.txt")).read()
    assert "a checkpoint was saved there" in log and "stopping at once" not in log, log[-2000:]


def _edited_sweep_file(path, epochs: float, learning_rate: float = 0.05):
  path.write_text(textwrap.dedent(f"""
      from configs.sweeps import tiny
      from gssp_jax.studies.sweep import sweep
      def get_config():
        c = tiny.get_config()
        c.sync.num_groups = 4   # tiny's GSSP setting, unread by this BSP-only sweep: the default
        c.train.num_epochs = {epochs}
        c.optimizer.learning_rate = {learning_rate}
        return c
      def get_sweep():
        return sweep("sync.scheme", ["bsp"])
      """))
  return str(path)


def test_a_changed_sweep_file_is_refused_or_its_changed_trials_rerun(tmp_path, data_dir,
                                                                     monkeypatch):
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  workdir = tmp_path / "sweep"
  path = _edited_sweep_file(tmp_path / "s.py", epochs=0.5)
  assert sweep.run_sweep(path, str(workdir)) == {"sync.scheme=bsp": "done"}
  summary_path = workdir / "sync.scheme=bsp" / "summary.json"
  stamp = summary_path.stat().st_mtime

  # More epochs in the file: refused, naming the trial, the change and that it is only epochs.
  _edited_sweep_file(tmp_path / "s.py", epochs=1.0)
  with pytest.raises(sweep.ChangedTrialsError,
                     match=r"train.num_epochs: 0.5 -> 1.0 \(finished; only more epochs.*\) in "
                           r"sync.scheme=bsp\); rerun with --rerun_changed"):
    sweep.run_sweep(path, str(workdir))
  assert summary_path.stat().st_mtime == stamp and not (workdir / "_stale").exists()
  # Any other change is named without that note; the command line says it in one line.
  _edited_sweep_file(tmp_path / "s.py", epochs=1.0, learning_rate=0.1)
  cmd = [sys.executable, "-m", "experiments.sweep", f"--sweep={path}", f"--workdir={workdir}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"error: sweep {path}: 1 trial(s) in {workdir} were run with a different config "
      "(optimizer.learning_rate: 0.05 -> 0.1, train.num_epochs: 0.5 -> 1.0 in sync.scheme=bsp)")
  assert summary_path.stat().st_mtime == stamp

  # With rerun_changed the old trial moves aside (kept) and runs again with the new config.
  _edited_sweep_file(tmp_path / "s.py", epochs=1.0)
  assert sweep.run_sweep(path, str(workdir), rerun_changed=True) == {"sync.scheme=bsp": "done"}
  (stale,) = (workdir / "_stale").iterdir()
  old = json.load(open(stale / "sync.scheme=bsp" / "summary.json"))
  new = json.load(open(summary_path))
  assert old["config"]["train"]["num_epochs"] == 0.5 and new["config"]["train"]["num_epochs"] == 1.0
  assert new["final"]["epoch"] == 1.0
  assert json.load(open(workdir / "sync.scheme=bsp" / "trial.json"))["attempts"] == 1
  assert "moved sync.scheme=bsp to" in open(workdir / "sweep.log").read()
  assert sweep.changed_trials(sweep.expand(path), str(workdir)) == {}
  # The current grid, which the report keeps to.
  grid = json.load(open(workdir / "sweep.json"))
  assert grid["trials"] == [{"name": "sync.scheme=bsp", "overrides": {"sync.scheme": "bsp"},
                             "tuned": []}]


def test_config_overrides_apply_to_every_trial_before_the_grid(tmp_path):
  path = _sweep_file(tmp_path, 'product(sweep("sync.scheme", ["bsp", "dssync"]), '
                               'sweep("seed", [0, 1]))')
  plain = sweep.expand(path)
  trials = sweep.expand(path, {"num_workers": 8, "sync.group_size": 4,
                               "cluster.profile": "tiers", "cluster.tiers": (1.0, 3.0)})
  assert [t.name for t in trials] == [t.name for t in plain]   # names: the grid's values only
  assert {(t.config.num_workers, t.config.sync.group_size, tuple(t.config.cluster.tiers))
          for t in trials} == {(8, 4, (1.0, 3.0))}
  assert [(t.config.sync.scheme, t.config.seed) for t in trials] == [
      ("bsp", 0), ("bsp", 1), ("dssync", 0), ("dssync", 1)]
  # A base-config key for DS-Sync only (sync.group_size) is allowed for the BSP trials too.
  assert all("sync.group_size" in t.allow_unread for t in trials)
  # A key the grid sets (or its parent) is refused, not silently replaced by the grid.
  for key in ("seed", "sync"):
    with pytest.raises(ValueError, match=rf"--config.{key}=.* overrides a key the grid of .* "
                                         r"sets \((sync.scheme|seed)\); allowed: keys the grid"):
      sweep.expand(path, {key: 3})
  with pytest.raises(ValueError, match=r"--config.\*: key 'sync.stalenes' is not a config key"):
    sweep.expand(path, {"sync.stalenes": 2})
  with pytest.raises(ValueError, match=r"config.num_workers=0 is invalid"):
    sweep.expand(path, {"num_workers": 0})


def test_override_args_parse_back_to_the_overrides(tmp_path):
  """The flags a parallel sweep passes to its trial processes, parsed as they parse them."""
  from absl import flags   # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags   # pylint: disable=g-import-not-at-top
  path = _sweep_file(tmp_path, 'sweep("seed", [0])')
  overrides = {"num_workers": 8, "optimizer.learning_rate": 0.1 / 3, "sync.scheme": "gssp",
               "data_download": False, "cluster.tiers": (1.0, 2.5), "data_dir": ""}
  argv = ["prog", f"--config={path}", *sweep.override_args(overrides)]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  assert config_flags.get_override_values(values["config"]) == overrides
  assert holder.value.cluster.tiers == (1.0, 2.5)


def _recorded_run(workdir, trial, status="done"):
  """What a run leaves in its trial directory for the sweep runner: its config and status."""
  trial_dir = workdir / trial.name
  trial_dir.mkdir(parents=True)
  (trial_dir / "config.json").write_text(trial.config.to_json())
  (trial_dir / "summary.json").write_text(json.dumps({"status": status}))


def test_a_rerun_with_other_overrides_is_a_changed_sweep(tmp_path):
  path = _sweep_file(tmp_path, 'sweep("seed", [0, 1])')
  workdir = tmp_path / "sweep"
  first = {"train.num_epochs": 0.5, "num_workers": 2}
  trials = sweep.expand(path, first)
  for trial in trials:
    _recorded_run(workdir, trial, "done" if trial.config.seed == 0 else "interrupted")
  sweep.write_grid(str(workdir), path, trials, first)
  assert json.load(open(workdir / "sweep.json"))["overrides"] == first
  assert sweep.changed_trials(sweep.expand(path, first), str(workdir)) == {}

  # Other overrides: refused like an edited sweep file, naming both sets of overrides.
  with pytest.raises(sweep.ChangedTrialsError,
                     match=r"2 trial\(s\) in .* were run with a different config \(num_workers: "
                           r"2 -> 4, train.num_epochs: 0.5 -> 1.0 in seed=0, seed=1\) \(the "
                           r"--config.\* overrides were .*'num_workers': 2.*, now .*'num_workers'"
                           r": 4.*\); rerun with --rerun_changed"):
    sweep.run_sweep(path, str(workdir), overrides={"train.num_epochs": 1.0, "num_workers": 4})

  # Only more epochs: the finished run is named with the ways to extend it; the interrupted
  # one (not finished) is just a changed trial.
  with pytest.raises(sweep.ChangedTrialsError) as e:
    sweep.run_sweep(path, str(workdir), overrides={"num_workers": 2})
  message = str(e.value)
  assert ("train.num_epochs: 0.5 -> 3.0 (finished; only more epochs) in seed=0; "   # smoke: 3
          "train.num_epochs: 0.5 -> 3.0 in seed=1" in message)
  assert message.endswith(
      "Finished runs asking for more train.num_epochs: seed=0 (0.5 -> 3.0). A finished run is "
      "not extended in place (its learning-rate schedule spans the epochs it was given, and "
      "resuming it with another train.num_epochs is refused): --rerun_changed trains them "
      f"again from the start for the new length (the old runs kept in {workdir}/_stale/<time>/),"
      " or --config.train.num_epochs=0.5 keeps them as they are")
  assert sorted(os.listdir(workdir)) == ["seed=0", "seed=1", "sweep.json"]   # nothing moved


def test_sweep_command_line_overrides_reach_every_trial_process(tmp_path, monkeypatch):
  """--config.* on the command line, with --parallel: each trial's process gets them (the
  trials fail at once on a data directory that does not exist, before training)."""
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  path = _sweep_file(tmp_path, 'sweep("seed", [0, 1])')
  workdir = tmp_path / "sweep"
  cmd = [sys.executable, "-m", "experiments.sweep", f"--sweep={path}", f"--workdir={workdir}",
         "--parallel=2", "--config.data_dir=/nonexistent/overridden",
         "--config.data_download=false",
         "--config.cluster.profile=tiers", "--config.cluster.tiers=(1.0, 3.0)"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split()[:4] == ["failed", "seed=0", "failed", "seed=1"]
  assert proc.stdout.strip().splitlines()[-1].startswith("no trial finished, nothing to report")
  for name in ("seed=0", "seed=1"):
    trial = json.load(open(workdir / name / "trial.json"))
    assert trial["status"] == "failed" and "/nonexistent/overridden" in trial["error"]
  assert json.load(open(workdir / "sweep.json"))["overrides"] == {
      "data_dir": "/nonexistent/overridden", "data_download": False, "cluster.profile": "tiers",
      "cluster.tiers": [1.0, 3.0]}


def test_a_sweep_ends_with_the_command_that_reports_it():
  assert sweep.report_command("/tmp/my sweep", {"a": "done", "b": "collapsed"}) == (
      "report: python -m experiments.report '/tmp/my sweep'")
  assert sweep.report_command("/tmp/s", {"a": "done", "b": "failed", "c": None}) == (
      "report (its 1 finished trial(s) of 3): python -m experiments.report /tmp/s")
  assert sweep.report_command("/tmp/s", {"a": "failed"}).startswith("no trial finished")
