"""The real multi-process runtime: transport, checks, and real runs of processes on loopback.

Every multi-process test is bounded in time and kills every process it started
(the launcher's children are listed in ``workdir/logs/pids.json``); one CPU
device per process.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from gssp_jax import config as config_lib
from gssp_jax.dist import launch
from gssp_jax.dist import wire
from tests.conftest import REPO

HETERO = "configs/mnist_lenet5_hetero.py:smoke"


def test_wire_carries_dense_and_sparse_leaves_exactly():
  rng = np.random.default_rng(0)
  dense = rng.standard_normal([3, 5]).astype(np.float32)
  sparse = np.zeros([100], np.float32)
  sparse[[3, 50, 99]] = [1.5, -2.0, 3.25]
  packed = wire.pack_leaves([dense, sparse], sparse=True)
  assert "i" not in packed[0] and packed[1]["i"].tolist() == [3, 50, 99]
  out = wire.unpack_leaves(wire.decode(wire.encode({"g": packed}))["g"])
  np.testing.assert_array_equal(out[0], dense)
  np.testing.assert_array_equal(out[1], sparse)


def _config(**changes):
  from configs import mnist_lenet5_hetero  # pylint: disable=g-import-not-at-top
  c = mnist_lenet5_hetero.get_config("smoke")
  c.num_workers = 4
  c.sync.num_groups = 2
  c.cluster.tiers = (1.0, 3.0)
  return config_lib.override(c, changes)


@pytest.mark.parametrize("topo, match", [
    (dict(num_meshes=3), r"--num_meshes=3 does not fit config.num_workers=4"),
    (dict(processes_per_mesh=3), r"--processes_per_mesh=3 does not divide config.batch_size=32"),
    (dict(processes_per_mesh=0), r"--processes_per_mesh=0 is invalid"),
    (dict(server_address="localhost"), r"--server_address='localhost' is invalid"),
    (dict(server_address="h:99999"), r"--server_address='h:99999' is invalid"),
    (dict(role="worker", mesh=4, server_address="127.0.0.1:1"), r"--mesh=4 is invalid.*0\.\.3"),
    (dict(role="worker", mesh=0), r"--server_address is required"),
    (dict(role="boss"), r"--role='boss' is invalid"),
])
def test_bad_topology_names_the_value(topo, match):
  with pytest.raises(ValueError, match=match):
    launch.check_topology(launch.Topology(**topo), _config())


@pytest.mark.parametrize("changes, match", [
    ({"sync.scheme": "dssync", "sync.num_groups": 4}, r"'dssync' cannot run on the real runtime"),
    ({"sync.scheme": "casp", "sync.num_groups": 4}, r"'casp' cannot run on the real runtime"),
    ({"sync.regroup_every_epoch": True}, r"regroup_every_epoch=True cannot run on the real"),
    ({"cluster.calibrate": True}, r"calibrate=True cannot apply to the real runtime"),
    ({"dist.heartbeat_timeout": 0.0}, r"dist.heartbeat_timeout=0.0 is invalid"),
    ({"dist.save_timeout": -1.0}, r"dist.save_timeout=-1.0 is invalid"),
    ({"dist.server_address": "nohost"}, r"dist.server_address='nohost' is invalid"),
])
def test_what_the_real_runtime_cannot_run_is_refused_with_the_reason(changes, match):
  config = _config(executor="dist", **changes)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_a_port_in_use_is_refused():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(ValueError, match=rf"port {port} cannot be bound"):
      launch.check_port_free(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="cannot be bound"):
      wire.make_server({name: dict for name in wire.METHODS}, f"127.0.0.1:{port}", 2)


def test_a_worker_gives_a_clear_error_when_the_server_stays_gone():
  client = wire.Client(f"127.0.0.1:{launch.free_port()}", retry_seconds=0.5)
  start = time.monotonic()
  with pytest.raises(wire.ServerGone, match=r"stayed unreachable for 0 s"):
    client.call("Heartbeat", {"mesh": 0})
  assert time.monotonic() - start < 10
  client.close()


def test_the_launcher_refuses_bad_input_before_starting_anything(tmp_path, data_dir):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.launch", f"--config={HETERO}", f"--workdir={workdir}",
       "--config.num_workers=4", "--config.sync.num_groups=2", "--num_meshes=3"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "GSSP_DATA_DIR": data_dir})
  assert proc.returncode != 0
  assert "--num_meshes=3 does not fit config.num_workers=4" in proc.stderr
  assert not (workdir / "logs").exists()


def test_the_server_compiles_nothing_while_it_serves(tmp_path, data_dir, caplog):
  """A join's pull, a push's round and release, and the evaluated weights compile nothing.

  They run under the server's lock after the run's clock started: a first-call
  compilation there (the pull's per-leaf slices, the learning-rate schedule,
  the replicas' mean: ~30 small programs, seconds on a loaded CPU) stalled every
  mesh and was counted in the wall time to target.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from gssp_jax.dist import server  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import executor  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _config(executor="dist", data_dir=data_dir)
  srv = server.DistServer(config, run_lib.prepare_run(config, str(tmp_path)), str(tmp_path))
  grad = [np.ones_like(x) for x in jax.tree.leaves(srv.state.replica_params)]
  try:
    with jax.log_compiles(), caplog.at_level("WARNING"):
      caplog.clear()
      for w in range(srv.W):   # what on_join does for each mesh at the start
        srv._pull_reply(w, srv._next_job(w))
      for w in (0, 3, 1):      # pushes: rounds applied, meshes released (pulls)
        reply = srv.on_push({"mesh": w, "session": srv.session, "iteration": 0, "loss": 1.0,
                             "grad": wire.pack_leaves([g[0] for g in grad]),
                             "model_state": [], "bytes": 4})
        assert "params" in reply, reply.keys()
      deadline = time.monotonic() + 30
      while srv.host["in_flight"] and time.monotonic() < deadline:   # forwards between groups
        time.sleep(0.01)
      with srv.lock:   # as evaluate() reads them; a delivery thread donates the state
        executor.served_weights(srv.state, srv.eval_replica)
    compiled = [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiled, compiled
  finally:
    srv.close()


def test_the_servers_host_state_round_trips_through_its_checkpoint(tmp_path, data_dir):
  """What the server saves (protocol, counters, staleness accounting) comes back the same from
  the versioned JSON item of its Orbax step, after a few pushes and forwards."""
  import jax  # pylint: disable=g-import-not-at-top
  from gssp_jax.dist import server  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import host_state  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _config(executor="dist", data_dir=data_dir)
  srv = server.DistServer(config, run_lib.prepare_run(config, str(tmp_path)), str(tmp_path))
  grad = [np.ones_like(x) for x in jax.tree.leaves(srv.state.replica_params)]
  try:
    for w in range(srv.W):
      srv._pull_reply(w, srv._next_job(w))
    for w in (0, 3, 1):   # pushes: rounds applied, meshes released, forwards between groups
      srv.on_push({"mesh": w, "session": srv.session, "iteration": 0, "loss": 1.0,
                   "grad": wire.pack_leaves([g[0] for g in grad]), "model_state": [],
                   "bytes": 4})
    deadline = time.monotonic() + 30
    while srv.host["in_flight"] and time.monotonic() < deadline:
      time.sleep(0.01)
    srv.save()
    with srv.lock:
      expected = host_state.to_tree({"protocol": srv.protocol, "host": srv.host,
                                     "acct": srv.acct.state_dict()})
    step = srv.checkpointer.latest_step()
    assert step == srv.host["pushes"] > 0
    restored = srv.checkpointer.restore_host(step)
    assert json.dumps(host_state.to_tree(restored)) == json.dumps(expected)
    assert type(restored["protocol"]) is type(srv.protocol)
    assert not list(tmp_path.rglob("*.pkl"))
  finally:
    srv.close()


# -- real runs ----------------------------------------------------------------------------------


def _launch(workdir, data_dir, *flags):
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.launch", f"--config={HETERO}", f"--workdir={workdir}",
       *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "GSSP_DATA_DIR": data_dir}, start_new_session=True)


def _pids(workdir) -> dict:
  path = os.path.join(workdir, "logs", launch.PIDS_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(") ")[-1][0] != "Z"   # a zombie has exited
  except FileNotFoundError:
    return False


def _kill_all(procs, workdir) -> None:
  """Kills the test's own processes and every child the launcher recorded."""
  pids = [p.pid for p in procs] + list(_pids(workdir).values())
  for proc in procs:
    if proc.poll() is None:
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for pid in pids:
    if _running(pid):
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for proc in procs:
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


def _metrics(workdir) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _wait_for(predicate, timeout: float, what: str, procs=()):
  deadline = time.monotonic() + timeout
  while not predicate():
    for proc in procs:
      if proc.poll() is not None:
        out = proc.stdout.read() if proc.stdout else ""
        raise AssertionError(f"a process exited ({proc.returncode}) while waiting for {what}:"
                             f"\n{out[-3000:]}")
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    time.sleep(0.2)


def _tv_distance(hist_a, hist_b) -> float:
  """Total variation distance of two staleness histograms (counts of 0, 1, 2, ...)."""
  n = max(len(hist_a), len(hist_b))
  a, b = (np.pad(np.asarray(h, float), (0, n - len(h))) for h in (hist_a, hist_b))
  return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


def _groups(config) -> np.ndarray:
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import cluster  # pylint: disable=g-import-not-at-top
  speeds = cluster.cluster_from_config(config).speeds
  return np.asarray(sync.scheme_from_config(config, worker_times=speeds).groups)


def _simulated_first_eval(config_changes, tmp_path) -> dict:
  """The simulator's first metrics line on the same cluster description."""
  from gssp_jax import train  # pylint: disable=g-import-not-at-top
  config = _config(**config_changes)
  config.train.stop_after_updates = int(config.num_workers * round(
      config.train.eval_every * (2048 // config.num_workers // config.batch_size)))
  train.train_and_evaluate(config, str(tmp_path / "sim"))
  return _metrics(tmp_path / "sim")[0]


@pytest.mark.slow
def test_real_gssp_converges_survives_a_killed_mesh_that_rejoins_and_agrees_with_the_simulator(
    tmp_path, data_dir):
  """4 one-process meshes in 2 GSSP groups (the second 3x slower) plus the server.

  The first evaluation (before anything is killed) is set against the
  simulator on the same cluster. Then a slow-group process is SIGKILLed and
  restarted: the fast group runs on, the server drops and readmits the mesh,
  keeps every update, and its checkpoint restores.
  """
  workdir = tmp_path / "real"
  changes = {"cluster.base_time": 0.2, "train.num_epochs": 7.0, "train.eval_every": 1.0,
             "dist.heartbeat_timeout": 5.0}
  flags = ["--config.num_workers=4", "--config.sync.num_groups=2",
           "--config.cluster.tiers=(1.0,3.0)", "--num_meshes=4"] + [
               f"--config.{k}={v}" for k, v in changes.items()]
  groups = _groups(_config(**changes))
  assert groups[0] != groups[-1]   # tiers (1, 3): meshes 0, 1 fast, 2, 3 three times slower
  procs = [_launch(workdir, data_dir, *flags)]
  try:
    _wait_for(lambda: _metrics(workdir), 240, "the first evaluation", procs)
    first = _metrics(workdir)[0]
    pids = _pids(workdir)
    victim = int(np.flatnonzero(groups == groups[-1])[-1])   # a mesh of the slow group
    os.kill(pids[f"mesh{victim}_rank0"], signal.SIGKILL)
    with open(workdir / "server_address.json") as f:
      address = json.load(f)["address"]
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "experiments.launch", "--role=worker", f"--mesh={victim}",
         f"--server_address={address}", f"--config={HETERO}", f"--workdir={workdir}",
         *[f for f in flags if f.startswith("--config")]], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "GSSP_DATA_DIR": data_dir}))
    out, _ = procs[0].communicate(timeout=300)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, workdir)
  summary = json.load(open(workdir / "summary.json"))
  lines = _metrics(workdir)
  assert summary["status"] == "done", summary["status"]
  assert summary["final"]["test_accuracy"] >= 0.8   # converges (the smoke set; BSP gets ~0.9)
  # The lost mesh was noticed and readmitted; nothing applied was lost.
  assert [e["mesh"] for e in summary["meshes"]["lost"]] == [victim]
  assert [e["mesh"] for e in summary["meshes"]["rejoined"]] == [victim]
  versions = np.array([m["updates_per_replica"] for m in lines])
  assert np.all(np.diff(versions, axis=0) >= 0)
  assert np.all(np.diff([m["pushes"] for m in lines]) > 0)
  assert summary["scheme"]["groups"] == groups.tolist()
  fast, slow_group = groups[0], groups[-1]
  per_replica = summary["totals"]["updates_per_replica"]
  # The unslowed group pushes (its server applies) about 3x as often as the slowed one; a
  # replica's version also counts the other group's forwarded sums, so compare pushes.
  pushes = np.array(summary["totals"]["pushes_per_worker"])
  assert pushes[groups == fast].sum() > 2 * pushes[groups == slow_group].sum(), pushes
  # The server's checkpoint restores what it reported.
  from gssp_jax.dist import server  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _config(executor="dist", **changes)
  restored = server.DistServer(config, run_lib.prepare_run(config, str(workdir)), str(workdir))
  assert restored.restore() == summary["totals"]["pushes"]
  assert restored.acct.version.tolist() == per_replica
  restored.close()
  # Agreement with the simulator on the same cluster, before the kill (docs/REAL_RUNS.md
  # justifies the tolerances): the staleness histograms within a total variation distance of
  # 0.15 (measured 0.03; SSP's histogram on this cluster is 0.64 away, ASP's 0.47), the means
  # within 25 %, the fast group server's share of the updates within 0.1.
  sim = _simulated_first_eval(changes, tmp_path)
  assert _tv_distance(first["staleness"]["hist"], sim["staleness"]["hist"]) <= 0.15, (
      first["staleness"], sim["staleness"])
  share = lambda m: m["updates_per_replica"][fast] / sum(m["updates_per_replica"][:2])
  assert abs(first["staleness"]["mean"] - sim["staleness"]["mean"]) <= 0.25 * sim[
      "staleness"]["mean"], (first["staleness"], sim["staleness"])
  assert abs(share(first) - share(sim)) <= 0.1, (first["updates_per_replica"],
                                                 sim["updates_per_replica"])


@pytest.mark.slow
def test_two_process_meshes_train_sigterm_leaves_no_process_and_a_rerun_resumes(
    tmp_path, data_dir):
  workdir = tmp_path / "real"
  flags = ["--config.num_workers=2", "--config.sync.scheme=ssp", "--config.cluster.profile=none",
           "--config.train.num_epochs=50.0", "--config.train.eval_every=0.25"]
  procs = [_launch(workdir, data_dir, *flags, "--processes_per_mesh=2")]
  try:
    _wait_for(lambda: _metrics(workdir), 240, "the first evaluation", procs)
    pids = _pids(workdir)
    assert sorted(pids) == ["launcher", "mesh0_rank0", "mesh0_rank1", "mesh1_rank0",
                            "mesh1_rank1", "server"]
    procs[0].send_signal(signal.SIGTERM)
    procs[0].communicate(timeout=60)
    assert not [name for name, pid in pids.items() if _running(pid)]
  finally:
    _kill_all(procs, workdir)
  first = _metrics(workdir)[0]
  assert first["pushes"] >= 2 * 4 and first["test_accuracy"] > 0.2
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "interrupted"
  for name in ("mesh0_rank1", "mesh1_rank1"):
    assert "joined" in (workdir / "logs" / f"{name}.txt").read_text()
  # The rerun (one process per mesh now: the split of a mesh is not part of the run) resumes
  # from the checkpoint the interrupted server saved, and stops after a few more pushes.
  saved = summary["totals"]["pushes"]
  procs = [_launch(workdir, data_dir, *flags, f"--config.train.stop_after_updates={saved + 8}")]
  try:
    out, _ = procs[0].communicate(timeout=240)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, workdir)
  assert f"resumed from the server checkpoint at {saved} pushes" in (workdir / "log.txt"
                                                                     ).read_text()
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "stopped" and summary["totals"]["pushes"] == saved + 8
  lines = _metrics(workdir)
  assert lines[0] == first and lines[-1]["pushes"] == saved + 8


def test_a_terminal_ctrl_c_reaches_the_launcher_only(tmp_path):
  """The launcher's children are outside its process group and session, so a terminal's Ctrl-C
  (SIGINT to the foreground group) reaches the launcher alone, and its shutdown's SIGTERM is the
  server's first signal: the server saves a checkpoint before it stops (a second one would stop
  it at once)."""
  launcher = launch.LocalLauncher([], str(tmp_path), launch.Topology(num_meshes=1),
                                  _config(num_workers=1))
  proc = launcher._spawn("server", ["--role=server"])   # no --config: it exits at once
  try:
    assert os.getpgid(proc.pid) != os.getpgid(0)
    assert os.getsid(proc.pid) != os.getsid(0)
  finally:
    launcher.shutdown(grace=30)


_SLOW_TO_STOP = """
import pathlib, signal, sys, time
def stop(*_):
  time.sleep(float(sys.argv[2]))   # a server writing its checkpoint on a loaded machine
  pathlib.Path(sys.argv[1]).touch()
  sys.exit(0)
signal.signal(signal.SIGTERM, stop)
pathlib.Path(sys.argv[1] + ".ready").touch()
time.sleep(120)
"""


def test_shutdown_gives_the_server_time_to_save_and_a_mesh_five_seconds(tmp_path):
  """After SIGTERM a mesh still running at ``grace`` is killed, but the server, which may be
  writing its checkpoint, gets ``dist.save_timeout``; a server past it is killed too."""
  launcher = launch.LocalLauncher([], str(tmp_path), launch.Topology(num_meshes=1),
                                  _config(num_workers=1))
  def child(name, seconds):
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TO_STOP, str(tmp_path / name),
                             str(seconds)])
    launcher.procs[name] = proc
    return proc
  try:
    mesh, server = child("mesh0_rank0", 60), child("server", 3)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{n}.ready").exists() for n in ("mesh0_rank0", "server")):
      assert time.monotonic() < deadline
      time.sleep(0.05)
    assert launcher.config.dist.save_timeout == 120
    launcher.shutdown(grace=0.5)
    assert mesh.returncode == -signal.SIGKILL and not (tmp_path / "mesh0_rank0").exists()
    assert server.returncode == 0 and (tmp_path / "server").exists()   # it finished saving
    launcher.procs.clear()
    (tmp_path / "server.ready").unlink()
    server = child("server", 60)
    while not (tmp_path / "server.ready").exists():
      time.sleep(0.05)
    launcher.shutdown(server_grace=1)
    assert server.returncode == -signal.SIGKILL
  finally:
    for proc in launcher.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_each_process_gets_its_own_gpu_round_robin_and_none_preallocates(tmp_path, monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
  launcher = launch.LocalLauncher([], str(tmp_path), launch.Topology(num_meshes=3,
                                                                     processes_per_mesh=1),
                                  _config(num_workers=3))
  assert launcher.gpus == ["3", "5"]
  assert [launcher._gpu(i) for i in range(4)] == ["3", "5", "3", "5"]
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  assert launch.visible_gpus() == []
  spawned = {}

  class FakePopen:   # records what a child would get; starts nothing
    pid = 0

    def __init__(self, cmd, env, **kwargs):
      del kwargs
      spawned.update(cmd=cmd, env=env)

  monkeypatch.setattr(launch.subprocess, "Popen", FakePopen)
  launcher._spawn("mesh0_rank0", ["--role=worker"], gpu="5")
  assert spawned["env"]["CUDA_VISIBLE_DEVICES"] == "5"
  assert spawned["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert spawned["cmd"][-1] == f"--workdir={tmp_path}"
