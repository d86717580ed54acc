"""The pure training step: per-worker gradients with a leading worker axis, then the server.

The seam for synchronization schemes is :func:`worker_gradients`: it returns
every worker's gradient stacked on axis 0 (``[W, ...]``), computed on the
parameters that worker holds. A scheme decides what the server applies from
that stack. This build ships the BSP server (:func:`bsp_server_update`): the
mean of all workers' gradients (each clipped first with ``optimizer.grad_clip``),
applied once per round.

BatchNorm: each worker normalises with its own batch statistics, as it would on
its own accelerator; the server averages the workers' running statistics
(mean and variance) of the round it applies. (The GSSP authors' code does not
synchronise them at all; averaging keeps the served model's statistics those
of the data it was trained on.)
"""

from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax import compress
from gssp_jax.base import optim


class TrainState(flax.struct.PyTreeNode):
  """Everything the server holds; a pytree, so it checkpoints and scans as a whole."""
  step: jax.Array          # int32 [], applied updates
  params: Any
  model_state: Any         # e.g. {"batch_stats": ...}; {} for models without BatchNorm
  opt_state: Any
  rng: jax.Array           # uint32 [2], the run's base key; step keys are folded in
  compress_state: Any = ()  # the workers' compressor state (error feedback), () without one


def init_train_state(task, tx: optax.GradientTransformation, seed: int,
                     compressor: optax.GradientTransformationExtraArgs | None = None
                     ) -> TrainState:
  rng = jax.random.PRNGKey(seed)
  init_rng, train_rng = jax.random.split(rng)
  params, model_state = task.init(init_rng)
  return TrainState(step=jnp.int32(0), params=params, model_state=model_state,
                    opt_state=tx.init(params), rng=train_rng,
                    compress_state=compressor.init(params) if compressor else ())


def tree_bytes(tree) -> int:
  """Bytes of a pytree's arrays (what sending it densely costs)."""
  return int(sum(x.dtype.itemsize * x.size for x in jax.tree.leaves(tree)))


def worker_rngs(base: jax.Array, step: jax.Array, num_workers: int) -> jax.Array:
  """Per-worker keys for one round: a pure function of (run key, step)."""
  return jax.random.split(jax.random.fold_in(base, step), num_workers)


def worker_gradients(loss_fn: Callable, params, model_state, batches, rngs):
  """Every worker's gradient on the same parameters: leading axis W on each output.

  Returns:
    (grads [W, ...], new model_state [W, ...], losses [W]).
  """
  def one(batch, rng):
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, model_state, batch, rng)
    return grads, new_state, loss
  return jax.vmap(one)(batches, rngs)


def mean_worker_gradient(loss_fn: Callable, params, model_state, batches, rngs):
  """The mean of the workers' gradients in one backward pass (BSP's fast path).

  Equal to ``worker_gradients(...)[0]`` averaged over W: the forward pass is
  vmapped over workers (so BatchNorm and dropout stay per worker), but the
  gradient is taken of the mean loss, so XLA computes weight gradients as one
  large batched contraction instead of W separate ones.

  Returns:
    (mean grads, new model_state [W, ...], losses [W]).
  """
  def mean_loss(p):
    losses, states = jax.vmap(lambda b, r: loss_fn(p, model_state, b, r))(batches, rngs)
    return losses.mean(), (states, losses)
  (_, (states, losses)), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
  return grads, states, losses


def bsp_server_update(tx: optax.GradientTransformation, state: TrainState, grads,
                      worker_model_states) -> TrainState:
  """Applies one BSP round: the mean gradient and the mean running statistics."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  model_state = jax.tree.map(lambda s: s.mean(0), worker_model_states)
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       model_state=model_state, opt_state=opt_state)


def make_bsp_step(loss_fn: Callable, tx: optax.GradientTransformation, num_workers: int,
                  compressor: optax.GradientTransformationExtraArgs | None = None, *,
                  grad_clip: float = 0.0):
  """(state, batches [W, B, ...]) -> (state, round metrics): one synchronous round.

  Without a compressor or clip the mean gradient comes from one fused backward
  pass. With ``grad_clip`` > 0 (``optimizer.grad_clip``) every worker's
  gradient is computed separately and clipped to that global norm
  (``optim.clip_gradient``), so the server applies the mean of the clipped
  worker gradients, exactly what the simulator's BSP applies
  (``sim.executor.make_worker_gradient``), not the clip of their mean; ``tx``
  must not clip (``optim.make_optimizer`` does not). With a compressor, every
  worker's (clipped) gradient is compressed (with its own error-feedback
  memory) before the server averages what was sent. Round metrics: ``loss``
  (mean over workers) and ``push_bytes`` ([W] int32, exact bytes each worker
  sent: its gradient payload plus its BatchNorm statistics).

  Raises:
    ValueError: ``grad_clip`` is not a finite number >= 0.
  """
  grad_clip = optim.check_grad_clip(grad_clip)

  def step(state: TrainState, batches):
    rngs = worker_rngs(state.rng, state.step, num_workers)
    stats_bytes = tree_bytes(state.model_state)
    if compressor is None and grad_clip == 0:
      grads, worker_states, losses = mean_worker_gradient(
          loss_fn, state.params, state.model_state, batches, rngs)
      push = jnp.full((num_workers,), tree_bytes(state.params) + stats_bytes, jnp.int32)
      compress_state = state.compress_state
    else:
      worker_grads, worker_states, losses = worker_gradients(
          loss_fn, state.params, state.model_state, batches, rngs)
      if grad_clip > 0:
        worker_grads = jax.vmap(lambda g: optim.clip_gradient(g, grad_clip))(worker_grads)
      if compressor is None:
        sent, compress_state = worker_grads, state.compress_state
        push = jnp.full((num_workers,), tree_bytes(state.params) + stats_bytes, jnp.int32)
      else:
        sent, compress_state = compressor.update(worker_grads, state.compress_state,
                                                 state.params)
        push = compress.push_bytes(compress_state) + stats_bytes
      grads = jax.tree.map(lambda g: g.mean(0), sent)
    state = bsp_server_update(tx, state, grads, worker_states)
    return state.replace(compress_state=compress_state), {"loss": losses.mean(),
                                                          "push_bytes": push}
  return step


def make_chunk_runner(step_fn: Callable, batch_size: int):
  """Runs ``num_steps`` rounds over one epoch's order with one jitted, state-donating step.

  ``order`` is ``[W, S]`` example indices (each worker's shard in this epoch's
  order); round ``t`` gives worker ``w`` the examples ``order[w, t*B:(t+1)*B]``,
  gathered on the device from the training arrays. Only the rounds' metrics
  (each stacked to ``[num_steps, ...]``) come back to the host, once per chunk.

  Why a host loop of jitted steps and not one ``lax.scan``: XLA:CPU (jax 0.10.2)
  runs convolutions inside a while-loop body on a much slower path (jax issue
  #12868). Measured here: a LeNet-5 round (4 workers x 32) costs 87 ms/step in
  a scan against 20 ms/step dispatched from Python, ResNet-18 (2 x 16) 47.8 s
  against 2.5 s. Dispatch is asynchronous, so the host loop adds only the
  per-call overhead (see benchmarks/step_throughput.py).
  """
  def one_round(state, arrays, order, t):
    idx = jax.lax.dynamic_slice_in_dim(order, t * batch_size, batch_size, axis=1)
    batches = jax.tree.map(lambda a: a[idx], arrays)
    return step_fn(state, batches)
  one_round = jax.jit(one_round, donate_argnums=(0,))

  def run(state, arrays, order, start: int, num_steps: int):
    metrics = []
    for t in range(start, start + num_steps):
      state, m = one_round(state, arrays, order, np.int32(t))
      metrics.append(m)
    return state, jax.tree.map(lambda *xs: jnp.stack(xs), *metrics)
  return run
