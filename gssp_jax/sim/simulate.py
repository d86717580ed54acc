"""``Simulation``: the executor that trains any scheme on a simulated heterogeneous cluster.

``train/loop.py`` drives it (``config.executor`` ``rounds`` or ``levels``, or
``auto`` for anything but BSP without a cluster). The host runs the scheme's
protocol over the cluster model event by event (``sync.TimelineEngine``); every
round it produces, and the next job of every worker that pulls in it (its
gradient, on the weights it pulled), goes to the device runner:

* ``rounds``: buffered as ``executor.Step`` objects and run one device call per round
  and per set of jobs (the reference);
* ``levels``: planned into fixed-shape chunks of dependency pieces and run one
  compiled program per chunk (``sim/levels.py``), with nothing read back
  from the device and no eager operation between evaluations.

Virtual time is the engine's clock; nothing about it depends on wall time, so
the same config and seed give the same metrics bit for bit (but
``wall_time``), and a run resumed from a checkpoint (device state + the host
state, with what was planned but not run) continues exactly as an
uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gssp_jax import compress
from gssp_jax import sync
from gssp_jax.data import sharding
from gssp_jax.sim import chunk as chunk_lib
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import devices as devices_lib
from gssp_jax.sim import executor
from gssp_jax.sim import flat as flat_lib
from gssp_jax.sim import hosts
from gssp_jax.sim import levels
from gssp_jax.sim import book as book_lib
from gssp_jax.sim import records
from gssp_jax.sim import traffic as traffic_lib
from gssp_jax.sync import local as local_lib
from gssp_jax.base import interrupt
from gssp_jax.base import checkpoint as ckpt_lib
from gssp_jax import host_state as host_state_lib
from gssp_jax.base import optim
from gssp_jax.base import run as run_lib
from gssp_jax.base import step as step_lib
from gssp_jax.base import workdir as workdir_lib


RUNNERS = ("rounds", "levels")   # the simulator's device runners (config.executor values)


class Ratios:
  """Per-worker keep-ratio of each iteration (GDTopK: by group speed class and worker epoch)."""

  def __init__(self, config, scheme, speeds, steps_per_epoch):
    self.name = config.compress.name
    self.ratio = float(config.compress.ratio)
    self.spe = steps_per_epoch
    self.set_groups(scheme.groups, speeds)

  def set_groups(self, groups: np.ndarray, times: np.ndarray) -> None:
    """The workers' groups, and for GDTopK the groups' speed ranks from ``times``."""
    self.groups = np.asarray(groups)
    if self.name == "gdtopk":
      self.ranks = sync.grouping.group_speed_rank(self.groups, times)

  def __call__(self, worker: int, iteration: int) -> float:
    if self.name != "gdtopk":
      return self.ratio
    epoch = iteration // self.spe + 1
    ratios = compress.gdtopk_group_ratios(epoch, self.ranks)
    return float(ratios[self.groups[worker]])

  def flush(self, worker: int, iteration: int) -> bool:
    """GDTopK: the last iteration of a worker's epoch sends everything and clears its residual."""
    del worker
    return self.name == "gdtopk" and iteration % self.spe == self.spe - 1

  def of(self, pairs: list) -> np.ndarray:
    """``[n]`` float32 keep-ratios of the jobs ``(worker, iteration)`` in ``pairs``."""
    if self.name != "gdtopk":
      return np.full([len(pairs)], self.ratio, np.float32)
    return np.array([self(w, k) for w, k in pairs], np.float32)

  def flushes(self, pairs: list) -> np.ndarray:
    """``[n]`` bool: which of the jobs in ``pairs`` flush (:meth:`flush`)."""
    if self.name != "gdtopk":
      return np.zeros([len(pairs)], bool)
    return np.array([self.flush(w, k) for w, k in pairs], bool)


def _calibrate(job_fn, state, arrays, batch_size, local=None) -> float:
  """Seconds of one worker's iteration on this machine (best of 5, after compilation).

  A local-update job is timed with one inner step (the rest skipped).
  """
  shape = [1, batch_size] if local is None else [1, local.max_steps, batch_size]
  args = (np.zeros([1], np.int32), np.zeros(shape, np.int32), np.zeros([1], np.int32),
          np.ones([1], np.float32), np.zeros([1], bool),
          None if local is None else np.ones([1], np.int32))
  state = job_fn(state, arrays, *args)
  jax.block_until_ready(state)
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    state = job_fn(state, arrays, *args)
    jax.block_until_ready(state)
    best = min(best, time.perf_counter() - start)
  return best


# Rounds the per-round runner buffers before the device runs them; a flush also happens before
# anything reads the device state (an evaluation, a checkpoint, DGC's byte counts).
MAX_BUFFERED_ROUNDS = 256
# Rounds whose accounting waits for the next evaluation, at most (they are held in memory).
MAX_UNACCOUNTED_ROUNDS = 4096


class _StepFeed:
  """The per-round runner's buffer of ``executor.Step`` objects (``levels.LevelRunner``'s API).

  ``make_jobs``: ``(workers, job numbers) -> executor.Jobs``.
  """

  def __init__(self, run_steps, make_jobs):
    self.run_steps, self.make_jobs = run_steps, make_jobs
    self.steps: list[executor.Step] = []

  def add(self, rnd, learning_rate: float, workers: np.ndarray, ks: np.ndarray) -> None:
    """Round ``rnd`` (None: no round) at ``learning_rate``, then job ``ks[i]`` of each of
    ``workers`` (those it released)."""
    args = None
    if rnd is not None:
      args = sync.round_args(rnd)
      args["learning_rate"] = np.float32(learning_rate)
    self.steps.append(executor.Step(args, self.make_jobs(workers, ks) if workers.size else None))

  def run_ready(self, state, arrays):
    if len(self.steps) < MAX_BUFFERED_ROUNDS:
      return state
    state = self.flush(state, arrays)
    jax.block_until_ready(state.loss_sum)   # keep the dispatch queue short
    return state

  def flush(self, state, arrays, *, jobs: bool = False):
    del jobs   # every job runs with its step
    if self.steps:
      state = self.run_steps(state, arrays, self.steps)
      self.steps = []
    return state

  def state_dict(self) -> dict:
    return {"steps": self.steps}

  def load_state_dict(self, state: dict) -> None:
    self.steps = [_with_adopt_weight(step) for step in state.get("steps", [])]


def flat_view(config: ml_collections.ConfigDict, layout: flat_lib.Layout):
  """How the replicas' optimizer steps flat weights: as they are for an elementwise rule
  (``flat.ELEMENTWISE_OPTIMIZERS``), else through the model's pytree (``flat.on_tree``)."""
  name = local_lib.outer_config(config).name
  if name in flat_lib.ELEMENTWISE_OPTIMIZERS:
    return None
  return lambda inner: flat_lib.on_tree(inner, layout)


class PushPlan(NamedTuple):
  """A run's length in data iterations, shared by every executor.

  One push is one data iteration (one worker's gradient) for every scheme but
  the local-update ones, whose push carries its job's ``H_w`` iterations; the
  simulator counts those (``Simulation._iterations``), the rest count pushes.
  """
  shards: np.ndarray   # [W, shard size]: each worker's example ids
  spe: int             # iterations per worker per epoch
  total_pushes: int    # train.num_epochs of every worker's iterations (at least one round)
  eval_pushes: int     # pushes between evaluations (train.eval_every epochs, whole rounds)
  end_pushes: int      # where this run stops: total_pushes or train.stop_after_updates


def plan_pushes(config: ml_collections.ConfigDict, num_train: int) -> PushPlan:
  """The :class:`PushPlan` of ``config`` on a training set of ``num_train`` examples."""
  W, B = config.num_workers, config.batch_size
  shards = sharding.worker_shards(num_train, W, config.seed)
  spe = shards.shape[1] // B
  total_pushes = max(W, round(config.train.num_epochs * spe) * W)
  eval_pushes = max(1, round(config.train.eval_every * spe)) * W
  stop = config.train.stop_after_updates
  return PushPlan(shards, spe, total_pushes, eval_pushes,
                  min(total_pushes, stop) if stop else total_pushes)


def at_end(iterations: int, pushes: int, total_pushes: int, stop_after: int) -> bool:
  """Whether a run is over: its epochs' data iterations are done, or it made
  ``train.stop_after_updates`` pushes (``stop_after``; 0: no such limit). The
  simulator and the real runtime (``runtime/server.py``) both end here."""
  return iterations >= total_pushes or bool(stop_after and pushes >= stop_after)


def learning_rates(config: ml_collections.ConfigDict, steps_per_epoch: int, total_pushes: int):
  """The outer learning rates of ``config``, for the simulator and the real runtime alike:
  ``optim.VirtualTimeSchedule`` under ``train.virtual_budget``, else the epochs' table
  (``optim.LearningRateTable``). ``book.round_learning_rate`` reads a round's rate from it."""
  outer, budget = local_lib.outer_config(config), config.train.get("virtual_budget", 0.0)
  if budget:
    return optim.VirtualTimeSchedule(outer, budget)
  return optim.learning_rate_table(outer, steps_per_epoch,
                                   round(total_pushes / config.num_workers))


def local_plan(config: ml_collections.ConfigDict, times, steps_per_epoch: int
               ) -> tuple[np.ndarray, executor.LocalJob | None]:
  """``([W] inner steps per job, LocalJob)`` of a local-update scheme; ``(ones, None)`` else.

  ``times``: the workers' mean iteration times (``Cluster.mean_times``; DyLU reads them).
  The simulator, the real runtime's server and its meshes all build it here.
  """
  if not local_lib.is_local(config.sync.scheme):
    return np.ones([config.num_workers], np.int64), None
  steps = local_lib.local_steps(config.local.steps, times, config.local.dylu)
  inner = optim.inner_optimizer(config, steps_per_epoch,
                                round(config.train.num_epochs * steps_per_epoch))
  return steps, executor.LocalJob(inner, int(steps.max()))


def job_indices(batches: sharding.WorkerBatches, w: int, k: int, h: int,
                local: executor.LocalJob | None) -> np.ndarray:
  """Worker ``w``'s job ``k``: its batch ``[B]``; a local-update job of ``h`` steps, ``[H_max, B]``:
  data iterations ``k h .. k h + h - 1``, padded to ``H_max`` with the last (the job skips them)."""
  if local is None:
    return batches.indices(w, k)
  first = k * h
  rows = batches.span(w, first, h)   # [h, B]
  if h < local.max_steps:
    rows = np.concatenate([rows, np.repeat(rows[-1:], local.max_steps - h, 0)])
  return rows


def job_time(cluster: cluster_lib.Cluster, w: int, k: int, h: int) -> float:
  """Seconds of worker ``w``'s job ``k`` of ``h`` steps: its data iterations ``k h .. k h + h - 1``,
  each timed by the cluster model, so jitter and stragglers stay per iteration."""
  if h == 1:
    return cluster.compute_time(w, k)
  return float(sum(cluster.compute_span(w, k * h, h)))


def compress_time(config: ml_collections.ConfigDict) -> float:
  """Seconds a worker spends compressing one push: ``compress.compute_time`` (absent from a
  config recorded before it existed: 0)."""
  return float(config.compress.get("compute_time", 0.0))


def _refuse_abstract(sim, what: str) -> None:
  if sim.abstract:
    raise ValueError(f"this Simulation was built with abstract=True (shapes only, to compile): it "
                     f"cannot {what}; build it without abstract to {what}")


def written_executor(workdir: str) -> str | None:
  """The simulator executor (``rounds`` or ``levels``) that wrote the latest checkpoint in
  ``workdir``, or None where there is none (nor a directory)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  checkpointer = ckpt_lib.Checkpointer(directory)
  try:
    latest = checkpointer.latest_step()
    if latest is None:
      return None
    layout = checkpointer.restore_host(latest)["host"].get("layout", "tree")
  finally:
    checkpointer.close()
  return _executor_of_layout(layout)


def _executor_of_layout(layout: str) -> str:
  """The executor that writes a checkpoint's ``layout`` (``flat``: levels; ``tree``: rounds)."""
  return "levels" if layout == "flat" else "rounds"


class Simulation:
  """Any scheme on the simulated cluster: the host's timeline drives the device's rounds and jobs.

  An executor of ``train/loop.py`` (see ``executors.Executor``). The
  host runs the protocol over the cluster model; each protocol event's rounds
  and the jobs they release go to the device runner: the per-round reference
  (``runner='rounds'``: ``executor.Step`` objects, one call per round and job set)
  or the level-batched one (``runner='levels'``: ``levels.LevelRunner``, one
  compiled program per chunk of many dependency pieces). Both give the same
  state, to float tolerance; the host figures (timeline, staleness, bytes)
  are the same code and the same numbers.
  """

  position_key = "pushes"

  def __init__(self, config: ml_collections.ConfigDict, task, workdir: str, *,
               runner: str = "rounds", abstract: bool = False):
    """``abstract``: the device state and the training arrays as shapes only (no device
    buffers, no calibration): a run to compile, not to run (:meth:`chunk_memory`)."""
    if runner not in RUNNERS:
      raise ValueError(f"runner={runner!r} is invalid; allowed: {', '.join(RUNNERS)}")
    self.config, self.task, self.workdir = config, task, workdir
    self.abstract = abstract
    self.metric_name, self.target = run_lib.metric_and_target(config, task)
    self._plan_pushes()
    self._build_model()
    self._build_state(runner)
    self._build_host()
    self._build_runner(runner)
    logging.info(run_header(config, self.cluster, self.scheme, self.calibrated))

  # -- building the run -----------------------------------------------------------------------

  def _plan_pushes(self) -> None:
    """Shards, iterations per epoch, and the run's end and evaluation points in pushes."""
    self.W, self.B = self.config.num_workers, self.config.batch_size
    plan = plan_pushes(self.config, self.task.num_train)
    self.shards, self.spe = plan.shards, plan.spe
    self.total_pushes, self.eval_pushes, self.end_pushes = (plan.total_pushes, plan.eval_pushes,
                                                            plan.end_pushes)
    self._stop_after = self.config.train.stop_after_updates
    # train.virtual_budget: virtual seconds (0: none); the run ends at it, the schedule follows it.
    self.budget = float(self.config.train.get("virtual_budget", 0.0))
    # train.eval_every_seconds: evaluations at every multiple of it in virtual time (0: none).
    self.eval_seconds = float(self.config.train.get("eval_every_seconds", 0.0))

  def _build_model(self) -> None:
    """The cluster, the scheme, the learning rates, the model's initial weights and sizes."""
    config = self.config
    self.cluster = cluster_lib.cluster_from_config(config)
    self.speeds = self.cluster.mean_times
    self.scheme = sync.scheme_from_config(config, worker_times=self.speeds)
    self.schedule = learning_rates(config, self.spe, self.total_pushes)
    # Inner steps per job (data iterations per push) and the local-update job (None for others).
    self.steps, self.local = local_plan(config, self.speeds, self.spe)
    self.compressor = run_lib.make_compressor(one_worker_config(config))   # None for "none"
    self.params, self.model_state, self.train_rng = run_lib.init_model(self.task, config.seed)
    self.sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(self.params)]
    self.dense_bytes = step_lib.tree_bytes(self.params)
    self.stats_bytes = step_lib.tree_bytes(self.model_state)
    self.pull_bytes = self.dense_bytes + self.stats_bytes
    self.ratio_of = Ratios(config, self.scheme, self.speeds, self.spe)
    # The replica evaluation serves: GSSP global's (HALoS's) global server; None: their mean.
    self.eval_replica = getattr(self.scheme.make_protocol(), "global_replica", None)

  def _build_state(self, runner: str) -> None:
    """The sync chain and the device state (flat buffers for ``levels``), in one jitted call.

    ``optimizer.grad_clip`` clips each worker's gradient in its job, before its
    compressor and before any server scales it: the sync chain's replicas do not clip.
    """
    config, task, W, R = self.config, self.task, self.W, self.scheme.num_replicas
    inner = self.local.inner if self.local else None
    self.layout = None
    self.mesh = None
    if runner == "levels":
      self.mesh = devices_lib.mesh_for(devices_lib.count(
          config.get("devices", 1), devices_lib.available(), hosts.processes()))
      self.layout = layout = flat_lib.make_layout(self.params, self.model_state)
      self.tx = optim.server_chain(config, self.scheme, inner_view=flat_view(config, layout))
      init = lambda p, m, rng: chunk_lib.init_state(layout, p, m, self.tx, self.compressor, W, R,
                                                    rng, inner=inner)
      served = lambda s: chunk_lib.served_weights(layout, s, self.eval_replica)
    else:
      self.tx = optim.server_chain(config, self.scheme)
      init = lambda p, m, rng: executor.init_state(p, m, self.tx, self.compressor, W, R, rng,
                                                   inner=inner)
      served = lambda s: executor.served_weights(s, self.eval_replica)
    self._served = served
    self.harvest = executor.make_harvest_fn(served, W)
    # One worker's job: the rounds runner's, and what calibration times under either runner.
    self.job_fn = executor.make_job_fn(task.loss, self.compressor, self.dense_bytes,
                                       self.stats_bytes, grad_clip=config.optimizer.grad_clip,
                                       local=self.local)
    self.calibrated = None
    if self.abstract:
      self.state = devices_lib.shaped_state(
          jax.eval_shape(init, self.params, self.model_state, self.train_rng), self.mesh, W)
      self.arrays = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), task.train)
      return
    self.state = devices_lib.place_state(
        jax.jit(init)(self.params, self.model_state, self.train_rng), self.mesh, W)
    self.arrays = devices_lib.place(task.train, self.mesh)
    if config.cluster.calibrate:
      # The per-round runner's state and arrays; on one device (the levels runner's are flat,
      # and may span processes). Across processes, process 0's time (sim/hosts.py).
      state, arrays = (self.state, self.arrays) if runner == "rounds" else (executor.init_state(
          self.params, self.model_state, optim.server_chain(config, self.scheme),
          self.compressor, W, R, self.train_rng, inner=inner), task.train)
      self.calibrated = hosts.agree_value(_calibrate(
          self.job_fn, jax.tree.map(jnp.copy, state), arrays, self.B, self.local))
      self.cluster = cluster_lib.cluster_from_config(config, base_time=self.calibrated)
      logging.info("calibrated base_time: %.4f s per iteration of %d samples", self.calibrated,
                   self.B)

  def _build_host(self) -> None:
    """The links, the timeline engine, the staleness accounting, the host counters, checkpoints."""
    config, W, scheme = self.config, self.W, self.scheme
    self._sent_job = np.full([W], -1, np.int64)
    self._sent_counts = np.zeros([W], np.int64)   # DGC: job_bytes as last read
    self._unaccounted: list = []                  # rounds not yet accounted (_account)
    self._sparse_bytes: dict = {}                 # top-k and GDTopK: bytes of a push by ratio
    self.links = links = self._traffic(self._push_payload)
    self._counts_per_round = links.counts_per_round   # read at every round
    self.engine = links.engine(scheme.make_protocol(), self._compute_time)
    self.book = book_lib.HostBook(
        num_workers=W, num_replicas=scheme.num_replicas,
        aggregating=self.engine.protocol.aggregating, steps=self.steps,
        local=self.local is not None, schedule=self.schedule, budget=self.budget,
        eval_pushes=self.eval_pushes, next_epoch_end=W * self.spe,
        time_evals=0,   # evaluations at multiples of train.eval_every_seconds
        layout="tree", groups=[scheme.groups.tolist()])
    # Across processes only process 0 keeps checkpoints (sim/hosts.py).
    self.checkpointer = None if jax.process_index() else ckpt_lib.Checkpointer(
        os.path.join(self.workdir, "checkpoints"), config.train.max_checkpoints)
    self.batches = sharding.WorkerBatches(self.shards, config.seed, self.B)
    self._session_start = time.perf_counter()
    self._eta = workdir_lib.Eta(0)
    self._wall_base = 0.0

  def _build_runner(self, runner: str) -> None:
    """The device runner: the per-round one, or the level runner sized by a dry run."""
    if runner == "rounds":
      self.feed = _StepFeed(executor.make_round_runner(
          self.job_fn, executor.make_round_fn(self.tx),
          executor.MAX_JOBS if self.local is None else executor.MAX_LOCAL_JOBS), self._make_jobs)
      return
    self.book.host["layout"] = "flat"
    self._make_level_feed(self._level_shape(padding_costs=self._job_batch() == 1))

  def _job_batch(self) -> int:
    return levels.job_batch_for(self.config.get("level_job_batch", 0), jax.default_backend())

  def _level_shape(self, padding_costs: bool) -> chunk_lib.Shape:
    """The level runner's chunk shape, sized by a dry run of the opening
    (``levels.choose_shape``; ``padding_costs``: its job slots sized for a CPU's)."""
    config, W, scheme = self.config, self.W, self.scheme
    protocol = scheme.make_protocol()
    rounds, rounds_per_push = self._opening()
    unroll = levels.unrolled_for(jax.default_backend())
    shape = levels.choose_shape(
        rounds, np.arange(W), num_workers=W, num_replicas=scheme.num_replicas,
        bounds=protocol.round_bounds(), job_slots=config.get("level_job_slots", 0),
        pieces=config.get("levels_per_call", 0),
        rounds_per_evaluation=rounds_per_push * self.eval_pushes,
        default_pieces=levels.UNROLLED_PIECES if unroll else levels.DEFAULT_PIECES,
        padding_costs=padding_costs, devices=1 if self.mesh is None else self.mesh.size)
    if config.compress.name == "dgc":   # its push times read the device: one piece per call
      shape = shape._replace(pieces=1)
    return shape

  def _make_level_feed(self, shape: chunk_lib.Shape) -> None:
    """``self.feed``: a level runner of ``shape`` (its job slots checked against the devices)."""
    config, scheme = self.config, self.scheme
    protocol = scheme.make_protocol()
    if self.mesh is not None:
      devices_lib.check_slots(self.mesh.size, shape.jobs)
    job_batch, unroll = self._job_batch(), levels.unrolled_for(jax.default_backend())
    job_shape = (self.B,) if self.local is None else (self.local.max_steps, self.B)
    self.feed = levels.LevelRunner(
        layout=self.layout, loss_fn=self.task.loss, compressor=self.compressor, tx=self.tx,
        dense_bytes=self.dense_bytes, stats_bytes=self.stats_bytes, num_workers=self.W,
        num_replicas=scheme.num_replicas, num_groups=protocol.num_groups, shape=shape,
        job_shape=job_shape, route=protocol.route, grad_clip=config.optimizer.grad_clip,
        local=self.local, make_jobs=self._make_jobs, round_fields=protocol.round_fields,
        one_exchange=protocol.one_exchange_per_round, job_batch=job_batch,
        unroll_pieces=unroll, mesh=self.mesh,
        state_sharding=devices_lib.state_shardings(self.state, self.mesh, self.W))
    logging.info("levels executor: %s", levels.describe(shape, job_batch, unroll))
    if self.mesh is not None:
      logging.info("devices: %d; the workers' own buffers %s", self.mesh.size,
                   f"split by owner, {self.W // self.mesh.size} workers a device"
                   if devices_lib.splits_owned(self.mesh, self.W) else
                   f"whole on every device ({self.W} workers: not a multiple of "
                   f"{self.mesh.size}, or several processes)")

  def _resume_shape(self, feed_state: dict) -> None:
    """Keeps the slots a checkpoint's pieces were planned with (its noted jobs and rounds fill
    them): a resumed run whose rule now picks others (another device count or backend, or a
    checkpoint from before the job slots were sized by the opening) rebuilds its level runner
    with the saved ones; only the pieces per call follow the config (``levels_per_call``)."""
    saved = feed_state.get("shape")
    saved = (chunk_lib.Shape(*saved) if saved is not None
             else self._level_shape(padding_costs=False))   # the rule such checkpoints had
    current = self.feed.shape
    saved = saved._replace(pieces=current.pieces)
    if saved != current:
      logging.info("the checkpoint's pieces were planned with other slots (%s); keeping them",
                   levels.describe(saved))
      self._make_level_feed(saved)

  def _traffic(self, push_payload) -> traffic_lib.Traffic:
    """The run's ``traffic.Traffic`` with pushes of ``push_payload(worker, iteration)`` bytes."""
    cfg = self.config.cluster
    return traffic_lib.Traffic(self.scheme.legs, self.cluster, push_payload,
                               self.dense_bytes + self.stats_bytes, self.pull_bytes,
                               shared=bool(cfg.shared_server_links),
                               capacity=cfg.get("server_capacity", "each"),
                               compress_time=compress_time(self.config))

  def _opening(self) -> tuple[list, float]:
    """The rounds of the run's first pushes from a fresh timeline (dense pushes), and rounds
    per push: what ``levels.choose_shape`` sizes the pieces by. Touches nothing of the run."""
    traffic = self._traffic(lambda w, k: self.dense_bytes + self.stats_bytes)
    engine = traffic.engine(self.scheme.make_protocol(), self._compute_time)
    pushes = min(self.total_pushes, max(8 * self.W, 256))
    rounds = []
    while engine.num_pushes < pushes and engine.queue:
      rounds.extend(engine.step())
    return rounds, len(rounds) / max(engine.num_pushes, 1)

  def chunk_memory(self) -> dict[str, int]:
    """The ``levels`` runner's chunk program's device memory (:func:`levels.chunk_memory`),
    compiled, not run: on an abstract run (``abstract=True``) nothing is allocated."""
    if not isinstance(self.feed, levels.LevelRunner):
      raise ValueError("chunk_memory needs the levels runner; this run uses 'rounds'")
    return levels.chunk_memory(self.feed, self.state, self.arrays)

  def served_weights(self, state=None):
    """``(params, model_state)`` the run evaluates and would deploy, as the model's pytrees
    (either executor's layout): of ``state`` (a restored checkpoint's), else the run's own."""
    return self._served(self.state if state is None else state)

  # -- the executor interface -----------------------------------------------------------------

  def _read_checkpoint(self) -> tuple[int, dict, Any] | None:
    """The latest checkpoint's step, host state and device state (host values), or None.

    Across processes, process 0's (the one that keeps checkpoints), sent to every process
    (``sim/hosts.py``); it alone reads the files and raises on a bad one.
    """
    found = None
    if self.checkpointer is not None:
      latest = self.checkpointer.latest_step()
      if latest is not None:
        saved = self.checkpointer.restore_host(latest)   # first: it refuses an older format
        self._check_layout(saved["host"].get("layout", "tree"), latest)
        found = latest, saved, self.checkpointer.restore(latest, self.state)[0]
    if hosts.processes() == 1:
      return found
    template = jax.eval_shape(lambda s: s, self.state)
    head = hosts.share_bytes(None if found is None else json.dumps(
        [found[0], host_state_lib.encode(found[1])]).encode())
    if head is None:
      return None
    latest, saved = json.loads(head)
    state = hosts.tree_from_bytes(hosts.share_bytes(
        None if found is None else hosts.tree_bytes(found[2])), template)
    return latest, host_state_lib.decode(saved, f"process 0's checkpoint at {latest}"), state

  def _check_layout(self, layout: str, latest: int) -> None:
    """Raises ValueError unless a checkpoint's ``layout`` is this run's executor's."""
    if layout != self.book.host["layout"]:
      written = _executor_of_layout(layout)
      raise ValueError(
          f"the checkpoint at {latest} pushes in {self.checkpointer.directory} was written by "
          f"the {written!r} executor, and this run uses the other one (config.executor="
          f"{self.config.executor!r}, backend {jax.default_backend()}); allowed: resume it with"
          f" --config.executor={written}")

  def restore(self) -> int:
    _refuse_abstract(self, "run")
    found = self._read_checkpoint()
    if found is not None:
      latest, saved, state = found
      layout = saved["host"].get("layout", "tree")
      self.state = devices_lib.place_state(state, self.mesh, self.W)
      self.engine.load_state_dict(saved["engine"])
      self.book.load(records.upgrade_counters({"iterations": 0, **saved["host"]}, self.links),
                     saved["acct"])
      # What was planned but not run (a checkpoint from before the feed: its steps).
      feed_state = saved.get("feed", {"steps": saved.get("steps", [])})
      if layout == "flat":
        self._resume_shape(feed_state)
      self.feed.load_state_dict(feed_state)
      logging.info("resumed from the checkpoint at %d pushes", latest)
    if "ratio_groups" in self.book.host:   # resumed after a regrouping
      self.ratio_of.groups, self.ratio_of.ranks = self.book.host["ratio_groups"]
    if self.engine.num_pushes == 0 and self.book.host["jobs"].sum() == 0:
      first = np.arange(self.W)
      self.feed.add(None, 0.0, first, self._dispatch(first))
    self._session_start = time.perf_counter()
    self._wall_base = self.book.host["wall_time"]
    self._eta = workdir_lib.Eta(self._work(), (self._work(), self._wall_base))
    return int(self.engine.num_pushes)

  @property
  def position(self) -> int:
    return int(self.engine.num_pushes)

  def finished(self) -> bool:   # train.stop_after_updates counts pushes for every scheme
    return (at_end(self._iterations(), self.engine.num_pushes, self.total_pushes,
                   self._stop_after) or self._budget_spent())

  def completed(self) -> bool:
    return self._iterations() >= self.total_pushes or self._budget_spent()

  def _budget_spent(self) -> bool:
    """Whether the run reached ``train.virtual_budget``: its next event is at or past it (every
    event before it has run; none at or after it runs)."""
    return bool(self.budget) and self.engine.next_time() >= self.budget

  def advance(self) -> bool:
    _refuse_abstract(self, "run")
    host, apply_round, iterations = self.book.host, self._apply_round, self._iterations
    next_eval_time = self._next_eval_time()
    while not self.finished():
      for rnd in self._next_rounds(min(self.budget or math.inf, next_eval_time)):
        apply_round(rnd)
      done = iterations()
      if done >= host["next_epoch_end"]:
        while host["next_epoch_end"] <= done:
          host["next_epoch_end"] += self.W * self.spe
        measured = self.engine.measured_times()
        if self.config.sync.regroup_every_epoch and not self.finished():
          self._regroup(measured)
      if self._budget_spent():
        self.engine.wait_until(self.budget)   # the final evaluation is stamped at the budget
        return True
      if self.engine.next_time() >= next_eval_time:
        self.engine.wait_until(next_eval_time)   # stamped there: every event before it ran
        return True
      if done >= host["next_eval"] or done >= self.total_pushes:
        return True
      if interrupt.requested() and hosts.processes() == 1:
        # Between events: host and planned device steps are consistent. Across processes a
        # signal waits for the evaluation, where all agree (sim/hosts.py, train/loop.py).
        return False
    return False

  def _next_rounds(self, limit: float) -> list:
    """Runs the events up to the next that pushes or emits rounds (only those change what
    :meth:`advance` checks), none at or past ``limit`` (virtual seconds: the budget or the
    next evaluation time); returns their rounds."""
    engine, pushes, rounds = self.engine, self.engine.num_pushes, []
    # An empty queue steps too: the engine names the deadlock.
    while (not rounds and engine.num_pushes == pushes
           and (engine.next_time() < limit or not engine.queue)):
      rounds = engine.step()
    return rounds

  def evaluate(self) -> dict[str, Any]:
    _refuse_abstract(self, "evaluate")
    self._flush()
    self._account()
    engine, host, W = self.engine, self.book.host, self.W
    # One call: the counters since the last evaluation (zeroed on the device) and the weights.
    self.state, counters, params_eval, ms_eval = self.harvest(self.state)
    loss_sum, loss_count, pushed = jax.device_get(counters)
    records.check_finite_loss(loss_sum, pushes=engine.num_pushes,
                              learning_rate=self.config.optimizer.learning_rate,
                              when=f" (virtual time {engine.now:.1f} s)")
    if self.links.counts_device_pushes:   # else the legs count them (InHAD's, CASP's: sync.legs)
      host["pushed_per_worker"] += executor.push_bytes_total(pushed)
    blocked = engine.blocked_time_so_far()
    # Across processes each evaluates its own copy alone (the same weights: sim/hosts.py).
    results = self.task.evaluate(*devices_lib.local((params_eval, ms_eval)))
    record = records.evaluation_record(
        pushes=engine.num_pushes, num_workers=W, spe=self.spe, updates=host["updates"],
        virtual_time=engine.now, wall_time=self._wall_time(), loss_sum=loss_sum,
        loss_count=loss_count, results=results, host=host, pull_bytes=self.pull_bytes,
        blocked=blocked, acct=self.book.acct, iterations=self._iterations())
    self.book.evaluated(self._iterations())
    while self._next_eval_time() <= engine.now:
      host["time_evals"] += 1
    return record

  @property
  def evaluations(self) -> int:
    return self.book.host["num_evals"]

  def progress(self, record: dict[str, Any]) -> str:
    end = self.end_pushes if self.local is None else self.total_pushes
    # A local round may pass the end; a budget's end is virtual seconds.
    eta = self._eta.seconds_left(self._work(), self.budget or end)
    return (f"{self.scheme.name} epoch {record['epoch']:.2f} | virtual"
            f" {record['virtual_time']:.1f} s | loss {record['train_loss']:.4f} |"
            f" {run_lib.metrics_text(record, self.metric_name)} | blocked"
            f" {record['blocked_time']:.1f} s | staleness mean {record['staleness']['mean']:.2f}"
            f" updates | ETA {workdir_lib.format_duration(eta)}")

  def save(self) -> None:
    # What is planned but not run is saved with the host state, not run: a run's flush points
    # (evaluations, DGC's reads, full chunks) then do not depend on where a session stopped,
    # so the levels runner, whose float sums depend on how jobs are grouped into pieces,
    # resumes bit for bit too.
    self._account()
    step, host = self.engine.num_pushes, self.book.host
    host["wall_time"] = self._wall_time()
    # Orbax writes the host copy in the background, overlapping the simulation (a 16-worker
    # ResNet-18 state is about 2 GB); the next save and close() wait for it. A step is
    # complete or absent, and a resume truncates the metrics to the step it finds.
    if self.checkpointer is None:   # another process than 0 (sim/hosts.py)
      return
    self.checkpointer.save(step, self.state, {"pushes": step}, host={
        "engine": self.engine.state_dict(), "acct": self.book.acct.state_dict(), "host": host,
        "feed": self.feed.state_dict()})

  def close(self) -> None:
    if self.checkpointer is not None:
      self.checkpointer.close()

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    self._account()
    engine, host = self.engine, self.book.host
    fields = records.summary_fields(
        history=history, reached=reached, metric=self.metric_name, target=self.target,
        scheme=self.scheme, groups=host["groups"][-1],
        cluster={**self.cluster.describe(), "calibrated_base_time": self.calibrated,
                 **self._servers()},
        pushes=engine.num_pushes, batch_size=self.B, virtual_time=engine.now,
        wall_time=self._wall_time(), host=host, pull_bytes=self.pull_bytes,
        blocked=engine.blocked_time_so_far(), acct=self.book.acct, iterations=self._iterations())
    self.book.scheme_fields(fields["scheme"])
    fields["scheme"]["groups_history"] = host["groups"]
    # train.virtual_budget: the budget and where the run ended (the totals' virtual_time too).
    fields["virtual_budget"] = ({"seconds": self.budget, "ended_at": float(engine.now),
                                 "reached": self._budget_spent()} if self.budget else None)
    return fields

  def _servers(self) -> dict[str, Any]:
    """``summary.json``'s word on the servers: how many interfaces the pushes cross, each one's
    bytes/s (``cluster.server_capacity``), and whether transfers share them."""
    protocol = self.engine.protocol
    return {"servers": self.links.legs.servers(protocol),
            "server_interface_bandwidth": self.links.interface_bandwidth(protocol),
            "shared_server_links": bool(self.config.cluster.shared_server_links)}

  # -- the steps of a round -------------------------------------------------------------------

  def _apply_round(self, rnd) -> None:
    """Host bookkeeping of one round, and its device step (the round, then the pulled jobs).

    Its accounting (staleness, updates, bytes) waits, with the rounds before it,
    for the next evaluation or checkpoint (:meth:`_account`, vectorised), unless
    its traffic depends on the protocol's state now (InHAD, CASP).
    """
    engine = self.engine
    learning_rate = self.book.round_rate(rnd, engine.num_pushes)
    if self._counts_per_round:
      self.links.count_round(engine.protocol, rnd, engine.iteration, self.book.host)
    self._unaccounted.append(rnd)
    if len(self._unaccounted) >= MAX_UNACCOUNTED_ROUNDS:
      self._account()
    # Before the pulled workers' next jobs: DGC's count reads the arrived jobs' bytes.
    pulled = rnd.pulls.nonzero()[0]
    self.feed.add(rnd, learning_rate, pulled, self._dispatch(pulled) if pulled.size else pulled)
    self.state = self.feed.run_ready(self.state, self.arrays)

  def _next_eval_time(self) -> float:
    """The virtual time of the next evaluation by ``train.eval_every_seconds`` (``inf``: none);
    a multiple of it, never a running sum (no drift)."""
    if not self.eval_seconds:
      return math.inf
    return (self.book.host.get("time_evals", 0) + 1) * self.eval_seconds

  def _work(self) -> float:
    """What the ETA counts: virtual seconds under a budget, else data iterations."""
    return self.engine.now if self.budget else self._iterations()

  def _account(self) -> None:
    """Accounts for the rounds since the last call (``records.account_rounds``)."""
    records.account_rounds(self._unaccounted, host=self.book.host, acct=self.book.acct,
                           protocol=self.engine.protocol, links=self.links,
                           pull_bytes=self.pull_bytes)
    self._unaccounted = []

  def flush_host(self) -> None:
    """Accounts for every round and dispatches every planned row (what an evaluation does
    first); the host's share of an evaluation, for ``benchmarks/sim_overhead.py``."""
    self._flush()
    self._account()

  def _flush(self, jobs: bool = False) -> None:
    """Runs everything planned on the device, in order (before anything reads its state).

    ``jobs``: the jobs not yet needed run too (``levels``; ``rounds`` runs them at once).
    """
    self.state = self.feed.flush(self.state, self.arrays, jobs=jobs)

  def _dispatch(self, workers: np.ndarray) -> np.ndarray:
    """The numbers of the next jobs of ``workers`` (they just pulled); counts them as dispatched."""
    return self.book.take_jobs(workers)

  def _make_jobs(self, workers: np.ndarray, ks: np.ndarray) -> executor.Jobs:
    """Job ``ks[i]`` of each of ``workers``: its batch, first iteration, keep-ratio, flush."""
    workers = np.asarray(workers, np.int64)
    pairs = list(zip(workers.tolist(), np.asarray(ks).tolist()))
    # Job k of worker w: its data iterations k H_w .. k H_w + H_w - 1 (H_w = 1 but for the
    # local-update schemes, whose jobs are padded to H_max with the last, skipped by the job).
    steps = self.steps[workers]
    if self.local is None:
      idx = self.batches.indices_many(workers, ks).astype(np.int32, copy=False)
    else:
      idx = np.array([job_indices(self.batches, w, k, h, self.local)
                      for (w, k), h in zip(pairs, steps.tolist())], np.int32)
    return executor.Jobs(
        workers=workers.astype(np.int32), idx=idx, iters=(ks * steps).astype(np.int32),
        ratios=self.ratio_of.of(pairs), flushes=self.ratio_of.flushes(pairs),
        steps=None if self.local is None else steps.astype(np.int32))

  def _job_time(self, w: int, k: int) -> float:
    """Seconds of worker ``w``'s job ``k`` (:func:`job_time`)."""
    return job_time(self.cluster, w, k, int(self.steps[w]))

  @property
  def _compute_time(self):
    """The timeline's ``(worker, job) -> seconds``: :meth:`_job_time`, or the cluster's own
    where every job is one iteration (no indirection at every start)."""
    return self._job_time if self.local is not None else self.cluster.compute_time

  def _iterations(self) -> int:
    """Data iterations that reached a server so far (``book.iterations_done``)."""
    return self.book.iterations(self.engine.num_pushes)

  def _regroup(self, measured: np.ndarray) -> None:
    """GSSP: new groups from the speeds measured over the last epoch, at the next barrier."""
    config, engine = self.config, self.engine
    groups = sync.make_groups(config.sync.grouping, self.W, config.sync.num_groups, measured)
    if not np.array_equal(groups, engine.protocol.route):
      engine.protocol.request_regroup(groups)
      self.ratio_of.set_groups(groups, measured)
      self.book.host["groups"].append(groups.tolist())
      self.book.host["ratio_groups"] = (self.ratio_of.groups, getattr(self.ratio_of, "ranks", None))
      logging.info("regrouping at %d pushes: %s", engine.num_pushes, groups.tolist())

  def _sent_bytes(self, w: int, k: int) -> int:
    """The bytes worker ``w``'s job ``k`` actually pushes, read from the device (DGC only).

    DGC's count depends on the gradient (a sampled threshold), so unlike top-k
    and GDTopK it cannot be known from the ratio; a deterministic count would
    no longer be DGC. The engine times push ``(w, k)`` at the start of
    iteration ``k``, after job ``k`` was dispatched at the pull before it, so
    the worker's ``job_bytes`` slot holds it once the buffered steps ran. One
    read fetches every worker's slot, so the host waits for the device about
    once per round with pulls, not once per job.
    """
    if self._sent_job[w] != k:
      self._flush(jobs=True)
      self._sent_counts[:] = np.asarray(jax.device_get(self.state.job_bytes), np.int64)
      self._sent_job[:] = self.book.host["jobs"] - 1
      if self._sent_job[w] != k:
        raise RuntimeError(f"push ({w}, {k}) timed before its job was dispatched")
    return int(self._sent_counts[w])

  def _push_payload(self, w: int, k: int) -> int:
    """Bytes of push ``(w, k)``, equal to what its job adds to ``bytes_pushed``."""
    name = self.ratio_of.name   # config.compress.name
    if name == "none" or self.ratio_of.flush(w, k):
      return self.dense_bytes + self.stats_bytes
    if name == "dgc":
      return self._sent_bytes(w, k)   # the job's slot already includes stats_bytes
    ratio = self.ratio_of(w, k)
    sent = self._sparse_bytes.get(ratio)   # a few distinct ratios per run (GDTopK's classes)
    if sent is None:
      sent = self._sparse_bytes[ratio] = compress.expected_push_bytes(
          self.sizes, ratio, scope=self.config.compress.scope) + self.stats_bytes
    return sent

  def _wall_time(self) -> float:
    return self._wall_base + time.perf_counter() - self._session_start


def _with_adopt_weight(step: executor.Step) -> executor.Step:
  """A step saved before ``Round.adopt_weight`` existed, with its default (copies)."""
  if step.args is None or "adopt_weight" in step.args:
    return step
  weight = np.ones(np.shape(step.args["adopt"]), np.float32)
  return step._replace(args={**step.args, "adopt_weight": weight})


def one_worker_config(config):
  """A copy of ``config`` with one worker: the executor runs a compressor per worker."""
  one = ml_collections.ConfigDict(config.to_dict())
  one.num_workers = 1
  return one


def _counts(values) -> str:
  """``[1, 1, 2, 2]`` -> ``1 x2, 2 x2`` (few distinct values), else their range."""
  values = np.asarray(values, np.float64)
  distinct = np.unique(values)
  if distinct.size > 6:
    return f"{values.min():.3g}..{values.max():.3g} (median {np.median(values):.3g})"
  return ", ".join(f"{v:.4g} x{int((values == v).sum())}" for v in distinct)


def run_header(config: ml_collections.ConfigDict, cluster, scheme, calibrated=None) -> str:
  """The simulator's opening log lines: the cluster, the groups and the scheme."""
  c, s = config.cluster, config.sync
  if cluster.trace is not None:
    pace = ("in seconds" if cluster_lib.trace_units(c) == "seconds"
            else f"scaled by {cluster.trace_scale:.4g} to a median of {cluster.base_time:.4g} s"
            + (" (calibrated)" if calibrated else ""))
    speed = (f"trace {c.trace_file} ({cluster.trace.shape[0]} iterations, {pace}), mean "
             f"iteration time {_counts(cluster.trace.mean(0))} s")
  else:
    base = f"{cluster.base_time:.4g} s" + (" (calibrated)" if calibrated else "")
    speed = f"profile {c.profile}, slowdown {_counts(cluster.speeds)}, base_time {base}"
  extras = "".join(f", {k} {c[k]}" for k in ("jitter", "straggler_prob") if c[k])
  link = f"link {_counts(cluster.bandwidth / 1e6)} MB/s, latency {_counts(cluster.latency)} s"
  if cluster.topology is not None:
    t = cluster.topology
    link += (f"; topology {t.name}: {t.num_regions} regions, "
             f"{_counts(t.bandwidth[~np.eye(t.num_regions, dtype=bool)] / 1e6)} MB/s between "
             f"them, the server in region {t.server_region}")
  groups = [np.flatnonzero(scheme.groups == g).tolist() for g in np.unique(scheme.groups)]
  knobs = sync.registry.settings_line(scheme.name, s)
  compress_name = config.compress.name
  comp = "" if compress_name == "none" else f", compress {compress_name}"
  return (f"simulated cluster: {scheme.num_workers} workers, {speed}{extras}; {link}\n"
          f"scheme: {scheme.name}{knobs}{comp}, {scheme.num_replicas} server replica(s);"
          f" groups: {groups}")
