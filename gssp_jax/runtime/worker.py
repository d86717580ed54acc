"""A mesh: one protocol worker of a real run, as an SPMD program over one or more processes.

Each process of a mesh holds its devices; the mesh's processes form one
``jax.distributed`` cluster of their own (one per mesh, so one mesh's crash or
shutdown never touches another). Inside the mesh training is synchronous data
parallelism: each process takes its slice of the worker's batch, and one
sharded ``jit`` gives every process the mean gradient (XLA's all-reduce; gloo
on CPUs, NCCL on GPUs). A one-process mesh runs a plain ``jit``.

Rank 0 talks to the control plane (``Join``, ``Push``, heartbeats) and, for
each push, sends each parameter shard its slice of the gradient first
(``PutGrad``, in parallel; each answers with a receipt), then the control
plane the push itself with shard 0's slice and the receipts. The reply (the
mesh's release) names the op count at which its weights are ready (the
watermark); every rank then fetches its weights from every shard itself
(shard 0's came with the reply for rank 0), in parallel. Only the small job
(iteration, ratio, watermark) is broadcast inside the mesh.

A mesh computes exactly what the simulator's job computes for the same worker
and iteration (``sim/executor.make_worker_gradient``): the batch of
``sharding.WorkerBatches``, the dropout key ``fold_in(fold_in(key, w), k)``,
the gradient clipped to ``optimizer.grad_clip``, the one-worker compressor
with its own error-feedback memory. With a cluster
description (``cluster.*``) and ``dist.emulate_cluster``, each iteration is
stretched by sleeping to the cluster model's ``compute_time(w, k)``, each
push waits its link time and each pull its transfer time, as the simulator
charges them (the scheme's legs, ``sync.legs``; InHAD: the node link plus an
8-byte iteration number), unless ``dist.emulate_network=False`` leaves them to a network
that imposes them itself (``benchmarks/sim_vs_real.py``: ``tc`` on the links).

A local-update scheme's job (``local_sgd``, ``diloco``, ``async_local_sgd``)
is the simulator's too: ``H_w`` inner optimizer steps (the job's ``steps``,
from the server) on the worker's data iterations ``k H_w .. k H_w + H_w - 1``,
then the pseudo-gradient is pushed; the inner optimizer state is the mesh's own
and carries over to its next job (``sim/executor.make_local_update``; a
multi-process mesh splits each inner step's batch, ``make_mesh_local_step``).

A restarted mesh process starts with an empty error-feedback memory and a
fresh inner optimizer state (its step count, and so its inner schedule, start
again): both are as large as the model and live only in the mesh, and sending
them with every push would double or triple the push traffic; a mesh that is
dropped and rejoins in the same process keeps them.
"""

from __future__ import annotations

import threading
import time
import uuid

from absl import logging
import grpc
import jax
import ml_collections
import msgpack
import numpy as np
from jax.sharding import Mesh

from gssp_jax.data import sharding
from gssp_jax.runtime import auth
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import mesh_compute
from gssp_jax.runtime import server as server_lib
from gssp_jax.runtime import shard_links
from gssp_jax.runtime import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import simulate
from gssp_jax.sim import traffic as traffic_lib
from gssp_jax.sync import registry
from gssp_jax.base import run as run_lib
from gssp_jax.base import step as step_lib
from gssp_jax.base import tasks

CONTROL_BYTES = 1 << 14   # the job broadcast inside a multi-process mesh (msgpack, padded)


class Stop(Exception):
  """The server said the run is over."""


# The SPMD steps live with the mesh's compute (re-exported: tools build them from here).
make_mesh_step = mesh_compute.make_mesh_step
make_mesh_local_step = mesh_compute.make_mesh_local_step


def _clients(addresses, credentials, config) -> list[endpoints.Client]:
  return [endpoints.Client(a, credentials, retry_seconds=float(config.dist.retry_seconds),
                           **endpoints.client_settings(config.dist, credentials))
          for a in addresses]


class _Heartbeat:
  """Rank 0's heartbeat thread: beats while the mesh makes progress; notes a stop or a rejoin.

  It stops beating when the main loop makes no progress for ``dist.hang_timeout`` (so the
  server drops a hung mesh); :meth:`ensure_running` restarts it after a rejoin.
  """

  def __init__(self, client: endpoints.Client, mesh: int, instance: str,
               config: ml_collections.ConfigDict):
    self.client, self.mesh, self.instance = client, mesh, instance
    self.interval = max(0.05, config.dist.heartbeat_timeout / 4)
    self.hang_timeout = config.dist.hang_timeout
    self.session = ""
    self.progress_at = time.monotonic()   # the main loop's last sign of life
    self.waiting = False                  # the main loop waits for the server (not hung)
    self.stop = threading.Event()
    self.closed = threading.Event()
    self.error: Exception | None = None
    self._thread: threading.Thread | None = None
    self.ensure_running()

  def ensure_running(self) -> None:
    self.progress_at = time.monotonic()
    if self._thread is None or not self._thread.is_alive():
      self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
      self._thread.start()

  def _run(self):
    while not self.closed.wait(self.interval):
      if not self.waiting and time.monotonic() - self.progress_at > self.hang_timeout:
        logging.error("mesh %d: no progress for %.0f s (dist.hang_timeout); heartbeats stop so "
                      "the server drops this mesh", self.mesh, self.hang_timeout)
        return
      try:
        reply, _ = self.client.call("Heartbeat", {"mesh": self.mesh, "instance": self.instance,
                                                  "session": self.session},
                                    timeout=self.interval * 4)
      except wire.ServerGone as e:   # unreachable for dist.retry_seconds: the mesh gives up
        self.error = e
        return
      except (wire.CallError, grpc.RpcError) as e:   # a slow answer: beat again next interval
        logging.warning("mesh %d: heartbeat failed (%s); retrying", self.mesh, e)
        continue
      if reply.get("stop"):
        self.stop.set()

  def close(self):
    self.closed.set()


class MeshWorker:
  """One mesh's process (rank ``rank`` of ``num_processes``) of worker ``mesh``.

  Args:
    config: the run's config (the same as the server's but ``dist.*``).
    mesh: the protocol worker this mesh is, ``0..num_workers-1``.
    rank: this process's rank in the mesh; rank 0 talks to the control plane.
    num_processes: processes in the mesh (each holds its local devices).
    server_address: the control plane's ``host:port``.
    credentials: the run's credentials (default: from the environment's secret).
  """

  def __init__(self, config: ml_collections.ConfigDict, mesh: int, rank: int, num_processes: int,
               server_address: str, credentials: auth.Credentials | None = None):
    self.config, self.w, self.rank, self.P = config, int(mesh), int(rank), int(num_processes)
    self.server_address = server_address
    self.credentials = (credentials if credentials is not None
                        else auth.load_credentials())
    self.instance = uuid.uuid4().hex
    self._shard0 = None   # shard 0's weights from the last join or push reply (rank 0; _accept)
    self.task = tasks.make_task(config)
    tasks.validate_sizes(config, self.task.num_train)
    self.B = config.batch_size
    plan = simulate.plan_pushes(config, self.task.num_train)
    self.batches = sharding.WorkerBatches(plan.shards, config.seed, self.B)
    self.cluster = cluster_lib.cluster_from_config(config)
    self.emulate = config.dist.emulate_cluster and cluster_lib.cluster_is_set(config)
    # Transfers sleep their modelled time too, unless the network itself imposes it.
    self.emulate_links = self.emulate and config.dist.emulate_network
    init_rng, self.train_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    # Shapes only: the weights come from the servers (the server initialises them once).
    shapes = jax.eval_shape(self.task.init, init_rng)
    params, model_state = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
    self.treedefs = (jax.tree.structure(params), jax.tree.structure(model_state))
    self.templates = (params, model_state)
    self.stats_bytes = step_lib.tree_bytes(model_state)
    pull_bytes = step_lib.tree_bytes(params) + self.stats_bytes
    self._push_bytes = 0
    self.links = traffic_lib.Traffic(registry.scheme_from_config(config).legs, self.cluster,
                                     lambda w, k: self._push_bytes, pull_bytes, pull_bytes)
    self.mesh = Mesh(np.array(jax.devices()), ("data",)) if self.P > 1 else None
    compressor = run_lib.make_compressor(simulate.one_worker_config(config))
    dense_bytes = step_lib.tree_bytes(params)
    _, self.local = simulate.local_plan(config, self.cluster.mean_times, plan.spe)
    clip = config.optimizer.grad_clip
    if self.mesh is None:   # one process: the simulator's own job on a one-worker state
      self.device = mesh_compute.OneProcess(self.task, compressor, dense_bytes, self.stats_bytes,
                                            self.templates, self.w, self.train_rng, self.local,
                                            clip)
    else:
      self.device = mesh_compute.Spmd(self.task, compressor, dense_bytes, self.templates, self.w,
                                      self.train_rng, self.local, clip, mesh=self.mesh,
                                      rank=self.rank, num_processes=self.P, batch_size=self.B)
    self.layout: layout_lib.ShardLayout | None = None
    self.server: endpoints.Client | None = None
    self.shards: list[endpoints.Client] = []
    self._calls: shard_links.CallPool | None = None   # the other shards' calls, at once
    self.iterations = 0
    self.seq = 0
    self.session = ""

  @property
  def comp_state(self):
    """The compressor's state (error feedback, keys), as the mesh's compute keeps it."""
    return self.device.comp_state

  @comp_state.setter
  def comp_state(self, value) -> None:
    self.device.comp_state = value

  # -- talking to the control plane (rank 0) ---------------------------------------------------

  def _join(self) -> tuple[dict, np.ndarray | None]:
    """Joins (or rejoins); a mesh held by a live process is refused after a grace period."""
    message = {"mesh": self.w, "instance": self.instance,
               "config": server_lib.config_id(self.config)}
    deadline = time.monotonic() + float(self.config.dist.heartbeat_timeout) + 2.0
    while True:
      try:
        return self.server.call("Join", message, reply_limit=self._pull_limit(0))
      except wire.CallError as e:
        # Another process holds this mesh: it may be a crashed one the server has not dropped
        # yet (it will within dist.heartbeat_timeout), or a live duplicate (it never will).
        if e.code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
          raise
        time.sleep(0.5)

  def _pull_limit(self, s: int) -> int:
    if self.layout is not None:
      return self.layout.pull_bytes(s)
    return 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.templates))

  def _accept(self, header: dict, body) -> dict:
    """Reads a Join or Push reply: the job, the session, the shards (rank 0)."""
    if header.get("refused"):
      logging.error("mesh %d: the server refused its push: %s", self.w, header["refused"])
    if header.get("stop"):
      return {"stop": True}
    self.session = header["session"]
    self.seq = int(header["seq"])
    if self.layout is None or len(header["shards"]) + 1 != self.layout.num_shards:
      self._connect_shards(header["shards"])
    if header["digest"] != self.layout.digest():
      raise ValueError(f"mesh {self.w}'s model layout differs from the server's (digest "
                       f"{self.layout.digest()} vs {header['digest']}); start every process "
                       "with the same --config and --config.* flags")
    self._shard0 = body
    return {k: header[k] for k in ("iteration", "ratio", "flush", "watermark")} | {
        "steps": int(header.get("steps", 1)), "session": self.session,
        "shards": header["shards"], "stop": False}

  def _connect_shards(self, addresses) -> None:
    for client in self.shards:
      client.close()
    self.layout = layout_lib.ShardLayout.balanced(*self.templates, len(addresses) + 1)
    self.shards = _clients(addresses, self.credentials, self.config)
    if self._calls is not None:
      self._calls.close()
    # The other shards at once, and the slices' digests beside their uploads (push).
    self._calls = shard_links.CallPool(len(addresses) + 1, "mesh-call")

  def _request_push(self, job: dict, loss, grad, model_state, nbytes) -> tuple[dict, object]:
    """Rank 0: the slices to the shards, then the push; ``rejoin`` answers lead to a ``Join``."""
    sparse = self.config.compress.name != "none"
    grads = [np.asarray(x) for x in jax.tree.leaves(grad)]
    stats = [np.asarray(x) for x in jax.tree.leaves(model_state)]
    bodies = [self.layout.pack_push(s, grads, stats, sparse) for s in range(self.layout.num_shards)]
    self.seq += 1
    header = {"mesh": self.w, "instance": self.instance, "session": self.session,
              "seq": self.seq, "iteration": job["iteration"], "loss": float(loss),
              "bytes": int(nbytes) + self.stats_bytes,
              "wire_bytes": sum(wire.body_bytes(body) for body, _ in bodies),
              "nnz": [nnz for _, nnz in bodies]}
    if not (np.isfinite(loss) and layout_lib.all_finite(grads + stats)):
      return self.server.call("Push", {**header, "nonfinite": "the mesh computed a non-finite "
                                       "loss or gradient"})
    try:   # the digests of the slices (SHA-256, which receipts name) while they upload
      digests, *receipts = self._calls.run([
          lambda: [wire.digest(body) for body, _ in bodies[1:]]] + [
              lambda s=s: self.shards[s - 1].call(
                  "PutGrad", {"mesh": self.w, "session": self.session, "seq": self.seq,
                              "nnz": bodies[s][1]}, bodies[s][0])[0]["receipt"]
              for s in range(1, self.layout.num_shards)])
    except wire.CallError as e:
      if e.code != grpc.StatusCode.FAILED_PRECONDITION:   # an old session: rejoin below
        raise
      return {"rejoin": True}, None
    return self.server.call("Push", {**header, "receipts": receipts, "digests": digests},
                            bodies[0][0],
                            reply_limit=self._pull_limit(0), reply_parts=True)

  def _fetch_weights(self, job: dict, shard0) -> tuple:
    """Every rank's weights at the job's watermark: shard 0's (given, or pulled), the others'."""
    layout = self.layout
    calls = []
    if shard0 is None:
      calls.append(lambda: self.server.call("Pull", {"mesh": self.w, "session": job["session"],
                                                     "watermark": job["watermark"]},
                                            reply_limit=layout.pull_bytes(0),
                                            reply_parts=True)[1])
    calls += [lambda s=s: self.shards[s - 1].call(
        "Pull", {"mesh": self.w, "session": job["session"], "watermark": job["watermark"]},
        reply_limit=layout.pull_bytes(s), reply_parts=True)[1]
        for s in range(1, layout.num_shards)]
    bodies = self._calls.run(calls) if calls else []
    if shard0 is not None:
      bodies = [shard0] + bodies
    params, model_state = layout.assemble(bodies, self.treedefs)
    return params, model_state, sum(wire.body_bytes(b) for b in bodies)

  def _share(self, job: dict | None) -> dict:
    """Broadcasts rank 0's job (small: iteration, ratio, watermark, shards) to every rank."""
    if self.P == 1:
      return job
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    buf = np.zeros([CONTROL_BYTES], np.uint8)
    if self.rank == 0:
      data = msgpack.packb(job, use_bin_type=True)
      buf[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
      buf[4:4 + len(data)] = np.frombuffer(data, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    size = int(np.frombuffer(buf[:4].tobytes(), np.uint32)[0])
    job = msgpack.unpackb(buf[4:4 + size].tobytes(), raw=False)
    if self.rank > 0 and not job["stop"] and (
        self.layout is None or len(job["shards"]) + 1 != self.layout.num_shards):
      self._connect_shards(job["shards"])
    return job

  # -- the loop ---------------------------------------------------------------------------------

  def run(self) -> int:
    """Trains until the server says stop; returns the number of iterations pushed."""
    self.warm_up()
    self.server = _clients([self.server_address], self.credentials, self.config)[0]
    heart, shard0, job = None, None, None
    if self.rank == 0:
      job = self._accept(*self._join())
      shard0 = self._shard0
      heart = _Heartbeat(_clients([self.server_address], self.credentials, self.config)[0],
                         self.w, self.instance, self.config)
      heart.session = self.session
    logging.info("mesh %d rank %d/%d: joined %s", self.w, self.rank, self.P, self.server_address)
    compute, over = [], 0   # seconds of real compute per iteration; how many exceeded emulation
    try:
      while True:
        job = self._share(job)
        if job["stop"]:
          break
        params, model_state, pulled = self._fetch_weights(job, shard0 if self.rank == 0 else None)
        if self.emulate_links:
          time.sleep(self.links.pull_delay(None, self.w))
        started = time.perf_counter()
        loss, grad, new_ms, nbytes = self._compute(job, params, model_state)
        compute.append(time.perf_counter() - started)
        if self.emulate:
          wait = simulate.job_time(self.cluster, self.w, job["iteration"], job_steps(job)) - (
              time.perf_counter() - started)
          over += wait < 0
          time.sleep(max(0.0, wait))
        self.iterations += job_steps(job)   # data iterations (a local job's H_w)
        if self.rank == 0:
          job, shard0 = self._push_and_wait(heart, job, loss, grad, new_ms, nbytes)
    finally:
      if heart is not None:
        heart.close()
      for client in [self.server, *self.shards]:
        if client is not None:
          client.close()
      _log_compute(self.w, self.rank, compute, over if self.emulate else None)
    logging.info("mesh %d rank %d: stopped after %d iterations", self.w, self.rank,
                 self.iterations)
    return self.iterations

  def _push_and_wait(self, heart, job, loss, grad, model_state, nbytes):
    """Rank 0: pushes, waits for its release; rejoins when told to. Returns the next job."""
    if heart.error is not None:
      raise heart.error
    if heart.stop.is_set():   # a heartbeat said the run is over: no push, stop
      return {"stop": True}, None
    heart.progress_at = time.monotonic()
    self._push_bytes = int(nbytes) + self.stats_bytes
    if self.emulate_links:
      time.sleep(self.links.push_delay(None, self.w, job["iteration"]))
    heart.waiting = True
    header, body = self._request_push(job, loss, grad, model_state, nbytes)
    if header.get("rejoin"):
      logging.warning("mesh %d: the server asks it to rejoin (it was dropped, or the server "
                      "restarted); joining again", self.w)
      header, body = self._join()
    heart.waiting = False
    job = self._accept(header, body)
    heart.session = self.session
    heart.ensure_running()
    return job, self._shard0

  def warm_up(self) -> None:
    """Compiles the mesh's step before it joins, so the run's clock does not count compilation."""
    params, model_state = self.templates
    copy = lambda tree: jax.tree.map(lambda x: x.copy(), tree)   # the job donates its own
    comp_state, inner_state = copy(self.comp_state), copy(self._inner())
    self._compute({"iteration": 0, "ratio": 1.0, "flush": False, "steps": 1}, params,
                  model_state)
    # The warm-up's gradient is not pushed: the memory and the inner state are untouched.
    self.comp_state = comp_state
    self._set_inner(inner_state)

  def _inner(self):
    """This mesh's inner optimizer state (``()`` but for the local-update schemes)."""
    return self.device.inner()

  def _set_inner(self, inner_state) -> None:
    self.device.set_inner(inner_state)

  def _compute(self, job: dict, params, model_state):
    """The mesh's gradient at ``job`` (host arrays, the same on every rank)."""
    steps = job_steps(job)
    idx = simulate.job_indices(self.batches, self.w, job["iteration"], steps, self.local)
    return self.device.compute(job, idx, params, model_state, steps)


def job_steps(job: dict) -> int:
  """A job's inner steps ``H_w`` (1 but for the local-update schemes)."""
  return int(job.get("steps", 1))


def _log_compute(mesh: int, rank: int, compute: list[float], over: int | None) -> None:
  """Logs the real compute per iteration, so a run can check it stayed under the emulated time."""
  if not compute:
    return
  ms = 1e3 * np.asarray(compute)
  logging.info("mesh %d rank %d: compute per iteration median %.1f ms, p90 %.1f ms, max %.1f ms "
               "over %d iterations; %s exceeded the emulated time", mesh, rank, np.median(ms),
               np.percentile(ms, 90), ms.max(), ms.size, "n/a" if over is None else over)
