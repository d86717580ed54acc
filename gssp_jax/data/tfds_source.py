"""Datasets already prepared by TensorFlow Datasets, read without TensorFlow.

Only a local prepared directory (``$TFDS_DATA_DIR/<name>/[<config>/]<version>/``) with
``array_record`` files is used, read through the ``tfds`` data-source API. Nothing here
downloads or asks GCS for metadata: offline, ``tfds.load`` retries for minutes before failing.
Any problem is logged and reported as "not available", so loading falls through to the next
source.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
from absl import logging

TFDS_NAMES = {"mnist": "mnist", "cifar10": "cifar10"}  # ours -> TFDS builder name
_CHUNK = 4096


def tfds_data_dir() -> pathlib.Path | None:
  """TFDS's data directory (``$TFDS_DATA_DIR`` or ~/tensorflow_datasets); None if remote."""
  value = os.environ.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets")
  if "://" in value:  # gs:// and the like would mean network access
    return None
  return pathlib.Path(value).expanduser()


def _version_key(path: pathlib.Path) -> tuple[int, ...]:
  try:
    return tuple(int(p) for p in path.name.split("."))
  except ValueError:
    return (-1,)


def find_prepared(name: str, tfds_name: str | None = None) -> pathlib.Path | None:
  """The newest prepared array_record directory of ``name`` (TFDS builder ``tfds_name``, by
  default ``TFDS_NAMES[name]``), or None. Does not import tfds."""
  tfds_name, root = tfds_name or TFDS_NAMES.get(name), tfds_data_dir()
  if tfds_name is None or root is None or not (root / tfds_name).is_dir():
    return None
  candidates = [info.parent for pattern in ("*/dataset_info.json", "*/*/dataset_info.json")
                for info in (root / tfds_name).glob(pattern)]
  # Version-named folders only: "incomplete.*" ones are preparations that never finished.
  candidates = [c for c in candidates
                if _version_key(c) != (-1,) and any(c.glob("*.array_record*"))]
  return max(candidates, key=_version_key) if candidates else None


def describe(name: str, tfds_name: str | None = None) -> str:
  """Where TFDS data for ``name`` (builder ``tfds_name``) was looked for, for error messages."""
  tfds_name = tfds_name or TFDS_NAMES.get(name)
  if tfds_name is None:
    return f"TensorFlow Datasets: not used (TFDS has no {name!r} dataset)"
  root = tfds_data_dir()
  if root is None:
    return "TensorFlow Datasets: $TFDS_DATA_DIR is remote; not probed offline"
  return (f"TensorFlow Datasets: no prepared {tfds_name!r} (array_record) under {root} "
          "(set TFDS_DATA_DIR to change)")


def _read_split(builder, split: str) -> tuple[np.ndarray, np.ndarray]:
  source = builder.as_data_source(split=split)
  images, labels = [], []
  for start in range(0, len(source), _CHUNK):
    for example in source.__getitems__(range(start, min(start + _CHUNK, len(source)))):
      images.append(np.asarray(example["image"], np.uint8))
      labels.append(int(example["label"]))
  return np.stack(images), np.asarray(labels, np.int32)


def load_tfds_arrays(name: str, tfds_name: str | None = None) -> dict[str, np.ndarray] | None:
  """train/test images and labels of a prepared TFDS dataset, or None if unavailable."""
  directory = find_prepared(name, tfds_name)
  if directory is None:
    return None
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    builder = tfds.builder_from_directory(directory)
    logging.info("Loading %s from TensorFlow Datasets at %s", name, directory)
    arrays = {}
    for split in ("train", "test"):
      arrays[f"{split}_images"], arrays[f"{split}_labels"] = _read_split(builder, split)
    return arrays
  except Exception as e:  # pylint: disable=broad-except
    # TFDS without TensorFlow fails in many ways (missing decoders, format); any of them just
    # means this source is unusable, and the caller moves on.
    logging.warning("Could not read %s from TensorFlow Datasets at %s: %r", name, directory, e)
    return None
