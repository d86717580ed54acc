"""On-device image augmentation and normalisation (pure JAX, jittable)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def augment_crop_flip(rng: jax.Array, images: jax.Array, pad: int = 4) -> jax.Array:
  """Random crop after zero-padding, then random horizontal flip, independently per image.

  Each image is zero-padded by ``pad`` pixels on every side and an ``H x W`` window is cut at
  a uniformly random offset in ``[0, 2 * pad]`` per axis (so the result is the image shifted
  by up to ``pad`` pixels, with zeros shifted in); it is then mirrored left-right with
  probability 1/2. The standard CIFAR-10 augmentation.

  Args:
    rng: a PRNG key; the same key and images give the same output.
    images: ``[B, H, W, C]`` of any dtype.
    pad: padding in pixels (a Python int; static under ``jit``). 0 means flip only.

  Returns:
    ``[B, H, W, C]`` of ``images.dtype``.
  """
  if images.ndim != 4:
    raise ValueError(f"images must be [B, H, W, C], got shape {images.shape}")
  if pad < 0:
    raise ValueError(f"pad must be >= 0, got {pad}")
  _, h, w, c = images.shape

  def one(key: jax.Array, image: jax.Array) -> jax.Array:
    key_y, key_x, key_flip = jax.random.split(key, 3)
    if pad:
      padded = jnp.pad(image, ((pad, pad), (pad, pad), (0, 0)))
      y = jax.random.randint(key_y, (), 0, 2 * pad + 1)
      x = jax.random.randint(key_x, (), 0, 2 * pad + 1)
      image = lax.dynamic_slice(padded, (y, x, 0), (h, w, c))
    return jnp.where(jax.random.bernoulli(key_flip), image[:, ::-1, :], image)

  keys = jax.random.split(rng, images.shape[0])
  return jax.vmap(one)(keys, images)


def normalize_images(images: jax.Array, mean: Sequence[float] | jax.Array,
                     std: Sequence[float] | jax.Array) -> jax.Array:
  """``(images / 255 - mean) / std`` as float32, with per-channel ``mean``/``std`` in [0, 1]
  units (as in :class:`ImageDataset`), broadcast over the last axis."""
  x = jnp.asarray(images).astype(jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
