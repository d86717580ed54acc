"""A round: what the device does at one protocol event, as fixed-shape data.

Protocols emit rounds (host NumPy); the executor stacks them and replays them
with :func:`apply_round`, which is pure and jittable. Every round carries every
field, so a stack of rounds of any scheme has one static shape.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax.sync import transforms


class Round(NamedTuple):
  """One protocol event. W workers, R replicas, G exchange groups (1 when unused).

  Attributes:
    time: virtual time of the event (host only; not passed to transforms).
    arrived: ``[W]`` bool, gradients that reach their replica now.
    pulls: ``[W]`` bool, workers that copy their replica's weights after the round.
    groups: ``[W]`` int32, the replica each worker talks to.
    applies: ``[R]`` bool, replicas that take an optimizer step.
    forward: ``[G]`` bool, GSSP groups that forward their pending sum.
    deliver: ``[G]`` bool, GSSP forwards delivered now.
    aggregate: ``[]`` bool, InHAD's server pulls the node aggregates.
    adopt: ``[R]`` int32, replica whose weights each replica copies (-1: none).
    average: ``[R]`` int32, averaging group of each replica (-1: not averaged).
    stats_mean: ``[R]`` int32; ``n >= 1``: the replica's model state
      (BatchNorm statistics, not weights) becomes the mean of replicas
      ``0..n-1``'s (GSSP global: the global server takes its group servers'
      mean); -1: unchanged.
  """
  time: float
  arrived: np.ndarray
  pulls: np.ndarray
  groups: np.ndarray
  applies: np.ndarray
  forward: np.ndarray
  deliver: np.ndarray
  aggregate: np.ndarray
  adopt: np.ndarray
  average: np.ndarray
  stats_mean: np.ndarray


def empty_round(time: float, num_workers: int, num_replicas: int, num_groups: int,
                groups: np.ndarray) -> Round:
  """A round in which nothing happens; protocols fill in the fields they use."""
  return Round(time=float(time), arrived=np.zeros([num_workers], bool),
               pulls=np.zeros([num_workers], bool), groups=np.asarray(groups, np.int32).copy(),
               applies=np.zeros([num_replicas], bool), forward=np.zeros([num_groups], bool),
               deliver=np.zeros([num_groups], bool), aggregate=np.zeros([], bool),
               adopt=np.full([num_replicas], -1, np.int32),
               average=np.full([num_replicas], -1, np.int32),
               stats_mean=np.full([num_replicas], -1, np.int32))


def round_args(rnd: Round) -> dict[str, Any]:
  """The extra args a transform chain receives for ``rnd`` (every field but ``time``)."""
  return {k: v for k, v in rnd._asdict().items() if k != "time"}


def stack_rounds(rounds: Sequence[Round]) -> dict[str, np.ndarray]:
  """Stacks rounds field by field (leading axis = round), e.g. for a ``lax.scan``."""
  return {k: np.stack([np.asarray(getattr(r, k)) for r in rounds]) for k in Round._fields}


def average_replicas(tree, average: jax.Array):
  """Replaces each replica with ``average[r] >= 0`` by the mean of its averaging group."""
  num = average.shape[0]
  member = average >= 0
  ids = jnp.where(member, average, 0)
  onehot = ((ids[:, None] == jnp.arange(num)[None, :]) & member[:, None]).astype(jnp.float32)
  counts = jnp.maximum(onehot.sum(0), 1.0)   # [groups]

  def one(x):
    flat = x.reshape(num, -1).astype(jnp.float32)
    means = (onehot.T @ flat) / counts[:, None]
    return jnp.where(transforms.rows(member, x), means[ids].reshape(x.shape).astype(x.dtype), x)
  return jax.tree.map(one, tree)


def mean_of_first(tree, count: jax.Array):
  """Replaces each replica with ``count[r] >= 1`` by the mean of replicas ``0..count[r]-1``."""
  num = count.shape[0]
  weights = (jnp.arange(num)[None, :] < count[:, None]).astype(jnp.float32)   # [R, R]
  weights = weights / jnp.maximum(weights.sum(1, keepdims=True), 1.0)
  take = count >= 1

  def one(x):
    flat = x.reshape(num, -1).astype(jnp.float32)
    means = jnp.matmul(weights, flat, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(transforms.rows(take, x), means.reshape(x.shape).astype(x.dtype), x)
  return jax.tree.map(one, tree)


def adopt_replicas(tree, adopt: jax.Array):
  """Each replica with ``adopt[r] >= 0`` takes replica ``adopt[r]``'s values."""
  src = jnp.where(adopt >= 0, adopt, jnp.arange(adopt.shape[0]))
  return jax.tree.map(lambda x: x[src], tree)


def apply_round(tx: optax.GradientTransformationExtraArgs, replica_params, tx_state,
                worker_params, worker_grads, args: dict, replica_model_state=None,
                worker_model_state=None):
  """Applies one round: the chain's updates, averaging, adoption, then the workers' pulls.

  Model state, in order: arrived workers' statistics, ``stats_mean``,
  averaging, adoption, pulls.

  Args:
    tx: ``optax.chain(<compressor>, <sync transform>, replicated(<optimizer>, R))``.
    replica_params: ``[R, ...]`` server replicas' weights.
    tx_state: the chain's state.
    worker_params: ``[W, ...]`` weights each worker last pulled.
    worker_grads: ``[W, ...]`` gradients; only arrived workers' are used.
    args: the round's fields (``round_args``), host arrays or traced.
    replica_model_state: ``[R, ...]`` non-trainable state (BatchNorm
      statistics) of the replicas, or None.
    worker_model_state: ``[W, ...]`` the workers' updated model state from
      this round's forward passes, or None. A replica that applies takes the
      mean of its arrived workers' statistics.

  Returns:
    ``(replica_params, tx_state, worker_params, replica_model_state,
    worker_model_state)``.
  """
  updates, tx_state = tx.update(worker_grads, tx_state, replica_params, **args)
  replica_params = optax.apply_updates(replica_params, updates)
  average = jnp.asarray(args["average"], jnp.int32)
  adopt = jnp.asarray(args["adopt"], jnp.int32)
  replica_params = adopt_replicas(average_replicas(replica_params, average), adopt)
  arrived = jnp.asarray(args["arrived"], bool)
  groups = jnp.asarray(args["groups"], jnp.int32)
  pulls = jnp.asarray(args["pulls"], bool)
  worker_params = jax.tree.map(lambda w, r: jnp.where(transforms.rows(pulls, w), r[groups], w),
                               worker_params, replica_params)
  if replica_model_state is not None and jax.tree.leaves(replica_model_state):
    num_replicas = jnp.asarray(args["applies"]).shape[0]
    onehot = ((groups[:, None] == jnp.arange(num_replicas)[None, :])
              & arrived[:, None]).astype(jnp.float32)          # [W, R]
    got = onehot.sum(0) > 0

    def take_mean(rep, wk):
      flat = wk.reshape(wk.shape[0], -1).astype(jnp.float32)
      mean = (onehot.T @ flat) / jnp.maximum(onehot.sum(0), 1.0)[:, None]
      return jnp.where(transforms.rows(got, rep), mean.reshape(rep.shape).astype(rep.dtype), rep)
    replica_model_state = jax.tree.map(take_mean, replica_model_state, worker_model_state)
    if "stats_mean" in args:   # absent from args built before the field existed
      replica_model_state = mean_of_first(replica_model_state,
                                          jnp.asarray(args["stats_mean"], jnp.int32))
    replica_model_state = adopt_replicas(average_replicas(replica_model_state, average), adopt)
    worker_model_state = jax.tree.map(lambda w, r: jnp.where(transforms.rows(pulls, w), r[groups], w),
                                      worker_model_state, replica_model_state)
  return replica_params, tx_state, worker_params, replica_model_state, worker_model_state
