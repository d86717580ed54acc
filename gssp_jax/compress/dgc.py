"""Deep Gradient Compression style sampled-threshold sparsification.

Instead of ranking every entry, DGC estimates the top-k threshold from a small
uniform sample of each leaf and keeps every entry at least that large, so the
number sent varies from round to round and bytes count what was actually sent.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from gssp_jax.compress import topk as topk_lib


def _threshold(mag: jax.Array, ratio: jax.Array, key: jax.Array, sample_size: int) -> jax.Array:
  """The ``ceil(ratio * s)``-th largest of ``s`` uniform samples of 1-D ``mag``.

  A full-size sample is the leaf itself, so ``sample_ratio=1`` gives the exact
  k-th largest; smaller samples are drawn with replacement, which is cheap and
  what makes the threshold an estimate.
  """
  n = mag.shape[0]
  if sample_size == n:
    sample = mag
  else:
    sample = mag[jax.random.randint(key, (sample_size,), 0, n)]
  kk = jnp.clip(topk_lib.num_kept(ratio, sample_size), 1, sample_size)
  return jnp.sort(sample)[sample_size - kk]


def dgc_selector(sample_ratio: float, value_bytes: int, index_bytes: int) -> topk_lib.Selector:
  """Per-leaf, per-worker sampled-threshold selection."""

  def select(flats, ratios, flush, rng, count):
    base = jax.random.fold_in(jax.random.wrap_key_data(rng, impl="threefry2x32"), count)
    workers = jnp.arange(ratios.shape[0])
    masks, total = [], jnp.zeros(ratios.shape, jnp.int32)
    for leaf_index, flat in enumerate(flats):
      n = flat.shape[1]
      s = min(n, max(1, math.ceil(sample_ratio * n)))
      leaf_key = jax.random.fold_in(base, leaf_index)
      keys = jax.vmap(lambda w, k=leaf_key: jax.random.fold_in(k, w))(workers)
      mag = jnp.abs(flat)
      thr = jax.vmap(lambda m, r, k, s=s: _threshold(m, r, k, s))(mag, ratios, keys)
      # Zeros carry nothing, so they are never counted as sent.
      mask = (mag >= thr[:, None]) & (mag > 0)
      mask = jnp.where(flush, True, mask)
      masks.append(mask)
      total = total + topk_lib.push_cost(jnp.sum(mask, axis=1), n, value_bytes, index_bytes)
    return masks, total

  return select


def dgc(num_workers: int, ratio: float = 0.001, *, sample_ratio: float = 0.01,
        error_feedback: bool = True, seed: int = 0, value_bytes: int = 4,
        index_bytes: int = 4) -> optax.GradientTransformationExtraArgs:
  """DGC-style sampled-threshold top-k per leaf per worker, with error feedback.

  For each leaf and worker, ``s = max(1, ceil(sample_ratio * n))`` entries are
  sampled uniformly (key folded from the state key, update count, leaf index
  and worker index); the threshold is the ``ceil(ratio * s)``-th largest
  sampled magnitude and every nonzero entry at least that large is sent.

  Args:
    num_workers: W, the leading axis of every gradient leaf.
    ratio: default kept fraction in (0, 1]; the extra arg ``ratios`` overrides it.
    sample_ratio: static fraction of each leaf sampled for the threshold, in (0, 1].
    error_feedback: carry unsent mass to the next round.
    seed: seed of the sampling key; same seed, same selection.
    value_bytes: bytes per sent value.
    index_bytes: bytes per sent index.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state ``TopKState``.
  """
  num_workers = topk_lib.check_num_workers(num_workers)
  topk_lib.check_unit_interval("ratio", ratio)
  # The sample size fixes an array shape, so sample_ratio must be a host number.
  topk_lib.check_unit_interval("sample_ratio", sample_ratio)
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"compress seed={seed!r} is invalid; allowed: an int")
  value_bytes = topk_lib.check_positive_int("value_bytes", value_bytes)
  index_bytes = topk_lib.check_positive_int("index_bytes", index_bytes)
  selector = dgc_selector(float(sample_ratio), value_bytes, index_bytes)
  return topk_lib.build_compressor(num_workers, ratio, selector,
                                   error_feedback=bool(error_feedback), seed=seed)
