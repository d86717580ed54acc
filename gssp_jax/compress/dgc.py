"""Deep Gradient Compression style sampled-threshold sparsification.

Instead of ranking every entry, DGC estimates the top-k threshold from a small
uniform sample of each leaf and keeps every entry at least that large, so the
number sent varies from round to round and bytes count what was actually sent.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax.compress import topk as topk_lib


def _sample_size(n: int, sample_ratio: float) -> int:
  return min(n, max(1, math.ceil(sample_ratio * n)))


def _kth_largest(sample: jax.Array, ratio: jax.Array) -> jax.Array:
  """The ``ceil(ratio * s)``-th largest of the ``s`` values of 1-D ``sample``."""
  size = sample.shape[0]
  kk = jnp.clip(topk_lib.num_kept(ratio, size), 1, size)
  return jnp.sort(sample)[size - kk]


def _sample_indices(keys: jax.Array, leaf_sizes: list[int], sample_sizes: list[int]):
  """``[W, sum s]`` uniform indices, with replacement: each sampled leaf's ``s`` in ``[0, n)``.

  One draw per worker for all the leaves that are sampled (not those whose
  sample is the whole leaf): the random-bits program is compiled once rather
  than once per leaf, which made DGC's selection about 2.5x slower to compile
  (LeNet-5's 10 leaves, 2 workers, a 2-core CPU: 4.0 to 5.0 s, now 1.7 to 1.9 s).
  """
  sampled = [(n, s) for n, s in zip(leaf_sizes, sample_sizes) if s < n]
  if not sampled:
    return None
  total = sum(s for _, s in sampled)
  # Each index's bound, built on the device (not a [sum s] constant in the program).
  high = jnp.repeat(jnp.asarray([n for n, _ in sampled], jnp.int32),
                    np.asarray([s for _, s in sampled]), total_repeat_length=total)
  return jax.vmap(lambda k: jax.random.randint(k, (total,), 0, high))(keys)


def dgc_selector(sample_ratio: float, value_bytes: int, index_bytes: int) -> topk_lib.Selector:
  """Per-leaf, per-worker sampled-threshold selection.

  A worker's samples of every leaf come from one key, folded from the state
  key, the update count and the worker index; a full-size sample is the leaf
  itself, so ``sample_ratio=1`` gives the exact k-th largest.
  """

  def select(flats, ratios, flush, rng, count):
    base = jax.random.fold_in(jax.random.wrap_key_data(rng, impl="threefry2x32"), count)
    keys = jax.vmap(lambda w: jax.random.fold_in(base, w))(jnp.arange(ratios.shape[0]))
    leaf_sizes = [flat.shape[1] for flat in flats]
    sample_sizes = [_sample_size(n, sample_ratio) for n in leaf_sizes]
    indices = _sample_indices(keys, leaf_sizes, sample_sizes)
    masks, total, offset = [], jnp.zeros(ratios.shape, jnp.int32), 0
    for flat, n, s in zip(flats, leaf_sizes, sample_sizes):
      mag = jnp.abs(flat)
      if s == n:
        sample = mag
      else:
        sample = jnp.take_along_axis(mag, indices[:, offset:offset + s], axis=1)
        offset += s
      thr = jax.vmap(_kth_largest)(sample, ratios)
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
  sampled uniformly with replacement (one key per worker and update, folded
  from the state key, the update count and the worker index); the threshold
  is the ``ceil(ratio * s)``-th largest sampled magnitude and every nonzero
  entry at least that large is sent.

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
