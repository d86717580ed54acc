"""``experiments.launch --launcher=ray``: a run's processes as Ray actors' children (issue 36).

Ray binds its own services to the host's address and to every interface, so each test runs
Ray, and everything of the run, inside a network namespace of its own (``tests/netns.py``):
the only addresses in use are that namespace's. Bounded in time; the namespace's teardown
kills whatever is left and checks that nothing is.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

import netns
from gssp_jax.runtime import launch
from tests.conftest import REPO

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

HETERO = "configs/mnist_lenet5_hetero.py:smoke"
BUDGET = 420.0
FLAGS = ["--config.num_workers=4", "--config.sync.num_groups=2",
         "--config.cluster.tiers=(1.0,3.0)", "--config.cluster.base_time=0.2",
         # Two evaluations: too few for the collapse rule (base/health.py) to judge a run of
         # 64 pushes, whose accuracy after a killed mesh is the timing's, not the launcher's.
         "--config.train.num_epochs=4.0", "--config.train.eval_every=2.0",
         "--config.dist.heartbeat_timeout=5.0", "--config.dist.num_servers=2"]
KILL_ACTOR = """
import sys, ray
ray.init(address="auto", namespace="gssp", log_to_driver=False)
ray.kill(ray.get_actor(sys.argv[1]))
print("killed", sys.argv[1])
"""


def _metrics(workdir):
  path = workdir / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pids):
  return [pid for pid in pids if netns.alive(pid)]


@pytest.mark.slow
def test_a_gssp_run_on_ray_finishes_without_a_killed_mesh_actor_and_leaves_nothing(
    tmp_path, data_dir):
  if reason := netns.skip_reason():
    pytest.skip(reason)
  start = time.monotonic()
  workdir = tmp_path / "run"
  ray_tmp = tempfile.mkdtemp(prefix="gr", dir="/tmp")   # short: Ray's sockets live under it
  env = {"GSSP_DATA_DIR": data_dir, "RAY_TMPDIR": ray_tmp, "PYTHONUNBUFFERED": "1",
         "RAY_USAGE_STATS_ENABLED": "0"}
  try:
    with netns.hosts(1, log_dir=tmp_path / "netns") as (host,):
      proc = host.popen([sys.executable, "-m", "experiments.launch", "--launcher=ray",
                         f"--config={HETERO}", f"--workdir={workdir}", *FLAGS],
                        env=env, cwd=REPO, log=tmp_path / "launcher.txt")
      log = lambda: (tmp_path / "launcher.txt").read_text(errors="replace")[-4000:]
      while not _metrics(workdir):   # the first evaluation: every process is up
        assert proc.poll() is None, log()
        assert time.monotonic() - start < BUDGET / 2, "no first evaluation\n" + log()
        time.sleep(0.5)
      pids = json.loads((workdir / "logs" / launch.PIDS_FILE).read_text())
      assert set(pids) >= {"server", "shard1", "mesh0_rank0", "mesh3_rank0"}
      run_id = json.loads((workdir / "server_address.json").read_text())["run_id"]
      address = json.loads((workdir / "server_address.json").read_text())["address"]
      # The node's address as Ray sees it: in a namespace with no route out, its loopback.
      assert address.rsplit(":", 1)[0] in (host.address, "127.0.0.1"), address
      # A mesh's actor killed, as a lost node would: its process dies with it.
      killed = host.run([sys.executable, "-c", KILL_ACTOR, f"{run_id}:mesh3_rank0"],
                        env=env, cwd=REPO, timeout=120)
      assert "killed" in killed.stdout, killed.stderr[-2000:]
      deadline = time.monotonic() + 30
      while netns.alive(pids["mesh3_rank0"]):
        assert time.monotonic() < deadline, "the killed actor's process still runs"
        time.sleep(0.2)
      proc.wait(timeout=max(10.0, BUDGET - (time.monotonic() - start)))
      assert proc.returncode == 0, log()
      # Every process of the run, and Ray's own, ended with the launcher.
      deadline = time.monotonic() + 30
      while _alive(pids.values()) or netns._namespace_pids(host.name):  # pylint: disable=protected-access
        assert time.monotonic() < deadline, (
            f"left running: ours {_alive(pids.values())}, in the namespace "
            f"{netns._namespace_pids(host.name)}")  # pylint: disable=protected-access
        time.sleep(0.5)
  finally:
    shutil.rmtree(ray_tmp, ignore_errors=True)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["status"] == "done", summary["status"]
  assert summary["servers"]["num"] == 2
  assert [e["mesh"] for e in summary["meshes"]["lost"]] == [3]
  assert not summary["meshes"]["rejoined"]
  assert not (workdir / launch.SECRET_FILE).exists()
  assert (workdir / "logs" / "mesh0_rank0.txt").stat().st_size > 0   # logs in the workdir


def test_the_ray_launcher_refuses_a_secret_in_a_variable(tmp_path, data_dir):
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.launch", "--launcher=ray", f"--config={HETERO}",
       f"--workdir={tmp_path / 'run'}", *FLAGS], cwd=REPO, capture_output=True, text=True,
      env={**os.environ, "GSSP_DATA_DIR": data_dir, "GSSP_SECRET": "ab" * 32}, timeout=120)
  assert proc.returncode == 1
  assert "$GSSP_SECRET is refused with --launcher=ray" in proc.stderr
  assert "allowed: a secret file every node can read" in proc.stderr


def _finished(workdir):
  from gssp_jax.studies import sweep  # pylint: disable=g-import-not-at-top
  return sorted(n for n in (os.listdir(workdir) if workdir.exists() else ())
                if sweep.trial_status(str(workdir / n)) in sweep.FINISHED)


@pytest.mark.slow
def test_a_sweep_on_ray_resumes_after_an_interrupt_and_leaves_nothing(tmp_path, data_dir):
  """``configs/sweeps/tiny.py`` (4 trials) as Ray tasks: SIGTERM once a trial has finished, then
  the same command again: the finished trials are kept, the others run, nothing is left."""
  if reason := netns.skip_reason():
    pytest.skip(reason)
  workdir = tmp_path / "sweep"
  ray_tmp = tempfile.mkdtemp(prefix="gr", dir="/tmp")
  env = {"GSSP_DATA_DIR": data_dir, "RAY_TMPDIR": ray_tmp, "PYTHONUNBUFFERED": "1",
         "RAY_USAGE_STATS_ENABLED": "0"}
  cmd = [sys.executable, "-m", "experiments.sweep", "--launcher=ray",
         "--sweep=configs/sweeps/tiny.py", f"--workdir={workdir}"]
  try:
    with netns.hosts(1, log_dir=tmp_path / "netns") as (host,):
      first = host.popen(cmd, env=env, cwd=REPO, log=tmp_path / "first.txt")
      deadline = time.monotonic() + BUDGET / 2
      while not _finished(workdir):
        assert first.poll() is None, (tmp_path / "first.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "no trial finished"
        time.sleep(0.3)
      first.terminate()   # SIGTERM: the sweep stops its running trials, which keep checkpoints
      first.wait(timeout=150)
      kept = {n: (workdir / n / "summary.json").stat().st_mtime for n in _finished(workdir)}
      assert 1 <= len(kept) < 4, kept
      deadline = time.monotonic() + 30
      while netns._namespace_pids(host.name):  # pylint: disable=protected-access
        assert time.monotonic() < deadline, "processes left after the interrupt"
        time.sleep(0.5)
      again = host.run(cmd, env=env, cwd=REPO, timeout=BUDGET)
      assert again.returncode == 0, again.stderr[-3000:]
      assert len(_finished(workdir)) == 4
      for name, mtime in kept.items():   # not run again
        assert (workdir / name / "summary.json").stat().st_mtime == mtime
      deadline = time.monotonic() + 30
      while netns._namespace_pids(host.name):  # pylint: disable=protected-access
        assert time.monotonic() < deadline, "processes left after the sweep"
        time.sleep(0.5)
  finally:
    shutil.rmtree(ray_tmp, ignore_errors=True)
  statuses = [json.loads((workdir / n / "trial.json").read_text())["status"]
              for n in _finished(workdir)]
  assert statuses == ["done"] * 4
