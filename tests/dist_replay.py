"""Replays a simulated run's exact event sequence through the real runtime, in one process.

The simulator (``sim/simulate.Simulation``, rounds runner) runs a config and
records its timeline's events (starts, pushes, server-to-server messages).
The same events then drive the real runtime's pieces: the control plane
(``DistServer``, with a manual clock and held messages), S parameter shards
(shard 0 in the control plane; shards 1..S-1 started by the shard role's own
``shard_process.start``, served over gRPC on loopback, with the run's token),
and one ``MeshWorker`` per worker (its gradient, compressor, packing, and its
gRPC calls to the shards). A mesh computes at its "start" event on the weights
it fetched at its release and pushes at its "push" event, exactly when the
simulator's worker does. Test files import it as ``dist_replay``.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax.runtime import auth
from gssp_jax.runtime import server as server_lib
from gssp_jax.runtime import shard as shard_lib
from gssp_jax.runtime import shard_process
from gssp_jax.runtime import wire
from gssp_jax.runtime import worker as worker_lib
from gssp_jax.sim import simulate
from gssp_jax.base import run as run_lib

RUN_ID = "replay-run"
CREDENTIALS = auth.Credentials(bytes(range(32)), RUN_ID)


class Clock:
  """The control plane's time: the replayed event's virtual time."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def simulate_events(config, workdir: str):
  """Runs the simulator to its end with its timeline recorded; returns it (device steps run)."""
  task = run_lib.prepare_run(config, workdir)
  sim = simulate.Simulation(config, task, workdir, runner="rounds")
  sim.engine.record = True
  sim.restore()
  while not sim.finished():   # one evaluation point, at the end: never evaluated (it resets
    sim.advance()             # the loss sums the comparison reads)
  sim.flush_host()   # the planned device steps run, the deferred accounting done
  return sim


class RealRun:
  """The control plane, its shards and the meshes of ``config`` (one process, loopback)."""

  def __init__(self, config, workdir: str, num_servers: int, meshes=None):
    self.config = config_lib.override(config, {"executor": "dist"})
    task = run_lib.prepare_run(self.config, workdir)
    self.clock = Clock()
    self.srv = server_lib.DistServer(self.config, task, workdir, num_servers=num_servers,
                                     credentials=CREDENTIALS, clock=self.clock,
                                     manual_messages=True)
    self.srv.restore()
    address = self.srv.bind("127.0.0.1:0")
    self.shards = [shard_process.start(self.config, workdir, s, num_servers, address,
                                       "127.0.0.1:0", CREDENTIALS)
                   for s in range(1, num_servers)]
    self.srv.membership.join_by = 0.0   # no start barrier
    self.meshes = meshes if meshes is not None else make_meshes(self.config)
    for mesh in self.meshes:   # a fresh start (meshes may be reused from another run)
      mesh.layout, mesh.seq = None, 0
      mesh.comp_state = jax.device_put(mesh.initial_comp_state)   # its job donates its own
      mesh._set_inner(jax.device_put(mesh.initial_inner_state))   # pylint: disable=protected-access
    self.weights = [None] * len(self.meshes)
    self.pending = [None] * len(self.meshes)
    self.jobs = [None] * len(self.meshes)
    self.computed = [0] * len(self.meshes)   # jobs each mesh computed
    for w, mesh in enumerate(self.meshes):
      header, body = self.srv.calls.on_join({"mesh": w, "instance": mesh.instance,
                                       "config": server_lib.config_id(self.config)}, None, "test")
      self._released(w, header, body)

  def _released(self, w: int, header: dict, body) -> None:
    mesh = self.meshes[w]
    self.jobs[w] = mesh._accept(header, body)   # pylint: disable=protected-access
    self.weights[w] = mesh._fetch_weights(self.jobs[w], mesh._shard0)[:2]   # pylint: disable=protected-access

  def start(self, w: int) -> None:
    """Mesh ``w`` starts an iteration: released (after its first) and computes its gradient."""
    mesh = self.meshes[w]
    if self.pending[w] is not None:   # its previous push: released since, by the protocol
      self.pending[w] = None
      header, body = self.srv.calls.await_release(w, mesh.seq, timeout=30)
      assert "stop" not in header and "rejoin" not in header, header
      self._released(w, header, body)
    params, model_state = self.weights[w]
    self.pending[w] = mesh._compute(self.jobs[w], params, model_state)   # pylint: disable=protected-access
    self.computed[w] += 1

  def compute_dispatched(self, dispatched) -> None:
    """Each mesh computes the jobs the simulator dispatched after its last replayed start.

    The simulator computes a job when it dispatches it (with the round that released its
    worker), so its final state holds the jobs released by the last rounds; a real mesh is
    told to stop instead. To compare what lives only in the meshes (a local-update scheme's
    inner optimizer state), each mesh computes those released jobs too (nothing is pushed).
    """
    for w, mesh in enumerate(self.meshes):
      while self.computed[w] < dispatched[w]:
        with self.srv.lock:
          seq, job = self.srv.core.releases[w]
        self._released(w, *self.srv.calls._reply_with_weights(w, seq, job))   # pylint: disable=protected-access
        self.pending[w] = None
        self.start(w)

  def push(self, w: int, expect_stop: bool = False) -> None:
    """Mesh ``w``'s push reaches the server: slices to the shards, receipts, then the push
    (``expect_stop``: the server answers stop at once, e.g. past ``train.virtual_budget``)."""
    mesh, job = self.meshes[w], self.jobs[w]
    loss, grad, model_state, nbytes = self.pending[w]
    sparse = self.config.compress.name != "none"
    grads, stats = jax.tree.leaves(grad), jax.tree.leaves(model_state)
    bodies = [mesh.layout.pack_push(s, grads, stats, sparse)
              for s in range(mesh.layout.num_shards)]
    mesh.seq += 1
    receipts = [mesh.shards[s - 1].call("PutGrad", {"mesh": w, "session": mesh.session,
                                                    "seq": mesh.seq, "nnz": bodies[s][1]},
                                        bodies[s][0])[0]["receipt"]
                for s in range(1, len(bodies))]
    header = {"mesh": w, "instance": mesh.instance, "session": mesh.session, "seq": mesh.seq,
              "iteration": job["iteration"], "loss": float(loss),
              "bytes": int(nbytes) + mesh.stats_bytes,
              "wire_bytes": sum(wire.body_bytes(b) for b, _ in bodies), "nnz": [n for _, n in bodies],
              "receipts": receipts,
              "digests": [wire.digest(bodies[s][0]) for s in range(1, len(bodies))]}
    _, _, immediate = self.srv.calls.accept_push(header, bodies[0][0])
    assert immediate == ({"stop": True} if expect_stop else None), immediate

  def replay(self, events) -> None:
    for kind, time, payload in events:
      self.clock.now = time
      if kind == "start":
        self.start(payload)
      elif kind == "push":
        self.push(payload)
      elif kind == "message":
        self.srv.deliver(payload, now=time)
      else:
        raise ValueError(f"cannot replay a {kind!r} event")
    self.settle()

  def settle(self) -> None:
    """Waits until every shard applied every op the control plane emitted."""
    with self.srv.lock:
      self.srv._emit({"k": "noop"})   # pylint: disable=protected-access
      ops = self.srv.shard_links.ops
    for core in self.cores():
      core.pull(0, ops, timeout=60)

  def cores(self) -> list[shard_lib.ShardCore]:
    return [self.srv.core0] + [h.core for h in self.shards]

  def close(self) -> None:
    # The replayed meshes are not processes that read a stop: the server need not wait 3 s
    # for them to (``DistServer.close``).
    self.srv.membership.told_stop[:] = True
    self.srv.close()   # its final checkpoint (every shard's), then Stop to the shards
    for handle in self.shards:
      shard_process.stop(handle)


def make_meshes(config) -> list[worker_lib.MeshWorker]:
  """One one-process mesh per worker (reusable by several :class:`RealRun`)."""
  config = config_lib.override(config, {"executor": "dist"})
  meshes = [worker_lib.MeshWorker(config, w, 0, 1, "127.0.0.1:1", CREDENTIALS)
            for w in range(config.num_workers)]
  for mesh in meshes:
    mesh.initial_comp_state = jax.tree.map(np.array, mesh.comp_state)   # a host copy
    mesh.initial_inner_state = jax.tree.map(np.array, mesh._inner())   # pylint: disable=protected-access
  return meshes


def restrict(tree, sub_treedef, indices, key):
  """``tree`` with every subtree shaped like ``sub_treedef`` replaced by ``{key(i): leaf i}``."""
  def pick(sub):
    if not _is(sub, sub_treedef):
      return sub
    leaves = jax.tree.leaves(sub)
    return {key(i): leaves[i] for i in indices}
  return jax.tree.map(pick, tree, is_leaf=lambda x: _is(x, sub_treedef))


def _is(x, treedef) -> bool:
  try:
    return jax.tree.structure(x) == treedef and jax.tree.leaves(x) != []
  except Exception:  # pylint: disable=broad-except
    return False


def expected_shard_state(sim_state, params_treedef, stats_treedef, layout, s: int) -> dict:
  """The simulator's state restricted to shard ``s``'s tensors (and statistics on shard 0)."""
  idx = list(layout.leaves(s))
  params = lambda tree: restrict(tree, params_treedef, idx, shard_lib.param_key)
  nstats = len(layout.stats_shapes)
  stats = lambda tree: (restrict(tree, stats_treedef, range(nstats), shard_lib.stats_key)
                        if s == 0 and nstats else {})
  return {"replica_params": params(sim_state.replica_params),
          "worker_params": params(sim_state.worker_params),
          "tx_state": params(sim_state.tx_state),
          "replica_model_state": stats(sim_state.replica_model_state),
          "loss_sum": sim_state.loss_sum, "loss_count": sim_state.loss_count,
          "push_bytes": sim_state.push_bytes}


def differences(real_state, expected: dict) -> list[str]:
  """Names of the fields (and leaves) of ``real_state`` that are not bit-identical to ``expected``."""
  out = []
  for name, want in expected.items():
    got = getattr(real_state, name)
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
      out.append(f"{name}: {len(got_leaves)} leaves vs {len(want_leaves)}")
      continue
    for (path, g), w in zip(got_leaves, want_leaves):
      g, w = np.asarray(g), np.asarray(w)
      if g.shape != w.shape or not np.array_equal(g, w):
        diff = (float(np.abs(g.astype(np.float64) - w).max()) if g.shape == w.shape
                else f"shape {g.shape} vs {w.shape}")
        out.append(f"{name}{jax.tree_util.keystr(path)}: max diff {diff}")
  return out


def env_with_secret() -> dict:
  return {**os.environ, auth.SECRET_ENV: bytes(range(32)).hex(), auth.RUN_ID_ENV: RUN_ID}
