"""MNIST from the four original IDX files (``.gz`` or unpacked)."""

from __future__ import annotations

import pathlib

import numpy as np
from absl import logging

from gssp_jax.data import checksums, images, paths
from gssp_jax.data.types import DataError, ImageDataset

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
ROWS = COLS = 28
NUM_CLASSES = 10
# split -> (images file, labels file, number of examples); names without the .gz suffix.
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}
FILE_NAMES = tuple(name for split in SPLITS.values() for name in split[:2])


def find_mnist_dir(root: pathlib.Path) -> pathlib.Path | None:
  """``root/mnist`` or ``root`` itself, whichever holds any MNIST file; None if neither does."""
  for directory in (root / "mnist", root):
    if any(paths.find_file(directory, name) for name in FILE_NAMES):
      return directory
  return None


def source_files(directory: pathlib.Path) -> list[pathlib.Path]:
  """The MNIST files present in ``directory`` (the ones :func:`load_mnist_dir` reads)."""
  return [p for p in (paths.find_file(directory, name) for name in FILE_NAMES) if p]


def _header(content: bytes, path: pathlib.Path, magic: int, ndim: int) -> list[int]:
  """The big-endian int32 header fields after the magic number, checked."""
  header_len = 4 * (1 + ndim)
  if len(content) < header_len:
    raise DataError(f"{path}: only {len(content)} bytes, too short for an IDX header; "
                    "the file is truncated, copy or download it again.")
  fields = np.frombuffer(content[:header_len], dtype=">i4").tolist()
  if fields[0] != magic:
    raise DataError(
        f"{path}: IDX magic number is {fields[0]}, expected {magic} "
        f"({'images' if magic == IMAGES_MAGIC else 'labels'}). This is not an MNIST "
        f"{'image' if magic == IMAGES_MAGIC else 'label'} file; check the file name and contents.")
  return fields[1:]


def _payload(content: bytes, path: pathlib.Path, offset: int, expected: int) -> np.ndarray:
  actual = len(content) - offset
  if actual != expected:
    problem = "truncated" if actual < expected else "has trailing data"
    raise DataError(f"{path}: payload {problem}: {actual} bytes after the header, expected "
                    f"{expected}. Copy or download the file again.")
  return np.frombuffer(content, dtype=np.uint8, offset=offset)


def parse_images(content: bytes, path: pathlib.Path, count: int) -> np.ndarray:
  """``[count, 28, 28, 1]`` uint8 from the content of an IDX3 image file."""
  n, rows, cols = _header(content, path, IMAGES_MAGIC, 3)
  if (rows, cols) != (ROWS, COLS):
    raise DataError(f"{path}: images are {rows}x{cols}, expected {ROWS}x{COLS}.")
  if n != count:
    raise DataError(f"{path}: header says {n} images, expected {count}.")
  return _payload(content, path, 16, n * rows * cols).reshape(n, rows, cols, 1)


def parse_labels(content: bytes, path: pathlib.Path, count: int) -> np.ndarray:
  """``[count]`` int32 from the content of an IDX1 label file."""
  (n,) = _header(content, path, LABELS_MAGIC, 1)
  if n != count:
    raise DataError(f"{path}: header says {n} labels, expected {count} (one per image).")
  labels = _payload(content, path, 8, n).astype(np.int32)
  if labels.size and labels.max() >= NUM_CLASSES:
    raise DataError(f"{path}: label {labels.max()} out of range [0, {NUM_CLASSES}).")
  return labels


def _read(directory: pathlib.Path, name: str) -> tuple[bytes, pathlib.Path]:
  path = paths.find_file(directory, name)
  if path is None:
    raise DataError(
        f"missing MNIST file {directory / (name + '.gz')} (the other MNIST files are there). "
        f"Expected {', '.join(n + '.gz' for n in FILE_NAMES)} in {directory}.")
  return paths.read_maybe_gzip(path), path


def load_mnist_dir(directory: pathlib.Path) -> ImageDataset:
  """MNIST from ``directory``, validated (structure, counts, content checksum).

  Raises:
    DataError: a file is missing, truncated, malformed or not the canonical MNIST file.
  """
  logging.info("Loading MNIST from %s", directory)
  arrays = {}
  for split, (images_name, labels_name, count) in SPLITS.items():
    content, path = _read(directory, images_name)
    split_images = parse_images(content, path, count)
    checksums.verify_content(f"mnist/{images_name}", content, path)
    content, path = _read(directory, labels_name)
    split_labels = parse_labels(content, path, count)
    checksums.verify_content(f"mnist/{labels_name}", content, path)
    arrays[split] = (split_images, split_labels)
  return images.make_image_dataset("mnist", *arrays["train"], *arrays["test"], NUM_CLASSES)
