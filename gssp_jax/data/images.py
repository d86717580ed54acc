"""Helpers shared by the image datasets."""

from __future__ import annotations

import numpy as np

from gssp_jax.data.types import ImageDataset

IMAGE_SIZE = 32
_STATS_CHUNK = 4096  # images per bincount call


def pad_to_32(images: np.ndarray) -> np.ndarray:
  """Zero-pads ``[N, H, W, C]`` images symmetrically to 32x32 (MNIST's 28 -> 32, as in LeNet-5)."""
  _, h, w, _ = images.shape
  if (h, w) == (IMAGE_SIZE, IMAGE_SIZE):
    return images
  dy, dx = IMAGE_SIZE - h, IMAGE_SIZE - w
  if dy < 0 or dx < 0 or dy % 2 or dx % 2:
    raise ValueError(f"cannot pad {h}x{w} images symmetrically to {IMAGE_SIZE}x{IMAGE_SIZE}")
  return np.pad(images, ((0, 0), (dy // 2, dy // 2), (dx // 2, dx // 2), (0, 0)))


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Exact per-channel mean and population std of uint8 ``[..., C]`` images, in [0, 1] units.

  Uses a 256-bin histogram per channel, so it is exact and needs no float copy of the
  (possibly 150M-value) array; chunks keep bincount's int64 copy small, which is also faster.
  """
  values = np.arange(256, dtype=np.float64) / 255.0
  means, stds = [], []
  for c in range(images.shape[-1]):
    counts = np.zeros(256, dtype=np.int64)
    for start in range(0, images.shape[0], _STATS_CHUNK):
      counts += np.bincount(images[start:start + _STATS_CHUNK, ..., c].ravel(), minlength=256)
    counts = counts.astype(np.float64)
    total = counts.sum()
    mean = float(counts @ values / total)
    var = float(counts @ (values - mean) ** 2 / total)
    means.append(mean)
    stds.append(var ** 0.5)
  return tuple(means), tuple(stds)


def make_image_dataset(name: str, train_images: np.ndarray, train_labels: np.ndarray,
                       test_images: np.ndarray, test_labels: np.ndarray,
                       num_classes: int) -> ImageDataset:
  """An ImageDataset with images padded to 32x32, int32 labels and train-set statistics."""
  train_images = np.ascontiguousarray(pad_to_32(np.asarray(train_images, np.uint8)))
  test_images = np.ascontiguousarray(pad_to_32(np.asarray(test_images, np.uint8)))
  mean, std = channel_stats(train_images)
  return ImageDataset(
      name=name,
      train_images=train_images,
      train_labels=np.asarray(train_labels, np.int32),
      test_images=test_images,
      test_labels=np.asarray(test_labels, np.int32),
      num_classes=num_classes,
      mean=mean,
      std=std,
  )
