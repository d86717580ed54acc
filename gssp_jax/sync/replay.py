"""The reference executor: replays rounds one by one with real gradients, exactly.

Each round computes every worker's gradient on the weights that worker last
pulled (``worker_params``), then applies the round with ``rounds.apply_round``.
Only arrived workers' gradients are used, so the result is exact whatever the
cost; the simulator's executor (faster, batched) is tested against it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.sync import transforms


class ReplayState(NamedTuple):
  """Replica weights ``[R, ...]``, the chain's state and each worker's pulled weights ``[W, ...]``."""
  replica_params: object
  tx_state: object
  worker_params: object


def init_replay(tx: optax.GradientTransformationExtraArgs, params, num_replicas: int,
                num_workers: int) -> ReplayState:
  """Every replica and every worker starts from ``params`` (one replica's weights)."""
  return ReplayState(transforms.stack(params, num_replicas), tx.init(params),
                     transforms.stack(params, num_workers))


def make_replay_step(tx: optax.GradientTransformationExtraArgs, grad_fn: Callable):
  """``(state, round_args, index) -> state``, jitted once for every round of the same shape.

  ``grad_fn(worker_params, index)`` returns ``[W, ...]`` gradients, worker ``w``'s
  computed on ``worker_params[w]``.
  """
  @jax.jit
  def step(state: ReplayState, args: dict, index):
    grads = grad_fn(state.worker_params, index)
    replica, tx_state, workers, _, _ = rounds_lib.apply_round(
        tx, state.replica_params, state.tx_state, state.worker_params, grads, args)
    return ReplayState(replica, tx_state, workers)
  return step


def replay(tx, params, rounds: Sequence[rounds_lib.Round], grad_fn: Callable, *,
           num_replicas: int, num_workers: int, on_round=None,
           extra_args: dict | None = None) -> ReplayState:
  """Replays ``rounds`` from ``params``.

  ``on_round(i, state)`` sees the state after round i; ``extra_args`` (e.g. a
  compressor's ``ratios``) are passed to every round's update.
  """
  state = init_replay(tx, params, num_replicas, num_workers)
  step = make_replay_step(tx, grad_fn)
  for i, rnd in enumerate(rounds):
    state = step(state, {**rounds_lib.round_args(rnd), **(extra_args or {})}, jnp.int32(i))
    if on_round is not None:
      on_round(i, state)
  return state
