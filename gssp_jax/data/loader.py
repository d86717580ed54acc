"""``load_dataset``: local files first, then prepared TFDS data, then an opt-in download."""

from __future__ import annotations

import numbers
import pathlib

import numpy as np
from absl import logging

from gssp_jax.data import cache, cifar10, download, images, mnist, multi30k, paths, tfds_source
from gssp_jax.data import user
from gssp_jax.data.types import DATASETS, DataError, ImageDataset, TranslationDataset

_TFDS_SHAPES = {"mnist": (28, 28, 1), "cifar10": (32, 32, 3)}


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _load_from_dir(name: str, root: pathlib.Path, cache_dir: pathlib.Path, max_len: int | None,
                   min_freq: int) -> ImageDataset | TranslationDataset | None:
  """The dataset in ``root``, decoded once per host (``cache``); None if none of its files are.

  Raises:
    DataError: some of the dataset's files are there but missing, malformed or corrupt.
  """
  if name == "mnist":
    directory = mnist.find_mnist_dir(root)
    if directory is None:
      return None
    return cache.cached_dataset("mnist", {}, mnist.source_files(directory), cache_dir,
                                lambda: mnist.load_mnist_dir(directory))
  if name == "multi30k":
    directory = multi30k.find_multi30k_dir(root)
    if directory is None:
      return None
    return cache.cached_dataset(
        "multi30k", {"max_len": max_len, "min_freq": min_freq},
        multi30k.source_files(directory), cache_dir,
        lambda: multi30k.load_multi30k_dir(directory, max_len, min_freq))
  source = cifar10.find_cifar10_source(root)
  if source is None:
    return None
  return cache.cached_dataset("cifar10", {}, [source[1]], cache_dir,
                              lambda: cifar10.load_cifar10_source(*source))


def _load_from_tfds(name: str) -> ImageDataset | None:
  arrays = tfds_source.load_tfds_arrays(name)
  if arrays is None:
    return None
  for split in ("train", "test"):
    shape = arrays[f"{split}_images"].shape[1:]
    if shape != _TFDS_SHAPES[name]:
      logging.warning("Ignoring TFDS %s: %s images are %s, expected %s", name, split, shape,
                      _TFDS_SHAPES[name])
      return None
  num_classes = mnist.NUM_CLASSES if name == "mnist" else cifar10.NUM_CLASSES
  if any(np.any((arrays[k] < 0) | (arrays[k] >= num_classes))
         for k in ("train_labels", "test_labels")):
    logging.warning("Ignoring TFDS %s: labels outside [0, %d)", name, num_classes)
    return None
  return images.make_image_dataset(name, arrays["train_images"], arrays["train_labels"],
                                   arrays["test_images"], arrays["test_labels"], num_classes)


def _expected_layout(name: str) -> str:
  if name == "mnist":
    return "DIR/mnist/{" + ",".join(f + ".gz" for f in mnist.FILE_NAMES) + "}"
  if name == "multi30k":
    return "DIR/multi30k/{" + ",".join(f + ".gz" for f in multi30k.FILE_NAMES) + "}"
  return (f"DIR/{cifar10.PYTHON_TARBALL} (official), or DIR/{cifar10.PYTHON_DIR}/, or "
          f"DIR/{cifar10.JPEG_DIR}/{cifar10.JPEG_TARBALL} (train/<class>/*.jpg, "
          "test/<class>/*.jpg)")


def _not_found(name: str, root: pathlib.Path | None, cache_dir: pathlib.Path,
               download_error: DataError | None = None) -> DataError:
  looked = (f"data directory {root}: none of the {name} files" if root else
            f"data directory: not set (neither data_dir nor ${paths.DATA_DIR_ENV})")
  tried = (f"failed: {download_error}" if download_error else
           "disabled (allow_download / data_download is False)")
  if download_error is None:   # the download is the other way: it was off
    second = (f"enable the checksummed download with --config.data_download=True (files go to "
              f"{download.downloads_dir(cache_dir)}; mirror with --config.data_url=URL or "
              f"${paths.DATA_URL_ENV})")
  else:   # it was on and failed: only a reachable mirror would change that
    second = (f"or, with a network, download from a reachable mirror of that layout: "
              f"--config.data_url=URL or ${paths.DATA_URL_ENV}")
  return DataError(
      f"No data found for dataset {name!r}. Looked at:\n"
      f"  - {looked}\n"
      f"  - {tfds_source.describe(name)}\n"
      f"  - download: {tried}\n"
      f"Provide the files:\n"
      f"  1. pass --config.data_dir=DIR or export {paths.DATA_DIR_ENV}=DIR, laid out as\n"
      f"     {_expected_layout(name)}\n"
      f"     (a copy of the project's shared data folder has exactly this layout);\n"
      f"  2. {second}.")


def load_dataset(name: str, data_dir: str | None = None, *, max_len: int | None = None,
                 min_freq: int = 2, allow_download: bool = False,
                 download_url: str | None = None,
                 cache_dir: str | None = None) -> ImageDataset | TranslationDataset:
  """Loads one of :data:`DATASETS` into host memory.

  Sources, in order: ``data_dir`` (else ``$GSSP_DATA_DIR``); a dataset TensorFlow Datasets has
  already prepared locally (MNIST, CIFAR-10); and, only if ``allow_download``, a checksummed
  download into ``<cache_dir>/downloads``. With none available it fails at once, saying how to
  provide the files. Files from a data directory or a download are decoded once per host into
  ``<cache_dir>/datasets`` and memory-mapped from there, so the returned arrays are read-only.

  Args:
    name: ``"mnist"``, ``"cifar10"`` or ``"multi30k"``; or a user dataset
      (:mod:`gssp_jax.data.user`: ``"tfds:<builder>"``, ``"module:load"``, a registered name),
      which ignores the other arguments.
    data_dir: data directory; None or ``""`` means ``$GSSP_DATA_DIR``.
    max_len: translation only: cut sentences to at most this many tokens before BOS/EOS are
      added; None or 0 keeps them whole.
    min_freq: translation only: minimum training-set count for a token to enter a vocabulary.
    allow_download: whether to download the canonical files if no local source has them.
    download_url: base URL mirroring the data directory layout; None or ``""`` means
      ``$GSSP_DATA_URL``, else the canonical public mirrors.
    cache_dir: for downloads and the decoded datasets (see :mod:`gssp_jax.data.cache`); None
      or ``""`` means ``$GSSP_CACHE_DIR``, else ``~/.cache/gssp_jax``.

  Returns:
    An :class:`ImageDataset` (mnist, cifar10) or a :class:`TranslationDataset` (multi30k).

  Raises:
    ValueError: unknown ``name`` or invalid ``max_len``/``min_freq``.
    DataError: no source has the data, or the data found is missing files or corrupt.
  """
  if name not in DATASETS:
    return user.load_user_dataset(name)   # raises, naming what is allowed, if it is none
  if max_len is not None and not (_is_int(max_len) and max_len >= 0):
    raise ValueError(f"max_len must be None or a non-negative integer, got {max_len!r}")
  if not (_is_int(min_freq) and min_freq >= 1):
    raise ValueError(f"min_freq must be a positive integer, got {min_freq!r}")
  max_len = int(max_len) if max_len else None
  cache = paths.resolve_cache_dir(cache_dir)

  root = paths.resolve_data_dir(data_dir)
  if root is not None:
    dataset = _load_from_dir(name, root, cache, max_len, min_freq)
    if dataset is not None:
      return dataset
    logging.info("No %s files in data directory %s", name, root)

  if name in tfds_source.TFDS_NAMES:
    dataset = _load_from_tfds(name)
    if dataset is not None:
      return dataset

  if allow_download:
    return _download_and_load(name, root, cache, download_url, max_len, min_freq)
  raise _not_found(name, root, cache)


def _download_and_load(name: str, root: str | None, cache: str, download_url: str | None,
                       max_len: int | None, min_freq: int) -> ImageDataset | TranslationDataset:
  """The checksummed download into ``<cache>/downloads``, decoded as a data directory is."""
  try:
    downloaded = download.download(name, cache, download_url)
  except DataError as e:
    raise _not_found(name, root, cache, download_error=e) from e
  dataset = _load_from_dir(name, downloaded, cache, max_len, min_freq)
  if dataset is None:  # download() fetched every file, so this means a bug in the plan
    raise DataError(f"downloaded {name} into {downloaded} but found no files there")
  return dataset
