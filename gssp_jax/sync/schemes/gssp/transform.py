"""GSSP on the device: SSP inside groups at group servers, an asynchronous exchange between
groups (``pending`` and ``outbox`` buffers), as masks or as rows (the level executor's rounds)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from gssp_jax.sync import arguments
from gssp_jax.sync import transforms


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


def gssp(num_workers: int, num_groups: int = 4, *, inter_group: str = "peer",
         assignment=None, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """GSSP: SSP inside groups at group servers, asynchronous exchange between groups.

  Replicas: the ``G`` group servers, plus, when ``inter_group="global"``, a global server at
  index ``G`` and ``G`` reply slots ``G+1..2G`` (the global weights as sent back to each
  group; they never apply anything). A worker's scaled gradient is applied at once by its
  group server and added to the group's ``pending`` sum. ``forward[g]`` moves that sum to
  ``outbox[g]``; ``deliver[g]`` applies it (peer: at every other group server; global: at the
  global server) and empties the outbox. Delivery happens before a forward of the same round,
  so a protocol delivers a zero-delay forward in the next round. ``adopt[r] = a`` makes
  replica ``r`` copy replica ``a`` (global: slot ``G+1+g`` copies the global server when
  ``g``'s sum is delivered, group ``g`` copies the slot when the reply lands; done by
  ``rounds.apply_round``, here it only advances the version).

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
    return GSSPState(**transforms.init_clocks(num_workers, num_replicas),
                     pending=transforms.zeros_like_stacked(params, num_groups),
                     outbox=transforms.zeros_like_stacked(params, num_groups),
                     since_forward=jnp.zeros([num_groups], jnp.int32))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             forward=None, deliver=None, adopt=None, worker_ids=None, no_branches=False,
             **extra):
    del params, extra
    arrived, route, pulls = transforms.worker_masks(num_workers, static_route, arrived, groups,
                                                    pulls)
    forward = transforms.mask(forward, [num_groups], bool, False)
    deliver = transforms.mask(deliver, [num_groups], bool, False)
    adopt = transforms.mask(adopt, [num_replicas], jnp.int32, -1)
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
  num_workers = arguments.check_int("gssp", "num_workers", num_workers, 1)
  num_groups = arguments.check_int("gssp", "num_groups", num_groups, 1)
  if inter_group not in arguments.INTER_GROUP:
    raise ValueError(f"gssp inter_group={inter_group!r} is invalid; allowed: "
                     f"{', '.join(arguments.INTER_GROUP)}")
  if num_groups > num_workers:
    raise ValueError(f"gssp num_groups={num_groups} is invalid; allowed: at most num_workers="
                     f"{num_workers}")
  static_route = (arguments.equal_groups("gssp", num_workers, num_groups) if assignment is None
                  else arguments.check_assignment("gssp", "assignment", assignment, num_workers,
                                                  num_groups))
  scale = arguments.check_scale("gssp", 1.0 / num_workers if scale is None else scale)
  return num_workers, num_groups, static_route, scale


def _gssp_applies(arrived, route, deliver, applies, num_groups: int, num_replicas: int,
                  is_global: bool) -> jax.Array:
  """GSSP's ``[R]`` applying replicas: ``applies`` if given, else derived from the round."""
  if applies is not None:
    return transforms.mask(applies, [num_replicas], bool, True)
  arrived_at = jnp.zeros([num_groups], bool).at[route].max(arrived)
  if is_global:
    return jnp.concatenate([arrived_at, jnp.any(deliver)[None], jnp.zeros([num_groups], bool)])
  got_peer = (jnp.sum(deliver) - deliver.astype(jnp.int32)) > 0
  return arrived_at | got_peer


def _gssp_state(state, arrived, route, pulls, forward, applies, adopt, pending, outbox,
                num_groups: int) -> GSSPState:
  """GSSP's new state: the clocks of the round, the exchange buffers, pushes since forward."""
  arrivals = transforms.count_into(num_groups, route, arrived.astype(jnp.int32))
  since = jnp.where(forward, 0, transforms.saturating_add(state.since_forward, arrivals))
  clocks = transforms.account(state, arrived=arrived, route=route, pulls=pulls, applies=applies,
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
  contrib = transforms.route_sum(updates, arrived, route, num_groups, scale,
                                 worker_ids)   # [G, ...]
  pending = jax.tree.map(lambda p, c: p + c, state.pending, contrib)

  def exchange(operand):
    """Deliveries and forwards, as masks: a round with neither gives ``no_exchange``'s result."""
    contrib, pending, outbox = operand
    sent = jax.tree.map(lambda o: jnp.where(transforms.rows(deliver, o), o, 0.0), outbox)
    if is_global:   # groups, the global server, the (never applied) reply slots
      incoming = jax.tree.map(lambda c, s: jnp.concatenate([c, s.sum(0, keepdims=True),
                                                            jnp.zeros_like(c)]), contrib, sent)
    else:  # Every group server applies the other groups' delivered sums.
      incoming = jax.tree.map(lambda c, s: c + (s.sum(0, keepdims=True) - s), contrib, sent)
    outbox = jax.tree.map(lambda o: jnp.where(transforms.rows(deliver, o), 0.0, o), outbox)
    outbox = jax.tree.map(lambda o, p: jnp.where(transforms.rows(forward, o), o + p, o), outbox,
                          pending)
    pending = jax.tree.map(lambda p: jnp.where(transforms.rows(forward, p), 0.0, p), pending)
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
  out = jax.tree.map(lambda u: jnp.where(transforms.rows(applies, u), u, 0.0), incoming)
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
  _, safe, valid = transforms.ids_or_all(worker_ids, num_workers)
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
