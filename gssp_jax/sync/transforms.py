"""Device side of every sync scheme: optax transforms from per-worker gradients to replica updates.

``update(worker_grads, state, params, **extra)`` takes gradients stacked on a
leading worker axis (``[W, ...]``, each computed on the parameters that worker
pulled) and returns updates with a leading **replica** axis ``[R, ...]``: one
slice per server replica (the server; group servers and a global server; or,
for DS-Sync, every worker's own copy). Chain an optimizer behind it with
:func:`replicated`, which gives every replica its own optimizer state and steps
only the replicas that apply this round::

    tx = optax.chain(topk(W), ssp(W, 3), replicated(optax.sgd(0.1, 0.9), 1))

What happens in a round is decided on the host by the scheme's protocol
(``gssp_jax.sync.protocols``) and arrives as keyword-only extra args, so the
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

import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

_INT32_MAX = np.iinfo(np.int32).max
INTER_GROUP = ("peer", "global")


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


class GSSPState(NamedTuple):
  """GSSP: ``ServerState`` fields plus the inter-group exchange buffers.

  Attributes:
    pending: pytree of ``[G, ...]`` float32, each group's sum of scaled pushes
      since its last forward.
    outbox: pytree of ``[G, ...]`` float32, forwards sent but not yet delivered.
    since_forward: ``[G]`` int32 pushes each group received since its last forward.
  """
  clock: jax.Array
  read: jax.Array
  staleness: jax.Array
  version: jax.Array
  pending: Any
  outbox: Any
  since_forward: jax.Array


class InHADState(NamedTuple):
  """InHAD: ``ServerState`` fields plus the node aggregates the server pulls.

  A worker may push several times before the server pulls the aggregates; each
  push is one gradient, applied (and counted in ``clock``) when the server
  pulls. The version cannot change while a gradient waits (the server applies
  every waiting gradient at once), so a gradient's staleness is fixed when it
  reaches its node: the version then minus the version its worker read.

  Attributes:
    node_acc: pytree of ``[N, ...]`` float32, each node's sum of scaled gradients
      not yet pulled by the server.
    waiting: ``[W]`` int32 gradients of the worker in its node's aggregate.
    pending_staleness: ``[W]`` int32 staleness of the worker's latest waiting gradient.
    pending_staleness_sum: ``[W]`` int32 summed staleness of its waiting gradients.
    staleness_total: ``[W]`` int32 summed staleness of its applied gradients
      (saturating); with ``clock`` and ``staleness`` (the latest applied
      gradient's) it pins every applied gradient's staleness.
    count: ``[]`` int32 iteration numbers the server counted since its last update.
  """
  clock: jax.Array
  read: jax.Array
  staleness: jax.Array
  version: jax.Array
  node_acc: Any
  waiting: jax.Array
  pending_staleness: jax.Array
  pending_staleness_sum: jax.Array
  staleness_total: jax.Array
  count: jax.Array


# ---------------------------------------------------------------- argument checks


def check_int(scheme: str, name: str, value: Any, minimum: int) -> int:
  """Returns ``value`` as int if it is an int >= minimum; else ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{scheme} {name}={value!r} is invalid; allowed: an int >= {minimum}")
  return int(value)


def check_scale(scheme: str, scale: Any) -> float:
  if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
      or not np.isfinite(float(scale)) or float(scale) <= 0):
    raise ValueError(f"{scheme} scale={scale!r} is invalid; allowed: a positive finite number")
  return float(scale)


def check_assignment(scheme: str, name: str, ids: Sequence[int], num_workers: int,
                     num_ids: int) -> np.ndarray:
  """Validates a static worker -> replica/group assignment of length W with ids in range."""
  arr = np.asarray(ids)
  if (arr.shape != (num_workers,) or not np.issubdtype(arr.dtype, np.integer)
      or np.any(arr < 0) or np.any(arr >= num_ids)):
    raise ValueError(f"{scheme} {name}={list(np.ravel(ids))!r} is invalid; allowed: "
                     f"{num_workers} ints in range({num_ids})")
  return arr.astype(np.int32)


def equal_groups(scheme: str, num_workers: int, num_groups: int) -> np.ndarray:
  """Contiguous equal groups ``[0]*m + [1]*m + ...``; the groups must divide the workers."""
  if num_workers % num_groups:
    raise ValueError(f"{scheme} num_groups={num_groups} does not divide num_workers="
                     f"{num_workers}; allowed: a divisor of {num_workers} for equal groups, "
                     "or pass an explicit assignment")
  return np.repeat(np.arange(num_groups, dtype=np.int32), num_workers // num_groups)


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
  staleness = jnp.where(arrived, state.version[route] - state.read, state.staleness)
  clock = _saturating_add(state.clock, arrived)
  inc = applies.astype(jnp.int32) + (0 if bumps is None else bumps.astype(jnp.int32))
  version = _saturating_add(state.version, inc)
  read = jnp.where(pulls, version[route], state.read)
  return dict(clock=clock, read=read, staleness=staleness.astype(jnp.int32), version=version)


# Shared with the transforms outside this module (sync/halos.py).
init_clocks, mask, account = _init_clocks, _mask, _account


def _zeros_like_stacked(params, n: int):
  return jax.tree.map(lambda p: jnp.zeros((n, *jnp.shape(p)), jnp.float32), params)


# ---------------------------------------------------------------- server schemes


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
  num_workers = check_int(name, "num_workers", num_workers, 1)
  num_replicas = check_int(name, "num_replicas", num_replicas, 1)
  scale = check_scale(name, 1.0 / num_workers if scale is None else scale)
  static_route = (np.zeros([num_workers], np.int32) if assignment is None
                  else check_assignment(name, "assignment", assignment, num_workers, num_replicas))

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


def bsp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """BSP: a round is every worker's gradient; the server applies their scaled sum (the mean)."""
  return server_sync(num_workers, scale=scale, name="bsp")


def asp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """ASP: each arrived gradient is applied at once; the protocol never blocks anyone."""
  return server_sync(num_workers, scale=scale, name="asp")


def ssp(num_workers: int, staleness: int = 3, *,
        scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """SSP(s): ASP's server; the protocol keeps every worker within ``s`` clocks of the slowest."""
  check_int("ssp", "staleness", staleness, 0)
  return server_sync(num_workers, scale=scale, name="ssp")


def check_staleness_range(scheme: str, staleness_range) -> tuple[int, int]:
  try:
    low, high = staleness_range
  except (TypeError, ValueError):
    raise ValueError(f"{scheme} staleness_range={staleness_range!r} is invalid; "
                     "allowed: a pair (s_L, s_U) of ints with 0 <= s_L <= s_U") from None
  low = check_int(scheme, "s_L", low, 0)
  high = check_int(scheme, "s_U", high, 0)
  if low > high:
    raise ValueError(f"{scheme} staleness_range=({low}, {high}) is invalid: s_L={low} > "
                     f"s_U={high}; allowed: 0 <= s_L <= s_U")
  return low, high


def dssp(num_workers: int, staleness_range=(3, 15), *,
         scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """DSSP([s_L, s_U]): SSP's server; the protocol picks each threshold in ``[s_L, s_U]``."""
  check_staleness_range("dssp", staleness_range)
  return server_sync(num_workers, scale=scale, name="dssp")


def casp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """CASP: a round is one community's gradients, applied as one scaled sum."""
  return server_sync(num_workers, scale=scale, name="casp")


def dssync(num_workers: int, *, scale: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """DS-Sync: no server; every worker applies its own gradient to its own replica (R = W).

  Averaging inside the round's groups is a parameter operation done after the
  optimizer step (``rounds.apply_round`` with the ``average`` field).
  """
  return server_sync(num_workers, num_replicas=num_workers,
                     assignment=np.arange(num_workers), scale=scale, name="dssync")


# ---------------------------------------------------------------- GSSP


def gssp(num_workers: int, num_groups: int = 4, *, inter_group: str = "peer",
         assignment=None, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """GSSP: SSP inside groups at group servers, asynchronous exchange between groups.

  Replicas: the ``G`` group servers, plus, when ``inter_group="global"``, a
  global server at index ``G`` and ``G`` reply slots ``G+1..2G`` (the global
  weights as sent back to each group; they never apply anything). A worker's scaled gradient is applied at once by
  its group server and added to the group's ``pending`` sum. ``forward[g]``
  moves that sum to ``outbox[g]``; ``deliver[g]`` applies it (peer: at every
  other group server; global: at the global server) and empties the outbox.
  Delivery happens before a forward of the same round, so a protocol delivers
  a zero-delay forward in the next round. ``adopt[r] = a`` makes replica ``r``
  copy replica ``a`` (global: slot ``G+1+g`` copies the global server when
  ``g``'s sum is delivered, group ``g`` copies the slot when the reply lands;
  done by ``rounds.apply_round``, here it only advances the version).

  Args:
    num_workers: W.
    num_groups: G >= 1.
    inter_group: ``"peer"`` or ``"global"``.
    assignment: static ``[W]`` group ids; default equal contiguous groups
      (the protocol groups workers by speed and passes ``groups``).
    scale: factor on every worker gradient, default ``1 / W``.
  """
  num_workers, num_groups, static_route, scale = _gssp_settings(num_workers, num_groups,
                                                               inter_group, assignment, scale)
  is_global = inter_group == "global"
  num_replicas = num_groups + int(is_global) * (num_groups + 1)

  def init(params):
    return GSSPState(**_init_clocks(num_workers, num_replicas),
                     pending=_zeros_like_stacked(params, num_groups),
                     outbox=_zeros_like_stacked(params, num_groups),
                     since_forward=jnp.zeros([num_groups], jnp.int32))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             forward=None, deliver=None, adopt=None, worker_ids=None, no_branches=False,
             **extra):
    del params, extra
    arrived, route, pulls = worker_masks(num_workers, static_route, arrived, groups, pulls)
    forward = _mask(forward, [num_groups], bool, False)
    deliver = _mask(deliver, [num_groups], bool, False)
    adopt = _mask(adopt, [num_replicas], jnp.int32, -1)
    applies = _gssp_applies(arrived, route, deliver, applies, num_groups, num_replicas,
                            is_global)
    round_ = dict(arrived=arrived, route=route, forward=forward, deliver=deliver,
                  applies=applies, worker_ids=worker_ids, num_groups=num_groups, scale=scale,
                  is_global=is_global)
    if no_branches and worker_ids is not None and jnp.shape(worker_ids)[0] == 1:
      # The level executor's rounds (one arrival slot, GSSP's bound): rows, not [G, ...].
      out, pending, outbox = _gssp_listed_exchange(updates, state, num_replicas=num_replicas,
                                                   **round_)
    else:
      out, pending, outbox = _gssp_masked_exchange(updates, state, no_branches=no_branches,
                                                   **round_)
    return out, _gssp_state(state, arrived, route, pulls, forward, applies, adopt, pending,
                            outbox, num_groups)

  return optax.GradientTransformationExtraArgs(init, update)


def _gssp_settings(num_workers, num_groups, inter_group, assignment, scale):
  """:func:`gssp`'s arguments, checked: ``(W, G, [W] static groups, scale)``."""
  num_workers = check_int("gssp", "num_workers", num_workers, 1)
  num_groups = check_int("gssp", "num_groups", num_groups, 1)
  if inter_group not in INTER_GROUP:
    raise ValueError(f"gssp inter_group={inter_group!r} is invalid; allowed: "
                     f"{', '.join(INTER_GROUP)}")
  if num_groups > num_workers:
    raise ValueError(f"gssp num_groups={num_groups} is invalid; allowed: at most num_workers="
                     f"{num_workers}")
  static_route = (equal_groups("gssp", num_workers, num_groups) if assignment is None
                  else check_assignment("gssp", "assignment", assignment, num_workers, num_groups))
  scale = check_scale("gssp", 1.0 / num_workers if scale is None else scale)
  return num_workers, num_groups, static_route, scale


def _gssp_applies(arrived, route, deliver, applies, num_groups: int, num_replicas: int,
                  is_global: bool) -> jax.Array:
  """GSSP's ``[R]`` applying replicas: ``applies`` if given, else derived from the round."""
  if applies is not None:
    return _mask(applies, [num_replicas], bool, True)
  arrived_at = jnp.zeros([num_groups], bool).at[route].max(arrived)
  if is_global:
    return jnp.concatenate([arrived_at, jnp.any(deliver)[None], jnp.zeros([num_groups], bool)])
  got_peer = (jnp.sum(deliver) - deliver.astype(jnp.int32)) > 0
  return arrived_at | got_peer


def _gssp_state(state, arrived, route, pulls, forward, applies, adopt, pending, outbox,
                num_groups: int) -> GSSPState:
  """GSSP's new state: the clocks of the round, the exchange buffers, pushes since forward."""
  arrivals = jnp.zeros([num_groups], jnp.int32).at[route].add(arrived.astype(jnp.int32))
  since = jnp.where(forward, 0, _saturating_add(state.since_forward, arrivals))
  clocks = _account(state, arrived=arrived, route=route, pulls=pulls, applies=applies,
                    bumps=adopt >= 0)
  return GSSPState(**clocks, pending=pending, outbox=outbox, since_forward=since)


def _gssp_masked_exchange(updates, state, *, arrived, route, forward, deliver, applies,
                          worker_ids, num_groups: int, scale: float, is_global: bool,
                          no_branches: bool):
  """GSSP's round on whole ``[G, ...]`` buffers, as masks: ``(out, pending, outbox)``.

  Every arrival's scaled gradient joins its group's ``pending`` sum; delivered
  outboxes are applied (peer: at every other group server; global: at the
  global server) and emptied; forwarding groups move ``pending`` to their
  outbox. ``no_branches``: a device program of many rounds (no ``cond``, no
  round trip to the host on a GPU); otherwise a round without an exchange
  skips its passes.
  """
  contrib = route_sum(updates, arrived, route, num_groups, scale, worker_ids)   # [G, ...]
  pending = jax.tree.map(lambda p, c: p + c, state.pending, contrib)

  def exchange(operand):
    """Deliveries and forwards, as masks: a round with neither gives ``no_exchange``'s result."""
    contrib, pending, outbox = operand
    sent = jax.tree.map(lambda o: jnp.where(rows(deliver, o), o, 0.0), outbox)
    if is_global:   # groups, the global server, the (never applied) reply slots
      incoming = jax.tree.map(lambda c, s: jnp.concatenate([c, s.sum(0, keepdims=True),
                                                            jnp.zeros_like(c)]), contrib, sent)
    else:  # Every group server applies the other groups' delivered sums.
      incoming = jax.tree.map(lambda c, s: c + (s.sum(0, keepdims=True) - s), contrib, sent)
    outbox = jax.tree.map(lambda o: jnp.where(rows(deliver, o), 0.0, o), outbox)
    outbox = jax.tree.map(lambda o, p: jnp.where(rows(forward, o), o + p, o), outbox, pending)
    pending = jax.tree.map(lambda p: jnp.where(rows(forward, p), 0.0, p), pending)
    return incoming, pending, outbox

  def no_exchange(operand):
    contrib, pending, outbox = operand
    incoming = (jax.tree.map(lambda c: jnp.concatenate([c, jnp.zeros_like(c[:1]),
                                                        jnp.zeros_like(c)]), contrib)
                if is_global else contrib)
    return incoming, pending, outbox

  operand = (contrib, pending, state.outbox)
  if no_branches:
    incoming, pending, outbox = exchange(operand)
  else:
    incoming, pending, outbox = jax.lax.cond(jnp.any(deliver) | jnp.any(forward), exchange,
                                             no_exchange, operand)
  out = jax.tree.map(lambda u: jnp.where(rows(applies, u), u, 0.0), incoming)
  return out, pending, outbox


def _gssp_listed_exchange(updates, state, *, arrived, route, forward, deliver, applies,
                          worker_ids, num_groups: int, num_replicas: int, scale: float,
                          is_global: bool):
  """GSSP's round on rows (``gssp``'s ``no_branches`` path): ``(out, pending, outbox)``.

  The same values as the mask path, which passes over every ``[G, ...]``
  exchange buffer several times per round whether or not a group exchanges
  (on an H100, ResNet-18 at 16 workers: about 2.7 ms per round, most of a
  piece's time). Here a round reads and writes rows only:

  * the round's one arrival slot (``worker_ids`` ``[1]``, padding past ``W``)
    adds its scaled gradient to its group's ``pending`` row;
  * the exchanging group ``x`` (the one group that forwards or delivers, if
    any: ``GSSPProtocol.one_exchange_per_round``, checked by the level
    planner) has its ``outbox`` and ``pending`` rows updated (row 0 is
    rewritten unchanged when no group exchanges);
  * ``out`` is the delivered row broadcast to the replicas that take it (and
    apply), plus each arrival's row at its group server if it applies.

  ``applies``: the ``[R]`` applying replicas (``_gssp_applies``).

  Every value is the mask path's, bit for bit: the same products, and sums of
  the same two terms (``tests/test_sync.py``). Each buffer gets in-place row writes
  (``dynamic_update_slice``) of rows read before them: a scatter of the two ``pending`` rows
  was XLA:CPU's costliest kernel of the round (its element loop recomputed the row indices;
  LeNet-5 GSSP at 16 workers on ``levels`` went from 0.77 to 0.87 of the serial loop, a
  near-free model from 0.26 to 0.38, ``benchmarks.serial_loop``).
  """
  num_workers = arrived.shape[0]
  _, safe, valid = ids_or_all(worker_ids, num_workers)
  take = arrived[safe[0]] & valid[0]                   # the slot holds an arrival
  r = jnp.minimum(route[safe[0]], num_groups - 1)      # its group's pending row
  exchanging = forward | deliver
  x = jnp.argmax(exchanging).astype(jnp.int32)       # the exchanging group (0: none, unchanged)
  fwd, dlv = forward[x], deliver[x]
  replica = jnp.arange(num_replicas)
  if is_global:
    takes_sum = dlv & (replica == num_groups)
  else:
    takes_sum = dlv & (replica < num_groups) & (replica != x)
  takes_sum = takes_sum & applies                                          # [R]
  f32 = jnp.float32(scale)
  # Writes of rows read before them (two reads of a row a write changed made XLA copy the
  # [G, ...] buffer each round): pending rows r (the arrival's group) and x, outbox row x.
  mask_of = lambda m, like: m.reshape((-1,) + (1,) * like.ndim)

  def one(u, p, o):
    scaled = u[safe[0]].astype(jnp.float32) * f32                          # the arrival's row
    # The rows as values of their own, gathered two at a time behind a barrier, so no write is
    # fused with a read of the buffer it changes: read by dynamic slices instead (or one row of
    # outbox alone), XLA:CPU copied both [G, ...] buffers twice a round (tests/test_levels.py's
    # HLO test now rejects such a copy); an H100's HLO copied neither.
    both, sent = lax.optimization_barrier((jnp.take(p, jnp.stack([r, x]), axis=0),
                                           jnp.take(o, jnp.stack([x, x]), axis=0)))
    p_r, p_x, sent = both[0], both[1], sent[0]
    p_r = jnp.where(take, p_r + scaled, p_r)                               # pending + contrib
    p_x = jnp.where(x == r, p_r, p_x)
    o_x = jnp.where(dlv, jnp.zeros_like(sent), sent)
    o_x = jnp.where(fwd, o_x + p_x, o_x)
    p_x = jnp.where(fwd, jnp.zeros_like(p_x), p_x)
    p_r = jnp.where(x == r, p_x, p_r)
    # Two in-place row writes (x == r: the same value twice) instead of a scatter of two.
    p = lax.dynamic_update_index_in_dim(p, p_r, r, 0)
    p = lax.dynamic_update_index_in_dim(p, p_x, x, 0)
    o = lax.dynamic_update_index_in_dim(o, o_x, x, 0)
    at_r = (replica == r) & take & applies
    out = (jnp.where(mask_of(takes_sum, sent), sent[None], jnp.float32(0.0))
           + jnp.where(mask_of(at_r, scaled), scaled[None], jnp.float32(0.0)))
    return out, p, o
  triples = jax.tree.map(one, updates, state.pending, state.outbox)
  treedef = jax.tree.structure(updates)
  flat = treedef.flatten_up_to(triples)
  pick = lambda i: treedef.unflatten([t[i] for t in flat])
  return pick(0), pick(1), pick(2)


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


# ---------------------------------------------------------------- InHAD


def inhad(num_workers: int, num_nodes: int = 4, *, assignment=None,
          scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """InHAD: workers add gradients to their node's aggregate; the server pulls them on ``aggregate``.

  Each arrived worker's scaled gradient joins its node's aggregate (nothing is
  applied). When the protocol's iteration-number count passes its threshold it
  sets ``aggregate``: the server applies the sum of every node aggregate as one
  update and the aggregates empty.

  Args:
    num_workers: W.
    num_nodes: N, the machines workers aggregate on.
    assignment: static ``[W]`` node ids; default equal contiguous nodes.
    scale: factor on every worker gradient, default ``1 / W``.
  """
  num_workers = check_int("inhad", "num_workers", num_workers, 1)
  num_nodes = check_int("inhad", "num_nodes", num_nodes, 1)
  static_route = (equal_groups("inhad", num_workers, num_nodes) if assignment is None
                  else check_assignment("inhad", "assignment", assignment, num_workers, num_nodes))
  scale = check_scale("inhad", 1.0 / num_workers if scale is None else scale)

  def init(params):
    zeros = lambda: jnp.zeros([num_workers], jnp.int32)   # distinct buffers (donated)
    return InHADState(**_init_clocks(num_workers, 1), node_acc=_zeros_like_stacked(params, num_nodes),
                      waiting=zeros(), pending_staleness=zeros(), pending_staleness_sum=zeros(),
                      staleness_total=zeros(), count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             aggregate=None, worker_ids=None, **extra):
    del params, extra
    arrived, route, pulls = worker_masks(num_workers, static_route, arrived, groups, pulls)
    aggregate = jnp.asarray(True if aggregate is None else aggregate, bool)
    applies = aggregate[None] if applies is None else _mask(applies, [1], bool, True)
    apply = applies[0]
    acc = jax.tree.map(lambda a, c: a + c, state.node_acc,
                       route_sum(updates, arrived, route, num_nodes, scale, worker_ids))
    out = jax.tree.map(lambda a: jnp.where(apply, a.sum(0, keepdims=True), 0.0), acc)
    acc = jax.tree.map(lambda a: jnp.where(apply, 0.0, a), acc)
    # Every push is its own gradient in the node's aggregate; the version is
    # constant while it waits, so its staleness is known on arrival.
    arriving = jnp.where(arrived, state.version[0] - state.read, 0)
    waiting = _saturating_add(state.waiting, arrived)
    latest = jnp.where(arrived, arriving, state.pending_staleness)
    pending_sum = _saturating_add(state.pending_staleness_sum, arriving)
    applied = (waiting > 0) & apply   # every gradient in the aggregates is applied now
    staleness = jnp.where(applied, latest, state.staleness)
    clock = _saturating_add(state.clock, jnp.where(apply, waiting, 0))
    total = _saturating_add(state.staleness_total, jnp.where(apply, pending_sum, 0))
    version = _saturating_add(state.version, applies)
    read = jnp.where(pulls, version[0], state.read)
    count = jnp.where(apply, 0, _saturating_add(state.count, jnp.sum(arrived)))
    keep = lambda x: jnp.where(apply, 0, x).astype(jnp.int32)
    return out, InHADState(clock=clock, read=read, staleness=staleness.astype(jnp.int32),
                           version=version, node_acc=acc, waiting=keep(waiting),
                           pending_staleness=keep(latest), pending_staleness_sum=keep(pending_sum),
                           staleness_total=total, count=count.astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init, update)


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
  num_replicas = check_int("replicated", "num_replicas", num_replicas, 1)

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
  rows again (a no-op; an empty list writes row ``R - 1``'s own rows back).
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
  if static_trips:
    src = jnp.where(valid, jnp.arange(ids.shape[0]), jnp.maximum(count - 1, 0))
    target, count = safe[src], ids.shape[0]
    new_inner, new_updates = (jax.tree.map(lambda x: x[src], t) for t in (new_inner, new_updates))
  row = lambda tree, i: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False),
                                     tree)
  put = lambda tree, r, new: jax.tree.map(
      lambda x, y: lax.dynamic_update_index_in_dim(x, y, r, 0), tree, new)

  def write(i, carry):
    full_inner, full_updates = carry
    return (put(full_inner, target[i], row(new_inner, i)),
            put(full_updates, target[i], row(new_updates, i)))

  zeros = jax.tree.map(lambda u: jnp.zeros((num_replicas, *u.shape[1:]), u.dtype), new_updates)
  full_inner, full_updates = lax.fori_loop(0, count, write, (state.inner, zeros))
  return full_updates, ReplicatedState(inner=full_inner)


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
