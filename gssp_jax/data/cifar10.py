"""CIFAR-10 from the official python pickles, else from the JPEG archive.

Looked for under a data directory, in this order:
  1. ``cifar-10-python.tar.gz`` (the official archive) or an extracted ``cifar-10-batches-py/``;
  2. ``cifar10-jpeg/cifar10_jpg.tar.gz`` or an extracted ``cifar10-jpeg/{train,test}/`` tree.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import tarfile
import zlib

import numpy as np
from absl import logging

from gssp_jax.data import cifar10_jpeg, images
from gssp_jax.data.types import DataError, ImageDataset

NUM_CLASSES = 10
PYTHON_TARBALL = "cifar-10-python.tar.gz"
PYTHON_DIR = "cifar-10-batches-py"
JPEG_DIR = "cifar10-jpeg"
JPEG_TARBALL = "cifar10_jpg.tar.gz"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)

# The batches are pickled dicts of a numpy array and lists. Only what rebuilding those needs is
# allowed, so a tampered file cannot run code when unpickled.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


class _NumpyOnlyUnpickler(pickle.Unpickler):

  def find_class(self, module, name):
    if (module, name) not in _ALLOWED_GLOBALS:
      raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-10 batch")
    # numpy 2 renamed numpy.core to numpy._core; old pickles name the former.
    return super().find_class(module.replace("numpy.core", "numpy._core"), name)


def find_cifar10_source(root: pathlib.Path) -> tuple[str, pathlib.Path] | None:
  """(kind, path) of the first CIFAR-10 source under ``root``; kind is 'python' or 'jpeg'."""
  for kind, path in (("python", root / PYTHON_TARBALL), ("python", root / PYTHON_DIR),
                     ("jpeg", root / JPEG_DIR / JPEG_TARBALL)):
    if path.exists():
      return kind, path
  if (root / JPEG_DIR).is_dir():
    # Present but without the tarball: must be an extracted tree (checked when loading).
    return "jpeg", root / JPEG_DIR
  return None


def parse_batch(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
  """``[N, 32, 32, 3]`` uint8 images and ``[N]`` int32 labels of one pickled batch."""
  try:
    batch = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
  except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
    raise DataError(f"{where}: not a CIFAR-10 python batch ({e}).") from e
  if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
    raise DataError(f"{where}: not a CIFAR-10 python batch (no b'data'/b'labels' entries).")
  pixels, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
  if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != 32 * 32 * 3:
    raise DataError(f"{where}: data is {pixels.dtype} {pixels.shape}, expected uint8 "
                    "[N, 3072] (32x32x3 images).")
  if labels.shape != (pixels.shape[0],):
    raise DataError(f"{where}: {labels.shape[0]} labels for {pixels.shape[0]} images.")
  if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
    raise DataError(f"{where}: labels outside [0, {NUM_CLASSES}).")
  # Rows are channel-major (1024 red, 1024 green, 1024 blue values).
  return pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels.astype(np.int32)


def _read_python_batches(path: pathlib.Path) -> dict[str, bytes]:
  """Raw bytes of every batch file, from the tarball (without extracting) or the folder."""
  wanted = TRAIN_BATCHES + TEST_BATCHES
  if path.is_dir():
    missing = [n for n in wanted if not (path / n).is_file()]
    if missing:
      raise DataError(f"{path}: missing {', '.join(missing)}; expected {', '.join(wanted)}.")
    return {n: (path / n).read_bytes() for n in wanted}
  found = {}
  try:
    with tarfile.open(path, "r:*") as tar:
      for member in tar:
        name = pathlib.PurePosixPath(member.name).name
        if member.isfile() and name in wanted:
          found[name] = tar.extractfile(member).read()
  except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
    raise DataError(f"{path}: unreadable or truncated archive ({e}); copy or download it "
                    "again.") from e
  missing = [n for n in wanted if n not in found]
  if missing:
    raise DataError(f"{path}: archive lacks {PYTHON_DIR}/{', '.join(missing)}; is it the "
                    f"official {PYTHON_TARBALL}?")
  return found


def _load_python(path: pathlib.Path) -> dict[str, np.ndarray]:
  raw = _read_python_batches(path)
  arrays = {}
  for split, names in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
    parts = [parse_batch(raw[n], f"{path}/{n}" if path.is_dir() else f"{path}:{n}")
             for n in names]
    arrays[f"{split}_images"] = np.concatenate([p[0] for p in parts])
    arrays[f"{split}_labels"] = np.concatenate([p[1] for p in parts])
  return arrays


def load_cifar10_source(kind: str, path: pathlib.Path) -> ImageDataset:
  """CIFAR-10 from a source found by :func:`find_cifar10_source`.

  Raises:
    DataError: the source is incomplete or malformed.
  """
  logging.info("Loading CIFAR-10 from %s", path)
  if kind == "python":
    arrays = _load_python(path)
  else:
    arrays = cifar10_jpeg.load_jpeg_arrays(path)
  return images.make_image_dataset("cifar10", arrays["train_images"], arrays["train_labels"],
                                   arrays["test_images"], arrays["test_labels"], NUM_CLASSES)
