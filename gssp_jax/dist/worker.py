"""A mesh: one protocol worker of a real run, as an SPMD program over one or more processes.

Each process of a mesh holds its devices; the mesh's processes form one
``jax.distributed`` cluster of their own (one per mesh, so one mesh's crash or
shutdown never touches another). Inside the mesh training is synchronous data
parallelism: each process takes its slice of the worker's batch, and one
sharded ``jit`` gives every process the mean gradient (XLA's all-reduce; gloo
on CPUs, NCCL on GPUs). Rank 0 talks to the parameter server (``Join``,
``Push``, heartbeats) and broadcasts each reply to the other ranks.

A mesh computes exactly what the simulator's job computes for the same worker
and iteration (``sim/executor.make_job_fn``): the batch of
``sharding.worker_order``, the dropout key ``fold_in(fold_in(key, w), k)``,
the one-worker compressor with its own error-feedback memory, the gradient
clipped to ``optimizer.grad_clip`` before it. With a cluster
description (``cluster.*``) and ``dist.emulate_cluster``, each iteration is
stretched by sleeping to the cluster model's ``compute_time(w, k)``, and each
push is delayed by its link time, so a real run can be set against the
simulator on the same cluster.
"""

from __future__ import annotations

import threading
import time

from absl import logging
import grpc
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from gssp_jax import config as config_lib
from gssp_jax.data import sharding
from gssp_jax.dist import server as server_lib
from gssp_jax.dist import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import executor as sim_executor
from gssp_jax.sim import simulate
from gssp_jax.train import run as run_lib
from gssp_jax.train import step as step_lib
from gssp_jax.train import tasks


class Stop(Exception):
  """The server said the run is over."""


def make_mesh_step(loss_fn, compressor, mesh: Mesh, dense_bytes: int, *,
                   grad_clip: float = 0.0):
  """``(params, model_state, comp, batch, rng, ratio, flush) -> (loss, grad, ms, comp, bytes)``.

  One jitted SPMD program over ``mesh``: the batch is split over the ``data``
  axis, everything else replicated, so the gradient is the mean over the whole
  worker batch, as one device computing it would get (up to float summation
  order). That mean gradient (the protocol worker's) is clipped to global norm
  ``grad_clip`` (``optimizer.grad_clip``; 0 = off) before its compressor, as
  the simulator's job clips it; the server does not clip.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec("data"))
  step = sim_executor.make_worker_gradient(loss_fn, compressor, dense_bytes,   # the simulator's
                                           grad_clip=grad_clip)
  return jax.jit(step, in_shardings=(replicated, replicated, replicated, split, replicated,
                                     replicated, replicated),
                 out_shardings=replicated), replicated, split


class _Heartbeat:
  """Rank 0's heartbeat thread: beats while the mesh makes progress; notes a stop or a rejoin."""

  def __init__(self, address: str, mesh: int, config: ml_collections.ConfigDict):
    self.client = wire.Client(address, config.dist.retry_seconds)
    self.mesh, self.interval = mesh, max(0.05, config.dist.heartbeat_timeout / 4)
    self.hang_timeout = config.dist.hang_timeout
    self.session = ""
    self.progress_at = time.monotonic()   # the main loop's last sign of life
    self.waiting = False                  # the main loop waits for the server (not hung)
    self.stop = threading.Event()
    self.error: Exception | None = None
    self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
    self._thread.start()

  def _run(self):
    while not self.stop.wait(self.interval):
      if not self.waiting and time.monotonic() - self.progress_at > self.hang_timeout:
        logging.error("mesh %d: no progress for %.0f s (dist.hang_timeout); heartbeats stop so "
                      "the server drops this mesh", self.mesh, self.hang_timeout)
        return
      try:
        reply = self.client.call("Heartbeat", {"mesh": self.mesh, "session": self.session},
                                 timeout=self.interval * 4)
      except wire.ServerGone as e:   # unreachable for dist.retry_seconds: the mesh gives up
        self.error = e
        return
      except grpc.RpcError as e:     # a slow answer (a loaded host): beat again next interval
        logging.warning("mesh %d: heartbeat failed (%s); retrying", self.mesh, e.code())
        continue
      if reply.get("stop"):
        self.stop.set()

  def close(self):
    self.stop.set()
    self.client.close()


class MeshWorker:
  """One mesh's process (rank ``rank`` of ``num_processes``) of worker ``mesh``.

  Args:
    config: the run's config (the same as the server's but ``dist.*``).
    mesh: the protocol worker this mesh is, ``0..num_workers-1``.
    rank: this process's rank in the mesh; rank 0 talks to the server.
    num_processes: processes in the mesh (each holds its local devices).
    server_address: the parameter server's ``host:port``.
  """

  def __init__(self, config: ml_collections.ConfigDict, mesh: int, rank: int, num_processes: int,
               server_address: str):
    self.config, self.w, self.rank, self.P = config, int(mesh), int(rank), int(num_processes)
    self.server_address = server_address
    self.task = tasks.make_task(config)
    config_lib.validate_sizes(config, self.task.num_train)
    self.B = config.batch_size
    self.shards = sharding.worker_shards(self.task.num_train, config.num_workers, config.seed)
    self.spe = self.shards.shape[1] // self.B
    self.cluster = cluster_lib.cluster_from_config(config)
    self.emulate = config.dist.emulate_cluster and config_lib.cluster_is_set(config)
    init_rng, self.train_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    # One compiled init (eager init compiles each initializer: ~7 s for LeNet-5 here).
    params, model_state = jax.jit(self.task.init)(init_rng)
    self.treedefs = (jax.tree.structure(params), jax.tree.structure(model_state))
    self.templates = (params, model_state)
    self.stats_bytes = step_lib.tree_bytes(model_state)
    self.mesh = Mesh(np.array(jax.devices()), ("data",))
    compressor = run_lib.make_compressor(simulate.one_worker_config(config))
    self.step, self.replicated, self.split = make_mesh_step(
        self.task.loss, compressor, self.mesh, step_lib.tree_bytes(params),
        grad_clip=config.optimizer.grad_clip)
    self.comp_state = self._init_compressor(compressor, params)
    self._order = (-1, None)
    self.iterations = 0
    self.session = ""   # the server's, from its last reply (a restarted server has a new one)

  def _init_compressor(self, compressor, params):
    if compressor is None:
      return ()
    one = compressor.init(params)
    if hasattr(one, "rng"):   # per-worker keys, as the simulator's init_state folds them
      one = one._replace(rng=jax.random.key_data(jax.random.fold_in(
          jax.random.wrap_key_data(one.rng), self.w)))
    return self._global(one, self.replicated)

  def _global(self, tree, sharding_):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding_, np.asarray(x)),
                        tree)

  # -- talking to the server (rank 0) and to the mesh (all ranks) ----------------------------

  def _request(self, client, name: str, message: dict) -> dict:
    """Rank 0: one call; a ``rejoin`` answer is followed by a ``Join``."""
    reply = client.call(name, message)
    if reply.get("rejoin"):   # the push from a dropped mesh or an old session is not applied
      logging.warning("mesh %d: the server asks it to rejoin (it was dropped, or the server "
                      "restarted); joining again", self.w)
      reply = client.call("Join", self._join_message())
    if reply.get("error"):
      raise ValueError(reply["error"])
    self.session = reply.get("session", self.session)
    return reply

  def _join_message(self) -> dict:
    return {"mesh": self.w, "config": server_lib.config_id(self.config)}

  def _share(self, reply: dict | None) -> tuple[bool, dict]:
    """Broadcasts rank 0's reply to every rank of the mesh: ``(stop, job and weights)``."""
    params, model_state = self.templates
    if self.rank == 0:
      stop = bool(reply.get("stop"))
      job = None if stop else reply
      leaves = ([np.zeros_like(x) for x in jax.tree.leaves(params)] if stop
                else wire.unpack_leaves(reply["params"]))
      stats = ([np.zeros_like(x) for x in jax.tree.leaves(model_state)] if stop
               else wire.unpack_leaves(reply["model_state"]))
      ctrl = np.array([stop, 0 if stop else job["iteration"], 0 if stop else job["flush"]],
                      np.int64)
      ratio = np.float32(0.0 if stop else job["ratio"])
    else:
      leaves = [np.zeros_like(x) for x in jax.tree.leaves(params)]
      stats = [np.zeros_like(x) for x in jax.tree.leaves(model_state)]
      ctrl, ratio = np.zeros([3], np.int64), np.float32(0.0)
    if self.P > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      ctrl, ratio, leaves, stats = multihost_utils.broadcast_one_to_all(
          (ctrl, ratio, leaves, stats))
    job = {"iteration": int(ctrl[1]), "flush": bool(ctrl[2]), "ratio": float(ratio),
           "params": jax.tree.unflatten(self.treedefs[0], [np.asarray(x) for x in leaves]),
           "model_state": jax.tree.unflatten(self.treedefs[1], [np.asarray(x) for x in stats])}
    return bool(ctrl[0]), job

  # -- the loop ---------------------------------------------------------------------------------

  def run(self) -> int:
    """Trains until the server says stop; returns the number of iterations pushed."""
    self.warm_up()
    client = heart = None
    if self.rank == 0:
      client = wire.Client(self.server_address, self.config.dist.retry_seconds)
      reply = self._request(client, "Join", self._join_message())
      heart = _Heartbeat(self.server_address, self.w, self.config)
      heart.session = self.session
    else:
      reply = None
    logging.info("mesh %d rank %d/%d: joined %s", self.w, self.rank, self.P, self.server_address)
    compute, over = [], 0   # seconds of real compute per iteration; how many exceeded emulation
    try:
      while True:
        stop, job = self._share(reply)
        if stop:
          break
        started = time.perf_counter()
        loss, grad, model_state, nbytes = self._compute(job)
        compute.append(time.perf_counter() - started)
        if self.emulate:
          k = job["iteration"]
          wait = self.cluster.compute_time(self.w, k) - (time.perf_counter() - started)
          over += wait < 0
          time.sleep(max(0.0, wait))
        if self.rank == 0:
          if heart.error is not None:
            raise heart.error
          if heart.stop.is_set():   # a heartbeat said the run is over: no push, stop
            reply = {"stop": True}
            continue
          heart.progress_at = time.monotonic()
          message = self._push_message(job, loss, grad, model_state, nbytes)
          if self.emulate:
            time.sleep(self.cluster.link_time(self.w, message["bytes"]))
          heart.waiting = True
          reply = self._request(client, "Push", message)
          heart.waiting = False
          heart.progress_at = time.monotonic()
          heart.session = self.session
        self.iterations += 1
    finally:
      if heart is not None:
        heart.close()
      if client is not None:
        client.close()
      _log_compute(self.w, self.rank, compute, over if self.emulate else None)
    logging.info("mesh %d rank %d: stopped after %d iterations", self.w, self.rank,
                 self.iterations)
    return self.iterations

  def warm_up(self) -> None:
    """Compiles the mesh's step before it joins, so the run's clock does not count compilation."""
    params, model_state = self.templates
    comp_state = self.comp_state
    self._compute({"iteration": 0, "ratio": 1.0, "flush": False, "params": params,
                   "model_state": model_state})
    self.comp_state = comp_state   # the warm-up's gradient is not pushed: memory untouched

  def _compute(self, job: dict):
    """The mesh's gradient at ``job`` (replicated on every rank)."""
    k = job["iteration"]
    idx = self._batch_indices(k)
    per = self.B // self.P
    local = idx[self.rank * per:(self.rank + 1) * per]
    batch = jax.tree.map(lambda a: a[local], self.task.train)
    rng = jax.random.fold_in(jax.random.fold_in(self.train_rng, self.w), k)
    put = lambda tree: self._global(tree, self.replicated)
    loss, grad, model_state, self.comp_state, nbytes = self.step(
        put(job["params"]), put(job["model_state"]), self.comp_state,
        self._global(batch, self.split), put(rng), put(np.float32(job["ratio"])),
        put(np.bool_(job["flush"])))
    local_copy = lambda tree: jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
    return local_copy((loss, grad, model_state, nbytes))

  def _push_message(self, job, loss, grad, model_state, nbytes) -> dict:
    sparse = self.config.compress.name != "none"
    message = {"mesh": self.w, "session": self.session, "iteration": job["iteration"],
               "grad": wire.pack_leaves(jax.tree.leaves(grad), sparse=sparse),
               "model_state": wire.pack_leaves(jax.tree.leaves(model_state)),
               "loss": float(loss), "bytes": int(nbytes) + self.stats_bytes}
    message["wire_bytes"] = sum(np.asarray(v).nbytes for leaf in message["grad"]
                                + message["model_state"] for v in leaf.values()
                                if isinstance(v, np.ndarray))
    return message

  def _batch_indices(self, k: int) -> np.ndarray:
    epoch, pos = divmod(k, self.spe)
    if self._order[0] != epoch:
      self._order = (epoch, sharding.worker_order(self.shards, self.config.seed, self.w, epoch))
    return self._order[1][pos * self.B:(pos + 1) * self.B]


def _log_compute(mesh: int, rank: int, compute: list[float], over: int | None) -> None:
  """Logs the real compute per iteration, so a run can check it stayed under the emulated time."""
  if not compute:
    return
  ms = 1e3 * np.asarray(compute)
  logging.info("mesh %d rank %d: compute per iteration median %.1f ms, p90 %.1f ms, max %.1f ms "
               "over %d iterations; %s exceeded the emulated time", mesh, rank, np.median(ms),
               np.percentile(ms, 90), ms.max(), ms.size, "n/a" if over is None else over)

