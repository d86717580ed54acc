"""Your own classification data: arrays, a prepared TFDS dataset, or your loader function.

``config.dataset`` takes, besides the built-in names:

* ``"tfds:<builder>"``: a dataset TensorFlow Datasets has prepared under ``$TFDS_DATA_DIR``
  (``image`` and ``label`` features, ``train`` and ``test`` splits; nothing is downloaded:
  prepare it once with ``tfds build <builder>`` or ``tfds.builder(...).download_and_prepare()``);
* ``"package.module:load"`` or ``"path/to/file.py:load"``: a function of no arguments returning
  an :class:`ImageDataset` (build one with :func:`from_arrays`), or the dataset object itself;
  every process of a run (sweep trials, the real runtime's server and meshes) imports it;
* a name given to :func:`register_dataset` in this process (a notebook).

The model sees ``(x / 255 - mean) / std`` per feature of the last axis, where ``mean`` and
``std`` are the training set's (in units of 1/255), so raw arrays of any scale arrive
standardised. ``data.augment`` (random crop and flip) needs ``[N, H, W, C]`` images.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gssp_jax import plugins
from gssp_jax.data import tfds_source
from gssp_jax.data.types import DATASETS, DataError, ImageDataset

TFDS_PREFIX = "tfds:"
_USER: dict[str, Callable[[], ImageDataset]] = {}
_HELP = (f"{', '.join(DATASETS)}, 'tfds:<builder>' (prepared locally), a name given to "
         f"register_dataset, or {plugins.SPEC_HELP} (a function returning an ImageDataset)")


def register_dataset(name: str, loader: Callable[[], ImageDataset] | ImageDataset) -> None:
  """Makes ``config.dataset=name`` use ``loader()`` (or the dataset itself), in this process.

  A run of several processes needs the spec form (``"package.module:load"``). Registering a
  name again replaces it.

  Raises:
    ValueError: a name that is not lower-case letters, digits and ``_``, or a built-in's, or a
      loader that is neither callable nor an :class:`ImageDataset`.
  """
  plugins.check_registered_name("register_dataset", name, DATASETS)
  if not (callable(loader) or isinstance(loader, ImageDataset)):
    raise ValueError(f"register_dataset({name!r}): {loader!r} is invalid; allowed: an "
                     "ImageDataset or a function of no arguments returning one")
  _USER[name] = loader if callable(loader) else (lambda: loader)


def is_user_dataset(name: Any) -> bool:
  """Whether ``name`` is a registered name, ``tfds:...`` or a spec (not a built-in)."""
  return name in _USER or plugins.is_spec(name)


def _is_tfds(name: Any) -> bool:
  return isinstance(name, str) and name.startswith(TFDS_PREFIX) and name not in _USER


def _source(name: Any) -> Any:
  """What a registered name or a spec names (a spec is imported).

  Raises:
    ValueError: neither, naming what is allowed.
  """
  if name in _USER:
    return _USER[name]
  if not plugins.is_spec(name):
    raise ValueError(f"dataset={name!r} is unknown; allowed: {_HELP}")
  return plugins.resolve(name, "dataset")


def check_name(name: Any) -> None:
  """Raises ValueError unless ``name`` can name a user dataset; resolves a spec (imports it)."""
  if _is_tfds(name):
    if not name[len(TFDS_PREFIX):].strip():
      raise ValueError(f"dataset={name!r} names no TFDS builder; allowed: {_HELP}")
    return
  _source(name)


def _stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-feature (last axis) mean and std of ``x`` in units of 1/255, std floored at 1e-6."""
  flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1]) / 255.0
  return (tuple(float(v) for v in flat.mean(0)),
          tuple(float(max(v, 1e-6)) for v in flat.std(0)))


def from_arrays(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                test_y: np.ndarray, *, name: str = "arrays",
                num_classes: int | None = None) -> ImageDataset:
  """An :class:`ImageDataset` of your arrays, with the training set's per-feature statistics.

  Args:
    train_x: ``[N, ..., F]`` uint8 or floating inputs (images ``[N, H, W, C]``, or feature
      vectors ``[N, F]``).
    train_y: ``[N]`` integer labels in ``[0, num_classes)``.
    test_x: like ``train_x`` (same shape after the first axis).
    test_y: like ``train_y``.
    name: shown in logs and the run's header.
    num_classes: default: the largest label + 1.

  Raises:
    ValueError: shapes, dtypes or labels that do not fit, naming which.
  """
  train_x, test_x = np.asarray(train_x), np.asarray(test_x)
  train_y, test_y = np.asarray(train_y), np.asarray(test_y)
  for what, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
    if not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)) or x.ndim < 2:
      raise ValueError(f"from_arrays: {what}_x is {x.dtype} {x.shape}; allowed: uint8 or float, "
                       "[N, ..., F] with N >= 1")
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
      raise ValueError(f"from_arrays: {what}_y is {y.dtype} {y.shape}; allowed: integers of "
                       f"shape [{len(x)}] (one label per {what}_x row)")
    if len(x) == 0:
      raise ValueError(f"from_arrays: {what}_x is empty; allowed: at least one example")
  if train_x.shape[1:] != test_x.shape[1:]:
    raise ValueError(f"from_arrays: test_x rows are {test_x.shape[1:]}, train_x rows "
                     f"{train_x.shape[1:]}; allowed: the same shape")
  top = int(max(train_y.max(), test_y.max())) + 1
  num_classes = top if num_classes is None else num_classes
  if (isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer))
      or num_classes < 2 or top > num_classes or min(train_y.min(), test_y.min()) < 0):
    raise ValueError(f"from_arrays: labels span [{min(train_y.min(), test_y.min())}, {top}) with "
                     f"num_classes={num_classes!r}; allowed: labels in [0, num_classes), "
                     "num_classes >= 2")
  if np.issubdtype(train_x.dtype, np.floating):
    train_x, test_x = train_x.astype(np.float32), test_x.astype(np.float32)
  mean, std = _stats(train_x)
  return ImageDataset(name=name, train_images=np.ascontiguousarray(train_x),
                      train_labels=train_y.astype(np.int32),
                      test_images=np.ascontiguousarray(test_x),
                      test_labels=test_y.astype(np.int32), num_classes=int(num_classes),
                      mean=mean, std=std)


def _from_tfds(builder: str) -> ImageDataset:
  arrays = tfds_source.load_tfds_arrays(builder, tfds_name=builder)
  if arrays is None:
    raise DataError(f"dataset='tfds:{builder}': {tfds_source.describe(builder, builder)}; "
                    f"prepare it once (e.g. `tfds build {builder}` with network access) or set "
                    "TFDS_DATA_DIR")
  return from_arrays(arrays["train_images"], arrays["train_labels"], arrays["test_images"],
                     arrays["test_labels"], name=f"tfds:{builder}")


def load_user_dataset(name: str) -> ImageDataset:
  """The dataset a registered name, ``tfds:<builder>`` or a spec gives.

  Raises:
    ValueError: an unknown name or spec, or a loader that returns something else.
    DataError: a TFDS dataset that is not prepared locally.
  """
  if _is_tfds(name):
    check_name(name)
    return _from_tfds(name[len(TFDS_PREFIX):].strip())
  source = _source(name)
  dataset = source() if callable(source) and not isinstance(source, ImageDataset) else source
  if not isinstance(dataset, ImageDataset):
    raise ValueError(f"dataset={name!r} gave {type(dataset).__name__}; allowed: an ImageDataset "
                     "(build one with gssp_jax.data.from_arrays)")
  return dataset
