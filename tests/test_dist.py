"""The real multi-process runtime: transport, checks, and real runs of processes on loopback.

Every multi-process test is bounded in time and kills every process it started
(the launcher's children are listed in ``workdir/logs/pids.json``); one CPU
device per process.
"""

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gssp_jax import config as config_lib
import dist_replay
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import launch
from gssp_jax.runtime import wire
from tests.conftest import REPO

HETERO = "configs/mnist_lenet5_hetero.py:smoke"


def test_a_shard_layout_balances_whole_tensors_and_round_trips_dense_and_sparse_pushes():
  from gssp_jax.runtime import layout as layout_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  params = {f"t{i}": rng.standard_normal(shape).astype(np.float32)
            for i, shape in enumerate([(6,), (300,), (50, 4), (7,), (120,)])}
  stats = {"mean": rng.standard_normal([3]).astype(np.float32)}
  layout = layout_lib.ShardLayout.balanced(params, stats, 3)
  assert layout.bounds == ((0, 2), (2, 3), (3, 5))   # the smallest largest shard: 306 + 3
  import jax  # pylint: disable=g-import-not-at-top
  dense = [np.asarray(x) for x in jax.tree.leaves(params)]
  sparse = [np.where(np.abs(g) > 1.8, g, 0.0).astype(np.float32) for g in dense]
  stat_leaves = [stats["mean"]]
  for leaves, want_sparse in ((dense, False), (sparse, True)):
    for s in range(3):
      body, nnz = layout.pack_push(s, leaves, stat_leaves, sparse=True)
      assert (nnz >= 0) == want_sparse
      got, got_stats = layout.unpack_push(s, body, nnz)
      for i, g in zip(layout.leaves(s), got):
        np.testing.assert_array_equal(g, leaves[i])
      assert len(got_stats) == (1 if s == 0 else 0)
  assert layout_lib.ShardLayout.from_description(layout.describe()) == layout


def _config(**changes):
  from configs import mnist_lenet5_hetero  # pylint: disable=g-import-not-at-top
  c = mnist_lenet5_hetero.get_config("smoke")
  c.num_workers = 4
  c.sync.num_groups = 2
  c.cluster.tiers = (1.0, 3.0)
  return config_lib.override(c, changes)


@pytest.mark.parametrize("topo, changes, match", [
    (dict(processes_per_mesh=3), {}, r"--processes_per_mesh=3 does not divide config.batch_size=32"),
    (dict(processes_per_mesh=0), {}, r"--processes_per_mesh=0 is invalid"),
    ({}, {"dist.server_address": "localhost"},
     r"config.dist.server_address='localhost' is invalid"),
    ({}, {"dist.server_address": "h:99999"}, r"config.dist.server_address='h:99999' is invalid"),
    (dict(role="worker", mesh=4), {"dist.server_address": "127.0.0.1:1"},
     r"--mesh=4 is invalid.*0\.\.3"),
    (dict(role="worker", mesh=0), {}, r"config.dist.server_address is required"),
    (dict(role="shard", shard=2), {"dist.num_servers": 2, "dist.server_address": "127.0.0.1:1"},
     r"--shard=2 is invalid; allowed: 1\.\.1 \(config.dist.num_servers=2"),
    (dict(role="boss"), {}, r"--role='boss' is invalid"),
])
def test_bad_topology_names_the_value(topo, changes, match):
  with pytest.raises(ValueError, match=match):
    launch.check_topology(launch.Topology(**topo), _config(**changes))


def test_the_runs_shape_is_the_configs_and_no_launch_flag_repeats_a_config_key():
  """The meshes, shards and server address come from the config (one source, as in a
  simulation); the launcher's flags say only where a process belongs."""
  topo = launch.check_topology(launch.Topology(role="worker", mesh=1), _config(
      **{"dist.num_servers": 3, "dist.server_address": "127.0.0.1:5000"}))
  assert (topo.num_meshes, topo.num_servers, topo.server_address) == (4, 3, "127.0.0.1:5000")
  listed = subprocess.run(
      [sys.executable, "-c", "import experiments.launch; from absl import flags; "
       "by = flags.FLAGS.flags_by_module_dict(); print(' '.join(f.name for m in "
       "('experiments.launch', 'gssp_jax.runtime.ray_launch') for f in by.get(m, [])))"],
      cwd=REPO, capture_output=True, text=True, timeout=120)
  assert listed.returncode == 0, listed.stderr[-2000:]
  names = set(listed.stdout.split())
  assert {"config", "workdir", "role", "mesh", "processes_per_mesh"} <= names, names
  keys = set()

  def walk(d, prefix=""):
    for k, v in d.items():
      keys.add(k)
      keys.add(prefix + k)
      if hasattr(v, "items"):
        walk(v, prefix + k + ".")
  walk(config_lib.default_config())
  assert names & keys == set(), names & keys


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
      launch.reserve_port("127.0.0.1", port)
    with pytest.raises(ValueError, match="cannot be bound"):
      launch.check_bindable("--server_address", f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="cannot be bound"):
      endpoints.make_server([], f"127.0.0.1:{port}", dist_replay.CREDENTIALS, max_workers=2)
  with pytest.raises(ValueError, match="cannot be bound here"):   # not an address of this host
    launch.check_bindable("--server_address", "192.0.2.1:5000")


def test_a_port_whose_server_just_died_is_bindable_as_grpc_binds_it():
  """A server killed with connections open leaves them in TIME_WAIT on its port: a plain bind
  fails there for a minute, gRPC's (SO_REUSEADDR) does not, so the restarted server's check
  must not either (it refused a restart under load)."""
  with socket.socket() as listener:
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC's servers are
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()   # the server's side closes first: its end waits in TIME_WAIT
    client.recv(1)
    client.close()
  with socket.socket() as plain, pytest.raises(OSError):
    plain.bind(("127.0.0.1", port))   # the state under test is there
  launch.check_bindable("--server_address", f"127.0.0.1:{port}")
  server, bound = endpoints.make_server([], f"127.0.0.1:{port}", dist_replay.CREDENTIALS,
                                        max_workers=2)
  assert bound == port
  server.stop(0)


def test_a_worker_gives_a_clear_error_when_the_server_stays_gone():
  client = endpoints.Client(f"127.0.0.1:{launch.free_port()}", dist_replay.CREDENTIALS,
                            retry_seconds=0.5)
  start = time.monotonic()
  with pytest.raises(wire.ServerGone, match=r"stayed unreachable for 0 s"):
    client.call("Heartbeat", {"mesh": 0})
  assert time.monotonic() - start < 10
  client.close()


def test_the_launcher_refuses_bad_input_before_starting_anything(tmp_path, data_dir):
  workdir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.launch", f"--config={HETERO}", f"--workdir={workdir}",
       "--config.num_workers=4", "--config.sync.num_groups=2", "--processes_per_mesh=3"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, "GSSP_DATA_DIR": data_dir})
  assert proc.returncode != 0
  assert "--processes_per_mesh=3 does not divide config.batch_size=32" in proc.stderr
  assert not (workdir / "logs").exists()


def _dist_server(tmp_path, data_dir, **changes):
  from gssp_jax.runtime import server  # pylint: disable=g-import-not-at-top
  from gssp_jax.base import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _config(executor="dist", data_dir=data_dir, **changes)
  srv = server.DistServer(config, run_lib.prepare_run(config, str(tmp_path)), str(tmp_path),
                          credentials=dist_replay.CREDENTIALS, manual_messages=True)
  srv.restore()
  srv.membership.join_by = 0.0   # no start barrier
  return srv


def _push_ones(srv, w, seq):
  leaves = [np.ones(shape, np.float32) for shape in srv.layout.shapes]
  body = srv.layout.pack_push(0, leaves, [], False)[0]
  srv.calls.accept_push({"mesh": w, "instance": "i", "session": srv.shard_links.session, "seq": seq,
                   "iteration": seq - 1, "loss": 1.0, "bytes": 4,
                   "wire_bytes": wire.body_bytes(body),
                   "nnz": [-1], "receipts": [], "digests": []}, body)


def _join_all(srv):
  from gssp_jax.runtime import server  # pylint: disable=g-import-not-at-top
  for w in range(srv.W):
    srv.calls.on_join({"mesh": w, "instance": "i", "config": server.config_id(srv.config)}, None, "t")


def test_the_server_compiles_nothing_while_it_serves(tmp_path, data_dir, caplog):
  """A join's pull, a push's ops and release, a snapshot and the evaluated weights compile
  nothing: they run while every mesh waits, and a first-call compilation there (seconds on a
  loaded CPU) was counted in the wall time to target."""
  import jax  # pylint: disable=g-import-not-at-top
  srv = _dist_server(tmp_path, data_dir)
  try:
    with jax.log_compiles(), caplog.at_level("WARNING"):
      caplog.clear()
      _join_all(srv)
      for w in (0, 3, 1):   # pushes: ops applied, meshes released (pulls)
        _push_ones(srv, w, 1)
        reply, body = srv.calls.await_release(w, 1, timeout=60)
        assert "iteration" in reply and wire.body_bytes(body), reply
      for message in list(m for _, m in srv.core.messages.pending()):
        srv.deliver(message)   # forwards between groups, now
      with srv.lock:
        srv._emit({"k": "snap", "id": 99})   # pylint: disable=protected-access
      srv.core0.snapshot(99, timeout=60)
    compiled = [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()]
    assert not compiled, compiled
  finally:
    srv.close()


def test_the_servers_host_state_round_trips_through_its_checkpoint(tmp_path, data_dir):
  """What the server saves (protocol, counters, push numbers, staleness accounting) comes back
  the same from the versioned JSON item of its Orbax step; shard 0's tensors from its own."""
  import jax  # pylint: disable=g-import-not-at-top
  from gssp_jax import host_state  # pylint: disable=g-import-not-at-top
  srv = _dist_server(tmp_path, data_dir)
  try:
    _join_all(srv)
    for w in (0, 3, 1):
      _push_ones(srv, w, 1)
    srv.save()
    with srv.lock:
      expected = host_state.to_tree({"protocol": srv.core.protocol, "host": srv.core.book.host,
                                     "acct": srv.core.book.acct.state_dict()})
    step = srv.checkpointer.latest_step()
    assert step == srv.core.book.host["pushes"] == 3
    restored = srv.checkpointer.restore_host(step)
    assert json.dumps(host_state.to_tree(restored)) == json.dumps(expected)
    assert type(restored["protocol"]) is type(srv.core.protocol)
    assert restored["host"]["seq"].tolist() == [1, 1, 0, 1]
    with srv.core0.cond:
      want = [np.array(x) for x in jax.tree.leaves(srv.core0.state)]
    shard, _ = srv.core0.checkpointer.restore(step, srv.core0.state)
    assert all(np.array_equal(a, b) for a, b in zip(want, jax.tree.leaves(shard)))
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


def _role(workdir, data_dir, role_flags, config_flags, secret_env, log):
  """A process of one role, as on a cluster (its own session; output to ``log``)."""
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.launch", f"--config={HETERO}",
       f"--workdir={workdir}", *config_flags, *role_flags], cwd=REPO, stdout=open(log, "ab"),
      stderr=subprocess.STDOUT, start_new_session=True,
      env={**os.environ, "GSSP_DATA_DIR": data_dir, **secret_env})


def _log_times(path, pattern) -> list[float]:
  """Wall-clock times (seconds since the epoch) of the log lines of ``path`` matching ``pattern``:
  absl's console format (``I1125 16:58:33.394395 ...``) or log.txt's (``2026-11-25 16:58:33,394``)."""
  out, year = [], time.localtime().tm_year
  for line in open(path, errors="replace"):
    if pattern not in line:
      continue
    if line[:1] in "IWE" and line[1:5].isdigit():
      stamp, fraction = time.strptime(f"{year}{line[1:5]} {line[6:14]}", "%Y%m%d %H:%M:%S"), line[14:21]
    elif line[:4].isdigit() and line[4:5] == "-":
      stamp, fraction = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"), "." + line[20:23]
    else:
      continue
    out.append(time.mktime(stamp) + float("0" + fraction))
  return out


def _exits(proc, timeout):
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    return None


@pytest.mark.slow
def test_real_gssp_on_two_shards_converges_refuses_a_duplicate_survives_a_killed_mesh_and_agrees(
    tmp_path, data_dir):
  """4 one-process meshes in 2 GSSP groups (the second 3x slower), 2 parameter shards.

  The first evaluation (before anything is killed) is set against the
  simulator on the same cluster. A second process started as an existing mesh
  is refused and exits with the reason. Then a slow-group process is
  SIGKILLed and restarted with the run's secret (the launcher's
  ``workdir/.secret``): the fast group runs on, the server drops and readmits
  the mesh, keeps every update, and its checkpoint restores.
  """
  workdir = tmp_path / "real"
  changes = {"cluster.base_time": 0.2, "train.num_epochs": 7.0, "train.eval_every": 1.0,
             "dist.heartbeat_timeout": 5.0}
  flags = ["--config.num_workers=4", "--config.sync.num_groups=2",
           "--config.cluster.tiers=(1.0,3.0)", "--config.dist.num_servers=2"] + [
               f"--config.{k}={v}" for k, v in changes.items()]
  config_flags = [f for f in flags if f.startswith("--config")]
  groups = _groups(_config(**changes))
  assert groups[0] != groups[-1]   # tiers (1, 3): meshes 0, 1 fast, 2, 3 three times slower
  procs = [_launch(workdir, data_dir, *flags)]
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    first = _metrics(workdir)[0]
    pids = _pids(workdir)
    assert "shard1" in pids
    address = json.load(open(workdir / "server_address.json"))["address"]
    secret = {"GSSP_SECRET_FILE": str(workdir / launch.SECRET_FILE),
              "GSSP_RUN_ID": json.load(open(workdir / "server_address.json"))["run_id"]}
    assert os.stat(secret["GSSP_SECRET_FILE"]).st_mode & 0o777 == 0o600
    # The kill and restart first, the duplicate while the restarted mesh starts up: a loaded
    # machine once took so long over both that the run ended before the mesh could rejoin.
    victim = int(np.flatnonzero(groups == groups[-1])[-1])   # a mesh of the slow group
    os.kill(pids[f"mesh{victim}_rank0"], signal.SIGKILL)
    procs.append(_role(workdir, data_dir, ["--role=worker", f"--mesh={victim}",
                                           f"--config.dist.server_address={address}"], config_flags,
                       secret, tmp_path / "restarted.txt"))
    duplicate = _role(workdir, data_dir, ["--role=worker", "--mesh=0",
                                          f"--config.dist.server_address={address}"], config_flags, secret,
                      tmp_path / "duplicate.txt")
    procs.append(duplicate)
    assert _exits(duplicate, 120) == 1
    assert "mesh 0 is held by another process" in (tmp_path / "duplicate.txt").read_text()
    out, _ = procs[0].communicate(timeout=400)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, workdir)
  assert not (workdir / launch.SECRET_FILE).exists()   # the launcher removed its secret
  summary = json.load(open(workdir / "summary.json"))
  lines = _metrics(workdir)
  assert summary["status"] == "done", summary["status"]
  # The launcher ends with the line experiments.main ends with, and counts the shards as the
  # progress lines do (the server holds shard 0).
  final = summary["final"]["test_accuracy"]
  assert (f"final test_accuracy: {final:.4f} after {summary['final']['epoch']:.2f} epochs, wall "
          in out and f"(done); workdir {workdir}" in out), out[-2000:]
  assert "virtual" not in out.splitlines()[-1]   # a real run's events follow wall time
  assert "(it holds shard 0 of 2); starting 1 more shard process(es) and 4 meshes" in out
  # Converges (the smoke set; BSP gets ~0.9). A real run's event order follows wall time, so
  # its accuracy varies from run to run: 0.79 in one full suite of 2026-11-26, > 0.8 otherwise.
  assert summary["final"]["test_accuracy"] >= 0.75
  assert summary["servers"]["num"] == 2
  # The lost mesh was noticed and readmitted; nothing applied was lost.
  assert [e["mesh"] for e in summary["meshes"]["lost"]] == [victim]
  assert [e["mesh"] for e in summary["meshes"]["rejoined"]] == [victim], (
      (tmp_path / "restarted.txt").read_text(errors="replace")[-2000:])
  versions = np.array([m["updates_per_replica"] for m in lines])
  assert np.all(np.diff(versions, axis=0) >= 0)
  assert np.all(np.diff([m["pushes"] for m in lines]) > 0)
  assert summary["scheme"]["groups"] == groups.tolist()
  fast, slow_group = groups[0], groups[-1]
  per_replica = summary["totals"]["updates_per_replica"]
  pushes = np.array(summary["totals"]["pushes_per_worker"])
  assert pushes[groups == fast].sum() > 2 * pushes[groups == slow_group].sum(), pushes
  # The server's checkpoint restores what it reported.
  from gssp_jax.runtime import server  # pylint: disable=g-import-not-at-top
  from gssp_jax.base import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _config(executor="dist", **changes)
  restored = server.DistServer(config, run_lib.prepare_run(config, str(workdir)), str(workdir),
                               num_servers=2, credentials=dist_replay.CREDENTIALS)
  assert restored.restore() == summary["totals"]["pushes"]
  assert restored.core.book.acct.version.tolist() == per_replica
  restored.close()
  # Agreement with the simulator on the same cluster, before the kill (docs/REAL_RUNS.md
  # justifies the tolerances): the staleness histograms within a total variation distance of
  # 0.25 (0.16 seen under load; SSP's histogram on this cluster is 0.64 away, ASP's 0.47), the
  # means within 25 %,
  # the fast group server's share of the updates within 0.1; the bytes of each applied push
  # exactly the simulator's (the same payload, counted when it is applied), and the bytes
  # between servers per update within 10 %.
  sim = _simulated_first_eval(changes, tmp_path)
  assert _tv_distance(first["staleness"]["hist"], sim["staleness"]["hist"]) <= 0.25, (
      first["staleness"], sim["staleness"])
  share = lambda m: m["updates_per_replica"][fast] / sum(m["updates_per_replica"][:2])
  assert abs(first["staleness"]["mean"] - sim["staleness"]["mean"]) <= 0.25 * sim[
      "staleness"]["mean"], (first["staleness"], sim["staleness"])
  assert abs(share(first) - share(sim)) <= 0.1, (first["updates_per_replica"],
                                                 sim["updates_per_replica"])
  push_bytes = lambda m: m["bytes_pushed"] / m["staleness"]["applied"]
  assert push_bytes(first) == push_bytes(sim)
  between = lambda m: m["bytes_between_servers"] / m["updates"]
  assert abs(between(first) - between(sim)) <= 0.1 * between(sim), (first, sim)


@pytest.mark.slow
def test_a_server_restart_is_rejoined_within_two_seconds_and_losing_every_mesh_ends_the_run(
    tmp_path, data_dir):
  """Roles started one by one, as on a cluster (2 one-process meshes, ASP, one shard).

  A server address already in use is refused before anything is built. The
  server is SIGKILLed after its first checkpoint and started again: both
  meshes, retrying their push, rejoin its new session. Then both
  meshes are killed: the run ends as ``failed`` within ``dist.all_lost_timeout``
  with one clear line, and the server exits with 1.
  """
  workdir = tmp_path / "run"
  port = launch.free_port()
  address = f"127.0.0.1:{port}"
  secret = {"GSSP_SECRET": "ab" * 32, "GSSP_RUN_ID": "two-meshes"}
  config_flags = ["--config.num_workers=2", "--config.sync.scheme=asp",
                  "--config.cluster.profile=none", "--config.train.num_epochs=100.0",
                  "--config.train.eval_every=0.25", "--config.dist.heartbeat_timeout=2.0",
                  "--config.dist.all_lost_timeout=4.0",
                  "--config.train.checkpoint_every=1"]   # a checkpoint before the kill
  server_flags = ["--role=server", f"--config.dist.server_address={address}"]
  procs = []
  try:
    with socket.socket() as taken:   # the port is in use: refused at once, nothing written
      taken.bind(("127.0.0.1", port))
      taken.listen()
      busy = _role(tmp_path / "busy", data_dir, server_flags, config_flags, secret,
                   tmp_path / "busy.txt")
      start = time.monotonic()
      assert _exits(busy, 120) == 1
      assert time.monotonic() - start < 60
    assert f"port {port}" in (tmp_path / "busy.txt").read_text() or "cannot be bound" in (
        tmp_path / "busy.txt").read_text()
    assert not (tmp_path / "busy" / "summary.json").exists()
    server_log = tmp_path / "server.txt"
    procs.append(_role(workdir, data_dir, server_flags, config_flags, secret, server_log))
    for m in (0, 1):
      procs.append(_role(workdir, data_dir, ["--role=worker", f"--mesh={m}",
                                             f"--config.dist.server_address={address}"], config_flags,
                         secret, tmp_path / f"mesh{m}.txt"))
    _wait_for(lambda: len(_metrics(workdir)) >= 2, 300, "two evaluations", procs)
    procs[0].kill()
    procs[0].wait()
    procs[0] = _role(workdir, data_dir, server_flags, config_flags, secret, server_log)
    _wait_for(lambda: len(_log_times(server_log, "rejoins at")) >= 2, 300,
              "both meshes to rejoin", procs)
    served = _log_times(server_log, "serving 2 meshes")[-1]
    rejoined = _log_times(server_log, "rejoins at")[-2:]
    # Both rejoined the restarted server's session (its retry interval is 0.25-0.5 s; how long
    # it takes is a machine's load, not asserted here).
    assert min(rejoined) >= served, (served, rejoined)
    for proc in procs[1:]:
      proc.kill()
      proc.wait()
    assert _exits(procs[0], 120) == 1   # the server ends the run once every mesh is lost
  finally:
    _kill_all(procs, workdir)
  log = server_log.read_text()
  assert log.count("every mesh was lost and none rejoined within dist.all_lost_timeout=4 s") == 1
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "failed" and "every mesh was lost" in summary["failure"]
  assert "resumed from the server checkpoint" in log


@pytest.mark.slow
def test_two_process_meshes_train_sigterm_stops_with_a_checkpoint_and_a_rerun_resumes(
    tmp_path, data_dir):
  workdir = tmp_path / "real"
  flags = ["--config.num_workers=2", "--config.sync.scheme=ssp", "--config.cluster.profile=none",
           "--config.train.num_epochs=50.0", "--config.train.eval_every=0.25"]
  procs = [_launch(workdir, data_dir, *flags, "--processes_per_mesh=2")]
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    pids = _pids(workdir)
    assert sorted(pids) == ["launcher", "mesh0_rank0", "mesh0_rank1", "mesh1_rank0",
                            "mesh1_rank1", "server"]
    procs[0].send_signal(signal.SIGTERM)
    out, _ = procs[0].communicate(timeout=120)
    ended = time.time()
    assert not [name for name, pid in pids.items() if _running(pid)]
  finally:
    _kill_all(procs, workdir)
  saved = _log_times(workdir / "log.txt", "the server stopped; its checkpoint is at")
  assert saved and saved[-1] <= ended, (ended, saved)   # saved before the launcher ended
  first = _metrics(workdir)[0]
  # It learns (chance: 0.1). A real run's first evaluation, after ~16 pushes in wall-time order,
  # varies: 0.19 in one suite of 2026-11-26, > 0.2 otherwise; that a 2-process mesh computes a
  # one-process mesh's gradient exactly is tested below.
  assert first["pushes"] >= 2 * 4 and first["test_accuracy"] > 0.15
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "interrupted"
  # The launcher ends with one line, no traceback: the server's checkpoint and the resume command.
  assert procs[0].returncode == 130 and "Traceback" not in out, out[-3000:]
  assert out.strip().splitlines()[-1].startswith(
      f"interrupted by SIGTERM at pushes {summary['totals']['pushes']}; its checkpoint is in "
      f"{workdir}/checkpoints. To resume, run the same command: python -m experiments.launch"), out
  for name in ("mesh0_rank1", "mesh1_rank1"):
    assert "joined" in (workdir / "logs" / f"{name}.txt").read_text()
  # The rerun (one process per mesh now: the split of a mesh is not part of the run) resumes
  # from the checkpoint the interrupted server saved, and stops after a few more pushes.
  saved_pushes = summary["totals"]["pushes"]
  procs = [_launch(workdir, data_dir, *flags,
                   f"--config.train.stop_after_updates={saved_pushes + 8}")]
  try:
    out, _ = procs[0].communicate(timeout=300)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, workdir)
  assert f"resumed from the server checkpoint at {saved_pushes} pushes" in (
      workdir / "log.txt").read_text()
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "stopped" and summary["totals"]["pushes"] == saved_pushes + 8
  lines = _metrics(workdir)
  assert lines[0] == first and lines[-1]["pushes"] == saved_pushes + 8


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
    deadline = time.monotonic() + 60
    while not (tmp_path / "server.ready").exists():
      assert time.monotonic() < deadline, "the slow server never started"
      time.sleep(0.05)
    launcher.shutdown(server_grace=1)
    assert server.returncode == -signal.SIGKILL
  finally:
    for proc in launcher.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_each_process_gets_its_own_gpu_round_robin_none_preallocates_and_malloc_is_tuned(
    tmp_path, monkeypatch):
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
  # Every child gets the launcher's malloc settings; a value of the user's own wins.
  for key, value in launch.ALLOCATOR_ENV.items():
    assert spawned["env"][key] == value
  monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
  launcher._spawn("mesh0_rank0", ["--role=worker"])
  assert spawned["env"]["MALLOC_TRIM_THRESHOLD_"] == "12345"
  assert spawned["env"]["MALLOC_MMAP_THRESHOLD_"] == launch.ALLOCATOR_ENV["MALLOC_MMAP_THRESHOLD_"]


_REUSED_BUFFERS_FAULTS = """
import resource
import numpy as np
for _ in range(3):   # 40 MB: above glibc's largest default mmap threshold (32 MB)
  a = np.ones(40 << 20, np.uint8); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  a = np.ones(40 << 20, np.uint8); del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_launchers_malloc_settings_take_effect_in_a_child():
  """``launch.ALLOCATOR_ENV`` names variables glibc reads: with them, a freed 40 MB buffer is
  reused without faulting its pages in again; without them, every one is mapped afresh."""
  import platform  # pylint: disable=g-import-not-at-top
  if platform.libc_ver()[0] != "glibc":
    pytest.skip("the settings are glibc's")
  env = {k: v for k, v in os.environ.items() if k not in launch.ALLOCATOR_ENV}

  def faults(env):
    out = subprocess.run([sys.executable, "-c", _REUSED_BUFFERS_FAULTS], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return int(out)
  tuned, default = faults(launch.with_allocator_env(env)), faults(env)
  assert tuned * 10 < default, (tuned, default)


_TWO_PROCESS_GRADIENT = """
import os, sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=rank, initialization_timeout=120)
sys.path.insert(0, "tests")
import test_dist
from gssp_jax.runtime import worker
import dist_replay
config = test_dist._config(data_dir=os.environ["GSSP_DATA_DIR"])
mesh = worker.MeshWorker(config, 1, jax.process_index(), 2, "127.0.0.1:1",
                         dist_replay.CREDENTIALS)
params, model_state = test_dist._initial_weights(mesh)
loss, grad, new_ms, nbytes = mesh._compute({"iteration": 3, "ratio": 1.0, "flush": False},
                                           params, model_state)
np.savez(out, loss=loss, nbytes=nbytes, *jax.tree.leaves(grad))
local = worker.MeshWorker(test_dist._config(**test_dist.DILOCO), 1, jax.process_index(), 2,
                          "127.0.0.1:1", dist_replay.CREDENTIALS)
np.savez(out.replace(".npz", "_local.npz"), *test_dist._two_local_jobs(local, params, model_state))
jax.distributed.shutdown()
"""

# DiLoCo with two inner steps per job (worker 1 of the two tiers runs 1 step under DyLU: so no
# DyLU here) and inner AdamW, whose state carries from one job to the next.
DILOCO = {"sync.scheme": "diloco", "local.steps": 2, "local.optimizer.name": "adamw",
          "local.optimizer.learning_rate": 1e-3, "optimizer.learning_rate": 0.7,
          "optimizer.nesterov": True, "optimizer.weight_decay": 0.0}


def _two_local_jobs(mesh, params, model_state) -> list:
  """The pseudo-gradients of a mesh's jobs 0 and 1 from the same weights, then its inner
  state's leaves: the second job starts from the inner state the first left."""
  import jax  # pylint: disable=g-import-not-at-top
  out = []
  for k in (0, 1):
    loss, push, _, _ = mesh._compute({"iteration": k, "ratio": 1.0, "flush": False, "steps": 2},
                                     params, model_state)
    out += [np.asarray(loss)] + [np.asarray(x) for x in jax.tree.leaves(push)]
  inner = mesh._inner()
  if mesh.mesh is None:   # a one-process mesh keeps it as its one-worker state's row
    inner = jax.tree.map(lambda x: x[0], inner)
  else:
    inner = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), inner)
  return out + [np.asarray(x) for x in jax.tree.leaves(inner)]


def _initial_weights(mesh):
  """The server's initial weights (eager init of the run's seed), as a mesh receives them."""
  import jax  # pylint: disable=g-import-not-at-top
  init_rng, _ = jax.random.split(jax.random.PRNGKey(mesh.config.seed))
  return jax.device_get(mesh.task.init(init_rng))


@pytest.mark.slow
def test_a_two_process_mesh_computes_the_gradient_of_a_one_process_mesh(tmp_path, data_dir):
  """Each rank takes half the worker's batch and every rank gets the mean (gloo all-reduce):
  the worker's gradient, to float32 summation order, as one process computes it."""
  import jax  # pylint: disable=g-import-not-at-top
  from gssp_jax.runtime import worker  # pylint: disable=g-import-not-at-top
  port = launch.free_port()
  procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_GRADIENT, str(rank), str(port),
                             str(tmp_path / f"rank{rank}.npz")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "GSSP_DATA_DIR": data_dir},
                            start_new_session=True) for rank in (0, 1)]
  try:
    for proc in procs:
      out, _ = proc.communicate(timeout=300)
      assert proc.returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, tmp_path)
  config = _config(data_dir=data_dir)
  one = worker.MeshWorker(config, 1, 0, 1, "127.0.0.1:1", dist_replay.CREDENTIALS)
  params, model_state = _initial_weights(one)
  loss, grad, _, nbytes = one._compute({"iteration": 3, "ratio": 1.0, "flush": False}, params,
                                       model_state)
  for rank in (0, 1):
    got = np.load(tmp_path / f"rank{rank}.npz")
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
    assert int(got["nbytes"]) == nbytes
    for i, leaf in enumerate(jax.tree.leaves(grad)):
      np.testing.assert_allclose(got[f"arr_{i}"], leaf, rtol=1e-4, atol=1e-6)
  # A local-update job (DiLoCo, 2 inner AdamW steps) splits each inner step's batch the same
  # way, and its inner state carries over to the mesh's next job as a one-process mesh's does.
  local = worker.MeshWorker(_config(data_dir=data_dir, **DILOCO), 1, 0, 1, "127.0.0.1:1",
                            dist_replay.CREDENTIALS)
  want = _two_local_jobs(local, params, model_state)
  assert want[-1].dtype.kind == "i" and int(want[-1]) == 4   # AdamW's count: 2 jobs x 2 steps
  for rank in (0, 1):
    got = np.load(tmp_path / f"rank{rank}_local.npz")
    assert len(got.files) == len(want)
    for i, leaf in enumerate(want):
      np.testing.assert_allclose(got[f"arr_{i}"], leaf, rtol=1e-4, atol=1e-6, err_msg=str(i))


_STRANGER = r"""
import os, signal, sys, threading, time, grpc
addresses, in_flight = sys.argv[1].split(","), int(sys.argv[2])
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
codes = {}
def flood(address):
  channel = grpc.insecure_channel(address)
  call = channel.unary_unary("/gssp.Run/Push")
  pending = set()
  while not stop.is_set():
    while len(pending) < in_flight:
      pending.add(call.future(b"x" * 64, timeout=30))
    done = [f for f in pending if f.done()]
    for f in done:
      pending.discard(f)
      codes[f.code().name] = codes.get(f.code().name, 0) + 1
    time.sleep(0.005)   # refusals come back at once: this keeps the flood from taking a core
for a in addresses:
  threading.Thread(target=flood, args=(a,), daemon=True).start()
while not stop.wait(0.1):
  pass
print("CODES", dict(codes), flush=True)
os._exit(0)   # no channel shutdown with hundreds of calls in flight
"""


def _stop_stranger(stranger: subprocess.Popen | None) -> str:
  """Stops a stranger process (SIGTERM, SIGKILL after 60 s) and returns what it printed."""
  if stranger is None:
    return ""
  stranger.terminate()
  try:
    return stranger.communicate(timeout=60)[0]
  except subprocess.TimeoutExpired:
    stranger.kill()
    return stranger.communicate()[0] + "\n(the stranger did not stop within 60 s)"


def _listening(pid: int) -> list[int]:
  import psutil  # pylint: disable=g-import-not-at-top
  try:
    connections = psutil.Process(pid).net_connections(kind="tcp")
  except psutil.NoSuchProcess:
    return []
  return sorted({c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN})


@pytest.mark.slow
def test_a_stranger_flooding_every_port_of_a_gssp_run_with_refused_calls_does_not_stop_it(
    tmp_path, data_dir):
  """A stranger process keeps 150 unauthenticated calls in flight on every port the server and
  the second shard listen on (gRPC and Flight), from the first evaluation to the end: the run
  ends done, every mesh trained on and none was lost (grpcio's call limit, which counted the
  refusals, failed such a run with RESOURCE_EXHAUSTED). Without TLS (``dist.tls_mode='none'``),
  so that every call reaches the token check: the default's TLS turns them away before
  (``test_a_stranger_sending_a_gib_to_every_port_of_a_gssp_run_...``)."""
  workdir = tmp_path / "real"
  procs = [_launch(workdir, data_dir, "--config.num_workers=4", "--config.sync.num_groups=2",
                   "--config.cluster.tiers=(1.0,3.0)", "--config.cluster.base_time=0.2",
                   "--config.train.num_epochs=4", "--config.dist.num_servers=2",
                   "--config.dist.tls_mode=none")]
  stranger = None
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    pids = _pids(workdir)
    ports = [p for role in ("server", "shard1") for p in _listening(pids[role])]
    assert len(ports) >= 4, (pids, ports)   # each: its gRPC port and its Flight port
    before = _metrics(workdir)[-1]["pushes"]
    stranger = subprocess.Popen(
        [sys.executable, "-c", _STRANGER, ",".join(f"127.0.0.1:{p}" for p in ports), "150"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = procs[0].communicate(timeout=400)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    flood_out = _stop_stranger(stranger)
    _kill_all(procs, workdir)
  assert "CODES " in flood_out, flood_out[-2000:]
  codes = ast.literal_eval(flood_out.split("CODES ", 1)[1].strip())
  assert codes.get("UNAUTHENTICATED", 0) >= 1000, flood_out[-2000:]
  assert "OK" not in codes, codes
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "done" and summary["meshes"]["lost"] == []
  assert summary["totals"]["pushes"] > before
  assert min(summary["totals"]["pushes_per_worker"]) > 0


_GIB_STRANGER = r"""
import signal, socket, ssl, sys, threading, time, grpc
from pyarrow import flight
addresses = sys.argv[1].split(",")
GIB = 1 << 30
BIG = b"x" * GIB
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
def raw(address, tls):   # 1 GiB of bytes on a TCP connection, or inside a TLS one of no key
  host, port = address.rsplit(":", 1)
  total, chunk = 0, memoryview(BIG)[:1 << 20]
  try:
    with socket.create_connection((host, int(port)), timeout=10) as s:
      if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        s = context.wrap_socket(s)
      while total < GIB and not stop.is_set():
        s.sendall(chunk)
        total += len(chunk)
  except (OSError, ssl.SSLError):
    pass
  return total
def grpc_call(address):   # a 1 GiB unary request, as gRPC sends it
  channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])
  try:
    channel.unary_unary("/gssp.Run/Push")(BIG, timeout=20)
    return "OK"
  except grpc.RpcError as e:
    return e.code().name
  finally:
    channel.close()
def flight_action(address, tls):   # a 1 GiB DoAction, plain or TLS without a certificate
  location = ("grpc+tls://" if tls else "grpc://") + address
  kwargs = {"disable_server_verification": True} if tls else {}
  try:
    client = flight.FlightClient(location, **kwargs)
    list(client.do_action(flight.Action("x", BIG), flight.FlightCallOptions(timeout=20)))
    return "OK"
  except Exception as e:
    return type(e).__name__
results = {}
for a in addresses:
  results[a] = (raw(a, False), raw(a, True), grpc_call(a), flight_action(a, False),
                flight_action(a, True))
print("GIB", results, flush=True)
def knock(address):   # then handshakes that fail, to the end (paced: the suite's other tests
  host, port = address.rsplit(":", 1)   # share the machine's two cores)
  while not stop.is_set():
    try:
      with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\x16\x03\x01" + bytes(4093))
        while s.recv(1 << 16):
          pass
    except OSError:
      pass
    time.sleep(0.02)
for a in addresses:
  threading.Thread(target=knock, args=(a,), daemon=True).start()
while not stop.wait(0.1):
  pass
print("DONE", flush=True)
"""

RSS_BOUND = 192 << 20   # bytes a process may grow while a stranger sends it 1 GiB per request


class _PeakRss:
  """The largest resident set of each of ``pids`` seen since :meth:`reset`, sampled every 50 ms."""

  def __init__(self, pids):
    import psutil  # pylint: disable=g-import-not-at-top
    self._procs = {pid: psutil.Process(pid) for pid in pids}
    self.peak = {pid: 0 for pid in pids}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()

  def _sample(self):
    while not self._stop.wait(0.05):
      for pid, proc in self._procs.items():
        try:
          self.peak[pid] = max(self.peak[pid], proc.memory_info().rss)
        except Exception:  # pylint: disable=broad-except  (it ended)
          pass

  def reset(self) -> dict:
    """The peaks so far, and a fresh start."""
    peaks, self.peak = self.peak, {pid: 0 for pid in self.peak}
    return peaks

  def stop(self) -> dict:
    self._stop.set()
    self._thread.join(5)
    return self.peak


@pytest.mark.slow
def test_a_stranger_sending_a_gib_to_every_port_of_a_gssp_run_grows_no_process_and_stops_nothing(
    tmp_path, data_dir):
  """The default, the run's own mutual TLS: a stranger sends 1 GiB to each port of the server
  and the second shard (gRPC and Flight) as raw bytes, inside a TLS connection without a
  certificate, as a gRPC request and as a Flight ``DoAction`` (plain and TLS), then keeps failing
  handshakes coming to the end. No process grows by :data:`RSS_BOUND` over its own peak before
  (a Flight ``DoAction`` used to be read whole before its token was checked: 1 GiB grew the
  server by 1.1 GiB), no port takes in more than a socket's buffers, and the run ends done."""
  workdir = tmp_path / "real"
  procs = [_launch(workdir, data_dir, "--config.num_workers=4", "--config.sync.num_groups=2",
                   "--config.cluster.tiers=(1.0,3.0)", "--config.cluster.base_time=0.2",
                   "--config.train.num_epochs=4", "--config.train.eval_every=0.5",
                   "--config.dist.num_servers=2")]
  stranger = rss = None
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    pids = _pids(workdir)
    watched = [pids["server"], pids["shard1"]]
    rss = _PeakRss(watched)
    evaluations = len(_metrics(workdir))
    _wait_for(lambda: len(_metrics(workdir)) > evaluations, 300, "another evaluation", procs)
    before = rss.reset()
    ports = [p for pid in watched for p in _listening(pid)]
    assert len(ports) >= 4, (pids, ports)   # each: its gRPC port and its Flight port
    stranger = subprocess.Popen(
        [sys.executable, "-c", _GIB_STRANGER, ",".join(f"127.0.0.1:{p}" for p in ports)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = procs[0].communicate(timeout=400)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    during = rss.stop() if rss is not None else {}
    stranger_out = _stop_stranger(stranger)
    _kill_all(procs, workdir)
  assert "GIB " in stranger_out and "DONE" in stranger_out, stranger_out[-2000:]
  results = ast.literal_eval(stranger_out.split("GIB ", 1)[1].splitlines()[0])
  for address, (raw, raw_tls, grpc_code, flight_plain, flight_tls) in results.items():
    assert raw < 64 << 20 and raw_tls < 64 << 20, (address, raw, raw_tls)
    assert grpc_code == "UNAVAILABLE", (address, grpc_code)
    assert "OK" not in (flight_plain, flight_tls), (address, flight_plain, flight_tls)
  print("peak RSS MiB before / during the stranger:", {pid: (before[pid] >> 20, during[pid] >> 20)
                                                        for pid in before}, "; sent:", results)
  for pid in before:
    assert during[pid] - before[pid] < RSS_BOUND, (pid, before[pid] >> 20, during[pid] >> 20)
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "done" and summary["meshes"]["lost"] == []
  assert min(summary["totals"]["pushes_per_worker"]) > 0


def _listening_in_namespace(pid: int) -> set[int]:
  """The TCP ports listened on in ``pid``'s network namespace (``/proc/PID/net/tcp``, tcp6)."""
  ports = set()
  for name in ("tcp", "tcp6"):
    with open(f"/proc/{pid}/net/{name}") as f:
      for line in list(f)[1:]:
        fields = line.split()
        if fields[3] == "0A":   # LISTEN
          ports.add(int(fields[1].rsplit(":", 1)[1], 16))
  return ports


def _private_network_reason():
  from gssp_jax.runtime import private_net  # pylint: disable=g-import-not-at-top
  try:
    private_net.check_available()
  except (ValueError, OSError, subprocess.SubprocessError) as e:
    return str(e)
  return None


@pytest.mark.slow
def test_a_run_on_a_private_network_is_out_of_every_other_processs_reach(tmp_path, data_dir):
  """``--private_network``: the launcher and every process it starts share a network namespace
  of their own, so no port of the run (the server's, the shards', each mesh's jax coordinator
  and gloo connections) answers from outside it, and the run ends done."""
  reason = _private_network_reason()
  if reason:
    pytest.skip(reason)
  workdir = tmp_path / "real"
  procs = [_launch(workdir, data_dir, "--config.num_workers=2", "--config.sync.scheme=asp",
                   "--config.cluster.profile=none", "--config.train.num_epochs=2.0",
                   "--config.train.eval_every=1.0",   # too few evaluations to judge a collapse
                   "--processes_per_mesh=2", "--config.dist.num_servers=2", "--private_network")]
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    pids = _pids(workdir)
    namespace = lambda pid: os.readlink(f"/proc/{pid}/ns/net")
    theirs = {namespace(pid) for pid in [procs[0].pid, *pids.values()] if _running(pid)}
    assert len(theirs) == 1 and namespace(os.getpid()) not in theirs, theirs
    ports = _listening_in_namespace(pids["server"])   # every listener of the namespace
    ours = _listening_in_namespace(os.getpid())
    ports -= ours
    # The server's and shard 1's gRPC and Flight ports, each mesh's coordinator.
    assert len(ports) >= 6, (pids, ports)
    for port in ports:
      with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    out, _ = procs[0].communicate(timeout=400)
    assert procs[0].returncode == 0, out[-3000:]
  finally:
    _kill_all(procs, workdir)
  summary = json.load(open(workdir / "summary.json"))
  assert summary["status"] == "done" and summary["meshes"]["lost"] == []


@pytest.mark.slow
def test_a_rank_that_leaves_its_loop_ends_its_mesh_which_the_server_drops(tmp_path, data_dir):
  """Rank 1 of a two-process mesh leaves its loop (Ctrl-C's SIGINT to it alone; jax keeps
  SIGTERM for its preemption notice): it ends its process at once,
  without the shutdown barrier its rank 0 would never reach, rank 0 ends within jax's heartbeat
  timeout, and the server drops the mesh while the other mesh trains on (before, rank 1 sat in
  the barrier and rank 0's heartbeats kept the stuck mesh "alive" for minutes)."""
  workdir = tmp_path / "real"
  flags = ["--config.num_workers=2", "--config.sync.scheme=asp", "--config.cluster.profile=none",
           "--config.train.num_epochs=50.0", "--config.train.eval_every=0.25",
           "--config.dist.heartbeat_timeout=5.0"]
  procs = [_launch(workdir, data_dir, *flags, "--processes_per_mesh=2")]
  try:
    _wait_for(lambda: _metrics(workdir), 300, "the first evaluation", procs)
    pids = _pids(workdir)
    stopped = time.monotonic()
    os.kill(pids["mesh1_rank1"], signal.SIGINT)
    _wait_for(lambda: not _running(pids["mesh1_rank1"]), 30, "rank 1 to end", procs)
    _wait_for(lambda: not _running(pids["mesh1_rank0"]), 90, "rank 0 of its mesh to end", procs)
    _wait_for(lambda: "mesh 1 lost" in (workdir / "log.txt").read_text(), 60,
              "the server to drop mesh 1", procs)
    dropped = time.monotonic() - stopped
    pushes = _metrics(workdir)[-1]["pushes"]
    _wait_for(lambda: _metrics(workdir)[-1]["pushes"] > pushes, 120, "mesh 0 to train on",
              procs)
    assert _running(pids["mesh0_rank0"]) and _running(pids["mesh0_rank1"])
  finally:
    _kill_all(procs, workdir)
  rank1 = (workdir / "logs" / "mesh1_rank1.txt").read_text(errors="replace")
  assert "ending its process without the mesh's shutdown barrier" in rank1, rank1[-3000:]
  assert dropped < 100, dropped   # jax's heartbeat timeout (10 s here) plus the server's (5 s)
