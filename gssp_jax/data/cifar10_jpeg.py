"""CIFAR-10 from JPEG files (``train/<class>/*.jpg``, ``test/<class>/*.jpg``).

Decoding 60,000 small JPEGs takes seconds; the loader keeps the decoded arrays in the dataset
cache (:mod:`gssp_jax.data.cache`), so a host decodes them once. A change to what this module
decodes (order, pixels) must bump ``cache.FORMAT``, or hosts keep the old arrays.
"""

from __future__ import annotations

import io
import pathlib
import tarfile
import time
import zlib
from collections.abc import Iterable, Iterator

import numpy as np
from absl import logging
from PIL import Image

from gssp_jax.data.types import DataError

CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")
SPLITS = ("train", "test")
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_LOG_EVERY = 10_000

Arrays = dict[str, np.ndarray]  # train_images, train_labels, test_images, test_labels


def _classify(member: str) -> tuple[str, int] | None:
  """(split, label) of an image path ``.../<split>/<class>/<file>``; None for non-images."""
  # str.split rather than pathlib: this runs 60,000 times and pathlib parsing dominated it.
  parts = member.replace("\\", "/").split("/")
  if len(parts) < 3 or not parts[-1].lower().endswith(_IMAGE_SUFFIXES):
    return None
  split, cls = parts[-3], parts[-2]
  if split not in SPLITS:
    return None
  if cls not in CLASSES:
    raise DataError(f"{member}: unknown CIFAR-10 class folder {cls!r}; expected one of {CLASSES}.")
  return split, CLASSES.index(cls)


def decode_image(data: bytes, where: str) -> np.ndarray:
  """A 32x32x3 uint8 array from encoded image bytes; DataError naming ``where`` otherwise."""
  try:
    with Image.open(io.BytesIO(data), formats=("JPEG", "PNG")) as image:
      if image.size != (32, 32):
        raise DataError(f"{where}: image is {image.size[0]}x{image.size[1]}, "
                        "CIFAR-10 images must be 32x32x3.")
      if image.mode != "RGB":
        raise DataError(f"{where}: image mode is {image.mode} ({len(image.getbands())} "
                        "channels), CIFAR-10 images must be RGB, 32x32x3.")
      return np.asarray(image, dtype=np.uint8)
  except (OSError, SyntaxError, ValueError) as e:  # what PIL raises on undecodable input
    raise DataError(f"{where}: cannot decode image ({e}).") from e


def _tar_members(tar_path: pathlib.Path) -> Iterator[tuple[str, bytes]]:
  """(name, bytes) of the image members, read sequentially: no extraction, no seeking."""
  try:
    with tarfile.open(tar_path, "r|*") as tar:
      for member in tar:
        if member.isfile() and _classify(member.name) is not None:
          yield member.name, tar.extractfile(member).read()
  except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
    raise DataError(f"{tar_path}: unreadable or truncated tar archive ({e}); "
                    "copy or download it again.") from e


def _tree_members(root: pathlib.Path) -> Iterator[tuple[str, bytes]]:
  for split in SPLITS:
    for path in sorted((root / split).rglob("*")):
      if path.is_file() and _classify(path.relative_to(root).as_posix()) is not None:
        yield str(path), path.read_bytes()


def mixed_order(split: str, labels: Iterable[int], names: Iterable[str]) -> np.ndarray:
  """The fixed order of a split's images: by a CRC32 of ``split/label/file name``.

  The JPEG layout is class by class, but ``data.train_size``/``test_size`` take
  a prefix, which must hold every class (as the official batches, which are
  shuffled, do). A hash of the name gives an order that mixes the classes, is
  the same for any archive order, and does not depend on a random generator's
  stream across library versions.
  """
  keys = [(zlib.crc32(f"{split}/{label}/{name}".encode()), int(label), name)
          for label, name in zip(labels, names)]
  return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def decode_members(members: Iterable[tuple[str, bytes]], source: pathlib.Path) -> Arrays:
  """Decodes all images, each split in :func:`mixed_order` (the same for any tar order)."""
  found: dict[str, list[tuple[int, str, np.ndarray]]] = {s: [] for s in SPLITS}
  start = time.monotonic()
  for count, (name, data) in enumerate(members, 1):
    split, label = _classify(name)
    found[split].append((label, name.rsplit("/", 1)[-1], decode_image(data, name)))
    if count % _LOG_EVERY == 0:
      logging.info("Decoded %d CIFAR-10 images from %s (%.1f s)", count, source,
                   time.monotonic() - start)
  arrays = {}
  for split, items in found.items():
    if not items:
      raise DataError(
          f"{source}: no images under {split}/; expected {split}/<class>/NNNN.jpg for the "
          f"classes {', '.join(CLASSES)}.")
    order = mixed_order(split, [item[0] for item in items], [item[1] for item in items])
    items = [items[i] for i in order]
    arrays[f"{split}_images"] = np.stack([item[2] for item in items])
    arrays[f"{split}_labels"] = np.array([item[0] for item in items], dtype=np.int32)
  logging.info("Decoded %d CIFAR-10 images from %s in %.1f s",
               sum(len(v) for v in found.values()), source, time.monotonic() - start)
  return arrays


def load_jpeg_arrays(source: pathlib.Path) -> Arrays:
  """CIFAR-10 arrays decoded from a JPEG tarball or extracted tree.

  Args:
    source: ``cifar10_jpg.tar.gz`` or a directory holding ``train/`` and ``test/``.

  Raises:
    DataError: the source is incomplete, unreadable, or holds a non-32x32x3 image.
  """
  if source.is_dir():
    missing = [s for s in SPLITS if not (source / s).is_dir()]
    if missing:
      raise DataError(
          f"{source}: missing {' and '.join(m + '/' for m in missing)}; an extracted CIFAR-10 "
          "JPEG tree needs train/<class>/*.jpg and test/<class>/*.jpg "
          f"(or put cifar10_jpg.tar.gz in {source}).")
  logging.info("Decoding CIFAR-10 JPEGs from %s", source)
  members = _tree_members(source) if source.is_dir() else _tar_members(source)
  return decode_members(members, source)
