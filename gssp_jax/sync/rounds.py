"""A round: what the device does at one protocol event, as fixed-shape data.

Protocols emit rounds (host NumPy); the executor stacks them and replays them
with :func:`apply_round`, which is pure and jittable. Every round carries every
field, so a stack of rounds of any scheme has one static shape.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax import host_state
from gssp_jax.sync import transforms


class Round(NamedTuple):
  """One protocol event. W workers, R replicas, G exchange groups (1 when unused).

  Attributes:
    time: virtual time of the event (host only; not passed to transforms).
    arrived: ``[W]`` bool, gradients that reach their replica now.
    pulls: ``[W]`` bool, workers that copy their replica's weights after the round.
    groups: ``[W]`` int32, each worker's group in its scheme's transform: the
      replica it talks to (GSSP's group server, DS-Sync's own), or, where the
      scheme has one replica, another grouping (InHAD's nodes); ``replica_route``.
    applies: ``[R]`` bool, replicas that take an optimizer step.
    forward: ``[G]`` bool, GSSP groups that forward their pending sum.
    deliver: ``[G]`` bool, GSSP forwards delivered now.
    aggregate: ``[]`` bool, InHAD's server pulls the node aggregates.
    adopt: ``[R]`` int32, replica whose weights each replica copies (-1: none).
    adopt_weight: ``[R]`` float32, how much of them: a replica with ``adopt[r] >= 0``
      becomes ``(1 - w) itself + w adopt[r]`` (1: a copy; HALoS's merge: alpha).
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
  adopt_weight: np.ndarray


# The fields a protocol may leave as they are: every round carries them, most schemes use few.
OPTIONAL_FIELDS = ("forward", "deliver", "aggregate", "adopt", "average", "stats_mean",
                   "adopt_weight")


@functools.lru_cache(maxsize=64)
def empty_fields(num_workers: int, num_replicas: int, num_groups: int) -> dict:
  """An empty round's fields but ``time`` and ``groups``, read-only (shared templates)."""
  fields = {"arrived": np.zeros([num_workers], bool), "pulls": np.zeros([num_workers], bool),
            "applies": np.zeros([num_replicas], bool),
            "forward": np.zeros([num_groups], bool), "deliver": np.zeros([num_groups], bool),
            "aggregate": np.zeros([], bool), "adopt": np.full([num_replicas], -1, np.int32),
            "average": np.full([num_replicas], -1, np.int32),
            "stats_mean": np.full([num_replicas], -1, np.int32),
            "adopt_weight": np.ones([num_replicas], np.float32)}
  for x in fields.values():
    x.flags.writeable = False
  return fields


@functools.lru_cache(maxsize=256)
def _templates(num_workers: int, num_replicas: int, num_groups: int, writable: tuple) -> tuple:
  """``(arrived, pulls, applies, [(optional field's template, copy it?)])`` for :func:`empty_round`."""
  t = empty_fields(num_workers, num_replicas, num_groups)
  return (t["arrived"], t["pulls"], t["applies"],
          tuple((t[name], name in writable) for name in OPTIONAL_FIELDS))


def empty_round(time: float, num_workers: int, num_replicas: int, num_groups: int,
                groups: np.ndarray, writable: Sequence[str] = OPTIONAL_FIELDS) -> Round:
  """A round in which nothing happens; protocols fill in the fields they use.

  ``arrived``, ``pulls``, ``applies`` and ``groups`` are the round's own;
  of :data:`OPTIONAL_FIELDS`, those in ``writable`` too, and the others are
  the shared read-only empty values (``Protocol.round_fields`` declares a
  protocol's: writing another raises at once, and the simulator never copies
  or stacks them).
  """
  return round_maker(num_workers, num_replicas, num_groups, tuple(writable))(
      time, np.array(groups, np.int32))


@functools.lru_cache(maxsize=256)
def round_maker(num_workers: int, num_replicas: int, num_groups: int, writable: tuple):
  """``(time, groups) -> Round``: :func:`empty_round` of these sizes, for a caller that makes
  many (a protocol's :meth:`new_round`). ``groups`` is taken as it is, not copied."""
  arrived, pulls, applies, optional = _templates(num_workers, num_replicas, num_groups, writable)
  copied = tuple(own for _, own in optional)
  templates = tuple(x for x, _ in optional)
  new = tuple.__new__
  if not any(copied):   # every optional field the shared empty value (GSSP's plain pushes)

    def make_plain(time: float, groups: np.ndarray) -> Round:
      return new(Round, (float(time), arrived.copy(), pulls.copy(), groups, applies.copy(),
                         *templates))
    return make_plain

  def make(time: float, groups: np.ndarray) -> Round:
    return new(Round, (float(time), arrived.copy(), pulls.copy(), groups, applies.copy(),
                       *[x.copy() if own else x for x, own in zip(templates, copied)]))
  return make


def _stack(arrays: list) -> np.ndarray:
  """``np.stack`` of equal-shaped arrays, for many small ones (a round's fields): 2x faster.
  (``np.concatenate`` then a reshape is faster still for a few hundred, slower for under about
  20: no faster overall in a run, measured 2026-11-27.)"""
  return np.array(arrays)


def stack_fields(rounds: Sequence[Round], names: Sequence[str],
                 writable: Sequence[str] = OPTIONAL_FIELDS) -> dict[str, np.ndarray]:
  """``{name: [n, ...]}`` of ``rounds``' fields ``names`` (leading axis = round).

  A field its protocol does not write (not in ``writable``) is every round's
  empty value: broadcast, read-only, with nothing stacked.
  """
  out = {}
  for name in names:
    if name in OPTIONAL_FIELDS and name not in writable:
      first = getattr(rounds[0], name)
      out[name] = np.broadcast_to(first, (len(rounds), *first.shape))
    elif name in OPTIONAL_FIELDS:
      first = rounds[0]
      empty = empty_fields(first.arrived.size, first.applies.size, first.forward.size)[name]
      out[name] = _stack_optional([getattr(r, name) for r in rounds], empty)
    else:
      out[name] = _stack([getattr(r, name) for r in rounds])
  return out


def _stack_optional(values: list, empty: np.ndarray) -> np.ndarray:
  """:func:`_stack` of an optional field, whose rounds that did not write it share its read-only
  ``empty`` value (``Protocol.new_round``'s ``writable``): only the others are gathered."""
  own = [i for i, x in enumerate(values) if x is not empty]
  if len(own) * 2 > len(values) or empty.shape != values[0].shape:
    return _stack(values)
  out = np.broadcast_to(empty, (len(values), *empty.shape)).copy()
  if own:
    out[own] = _stack([values[i] for i in own])
  return out


# The index args of a sparse round (``round_indices``): each lists, ascending and padded with
# an out-of-range id, the only rows of a worker or replica axis that the round may change.
INDEX_ARGS = ("worker_ids", "replica_ids")


# The smallest bucket of worker ids. A worker row costs a round a copy of its weights or
# gradient, the same for a few rows as for one, while each bucket size met is one more
# compilation of the round: with no floor a 16-worker run compiled up to 5 worker sizes, a
# 4-worker one 3 (about a second each for LeNet-5 on a 2-core CPU). Replica ids keep no floor:
# each replica row is an optimizer step (Adam on one group server, not on four).
MIN_WORKER_BUCKET = 4


def bucket(n: int, cap: int, floor: int = 1) -> int:
  """The padded size of ``n`` ids: the next power of two, at least ``floor``, at most ``cap``."""
  return min(max(1 << max(0, int(n) - 1).bit_length(), floor), max(int(cap), 1))


def _padded_ids(ids: np.ndarray, size: int, num: int) -> np.ndarray:
  """``ids`` padded to ``size`` with the distinct out-of-range ids ``num, num + 1, ...``."""
  out = np.arange(num, num + size, dtype=np.int32)
  out[:ids.size] = ids
  return out


def round_indices(args: dict, *, num_worker_ids: int | None = None,
                  num_replica_ids: int | None = None) -> dict[str, np.ndarray]:
  """The rows a round touches, as fixed-size host index arrays (``INDEX_ARGS``).

  ``worker_ids``: the workers that arrive or pull, padded with ``W, W + 1, ...``;
  ``replica_ids``: the replicas that apply, are averaged or adopt, padded with
  ``R, R + 1, ...`` (distinct, so every scatter by them has unique ids).
  With them :func:`apply_round` reads and writes only those rows, so a round's
  cost follows the workers and replicas it involves, not ``W x params``.
  Sizes are powers of two (``bucket``; worker ids at least
  ``MIN_WORKER_BUCKET``), so a jitted round compiles once per pair of sizes;
  ``num_worker_ids``/``num_replica_ids`` force larger sizes (rounds stacked
  for a ``lax.scan`` must share them).

  Args:
    args: the round's fields (``round_args``), host arrays.
    num_worker_ids: the size of ``worker_ids``; default its bucket.
    num_replica_ids: the size of ``replica_ids``; default its bucket.

  Raises:
    ValueError: a size smaller than the ids it must hold, or above ``W``/``R``.
  """
  arrived = np.asarray(args["arrived"], bool)
  applies = np.asarray(args["applies"], bool)
  num_workers, num_replicas = arrived.shape[0], applies.shape[0]
  workers = np.flatnonzero(arrived | np.asarray(args["pulls"], bool))
  replicas = np.flatnonzero(applies | (np.asarray(args.get("average", -1)) >= 0)
                            | (np.asarray(args.get("adopt", -1)) >= 0))
  sizes = []
  for name, ids, size, cap, floor in (
      ("num_worker_ids", workers, num_worker_ids, num_workers, MIN_WORKER_BUCKET),
      ("num_replica_ids", replicas, num_replica_ids, num_replicas, 1)):
    size = bucket(ids.size, cap, floor) if size is None else size
    if not ids.size <= size <= max(cap, 1):
      raise ValueError(f"{name}={size} is invalid for a round with {ids.size} such ids; "
                       f"allowed: {ids.size} to {cap}")
    sizes.append(size)
  return {"worker_ids": _padded_ids(workers, sizes[0], num_workers),
          "replica_ids": _padded_ids(replicas, sizes[1], num_replicas)}


def with_indices(args: dict) -> dict:
  """``args`` plus ``round_indices(args)`` (the sparse round's ids), if it has none yet."""
  if all(k in args for k in INDEX_ARGS):
    return args
  return {**args, **round_indices(args)}


def with_common_indices(rounds: Sequence[dict]) -> list[dict]:
  """Every round's args plus its ids, padded to the largest sizes among ``rounds``.

  Rounds stacked for one ``lax.scan`` need one shape; the largest bucket among
  them keeps the padding (and the number of compilations) small.
  """
  own = [round_indices(r) for r in rounds]
  num_w = max(i["worker_ids"].size for i in own)
  num_r = max(i["replica_ids"].size for i in own)
  return [{**r, **round_indices(r, num_worker_ids=num_w, num_replica_ids=num_r)}
          for r in rounds]


def round_args(rnd: Round) -> dict[str, Any]:
  """The extra args a transform chain receives for ``rnd`` (every field but ``time``)."""
  return {k: v for k, v in rnd._asdict().items() if k != "time"}


def stack_rounds(rounds: Sequence[Round]) -> dict[str, np.ndarray]:
  """Stacks rounds field by field (leading axis = round), e.g. for a ``lax.scan``."""
  return {k: np.stack([np.asarray(getattr(r, k)) for r in rounds]) for k in Round._fields}


def average_replicas(tree, average: jax.Array, replica_ids=None):
  """Replaces each replica with ``average[r] >= 0`` by the mean of its averaging group.

  Only the rows in ``replica_ids`` (default all) are read and written; it must
  list every averaged replica (``round_indices`` does).
  """
  num = average.shape[0]
  ids, safe, valid = transforms.ids_or_all(replica_ids, num)
  group = average[safe]
  member = (group >= 0) & valid                                        # [K]
  same = ((group[:, None] == group[None, :]) & member[:, None] & member[None, :])
  onehot = same.astype(jnp.float32)                                    # [K, K]
  counts = jnp.maximum(onehot.sum(1), 1.0)

  def one(x):
    rows_in = x[safe]
    flat = rows_in.reshape(ids.shape[0], -1).astype(jnp.float32)
    means = transforms.exact_matmul(onehot, flat) / counts[:, None]
    means = means.reshape(rows_in.shape).astype(x.dtype)
    return x.at[ids].set(jnp.where(transforms.rows(member, rows_in), means, rows_in), mode="drop",
                         unique_indices=True)
  return jax.tree.map(one, tree)


def mean_of_first(tree, count: jax.Array):
  """Replaces each replica with ``count[r] >= 1`` by the mean of replicas ``0..count[r]-1``."""
  num = count.shape[0]
  weights = (jnp.arange(num)[None, :] < count[:, None]).astype(jnp.float32)   # [R, R]
  weights = weights / jnp.maximum(weights.sum(1, keepdims=True), 1.0)
  take = count >= 1

  def one(x):
    flat = x.reshape(num, -1).astype(jnp.float32)
    means = transforms.exact_matmul(weights, flat)
    return jnp.where(transforms.rows(take, x), means.reshape(x.shape).astype(x.dtype), x)
  return jax.tree.map(one, tree)


def adopt_replicas(tree, adopt: jax.Array, weight=None, replica_ids=None):
  """Each replica with ``adopt[r] >= 0`` takes replica ``adopt[r]``'s values.

  With ``weight`` (``[R]``), it becomes ``(1 - weight[r]) x[r] + weight[r] x[adopt[r]]``
  instead; a weight of 1 is the copy, bit for bit (selected, not mixed). With
  ``replica_ids`` (every adopting replica listed) only those rows are read and
  written; every copy reads the values before any is written.
  """
  num = adopt.shape[0]
  ids, safe, valid = transforms.ids_or_all(replica_ids, num)
  target = adopt[safe]
  take = (target >= 0) & valid
  src = jnp.where(target >= 0, target, safe)
  w = (jnp.ones(ids.shape, jnp.float32) if weight is None
       else jnp.asarray(weight, jnp.float32)[safe])

  def one(x):
    old, new = x[safe], x[src]
    mixed = ((1.0 - transforms.rows(w, old)) * old.astype(jnp.float32)
             + transforms.rows(w, old) * new.astype(jnp.float32)).astype(x.dtype)
    rows_out = jnp.where(transforms.rows(take, old),
                         jnp.where(transforms.rows(w == 1.0, old), new, mixed), old)
    if replica_ids is None:
      return rows_out
    return x.at[ids].set(rows_out, mode="drop", unique_indices=True)
  return jax.tree.map(one, tree)


def replica_route(groups: jax.Array, num_replicas: int) -> jax.Array:
  """``[W]`` the replica each worker pushes to and pulls from.

  A round's ``groups`` name replicas where a scheme has several; with one
  replica every worker's is 0, whatever grouping ``groups`` carries (InHAD's
  node ids: reading them as replicas kept the statistics of node 0's workers
  only, and its pulls worked only because the gather clamps to row 0).
  """
  return groups if num_replicas > 1 else jnp.zeros_like(groups)


def pull_rows(workers, replicas, groups: jax.Array, pulls: jax.Array, worker_ids=None):
  """Workers in ``pulls`` take their replica's (``groups[w]``) values; only ``worker_ids`` rows.

  Without ``worker_ids`` every row is selected in place (one pass over ``[W, ...]``). With
  them, a listed worker that does not pull is written nowhere (its id moved past the padding,
  ``mode="drop"``): no row of ``workers`` is read, so where its rows are split over devices by
  owner (``sim/devices.py``) a round's pull is a write on the owner alone, with no exchange.
  """
  num = groups.shape[0]
  if worker_ids is None:
    return jax.tree.map(lambda w, r: jnp.where(transforms.rows(pulls, w), r[groups], w),
                        workers, replicas)
  ids, safe, valid = transforms.ids_or_all(worker_ids, num)
  take = pulls[safe] & valid
  src = groups[safe]
  # Distinct ids past the padding's (num .. num + K - 1) for the slots that do not pull.
  k = ids.shape[0]
  target = jnp.where(take, ids, num + k + jnp.arange(k, dtype=ids.dtype))
  return jax.tree.map(lambda w, r: w.at[target].set(r[src].astype(w.dtype), mode="drop",
                                                    unique_indices=True), workers, replicas)


def arrived_mean(replica_model_state, worker_model_state, groups, arrived, num_replicas: int,
                 worker_ids=None):
  """Each replica's model state as the mean of its arrived workers' (unchanged where none arrived).

  Args:
    replica_model_state: ``[R, ...]`` the replicas' non-trainable state.
    worker_model_state: ``[W, ...]`` the workers' state from this round's forward passes.
    groups: ``[W]`` each worker's replica (``replica_route``).
    arrived: ``[W]`` the workers whose push this round holds.
    num_replicas: R.
    worker_ids: the listed workers (``round_indices``), or None for every row.
  """
  ids, safe, valid = transforms.ids_or_all(worker_ids, groups.shape[0])
  onehot = ((groups[safe][:, None] == jnp.arange(num_replicas)[None, :])
            & (arrived[safe] & valid)[:, None]).astype(jnp.float32)          # [K, R]
  got = onehot.sum(0) > 0

  def take_mean(rep, wk):
    flat = wk[safe].reshape(ids.shape[0], -1).astype(jnp.float32)
    mean = transforms.exact_matmul(onehot.T, flat) / jnp.maximum(onehot.sum(0), 1.0)[:, None]
    return jnp.where(transforms.rows(got, rep), mean.reshape(rep.shape).astype(rep.dtype), rep)
  return jax.tree.map(take_mean, replica_model_state, worker_model_state)


def never(field) -> bool:
  """Whether a replica field (``average``, ``adopt``, ``stats_mean``: -1 for none) is known, on
  the host, to name no replica: a host array of -1s (the level executor passes a field its
  protocol never sets as its empty value, ``chunk.never_set``). A traced field is never known."""
  return isinstance(field, np.ndarray) and not (field >= 0).any()


def apply_round(tx: optax.GradientTransformationExtraArgs, replica_params, tx_state,
                worker_params, worker_grads, args: dict, replica_model_state=None,
                worker_model_state=None):
  """Applies one round: the chain's updates, averaging, adoption, then the workers' pulls.

  Cost: with ``worker_ids``/``replica_ids`` a round gathers the ``K`` listed
  workers' gradients, steps the optimizer of the ``Kr`` listed replicas and
  writes the pulling workers' rows: ``(K + Kr) x params``, plus elementwise
  work over the ``R`` replicas' weights; never ``W x params``.

  Model state, in order: arrived workers' statistics, ``stats_mean``,
  averaging, adoption, pulls. A replica field known on the host to name no replica
  (:func:`never`) leaves its pass out (it would change nothing).

  Args:
    tx: ``optax.chain(<compressor>, <sync transform>, replicated(<optimizer>, R))``.
    replica_params: ``[R, ...]`` server replicas' weights.
    tx_state: the chain's state.
    worker_params: ``[W, ...]`` weights each worker last pulled.
    worker_grads: ``[W, ...]`` gradients; only arrived workers' are used.
    args: the round's fields (``round_args``), host arrays or traced; with
      the ``INDEX_ARGS`` (``round_indices``) only the listed workers' and
      replicas' rows are read and written (the sync transforms and
      ``transforms.replicated`` receive them too), else every row. An
      optional ``pull_ids`` lists the pulling workers apart (the level
      executor's rounds: ``worker_ids`` then lists only the arrived ones).
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
  average, adopt = args["average"], args["adopt"]
  worker_ids, replica_ids = args.get("worker_ids"), args.get("replica_ids")
  pull_ids = args.get("pull_ids", worker_ids)
  weight = args.get("adopt_weight")   # absent from the real runtime's shards' args: copies

  def exchange(tree):   # averaging, then adoption; a pass whose field is never set is left out
    if not never(average):
      tree = average_replicas(tree, jnp.asarray(average, jnp.int32), replica_ids)
    if not never(adopt):
      tree = adopt_replicas(tree, jnp.asarray(adopt, jnp.int32), weight, replica_ids)
    return tree
  replica_params = exchange(replica_params)
  arrived = jnp.asarray(args["arrived"], bool)
  num_replicas = jnp.asarray(args["applies"]).shape[0]
  groups = replica_route(jnp.asarray(args["groups"], jnp.int32), num_replicas)
  pulls = jnp.asarray(args["pulls"], bool)
  worker_params = pull_rows(worker_params, replica_params, groups, pulls, pull_ids)
  if replica_model_state is not None and jax.tree.leaves(replica_model_state):
    replica_model_state = arrived_mean(replica_model_state, worker_model_state, groups, arrived,
                                       num_replicas, worker_ids)
    stats_mean = args.get("stats_mean")   # absent from args built before the field existed
    if stats_mean is not None and not never(stats_mean):
      replica_model_state = mean_of_first(replica_model_state,
                                          jnp.asarray(stats_mean, jnp.int32))
    replica_model_state = exchange(replica_model_state)
    worker_model_state = pull_rows(worker_model_state, replica_model_state, groups, pulls,
                                   pull_ids)
  return replica_params, tx_state, worker_params, replica_model_state, worker_model_state


host_state.allow(Round)   # the protocols' pending rounds are host state
