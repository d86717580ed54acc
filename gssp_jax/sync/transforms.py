"""The device side's shared machinery: the server's core and what every scheme's transform uses.

Each scheme's own transform is in its package (``sync/schemes/<name>/transform.py``).

``update(worker_grads, state, params, **extra)`` takes gradients stacked on a
leading worker axis (``[W, ...]``, each computed on the parameters that worker
pulled) and returns updates with a leading **replica** axis ``[R, ...]``: one
slice per server replica (the server; group servers and a global server; or,
for DS-Sync, every worker's own copy). Chain an optimizer behind it with
:func:`replicated`, which gives every replica its own optimizer state and steps
only the replicas that apply this round::

    tx = optax.chain(topk(W), ssp(W, 3), replicated(optax.sgd(0.1, 0.9), 1))

What happens in a round is decided on the host by the scheme's protocol
(``sync/schemes/<name>/protocol.py``) and arrives as keyword-only extra args, so the
transform never branches in Python on arrays and never recompiles:

* ``arrived`` ``[W]`` bool: workers whose gradient reaches its replica now
  (default: all).
* ``groups`` ``[W]`` int32: the replica (GSSP group, InHAD node) each worker
  talks to this round (default: the static assignment of the factory).
* ``pulls`` ``[W]`` bool: workers that pull after this round (default:
  ``arrived``); recorded to measure staleness.
* ``applies`` ``[R]`` bool: replicas that take an optimizer step (default:
  derived from the other masks).
* ``forward``/``deliver`` ``[G]`` bool (GSSP), ``aggregate`` ``[]`` bool
  (InHAD), ``adopt`` ``[R]`` int32 (GSSP global: the source replica a replica
  copies, -1 for none).
* ``no_branches`` (a Python bool, default False): the round runs inside a
  device program of many rounds (the level executor's chunk), where a
  ``lax.cond`` or a data-dependent loop costs a round trip to the host on a
  GPU; the transforms then use masks and fixed trip counts, with the same
  result. One round per call (the ``rounds`` executor, the real runtime)
  keeps the branches, which skip work a round does not need.

``init`` takes ONE replica's parameters (no replica axis); ``update`` takes the
replicas' parameters ``[R, ...]`` (only the optimizer behind uses them).
Unknown extra args are ignored. Staleness of an applied gradient is the number
of updates its replica applied between the worker's pull and the gradient's
application; ``state.staleness`` holds it for each worker's latest one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from gssp_jax.sync import arguments

_INT32_MAX = np.iinfo(np.int32).max


class ServerState(NamedTuple):
  """Staleness state of schemes without buffers (BSP, ASP, SSP, DSSP, CASP, DS-Sync).

  Attributes:
    clock: ``[W]`` int32 gradients of each worker applied so far (saturating).
    read: ``[W]`` int32 version of its replica each worker last pulled.
    staleness: ``[W]`` int32 staleness of each worker's latest applied
      gradient; -1 before its first.
    version: ``[R]`` int32 updates applied by each replica (saturating).
  """
  clock: jax.Array
  read: jax.Array
  staleness: jax.Array
  version: jax.Array


# ---------------------------------------------------------------- shared pieces


def _saturating_add(x: jax.Array, inc: jax.Array) -> jax.Array:
  inc = inc.astype(jnp.int32)
  return jnp.where(x > _INT32_MAX - inc, _INT32_MAX, x + inc).astype(jnp.int32)


def _mask(value, shape, dtype, default):
  if value is None:
    return jnp.full(shape, default, dtype)
  return jnp.broadcast_to(jnp.asarray(value, dtype), shape)


def worker_masks(num_workers: int, static_route, arrived, groups, pulls):
  """A round's ``[W]`` ``(arrived, route, pulls)``; by default every worker arrives, on its
  static group (``static_route``), and the arrived ones pull."""
  arrived = _mask(arrived, [num_workers], bool, True)
  route = jnp.asarray(static_route) if groups is None else jnp.asarray(groups, jnp.int32)
  pulls = arrived if pulls is None else _mask(pulls, [num_workers], bool, True)
  return arrived, route, pulls


def route_sum(grads, arrived: jax.Array, route: jax.Array, num_out: int, scale: float,
              worker_ids=None):
  """``out[r] = scale * sum of grads[w] with arrived[w] and route[w] == r``; leaves ``[num_out, ...]``.

  With ``worker_ids`` (``[K]`` ascending, padded with ``W``; every arrived
  worker listed) only those K rows of ``grads`` are read: ``K x params``
  instead of ``W x params``. The sum runs over them in worker order either way.
  """
  if worker_ids is None:
    take, route_k, pick = arrived, route, lambda g: g
  else:
    _, safe, valid = ids_or_all(worker_ids, arrived.shape[0])
    take, route_k, pick = arrived[safe] & valid, route[safe], lambda g: g[safe]
  onehot = (route_k[:, None] == jnp.arange(num_out)[None, :]) & take[:, None]
  weights = onehot.astype(jnp.float32) * jnp.float32(scale)   # [K, R]

  def one(g):
    g = pick(g)
    flat = g.reshape(g.shape[0], -1).astype(jnp.float32)
    return exact_matmul(weights.T, flat).reshape((num_out,) + g.shape[1:])
  return jax.tree.map(one, grads)


def _init_clocks(num_workers: int, num_replicas: int) -> dict:
  return dict(clock=jnp.zeros([num_workers], jnp.int32), read=jnp.zeros([num_workers], jnp.int32),
              staleness=jnp.full([num_workers], -1, jnp.int32),
              version=jnp.zeros([num_replicas], jnp.int32))


def _account(state, *, arrived, route, pulls, applies, bumps=None):
  """Clock, staleness and version bookkeeping of one round.

  ``arrived`` workers' gradients are applied now by replica ``route[w]``: their
  staleness is the replica's version before this round minus what they read.
  Replicas in ``applies`` (and ``bumps``, e.g. adopted weights) advance their
  version; then ``pulls`` workers read the new version of their replica.
  """
  staleness = jnp.where(arrived, pick(state.version, route) - state.read, state.staleness)
  clock = _saturating_add(state.clock, arrived)
  inc = applies.astype(jnp.int32) + (0 if bumps is None else bumps.astype(jnp.int32))
  version = _saturating_add(state.version, inc)
  read = jnp.where(pulls, pick(version, route), state.read)
  return dict(clock=clock, read=read, staleness=staleness.astype(jnp.int32), version=version)


# Up to this many replicas (groups) a round's clocks index them by one-hot sums, above it by a
# gather or a scatter: a one-hot comparison is ``[W, N]`` elementwise work, cheap for a few
# group servers, quadratic where every worker has a replica of its own (DS-Sync).
ONE_HOT_MAX = 16


def pick(values: jax.Array, index: jax.Array) -> jax.Array:
  """``values[index]`` for a short ``[N]`` integer vector (``index`` in range).

  For ``N <= ONE_HOT_MAX`` a sum over a one-hot comparison: elementwise work XLA fuses with
  what reads it, where a gather is a kernel of its own (a GSSP round's clocks: several fewer
  kernels a round on a CPU); else the gather. Exact for integers either way.
  """
  if values.shape[0] > ONE_HOT_MAX:
    return values[index]
  onehot = index[..., None] == jnp.arange(values.shape[0], dtype=index.dtype)
  return jnp.sum(jnp.where(onehot, values, jnp.zeros((), values.dtype)), axis=-1)


def count_into(num: int, index: jax.Array, weights: jax.Array) -> jax.Array:
  """``zeros[num].at[index].add(weights)`` for integer ``weights`` (``index`` in range): for
  ``num <= ONE_HOT_MAX`` a sum over a one-hot comparison (fused, where a scatter is a kernel of
  its own), else the scatter. Exact either way."""
  if num > ONE_HOT_MAX:
    return jnp.zeros([num], weights.dtype).at[index].add(weights)
  onehot = index[:, None] == jnp.arange(num, dtype=index.dtype)
  return jnp.sum(jnp.where(onehot, weights[:, None], jnp.zeros((), weights.dtype)), axis=0)


# Shared with the schemes' transforms (sync/schemes/*/transform.py).
init_clocks, mask, account, saturating_add = _init_clocks, _mask, _account, _saturating_add


def zeros_like_stacked(params, n: int):
  return jax.tree.map(lambda p: jnp.zeros((n, *jnp.shape(p)), jnp.float32), params)


# ---------------------------------------------------------------- the server's core


def server_sync(num_workers: int, *, num_replicas: int = 1, assignment=None, scale: float | None = None,
                name: str = "server") -> optax.GradientTransformationExtraArgs:
  """Applies every arrived gradient at once at its replica, scaled: the core of most schemes.

  Args:
    num_workers: W.
    num_replicas: R; each worker routes to ``assignment[w]`` (default all to 0).
    assignment: static ``[W]`` replica ids, overridden per round by ``groups``.
    scale: factor on every worker gradient; default ``1 / W`` (a full round of
      W pushes then moves as far as one BSP step).
    name: the scheme's name, for error messages.
  """
  num_workers = arguments.check_int(name, "num_workers", num_workers, 1)
  num_replicas = arguments.check_int(name, "num_replicas", num_replicas, 1)
  scale = arguments.check_scale(name, 1.0 / num_workers if scale is None else scale)
  static_route = (np.zeros([num_workers], np.int32) if assignment is None
                  else arguments.check_assignment(name, "assignment", assignment, num_workers,
                                                  num_replicas))

  def init(params):
    del params
    return ServerState(**_init_clocks(num_workers, num_replicas))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             worker_ids=None, **extra):
    del params, extra
    arrived, route, pulls = worker_masks(num_workers, static_route, arrived, groups, pulls)
    if applies is None:
      applies = jnp.zeros([num_replicas], bool).at[route].max(arrived)
    applies = _mask(applies, [num_replicas], bool, True)
    out = route_sum(updates, arrived, route, num_replicas, scale, worker_ids)
    out = jax.tree.map(lambda u: jnp.where(applies.reshape((-1,) + (1,) * (u.ndim - 1)), u, 0.0),
                       out)
    return out, ServerState(**_account(state, arrived=arrived, route=route, pulls=pulls,
                                       applies=applies))

  return optax.GradientTransformationExtraArgs(init, update)


def exact_matmul(weights: jax.Array, flat: jax.Array) -> jax.Array:
  """``weights @ flat`` in full float32: the sums and means over workers and replicas.

  A GPU runs a float32 matmul at TF32 by default (a 10-bit mantissa), which
  rounds every parameter or gradient that goes through a replica mean or a
  gradient sum to about 3 decimal digits: on an H200, one epoch of weight
  decay by ``1 - 2.5e-5`` vanished in DS-Sync's averaging. HIGHEST keeps these
  exact on every backend (the CPU computes float32 either way).
  """
  return jnp.matmul(weights, flat, precision=lax.Precision.HIGHEST)


def ids_or_all(ids, num: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(ids, safe, valid)`` of a padded id list over an axis of ``num`` rows.

  ``ids`` None means every row. ``safe`` clamps padding (``id >= num``) into
  range for gathers, whose results ``valid`` masks; scatters use ``ids`` with
  ``mode="drop"`` so padding writes nowhere (``rounds.round_indices`` pads with
  distinct ids ``num, num + 1, ...``, so every scatter's ids are unique).
  """
  ids = jnp.arange(num, dtype=jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32)
  return ids, jnp.minimum(ids, num - 1), ids < num


def rows(mask: jax.Array, like: jax.Array) -> jax.Array:
  """Broadcasts a ``[N]`` mask against a ``[N, ...]`` leaf."""
  return mask.reshape((-1,) + (1,) * (like.ndim - 1))


def stack(tree, n: int):
  """``n`` copies of every leaf along a new leading axis (replicas or workers)."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)


# ---------------------------------------------------------------- replica optimizer


class ReplicatedState(NamedTuple):
  """``inner``: the inner optimizer's state with a leading ``[R]`` axis on every leaf."""
  inner: Any


def replicated(inner: optax.GradientTransformation,
               num_replicas: int) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` independently on every replica; only replicas in ``applies`` step.

  Parameters and updates carry a leading ``[R]`` axis. A replica outside
  ``applies`` keeps its optimizer state and gets a zero update, so momentum
  and Adam's counters move only when that server really applies something, as
  a real parameter server's would. Without ``applies`` every replica steps.

  With the extra arg ``replica_ids`` (``[Kr]`` ascending, padded past ``R``;
  every applying replica listed, as ``rounds.round_indices`` builds it) the
  inner optimizer runs on those ``Kr`` replicas only, written back one at a
  time and in place (``_listed_update``), so its cost follows the replicas
  that apply. The extra arg ``no_branches=True`` (a Python bool: the level
  executor's rounds set it) writes them back in a loop of exactly ``Kr``
  steps rather than one that stops at the listed count: no data-dependent
  loop, which on a GPU would return to the host every step.
  """
  num_replicas = arguments.check_int("replicated", "num_replicas", num_replicas, 1)

  def init(params):
    # Like every transform of a sync chain, init takes ONE replica's parameters
    # (no replica axis): all replicas start from the same weights.
    return ReplicatedState(inner=jax.vmap(inner.init)(stack(params, num_replicas)))

  def update(updates, state, params=None, *, applies=None, replica_ids=None,
             no_branches=False, **extra):
    del extra  # The inner optimizer sees one replica; round masks are not its business.
    applies = _mask(applies, [num_replicas], bool, True)
    if replica_ids is not None:
      return _listed_update(inner, num_replicas, updates, state, params, applies, replica_ids,
                            static_trips=no_branches)
    if params is None:
      new_updates, new_inner = jax.vmap(lambda u, s: inner.update(u, s))(updates, state.inner)
    else:
      new_updates, new_inner = jax.vmap(inner.update)(updates, state.inner, params)
    keep = lambda new, old: jnp.where(rows(applies, new), new, old)
    new_inner = jax.tree.map(keep, new_inner, state.inner)
    new_updates = jax.tree.map(lambda u: jnp.where(rows(applies, u), u, jnp.zeros_like(u)),
                               new_updates)
    return new_updates, ReplicatedState(inner=new_inner)

  return optax.GradientTransformationExtraArgs(init, update)


def _listed_update(inner, num_replicas: int, updates, state: ReplicatedState, params,
                   applies: jax.Array, replica_ids, static_trips: bool = False):
  """``replicated``'s update for the listed replicas only (``replica_ids``, padded past ``R``).

  The listed replicas' rows are gathered (``[Kr, ...]``), their optimizers
  stepped (``vmap``), and the new rows written back one id at a time by a
  ``fori_loop`` that stops before the padding. A scatter back instead
  (``x.at[ids].set``) let XLA fuse the optimizer's arithmetic into the writes,
  which then read the old moments after their own write, so XLA copied every
  ``[R, ...]`` optimizer leaf each round (Seq2Seq with Adam: slower than
  stepping all replicas). A loop body cannot be fused with what precedes it,
  so its ``dynamic_update_slice`` writes happen in place: the round costs
  ``Kr x params`` in the optimizer plus one zero-filled ``[R, ...]`` update tree.

  ``static_trips``: the loop runs exactly ``Kr`` steps (a device program of
  many rounds, ``sim/chunk.py``: a trip count that is data costs a round trip
  to the host on a GPU); a padding step writes the last listed replica's new
  rows again (a no-op; an empty list writes row ``R - 1``'s own rows back). Up to
  ``ONE_HOT_MAX`` replicas the updates are then one select over the listed rows
  (:func:`_select_rows`: fused with what follows, no zero ``[R, ...]`` tree written row by
  row; XLA:CPU ran a GSSP level chunk 3-15 % faster) and the loop writes the optimizer
  state only.
  """
  ids, safe, valid = ids_or_all(replica_ids, num_replicas)
  pick = lambda tree: jax.tree.map(lambda x: x[safe], tree)
  old_inner = pick(state.inner)
  if params is None:
    new_updates, new_inner = jax.vmap(lambda u, s: inner.update(u, s))(pick(updates), old_inner)
  else:
    new_updates, new_inner = jax.vmap(inner.update)(pick(updates), old_inner, pick(params))
  # A listed replica that is only averaged or adopted keeps its state and gets a zero update.
  step = valid & applies[safe]                                             # [Kr]
  new_inner = jax.tree.map(lambda n, o: jnp.where(rows(step, n), n, o), new_inner, old_inner)
  new_updates = jax.tree.map(lambda u: jnp.where(rows(step, u), u, jnp.zeros_like(u)),
                             new_updates)
  # Listed ids come first, ascending: the loop stops before the padding, or repeats the last.
  count = jnp.sum(valid, dtype=jnp.int32)
  target = ids
  select = static_trips and num_replicas <= ONE_HOT_MAX   # the updates as one select, below
  if static_trips:
    src = jnp.where(valid, jnp.arange(ids.shape[0]), jnp.maximum(count - 1, 0))
    target, count = safe[src], ids.shape[0]
    new_inner = jax.tree.map(lambda x: x[src], new_inner)
    if not select:
      new_updates = jax.tree.map(lambda x: x[src], new_updates)
  row = lambda tree, i: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False),
                                     tree)
  put = lambda tree, r, new: jax.tree.map(
      lambda x, y: lax.dynamic_update_index_in_dim(x, y, r, 0), tree, new)

  if select:
    # The updates as one select over the few replicas (fused, exact: no sums), not a zero
    # [R, ...] tree written row by row; the optimizer state still written back in place.
    at = (ids[:, None] == jnp.arange(num_replicas)) & valid[:, None]             # [Kr, R]
    full_updates = jax.tree.map(lambda u: _select_rows(at, u), new_updates)
    full_inner = lax.fori_loop(0, count, lambda i, full: put(full, target[i], row(new_inner, i)),
                               state.inner)
    return full_updates, ReplicatedState(inner=full_inner)

  def write(i, carry):
    full_inner, full_updates = carry
    return (put(full_inner, target[i], row(new_inner, i)),
            put(full_updates, target[i], row(new_updates, i)))

  zeros = jax.tree.map(lambda u: jnp.zeros((num_replicas, *u.shape[1:]), u.dtype), new_updates)
  full_inner, full_updates = lax.fori_loop(0, count, write, (state.inner, zeros))
  return full_updates, ReplicatedState(inner=full_inner)


def _select_rows(at: jax.Array, rows_: jax.Array) -> jax.Array:
  """``out[r] = rows_[i]`` where ``at[i, r]`` (at most one ``i`` a replica), else 0: ``[R, ...]``."""
  out = jnp.zeros((at.shape[1], *rows_.shape[1:]), rows_.dtype)
  for i in range(at.shape[0]):
    out = jnp.where(rows(at[i], out), rows_[i][None], out)
  return out


# ---------------------------------------------------------------- accessors


def staleness(state) -> jax.Array:
  """``[W]`` int32 staleness of each worker's latest applied gradient (-1: none yet)."""
  return state.staleness


def clocks(state) -> jax.Array:
  """``[W]`` int32 gradients applied per worker."""
  return state.clock


def versions(state) -> jax.Array:
  """``[R]`` int32 updates applied per replica."""
  return state.version


def find_sync_state(chain_state):
  """The sync state inside an ``optax.chain`` state (the first with a ``staleness`` field)."""
  for s in (chain_state if isinstance(chain_state, tuple) and not hasattr(chain_state, "_fields")
            else (chain_state,)):
    if hasattr(s, "staleness") and hasattr(s, "version"):
      return s
  raise ValueError("no sync state (ServerState, GSSPState or InHADState) in this chain state")
