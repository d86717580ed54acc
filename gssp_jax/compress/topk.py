"""Top-k sparsification with per-worker error feedback, and the machinery shared by compressors.

Gradients arrive with a leading worker axis (every leaf ``[W, ...]``). A
compressor returns the *sent* gradients (dense, zeros where entries were
dropped) and keeps what it did not send in ``residual`` so that it is sent
later (error feedback). ``sent + residual' == acc`` holds bit for bit because
both sides are selected from ``acc`` with ``jnp.where`` rather than subtracted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

_INT32_MAX = jnp.iinfo(jnp.int32).max
_SCOPES = ("tensor", "global")
# ``ratio * n`` is formed in float32; shaving a relative 1e-6 keeps ratios that
# are exact fractions of n (0.01 * 1000) from rounding up to k + 1. It only
# matters for ratios within 1e-6 of a multiple of 1/n, below float32 resolution.
_K_SLACK = 1.0 - 1e-6


class TopKState(NamedTuple):
  """State shared by every compressor in ``gssp_jax.compress``.

  Attributes:
    residual: pytree like the gradients, ``[W, ...]`` float32 error-feedback
      memory (all zeros when ``error_feedback=False``).
    last_bytes: ``[W]`` int32 exact bytes of each worker's last push (values
      plus indices); 0 for workers that did not push.
    count: ``[]`` int32 number of update calls, saturating at int32 max.
    rng: ``[2]`` uint32 threefry key data (used by ``dgc``; carried by all so
      that every compressor has the same state structure).
  """
  residual: Any
  last_bytes: jax.Array
  count: jax.Array
  rng: jax.Array


# A selector maps (acc leaves [W, n] flattened, ratios [W], flush [], key data,
# count) to (masks like the leaves, bool; bytes [W] int32).
Selector = Callable[[list, jax.Array, jax.Array, jax.Array, jax.Array], tuple[list, jax.Array]]


def check_num_workers(num_workers: Any) -> int:
  """Returns ``num_workers`` if it is a positive int, else raises ValueError."""
  return check_positive_int("num_workers", num_workers)


def check_unit_interval(name: str, value: Any) -> None:
  """Raises ValueError unless ``value`` lies in (0, 1]; traced values pass unchecked."""
  try:
    ok = 0.0 < float(value) <= 1.0
  except jax.errors.ConcretizationTypeError:
    return  # Traced hyperparameters (inject_hyperparams) cannot be checked on the host.
  except (TypeError, ValueError):
    ok = False
  if not ok or isinstance(value, bool):
    raise ValueError(f"compress {name}={value!r} is invalid; allowed: a number in (0, 1]")


def check_scope(scope: Any) -> str:
  """Returns ``scope`` if it is ``"tensor"`` or ``"global"``, else raises ValueError."""
  if scope not in _SCOPES:
    raise ValueError(f"compress scope={scope!r} is invalid; allowed: {', '.join(_SCOPES)}")
  return scope


def check_positive_int(name: str, value: Any) -> int:
  """Returns ``value`` if it is a positive int, else raises ValueError."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"compress {name}={value!r} is invalid; allowed: a positive int")
  return int(value)


def num_kept(ratios: jax.Array, n: int) -> jax.Array:
  """``ceil(ratio * n)`` per worker as int32, clipped to [0, n]."""
  k = jnp.ceil(ratios.astype(jnp.float32) * jnp.float32(n) * _K_SLACK)
  return jnp.clip(k, 0, n).astype(jnp.int32)


def push_cost(nnz: jax.Array, n: int, value_bytes: int, index_bytes: int) -> jax.Array:
  """Bytes to push ``nnz`` of ``n`` entries: sparse, unless dense is no dearer."""
  sparse = nnz.astype(jnp.int32) * jnp.int32(value_bytes + index_bytes)
  return jnp.minimum(sparse, jnp.int32(n * value_bytes))


def _rank_mask(mag: jax.Array, k: jax.Array) -> jax.Array:
  """Marks the ``k`` largest entries of 1-D ``mag``; ties go to the lower index.

  ``k`` is traced, so instead of ``lax.top_k`` (static k) we rank every entry
  with a stable argsort and compare ranks against ``k``.
  """
  order = jnp.argsort(-mag, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(mag.shape[0], dtype=order.dtype))
  return rank < k


def topk_selector(scope: str, value_bytes: int, index_bytes: int) -> Selector:
  """Exact top-k per leaf (``scope="tensor"``) or over the whole model (``"global"``)."""

  def select_tensor(flats, ratios, flush, rng, count):
    del flush, rng, count  # flush arrives as ratios == 1.
    masks, total = [], jnp.zeros(ratios.shape, jnp.int32)
    for flat in flats:
      n = flat.shape[1]
      k = num_kept(ratios, n)
      masks.append(jax.vmap(_rank_mask)(jnp.abs(flat), k))
      total = total + push_cost(k, n, value_bytes, index_bytes)
    return masks, total

  def select_global(flats, ratios, flush, rng, count):
    del flush, rng, count
    whole = jnp.concatenate(flats, axis=1)
    n = whole.shape[1]
    k = num_kept(ratios, n)
    mask = jax.vmap(_rank_mask)(jnp.abs(whole), k)
    splits = [sum(f.shape[1] for f in flats[:i + 1]) for i in range(len(flats) - 1)]
    return jnp.split(mask, splits, axis=1), push_cost(k, n, value_bytes, index_bytes)

  return select_tensor if scope == "tensor" else select_global


def build_compressor(num_workers: int, default_ratio: Any, selector: Selector, *,
                     error_feedback: bool, seed: int = 0,
                     require_ratios: str | None = None) -> optax.GradientTransformationExtraArgs:
  """Wraps a selector into an error-feedback compressor (shared by topk, dgc, gdtopk).

  Args:
    num_workers: W, the size of every leaf's leading axis.
    default_ratio: ratio used when the ``ratios`` extra arg is absent.
    selector: chooses which entries of the accumulated gradient to send.
    error_feedback: keep unsent mass in ``residual`` and add it next round.
    seed: seed of the carried key.
    require_ratios: if set, the compressor's name; ``ratios`` is then mandatory.

  Returns:
    The transformation; ``update`` takes keyword-only ``ratios`` ([W] float),
    ``arrived`` ([W] bool) and ``flush`` ([] bool) and ignores other extras.
  """

  def init(params):
    residual = jax.tree.map(lambda p: jnp.zeros((num_workers, *jnp.shape(p)), jnp.float32), params)
    rng = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
    return TopKState(residual=residual, last_bytes=jnp.zeros([num_workers], jnp.int32),
                     count=jnp.zeros([], jnp.int32), rng=rng)

  def update(updates, state, params=None, *, ratios=None, arrived=None, flush=None, **extra):
    del params, extra  # Unknown extras belong to other transforms in the chain.
    if require_ratios and ratios is None:
      raise ValueError(f"compressor {require_ratios!r} needs the extra arg ratios=[W] float "
                       "on every update; got ratios=None")
    ratios = default_ratio if ratios is None else ratios
    ratios = jnp.broadcast_to(jnp.asarray(ratios, jnp.float32), (num_workers,))
    arrived = (jnp.ones([num_workers], bool) if arrived is None
               else jnp.broadcast_to(jnp.asarray(arrived, bool), (num_workers,)))
    flush = jnp.asarray(False if flush is None else flush, bool)
    ratios = jnp.where(flush, 1.0, ratios)  # An epoch-end flush sends everything.

    leaves, treedef = jax.tree.flatten(updates)
    old_res = treedef.flatten_up_to(state.residual)
    accs = [r + g.astype(jnp.float32) if error_feedback else g.astype(jnp.float32)
            for g, r in zip(leaves, old_res)]
    flats = [a.reshape(num_workers, -1) for a in accs]
    masks, costs = selector(flats, ratios, flush, state.rng, state.count)

    sent, residual = [], []
    for acc, mask, old in zip(accs, masks, old_res):
      pushed = arrived.reshape((num_workers,) + (1,) * (acc.ndim - 1))
      mask = mask.reshape(acc.shape) & pushed
      sent.append(jnp.where(mask, acc, 0.0))
      if error_feedback:
        # Absent workers keep their memory untouched; it is not folded into acc.
        residual.append(jnp.where(pushed, jnp.where(mask, 0.0, acc), old))
      else:
        residual.append(old)
    new_state = TopKState(
        residual=treedef.unflatten(residual),
        last_bytes=jnp.where(arrived, costs, 0).astype(jnp.int32),
        count=jnp.where(state.count < _INT32_MAX, state.count + 1, state.count).astype(jnp.int32),
        rng=state.rng)
    return treedef.unflatten(sent), new_state

  return optax.GradientTransformationExtraArgs(init, update)


def topk(num_workers: int, ratio: float = 0.01, *, scope: str = "tensor",
         error_feedback: bool = True, value_bytes: int = 4,
         index_bytes: int = 4) -> optax.GradientTransformationExtraArgs:
  """Top-k sparsification per worker with error feedback.

  Keeps exactly ``k = ceil(ratio * n)`` largest-magnitude entries per worker,
  of each leaf (``scope="tensor"``) or of the whole flattened model
  (``scope="global"``); ties go to the lower flat index.

  Args:
    num_workers: W, the leading axis of every gradient leaf.
    ratio: default kept fraction in (0, 1]; the extra arg ``ratios`` ([W])
      overrides it per round.
    scope: ``"tensor"`` or ``"global"``.
    error_feedback: carry unsent mass to the next round.
    value_bytes: bytes per sent value.
    index_bytes: bytes per sent index.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state ``TopKState``.
  """
  num_workers = check_num_workers(num_workers)
  check_unit_interval("ratio", ratio)
  check_scope(scope)
  value_bytes = check_positive_int("value_bytes", value_bytes)
  index_bytes = check_positive_int("index_bytes", index_bytes)
  return build_compressor(num_workers, ratio, topk_selector(scope, value_bytes, index_bytes),
                          error_feedback=bool(error_feedback))


def expected_push_bytes(sizes, ratio: float, *, scope: str = "tensor", value_bytes: int = 4,
                        index_bytes: int = 4) -> int:
  """Host-side twin of the selector's byte count: a top-k push of leaves with ``sizes`` entries.

  Same arithmetic as :func:`num_kept` and :func:`push_cost` (float32 ``ratio * n``
  with the same slack), so a simulator can time a push before it is computed.
  """
  def one(n):
    k = math.ceil(np.float32(ratio) * np.float32(n) * np.float32(_K_SLACK))
    return min(min(max(k, 0), n) * (value_bytes + index_bytes), n * value_bytes)
  return one(sum(sizes)) if scope == "global" else sum(one(n) for n in sizes)


def push_bytes(state: TopKState) -> jax.Array:
  """``[W]`` int32 bytes of each worker's last push."""
  return state.last_bytes


def residual_norm(state: TopKState) -> jax.Array:
  """``[W]`` float32 global L2 norm of each worker's error-feedback memory."""
  sq = [jnp.sum(jnp.square(r).reshape(r.shape[0], -1), axis=1)
        for r in jax.tree.leaves(state.residual)]
  return jnp.sqrt(sum(sq, jnp.zeros(state.last_bytes.shape, jnp.float32)))
