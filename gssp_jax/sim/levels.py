"""The level-batched simulator executor: a dependency level of gradients per device call.

A worker's gradient depends only on the weights (and model state, compressor
memory) it holds when its job runs, and those change only when it pulls. So
the jobs dispatched since the last level can all wait and run together, as
long as no round in between reads their result (the worker arrives) or
overwrites their input (the worker pulls again). :func:`plan_levels` cuts the
steps (``executor.Step``) into such levels on the host; :func:`make_level_runner`
runs each level as one batched call of its jobs (``vmap`` over per-worker
weight copies) followed by one ``lax.scan`` of its rounds (the same
``executor.round_body`` as the per-round runner).

It returns the same state as ``executor.make_round_runner`` for the same steps
(to float tolerance; integer counters bit for bit): every job is computed on
exactly the inputs it had there, and the jobs still pending at the end of a
``run`` are computed before it returns, so checkpoints do not depend on the
executor.

Shapes are padded to a fixed set so nothing recompiles per level: jobs to a
power of two (at most ``num_workers``; padded jobs scatter to an out-of-range
worker and are dropped), rounds to a power of two up to ``max_rounds`` (padded
rounds are skipped with ``lax.cond``), and the rounds' worker and replica ids
(``rounds.round_indices``) to the largest power-of-two bucket in the chunk. Jobs and rounds are separate jitted
functions rather than one function per (jobs, rounds) pair: the model is then
compiled once per job bucket, not once per pair of buckets (about 5 x 7 pairs
at 16 workers), which matters for a ResNet.

With ``levels_per_call > 1`` the runner instead groups that many consecutive
levels into one jitted call (:func:`make_multi_level_fn`: a ``lax.scan`` over
the levels, each its jobs' ``vmap`` then its rounds' scan), padded to the
call's (jobs bucket, rounds bucket) and to ``levels_per_call`` levels (padded
levels are skipped by ``lax.cond``). That trades compiling the model once per
pair of buckets for one dispatch per many levels, where dispatches dominate
(GPUs). The level count is padded to ``levels_per_call`` itself rather than to
its own bucket: a padded level costs one skipped ``cond``, and a third shape
axis would multiply the compilations.

Its target is accelerators: on a CPU, ``vmap`` over weight copies turns
convolutions into grouped convolutions, which are slower than the per-round
runner's unrolled gradients (see ``executor.py``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax.sim import executor
from gssp_jax.sync import rounds as rounds_lib


class Level(NamedTuple):
  """A dependency level: its jobs run first (together), then its rounds in order.

  Attributes:
    jobs: the jobs pending at the level's start (distinct workers), or None.
    rounds: the rounds' args (``executor.Step.args``), in order.
  """
  jobs: executor.Jobs | None
  rounds: list


def _concat_jobs(parts: list) -> executor.Jobs | None:
  if not parts:
    return None
  return executor.Jobs(*(None if getattr(parts[0], f) is None
                         else np.concatenate([np.asarray(getattr(p, f)) for p in parts])
                         for f in executor.Jobs._fields))


def plan_levels(steps: Sequence[executor.Step]) -> list[Level]:
  """Cuts ``steps`` into dependency levels (host NumPy, pure).

  A job dispatched in a level's steps is deferred to the next level. The
  level is cut before a round in which such a worker arrives (the round reads
  its gradient) or pulls (the round overwrites the weights and model state the
  job must read), and before a step that dispatches a second job to such a
  worker. Rounds never read a non-arrived worker's gradient, statistics, loss
  or bytes except multiplied by a zero mask, and never touch compressor
  memories, so deferring a job past them changes nothing. The last level holds
  the jobs still pending after the last step, with no rounds.

  Args:
    steps: the steps, as ``executor.make_round_runner`` takes them.

  Returns:
    The levels in order; levels with neither jobs nor rounds are left out.
  """
  levels: list[Level] = []
  head, rounds, fresh, fresh_workers = None, [], [], set()

  def close():
    nonlocal head, rounds, fresh, fresh_workers
    if head is not None or rounds:
      levels.append(Level(head, rounds))
    head, rounds, fresh, fresh_workers = _concat_jobs(fresh), [], [], set()

  for step in steps:
    if step.args is not None:
      touched = np.asarray(step.args["arrived"], bool) | np.asarray(step.args["pulls"], bool)
      if fresh_workers.intersection(np.flatnonzero(touched).tolist()):
        close()
      rounds.append(step.args)
    if step.jobs is not None and np.asarray(step.jobs.workers).size:
      workers = np.asarray(step.jobs.workers).tolist()
      if len(set(workers)) != len(workers):
        raise ValueError(f"a step's jobs must be for distinct workers; got workers={workers}")
      if fresh_workers.intersection(workers):
        close()
      fresh.append(step.jobs)
      fresh_workers.update(workers)
  close()
  if head is not None:
    levels.append(Level(head, []))
  return levels


def _bucket(n: int, cap: int) -> int:
  """The padded size of ``n`` items: the next power of two, at most ``cap`` (n <= cap)."""
  return min(1 << max(0, int(n) - 1).bit_length(), cap)


def pad_jobs(jobs: executor.Jobs, num_workers: int, size: int | None = None) -> executor.Jobs:
  """Pads ``jobs`` to ``size`` entries (default: their bucket); padded ones are for worker ``W``.

  Worker ``W`` is out of range, so the padded jobs' results are dropped by the
  scatter (``mode="drop"``).
  """
  k = jobs.workers.size
  size = _bucket(k, num_workers) if size is None else size
  pad = size - k

  def grow(x, fill):
    x = np.asarray(x)
    return np.concatenate([x, np.full((pad, *x.shape[1:]), fill, x.dtype)])
  return executor.Jobs(workers=grow(np.asarray(jobs.workers, np.int32), num_workers),
                       idx=grow(np.asarray(jobs.idx, np.int32), 0),
                       iters=grow(np.asarray(jobs.iters, np.int32), 0),
                       ratios=grow(np.asarray(jobs.ratios, np.float32), 1.0),
                       flushes=grow(np.asarray(jobs.flushes, bool), False),
                       steps=None if jobs.steps is None
                       else grow(np.asarray(jobs.steps, np.int32), 0))


def stack_round_args(rounds: list, size: int) -> tuple[dict, np.ndarray]:
  """Stacks round args (leading axis = round), padded to ``size`` by repeating the last.

  Returns:
    ``(stacked args, valid [size] bool)``; padded rounds have ``valid`` False.
  """
  n = len(rounds)
  keys = set(rounds[0])
  if any(set(r) != keys for r in rounds):
    kinds = sorted(map(sorted, {frozenset(r) for r in rounds}))
    raise ValueError(f"every round needs the same args; got the key sets {kinds}")
  padded = list(rounds) + [rounds[-1]] * (size - n)
  stacked = {k: np.stack([np.asarray(r[k]) for r in padded]) for k in rounds[0]}
  return stacked, np.arange(size) < n


def level_jobs_body(loss_fn: Callable, compressor, dense_bytes: int, stats_bytes: int,
                    num_workers: int, *, grad_clip: float = 0.0,
                    local: executor.LocalJob | None = None):
  """``(state, arrays, workers [k], idx, iters [k], ratios [k], flushes [k], steps) -> state``.

  Pure (not jitted).
  ``executor.make_job_fn``'s contract (``grad_clip``: each worker's gradient
  clipped before its compressor, ``executor.make_worker_gradient``), computed
  as one ``vmap`` over the jobs' weight copies instead of unrolled; workers
  ``>= num_workers`` are padding and write nowhere. Shared by
  ``make_level_jobs_fn`` (one level per call) and ``make_multi_level_fn``
  (many levels per call), so the two cannot drift. With ``local`` the jobs are
  local-update jobs (``executor.make_local_update``), as in ``make_job_fn``.
  """

  executor.check_push_bytes(dense_bytes + stats_bytes, "the model's dense gradient and statistics")
  gradient = executor.make_worker_gradient(loss_fn, compressor, dense_bytes,
                                           grad_clip=grad_clip)
  if local is not None:
    local_update = executor.make_local_update(loss_fn, compressor, dense_bytes, local,
                                              grad_clip=grad_clip)

  def one_job(params, model_state, inner, comp, batch, key, first, steps, ratio, flush):
    # A one-worker compressor on this worker's state slice (worker axis of size 1).
    if local is None:
      loss, grad, new_ms, comp, nbytes = gradient(params, model_state, comp, batch,
                                                  jax.random.fold_in(key, first), ratio, flush)
    else:
      loss, grad, new_ms, inner, comp, nbytes = local_update(
          params, model_state, inner, comp, batch, key, first, steps, ratio, flush)
    return grad, new_ms, inner, comp, loss, nbytes + jnp.int32(stats_bytes)

  def jobs(state: executor.SimState, arrays, workers, idx, iters, ratios, flushes, steps=None):
    safe = jnp.minimum(workers, num_workers - 1)   # padded jobs compute on worker W-1's inputs
    take = lambda tree: jax.tree.map(lambda x: x[safe], tree)
    put = lambda tree, v: jax.tree.map(lambda x, y: x.at[workers].set(y, mode="drop"), tree, v)
    batch = jax.tree.map(lambda a: a[idx], arrays)
    if steps is None:
      steps = jnp.ones(workers.shape, jnp.int32)
    # Exactly make_job_fn's dropout keys: fold in the worker, then its iteration.
    keys = jax.vmap(lambda w: jax.random.fold_in(state.rng, w))(safe)
    comp = take(state.comp_state) if compressor is not None else None
    inner = take(state.inner_state) if local is not None else None
    grad, new_ms, inner, comp, loss, nbytes = jax.vmap(
        one_job, in_axes=(0, 0, 0 if local is not None else None,
                          0 if compressor is not None else None, 0, 0, 0, 0, 0, 0))(
            take(state.worker_params), take(state.worker_model_state), inner, comp, batch, keys,
            iters, steps, ratios, flushes)
    return state.replace(
        grad_buf=put(state.grad_buf, grad),
        worker_model_state=put(state.worker_model_state, new_ms),
        inner_state=put(state.inner_state, inner) if local is not None else state.inner_state,
        comp_state=put(state.comp_state, comp) if compressor is not None else state.comp_state,
        job_loss=state.job_loss.at[workers].set(loss, mode="drop"),
        job_bytes=state.job_bytes.at[workers].set(nbytes, mode="drop"))
  return jobs


def make_level_jobs_fn(loss_fn: Callable, compressor, dense_bytes: int, stats_bytes: int,
                       num_workers: int, on_trace: Callable[[], None] = lambda: None, *,
                       grad_clip: float = 0.0, local: executor.LocalJob | None = None):
  """``level_jobs_body``, jitted (state donated).

  ``on_trace`` is called each time it is traced (tests count compilations with it).
  """
  body = level_jobs_body(loss_fn, compressor, dense_bytes, stats_bytes, num_workers,
                         grad_clip=grad_clip, local=local)

  def jobs(state: executor.SimState, arrays, workers, idx, iters, ratios, flushes, steps=None):
    on_trace()
    return body(state, arrays, workers, idx, iters, ratios, flushes, steps)
  return jax.jit(jobs, donate_argnums=(0,))


def level_rounds_body(tx: optax.GradientTransformationExtraArgs):
  """``(state, stacked args [n, ...], valid [n]) -> state``: a ``lax.scan`` of ``round_body``.

  Pure (not jitted); shared by ``make_level_rounds_fn`` and ``make_multi_level_fn``.
  """
  body = executor.round_body(tx)

  def rounds(state: executor.SimState, stacked, valid):

    def step(s, xs):
      args, ok = xs
      return jax.lax.cond(ok, body, lambda s, a: s, s, args), None
    state, _ = jax.lax.scan(step, state, (stacked, valid))
    return state
  return rounds


def make_level_rounds_fn(tx: optax.GradientTransformationExtraArgs,
                         on_trace: Callable[[], None] = lambda: None):
  """``level_rounds_body``, jitted (state donated); ``on_trace`` as in ``make_level_jobs_fn``."""
  body = level_rounds_body(tx)

  def rounds(state: executor.SimState, stacked, valid):
    on_trace()
    return body(state, stacked, valid)
  return jax.jit(rounds, donate_argnums=(0,))


class Call(NamedTuple):
  """One multi-level device call: up to ``levels_per_call`` pieces run in order.

  Attributes:
    pieces: the levels it runs, each with at most ``max_rounds`` rounds (a longer
      level is split into pieces, its jobs in the first).
    jobs_size: the jobs bucket every piece's jobs are padded to.
    rounds_size: the rounds bucket every piece's rounds are padded to.
  """
  pieces: list
  jobs_size: int
  rounds_size: int


def plan_calls(plan: Sequence[Level], num_workers: int, max_rounds: int,
               levels_per_call: int) -> list[Call]:
  """Groups consecutive levels into device calls of ``levels_per_call`` (host, pure).

  A level longer than ``max_rounds`` rounds is first split into pieces (its
  jobs go with the first), exactly as the one-level path splits its scans; then
  consecutive pieces are taken ``levels_per_call`` at a time. A call's shapes
  are the buckets of its largest piece, so they come from the same small set as
  the one-level path's ((jobs bucket, rounds bucket) pairs).

  Args:
    plan: levels, as ``plan_levels`` returns them.
    num_workers: W (the jobs cap).
    max_rounds: rounds per piece; a power of two.
    levels_per_call: pieces per call; a power of two.

  Returns:
    The calls in order.
  """
  pieces = []
  for level in plan:
    if not level.rounds:
      pieces.append(Level(level.jobs, []))
    for start in range(0, len(level.rounds), max_rounds):
      pieces.append(Level(level.jobs if start == 0 else None,
                          level.rounds[start:start + max_rounds]))
  calls = []
  for start in range(0, len(pieces), levels_per_call):
    group = pieces[start:start + levels_per_call]
    most_jobs = max(0 if p.jobs is None else p.jobs.workers.size for p in group)
    most_rounds = max(len(p.rounds) for p in group)
    calls.append(Call(group, _bucket(max(most_jobs, 1), num_workers),
                      _bucket(max(most_rounds, 1), max_rounds)))
  return calls


def stack_call(call: Call, num_workers: int, levels_per_call: int):
  """A call's host arrays, leading axis = piece, padded to ``levels_per_call`` pieces.

  Padded pieces, and pieces without jobs or rounds, are no-ops: their jobs are
  all for worker ``W`` with ``has_jobs`` False, their rounds repeat one of the
  call's rounds with ``valid`` False.

  Args:
    call: a call with at least one job and one round among its pieces.
    num_workers: W.
    levels_per_call: the padded piece count.

  Returns:
    ``(jobs, has_jobs [L] bool, stacked round args [L, R, ...], valid [L, R] bool)``,
    ``jobs`` an ``executor.Jobs`` of ``[L, J, ...]`` arrays.
  """
  size, n = call.jobs_size, len(call.pieces)
  # One id size for the whole call (its largest bucket): every scanned round shares a shape.
  common = iter(rounds_lib.with_common_indices([r for p in call.pieces for r in p.rounds]))
  call = call._replace(pieces=[Level(p.jobs, [next(common) for _ in p.rounds])
                               for p in call.pieces])
  template = next(p.jobs for p in call.pieces if p.jobs is not None)
  idle = executor.Jobs(workers=np.full([size], num_workers, np.int32),
                       idx=np.zeros([size, *np.shape(template.idx)[1:]], np.int32),
                       iters=np.zeros([size], np.int32), ratios=np.ones([size], np.float32),
                       flushes=np.zeros([size], bool),
                       steps=None if template.steps is None else np.zeros([size], np.int32))
  filler = next(p.rounds for p in call.pieces if p.rounds)[:1]
  jobs, has_jobs, stacked, valid = [], [], [], []
  for i in range(levels_per_call):
    piece = call.pieces[i] if i < n else Level(None, [])
    real = piece.jobs is not None and piece.jobs.workers.size > 0
    jobs.append(pad_jobs(piece.jobs, num_workers, size) if real else idle)
    has_jobs.append(real)
    args, ok = stack_round_args(piece.rounds or filler, call.rounds_size)
    stacked.append(args)
    valid.append(ok & bool(piece.rounds))
  keys = set(stacked[0])
  if any(set(a) != keys for a in stacked):
    raise ValueError(f"every round needs the same args; got the key sets "
                     f"{sorted(map(sorted, {frozenset(a) for a in stacked}))}")
  jobs = executor.Jobs(*(None if getattr(template, f) is None
                         else np.stack([np.asarray(getattr(j, f)) for j in jobs])
                         for f in executor.Jobs._fields))
  return (jobs, np.asarray(has_jobs), {k: np.stack([a[k] for a in stacked]) for k in keys},
          np.stack(valid))


def make_multi_level_fn(loss_fn: Callable, compressor, tx: optax.GradientTransformationExtraArgs,
                        dense_bytes: int, stats_bytes: int, num_workers: int,
                        on_trace: Callable[[], None] = lambda: None, *,
                        grad_clip: float = 0.0, local: executor.LocalJob | None = None):
  """``(state, arrays, jobs [L, J, ..], has_jobs [L], stacked [L, R, ..], valid [L, R]) -> state``.

  One jitted call (state donated) that runs ``L`` levels in order, a
  ``lax.scan`` over them: each level's jobs (``level_jobs_body``, skipped by
  ``lax.cond`` when it has none), then its rounds (``level_rounds_body``,
  skipped when none is valid). The model is compiled once per (J, R) shape,
  inside this function.
  """
  jobs_body = level_jobs_body(loss_fn, compressor, dense_bytes, stats_bytes, num_workers,
                              grad_clip=grad_clip, local=local)
  rounds_body = level_rounds_body(tx)

  def call(state: executor.SimState, arrays, jobs: executor.Jobs, has_jobs, stacked, valid):
    on_trace()

    def level(s, xs):
      lj, h, args, ok = xs
      s = jax.lax.cond(h, lambda s: jobs_body(s, arrays, *lj), lambda s: s, s)
      s = jax.lax.cond(jnp.any(ok), lambda s: rounds_body(s, args, ok), lambda s: s, s)
      return s, None
    state, _ = jax.lax.scan(level, state, (tuple(jobs), has_jobs, stacked, valid))
    return state
  return jax.jit(call, donate_argnums=(0,))


def make_level_runner(loss_fn: Callable, compressor, tx: optax.GradientTransformationExtraArgs,
                      dense_bytes: int, stats_bytes: int, num_workers: int, *,
                      max_rounds: int = 64, levels_per_call: int = 1,
                      grad_clip: float = 0.0, local: executor.LocalJob | None = None):
  """``(state, arrays, steps) -> state``, the contract of ``executor.make_round_runner``.

  Args:
    loss_fn: ``(params, model_state, batch, rng) -> (loss, new_model_state)``.
    compressor: the one-worker compressor, or None.
    tx: the sync chain (as ``executor.make_round_fn`` takes it).
    dense_bytes: bytes of an uncompressed push.
    stats_bytes: bytes of the model state a push carries.
    num_workers: W.
    max_rounds: rounds per scan call; a power of two (longer levels are split).
    levels_per_call: levels per device call; a power of two. 1: two calls per
      level (its jobs, then its rounds). More: ``plan_calls`` groups that many
      consecutive levels into one call of ``make_multi_level_fn``, so the host
      dispatches (and the device idles between) far fewer calls; a call whose
      levels have no jobs, or no rounds, at all uses the one-level functions.
    grad_clip: ``optimizer.grad_clip``: each worker's gradient is clipped to
      this global norm before its compressor (``executor.make_worker_gradient``);
      0 = off.
    local: the local-update schemes' job (``executor.LocalJob``), or None.

  Returns:
    ``run``; ``run.traces`` counts the traces of its jobs, rounds and (for
    ``levels_per_call > 1``) multi-level functions.

  Raises:
    ValueError: ``num_workers``, ``max_rounds``, ``levels_per_call`` or ``grad_clip`` is
      invalid.
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) \
      or num_workers < 1:
    raise ValueError(f"num_workers={num_workers!r} is invalid; allowed: an int >= 1")
  if (isinstance(max_rounds, bool) or not isinstance(max_rounds, (int, np.integer))
      or max_rounds < 1 or max_rounds & (max_rounds - 1)):
    raise ValueError(f"max_rounds={max_rounds!r} is invalid; allowed: a power of two >= 1")
  if (isinstance(levels_per_call, bool) or not isinstance(levels_per_call, (int, np.integer))
      or levels_per_call < 1 or levels_per_call & (levels_per_call - 1)):
    raise ValueError(f"levels_per_call={levels_per_call!r} is invalid; "
                     "allowed: a power of two >= 1")
  traces = {"jobs": 0, "rounds": 0, "levels": 0}

  def count(kind):
    def bump():
      traces[kind] += 1
    return bump

  jobs_fn = make_level_jobs_fn(loss_fn, compressor, dense_bytes, stats_bytes, num_workers,
                               count("jobs"), grad_clip=grad_clip, local=local)
  rounds_fn = make_level_rounds_fn(tx, count("rounds"))

  def run_one(state: executor.SimState, arrays, level: Level) -> executor.SimState:
    if level.jobs is not None:
      state = jobs_fn(state, arrays, *pad_jobs(level.jobs, num_workers))
    for start in range(0, len(level.rounds), max_rounds):
      # One id size per chunk (its largest bucket): the scan's rounds share a shape.
      chunk = rounds_lib.with_common_indices(level.rounds[start:start + max_rounds])
      state = rounds_fn(state, *stack_round_args(chunk, _bucket(len(chunk), max_rounds)))
    return state

  if levels_per_call == 1:
    def run(state: executor.SimState, arrays,
            steps: Sequence[executor.Step]) -> executor.SimState:
      for level in plan_levels(steps):
        state = run_one(state, arrays, level)
      return state
  else:
    multi_fn = make_multi_level_fn(loss_fn, compressor, tx, dense_bytes, stats_bytes,
                                   num_workers, count("levels"), grad_clip=grad_clip, local=local)

    def run(state: executor.SimState, arrays,
            steps: Sequence[executor.Step]) -> executor.SimState:
      for call in plan_calls(plan_levels(steps), num_workers, max_rounds, levels_per_call):
        has_jobs = any(p.jobs is not None and p.jobs.workers.size for p in call.pieces)
        if has_jobs and any(p.rounds for p in call.pieces):
          state = multi_fn(state, arrays, *stack_call(call, num_workers, levels_per_call))
        else:   # no job or no round to take a shape from (a run's ends): one level at a time
          for piece in call.pieces:
            state = run_one(state, arrays, piece)
      return state
  run.traces = traces
  return run
