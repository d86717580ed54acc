"""The device half of the simulator: jobs (worker gradients) and rounds (server applications).

Every worker always has exactly one gradient job outstanding: the iteration it
started after its last pull, on the weights it pulled. The executor therefore
computes a worker's gradient as soon as it pulls (the weights are fixed from
then until its next push) and keeps it in ``grad_buf[w]``; a round reads the
arrived workers' slots. That is exact (true staleness) and needs no batching
across versions.

Why jobs are per worker and dispatched from the host, not a ``lax.scan`` of
rounds or a ``vmap`` over per-worker weights (measured here, LeNet-5, 16
workers x 32, jax 0.10.2, 2-core CPU): one batched 512-sample gradient costs
134 ms, ``vmap`` over 16 weight copies 154 ms (convolutions become grouped
convolutions), 16 separate batch-32 gradients unrolled in one jitted program
78 ms, 16 separately dispatched ones 89 ms; and convolutions inside a
``lax.scan`` body take a several times slower path (jax#12868). So a job call
computes up to ``MAX_JOBS`` workers' gradients unrolled in one program, and a
round is one small jitted call.

Compression runs inside the job: a worker compresses its own gradient with its
own error-feedback memory before it pushes, which is what the chained
compressor does at apply time, without touching every worker's memory in every
round. So does ``optimizer.grad_clip``: a worker clips its own gradient, before
its compressor and before any server scales it by 1/W (``make_worker_gradient``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax import host_state
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.sync import transforms
from gssp_jax.base import optim

MAX_JOBS = 8   # gradients per job call; larger sets are split in powers of two
# Local-update jobs per call: one. A job is already its H inner steps unrolled
# (MAX_UNROLLED_STEPS); k of them in one program compiled k times as long (XLA:CPU
# warned "very slow compile" at 8 DiLoCo jobs of 8 ResNet-18 steps) for a dispatch that
# costs about 0.1 ms against a job's tens of milliseconds or more.
MAX_LOCAL_JOBS = 1


# A byte counter on the device is two int32 words, (MiB, bytes below one MiB): exact up to
# 2**31 MiB (2 PiB) without 64-bit types, which jax enables only globally. One push (a
# ``job_bytes`` slot, int32) may hold at most MAX_PUSH_BYTES, so adding it never wraps the low word.
_MIB = 1 << 20
MAX_PUSH_BYTES = (1 << 31) - _MIB


def zero_push_bytes(num_workers: int) -> jax.Array:
  """An empty ``[W, 2]`` byte counter."""
  return jnp.zeros([num_workers, 2], jnp.int32)


def add_push_bytes(counter: jax.Array, nbytes: jax.Array) -> jax.Array:
  """``counter [W, 2] + nbytes [W]`` (each 0..MAX_PUSH_BYTES), exactly, in int32."""
  low = counter[:, 1] + nbytes
  # Two column scatters, not a stack: a round updates the [W, 2] counter in place.
  return counter.at[:, 1].set(low % _MIB).at[:, 0].add(low // _MIB)


def push_bytes_total(counter) -> np.ndarray:
  """A ``[W, 2]`` byte counter (on the device or the host) as ``[W]`` int64 bytes."""
  words = np.asarray(counter, np.int64)
  return words[:, 0] * _MIB + words[:, 1]


def check_push_bytes(nbytes: int, what: str) -> None:
  """Refuses a push that one ``job_bytes`` slot (int32) cannot hold."""
  if not 0 <= nbytes <= MAX_PUSH_BYTES:
    raise ValueError(f"{what}: one push of {nbytes:,} bytes; allowed: at most "
                     f"{MAX_PUSH_BYTES:,} (a job's byte count is an int32 on the device)")


class SimState(flax.struct.PyTreeNode):
  """Everything on the device; a pytree, so Orbax saves it whole.

  Attributes:
    replica_params: ``[R, ...]`` server replicas' weights.
    replica_model_state: ``[R, ...]`` their BatchNorm statistics ({} without).
    tx_state: the sync chain's state (staleness, buffers, replica optimizers).
    worker_params: ``[W, ...]`` the weights each worker pulled.
    worker_model_state: ``[W, ...]`` each worker's statistics after its job.
    grad_buf: ``[W, ...]`` each worker's outstanding (compressed) gradient.
    comp_state: per-worker compressor states stacked on ``[W]`` (() without).
    loss_sum: ``[]`` float32 sum of the losses of the gradients that reached
      a server since the last evaluation.
    loss_count: ``[]`` int32 number of those gradients.
    push_bytes: ``[W, 2]`` int32 bytes of those gradients' pushes, per worker,
      as (MiB, bytes below one MiB) (``add_push_bytes``; ``push_bytes_total``
      reads them): one int32 wraps after 2 GiB, 27 VGG-19 pushes.
    job_loss: ``[W]`` float32 loss of each worker's outstanding job (computed,
      not pushed yet); moved into ``loss_sum`` in the round it arrives.
    job_bytes: ``[W]`` int32 bytes of each worker's outstanding push (what
      its compressor actually sends, plus its BatchNorm statistics); moved
      into ``push_bytes`` in the round it arrives.
    rng: ``[2]`` uint32 base key of the workers' dropout.
    inner_state: the local-update schemes' per-worker inner optimizer states
      stacked on ``[W]`` (``()`` for every other scheme): each worker's own,
      kept across its pulls, as a worker of DiLoCo keeps its AdamW moments.
  """
  replica_params: Any
  replica_model_state: Any
  tx_state: Any
  worker_params: Any
  worker_model_state: Any
  grad_buf: Any
  comp_state: Any
  loss_sum: jax.Array
  loss_count: jax.Array
  push_bytes: jax.Array
  job_loss: jax.Array
  job_bytes: jax.Array
  rng: jax.Array
  inner_state: Any = ()


def init_state(params, model_state, tx, compressor, num_workers: int, num_replicas: int,
               rng: jax.Array, inner: optax.GradientTransformation | None = None) -> SimState:
  """All replicas and workers start from ``params``; compressor keys differ per worker.

  ``inner``: the local-update schemes' inner optimizer (``LocalJob.inner``);
  every worker gets its own state of it, initialized on ``params``.
  """
  comp_state = ()
  if compressor is not None:
    one = compressor.init(params)
    comp_state = transforms.stack(one, num_workers)
    if hasattr(one, "rng"):
      keys = jax.vmap(lambda w: jax.random.key_data(jax.random.fold_in(
          jax.random.wrap_key_data(one.rng), w)))(jnp.arange(num_workers))
      comp_state = comp_state._replace(rng=keys)
  return SimState(
      replica_params=transforms.stack(params, num_replicas),
      replica_model_state=transforms.stack(model_state, num_replicas),
      tx_state=() if tx is None else tx.init(params),
      worker_params=transforms.stack(params, num_workers),
      worker_model_state=transforms.stack(model_state, num_workers),
      grad_buf=jax.tree.map(lambda p: jnp.zeros((num_workers, *p.shape), jnp.float32), params),
      comp_state=comp_state, loss_sum=jnp.zeros([], jnp.float32),
      loss_count=jnp.zeros([], jnp.int32), push_bytes=zero_push_bytes(num_workers),
      job_loss=jnp.zeros([num_workers], jnp.float32),
      job_bytes=jnp.zeros([num_workers], jnp.int32), rng=rng,
      inner_state=() if inner is None else transforms.stack(inner.init(params), num_workers))


def make_worker_gradient(loss_fn: Callable, compressor, dense_bytes: int, *,
                         grad_clip: float = 0.0):
  """``(params, model_state, comp, batch, rng, ratio, flush) -> (loss, grad, ms, comp, bytes)``.

  One worker's job, pure: its float32 gradient on the weights it pulled,
  clipped to global norm ``grad_clip`` (``optimizer.grad_clip``; 0 = off,
  nothing traced), then compressed with its own one-worker compressor state
  ``comp`` (worker axis of size 1; ``()`` without a compressor), and the bytes
  that compressor sends (``dense_bytes`` without one). The clip comes first, so
  error feedback accumulates clipped gradients, and every scheme's servers
  (which scale a push by 1/W, or a delivery by K/W) receive the same clipped
  gradient: the clip bounds each worker's gradient, for every scheme (BSP's
  step is the mean of clipped gradients). The simulator's jobs (unrolled here,
  ``vmap``-ed in ``sim/levels.py``) and the real runtime's meshes
  (``runtime/worker.py``) all compute this function.

  Raises:
    ValueError: ``grad_clip`` is not a finite number >= 0.
  """
  grad_clip = optim.check_grad_clip(grad_clip)

  def gradient(params, model_state, comp, batch, rng, ratio, flush):
    (loss, new_ms), grad = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, batch,
                                                                      rng)
    grad = optim.clip_gradient(jax.tree.map(lambda g: g.astype(jnp.float32), grad), grad_clip)
    grad, comp, nbytes = compress_push(compressor, grad, comp, ratio, flush, dense_bytes)
    return loss.astype(jnp.float32), grad, new_ms, comp, nbytes
  return gradient


def compress_push(compressor, push, comp, ratio, flush, dense_bytes: int):
  """``(sent, comp, bytes)``: a worker's push through its one-worker compressor (or as is)."""
  if compressor is None:
    return push, comp, jnp.int32(dense_bytes)
  sent, comp = compressor.update(jax.tree.map(lambda g: g[None], push), comp,
                                 ratios=ratio[None], flush=flush)
  return jax.tree.map(lambda s: s[0], sent), comp, comp.last_bytes[0]


class LocalJob(NamedTuple):
  """The local-update schemes' job: up to ``max_steps`` inner optimizer steps, then a push.

  Attributes:
    inner: the workers' inner optimizer (one worker's; each keeps its own state).
    max_steps: ``H_max``, the longest job's steps (the scan's length); a job of
      ``H_w < H_max`` steps computes the rest and keeps none of them (a ``select``).
  """
  inner: optax.GradientTransformation
  max_steps: int


# Inner steps of a local-update job unrolled up to this many (a loop beyond): XLA:CPU runs a
# convolution inside a loop body or a conditional on a slow path (jax#12868). A job of 8 AdamW
# steps of the x1/4 ResNet-18 on 32 images took 20.9-21.8 s in a loop with a lax.cond per step
# and 0.63-0.65 s unrolled with a select, its first call 28.0 s and 17.4 s
# (benchmarks/local_job.py, 2-core CPU, 2026-11-27).
MAX_UNROLLED_STEPS = 16


def make_local_update(loss_fn: Callable, compressor, dense_bytes: int, local: LocalJob, *,
                      grad_clip: float = 0.0):
  """``(params, ms, inner, comp, batches [H_max, B], key, first, steps, ratio, flush) -> ...``.

  One worker's local-update job, pure: ``steps`` inner optimizer steps from the
  weights it pulled, on its batches of data iterations ``first ..
  first + steps - 1`` (dropout key of step ``i``: ``fold_in(key, first + i)``,
  exactly a one-step job's key of that iteration), each gradient clipped to
  ``grad_clip`` as ``make_worker_gradient`` clips; then the pseudo-gradient
  ``pulled - local`` (float32) goes through the worker's compressor as a
  gradient would. Returns ``(mean loss of the steps, pseudo-gradient,
  statistics after the last step, inner state, compressor state, bytes)``.
  With one step of plain SGD at rate ``lr`` the pseudo-gradient is ``lr`` times
  the gradient (to rounding), which is how ``local_sgd`` reduces to BSP.
  """
  grad_clip = optim.check_grad_clip(grad_clip)
  inner = local.inner

  def one_step(carry, i, batch, key):
    params, model_state, opt, loss_sum = carry
    (loss, new_ms), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        params, model_state, batch, jax.random.fold_in(key, i))
    grad = optim.clip_gradient(jax.tree.map(lambda g: g.astype(jnp.float32), grad), grad_clip)
    updates, opt = inner.update(grad, opt, params)
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    return params, new_ms, opt, loss_sum + loss.astype(jnp.float32)

  def update(params, model_state, opt, comp, batches, key, first, steps, ratio, flush):
    def body(carry, xs):
      j, batch = xs
      # A step past the job's own ``steps`` is computed and not kept (a select: what a
      # ``lax.cond`` becomes under ``vmap`` anyway; no conditional for a GPU to return to the
      # host for, and none around the convolutions, which XLA:CPU runs on a slow path there).
      stepped = one_step(carry, first + j, batch, key)
      return jax.tree.map(lambda new, old: jnp.where(j < steps, new, old), stepped, carry), None
    init = (params, model_state, opt, jnp.zeros([], jnp.float32))
    (local_params, new_ms, opt, loss_sum), _ = jax.lax.scan(
        body, init, (jnp.arange(local.max_steps, dtype=jnp.int32), batches),
        unroll=local.max_steps <= MAX_UNROLLED_STEPS)
    push = jax.tree.map(lambda p, q: p.astype(jnp.float32) - q.astype(jnp.float32), params,
                        local_params)
    push, comp, nbytes = compress_push(compressor, push, comp, ratio, flush, dense_bytes)
    return loss_sum / jnp.maximum(steps, 1).astype(jnp.float32), push, new_ms, opt, comp, nbytes
  return update


def make_job_fn(loss_fn: Callable, compressor, dense_bytes: int, stats_bytes: int = 0, *,
                grad_clip: float = 0.0, local: LocalJob | None = None):
  """``(state, arrays, workers [k], idx, iters [k], ratios [k], flushes [k], steps [k]) -> state``.

  Jitted per k; each job is ``make_worker_gradient`` (``grad_clip`` as
  there), ``idx`` its ``[k, B]`` batches; or, with ``local``, a local-update
  job (``make_local_update``): ``idx`` is ``[k, H_max, B]``, ``iters`` each
  job's first data iteration and ``steps`` (default all 1) its inner steps,
  and the worker's inner optimizer state (``SimState.inner_state``) carries
  over to its next job. The real runtime's one-process mesh runs this very function on a
  one-worker state (``key_workers``: the worker ids its dropout keys fold in,
  default ``workers``): XLA rounds a computation differently inside another
  program (a BatchNorm running-statistics update came out one ulp apart in a
  standalone jit), so the mesh runs the simulator's program, not a copy. ``flushes`` (bool, default all False) marks the jobs whose
  compressor flushes (GDTopK's epoch end: gradient plus residual sent densely,
  residual cleared); it is traced, so it never recompiles. A job leaves its
  loss and its push's bytes in the worker's outstanding slots (``job_loss``,
  ``job_bytes``); they count only once the push arrives (``make_round_fn``).
  """

  check_push_bytes(dense_bytes + stats_bytes, "the model's dense gradient and statistics")
  gradient = make_worker_gradient(loss_fn, compressor, dense_bytes, grad_clip=grad_clip)
  if local is not None:
    local_update = make_local_update(loss_fn, compressor, dense_bytes, local, grad_clip=grad_clip)

  def jobs(state: SimState, arrays, workers, idx, iters, ratios, flushes=None, steps=None,
           key_workers=None):
    if flushes is None:
      flushes = jnp.zeros(workers.shape, bool)
    if steps is None:
      steps = jnp.ones(workers.shape, jnp.int32)
    if key_workers is None:   # the real runtime's mesh: a one-row state of worker key_workers[0]
      key_workers = workers
    take = lambda tree, w: jax.tree.map(lambda x: x[w], tree)
    put = lambda tree, w, v: jax.tree.map(lambda x, y: x.at[w].set(y), tree, v)
    for i in range(workers.shape[0]):   # unrolled: no convolution inside a loop body
      w = workers[i]
      batch = jax.tree.map(lambda a: a[idx[i]], arrays)
      key = jax.random.fold_in(state.rng, key_workers[i])
      comp_state, inner_state = state.comp_state, state.inner_state
      # A one-worker compressor: its state's worker axis has size 1.
      comp = take(comp_state, w) if compressor is not None else ()
      if local is None:
        loss, grad, new_ms, one, nbytes = gradient(
            take(state.worker_params, w), take(state.worker_model_state, w), comp, batch,
            jax.random.fold_in(key, iters[i]), ratios[i], flushes[i])
      else:
        loss, grad, new_ms, opt, one, nbytes = local_update(
            take(state.worker_params, w), take(state.worker_model_state, w),
            take(inner_state, w), comp, batch, key, iters[i], steps[i], ratios[i], flushes[i])
        inner_state = put(inner_state, w, opt)
      if compressor is not None:
        comp_state = put(comp_state, w, one)
      state = state.replace(
          grad_buf=put(state.grad_buf, w, grad),
          worker_model_state=put(state.worker_model_state, w, new_ms),
          comp_state=comp_state, inner_state=inner_state,
          job_loss=state.job_loss.at[w].set(loss.astype(jnp.float32)),
          job_bytes=state.job_bytes.at[w].set(nbytes + jnp.int32(stats_bytes)))
    return state
  return jax.jit(jobs, donate_argnums=(0,))


def round_body(tx: optax.GradientTransformationExtraArgs, count_arrivals: bool = True):
  """``(state, args) -> state``: one round (``rounds.apply_round``), pure.

  Shared by ``make_round_fn`` (one jitted call per round) and the level
  runner's ``lax.scan`` of rounds (``sim/levels.py``), so the two cannot drift.
  ``count_arrivals``: the round adds its arrivals' losses and bytes to the counters
  (:func:`count_arrivals_of`); the level runner counts a piece's at once instead.
  """

  def one_round(state: SimState, args):
    rp, txs, wp, rms, wms = rounds_lib.apply_round(
        tx, state.replica_params, state.tx_state, state.worker_params, state.grad_buf, args,
        state.replica_model_state, state.worker_model_state)
    state = state.replace(replica_params=rp, tx_state=txs, worker_params=wp,
                          replica_model_state=rms, worker_model_state=wms)
    if not count_arrivals:
      return state
    return count_arrivals_of(state, jnp.asarray(args["arrived"], bool)[None])
  return one_round


def count_arrivals_of(state: SimState, arrived: jax.Array) -> SimState:
  """The loss and byte counters after the arrivals ``arrived`` (``[n, W]``: ``n`` rounds' masks).

  A gradient's loss and bytes count once it reaches its server, not when computed. The
  rounds' loss sums are added one after another, as ``n`` rounds would add them. Bytes add
  exactly while a worker arrives at most once in the ``n`` rounds (one round; a level piece,
  where each worker has at most one job: ``planner.Cutter``).
  """
  losses = jnp.sum(jnp.where(arrived, state.job_loss[None], 0.0), axis=1)   # [n]
  loss_sum = state.loss_sum
  for i in range(arrived.shape[0]):
    loss_sum = loss_sum + losses[i]
  nbytes = jnp.sum(jnp.where(arrived, state.job_bytes[None], 0), axis=0, dtype=jnp.int32)
  return state.replace(loss_sum=loss_sum,
                       loss_count=state.loss_count + jnp.sum(arrived, dtype=jnp.int32),
                       push_bytes=add_push_bytes(state.push_bytes, nbytes))


def make_round_fn(tx: optax.GradientTransformationExtraArgs,
                  on_trace: Callable[[], None] = lambda: None):
  """``(state, args) -> state``: one round (``round_body``), jitted.

  The host adds the round's ids (``rounds.with_indices``), so the round
  touches only the workers and replicas it involves; it compiles once per pair
  of id buckets (``rounds.bucket``: powers of two up to ``W`` and ``R``), not per round.
  ``on_trace`` is called each time it is traced (tests count compilations).
  """
  body = round_body(tx)

  def traced(state, args):
    on_trace()
    return body(state, args)
  jitted = jax.jit(traced, donate_argnums=(0,))
  return lambda state, args: jitted(state, rounds_lib.with_indices(args))


class Jobs(NamedTuple):
  """Gradient jobs to compute, one entry per worker (host arrays; distinct workers).

  Attributes:
    workers: ``[k]`` int32, the workers; each computes on the weights it last pulled.
    idx: ``[k, B]`` int32, each job's batch (indices into the training arrays).
    iters: ``[k]`` int32, each job's iteration number (its dropout key).
    ratios: ``[k]`` float32, each job's compressor keep-ratio.
    flushes: ``[k]`` bool, jobs whose compressor flushes (GDTopK's epoch end).
    steps: ``[k]`` int32, each job's inner steps (local-update schemes; then
      ``idx`` is ``[k, H_max, B]`` and ``iters`` each job's first data
      iteration), or None: one gradient each.
  """
  workers: np.ndarray
  idx: np.ndarray
  iters: np.ndarray
  ratios: np.ndarray
  flushes: np.ndarray
  steps: np.ndarray | None = None

  def part(self, sl) -> "Jobs":
    return Jobs(*(None if x is None else x[sl] for x in self))


class Step(NamedTuple):
  """What the device does at one protocol event, in order: the round, then the pulled workers' jobs.

  Attributes:
    args: the round's arguments (``sync.round_args`` plus ``learning_rate``),
      or None for no round (the first jobs of a run).
    jobs: the jobs of the workers that pulled in that round, or None.
  """
  args: dict | None
  jobs: Jobs | None


def make_round_runner(job_fn, round_fn, max_jobs: int = MAX_JOBS):
  """``(state, arrays, steps) -> state``: applies steps one device call per round and job set.

  The reference executor: every other executor must give the same state (to
  float tolerance) for the same steps. ``max_jobs``: jobs per call at most
  (``split_jobs``; ``MAX_LOCAL_JOBS`` for local-update jobs).
  """

  def run(state: SimState, arrays, steps: Sequence[Step]) -> SimState:
    for step in steps:
      if step.args is not None:
        state = round_fn(state, step.args)
      if step.jobs is not None and step.jobs.workers.size:
        start = 0
        for part in split_jobs(step.jobs.workers, max_jobs):
          jobs = step.jobs.part(slice(start, start + part.size))
          start += part.size
          state = job_fn(state, arrays, *jobs)
    return state
  return run


def split_jobs(workers: np.ndarray, max_jobs: int = MAX_JOBS) -> list[np.ndarray]:
  """Splits a set of workers into calls of power-of-two sizes <= ``max_jobs`` (few
  compilations)."""
  out, start = [], 0
  while start < workers.size:
    size = min(max_jobs, 1 << int(np.log2(workers.size - start)))
    out.append(workers[start:start + size])
    start += size
  return out


def make_harvest_fn(served: Callable, num_workers: int):
  """``state -> (state, (loss_sum, loss_count, push_bytes), params, model_state)``, jitted.

  What an evaluation reads, in one call (state donated): the counters since
  the last evaluation, zeroed on the device, and ``served(state)``, the
  weights to evaluate as the model's pytrees.
  """

  def harvest(state: SimState):
    counters = (state.loss_sum, state.loss_count, state.push_bytes)
    params, model_state = served(state)
    state = state.replace(loss_sum=jnp.zeros([], jnp.float32),
                          loss_count=jnp.zeros([], jnp.int32),
                          push_bytes=zero_push_bytes(num_workers))
    return state, counters, params, model_state
  return jax.jit(harvest, donate_argnums=(0,))


def served_weights(state: SimState, eval_replica: int | None):
  """The weights a user would deploy: the global server's, else the replicas' mean."""
  if eval_replica is not None:
    pick = lambda x: x[eval_replica]
  else:
    pick = lambda x: x.mean(0).astype(x.dtype)
  return jax.tree.map(pick, state.replica_params), jax.tree.map(pick, state.replica_model_state)


# A checkpoint's host state holds the buffered steps and the planned jobs.
host_state.allow(Jobs, Step)
