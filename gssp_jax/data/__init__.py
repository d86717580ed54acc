"""Offline-first datasets: MNIST, CIFAR-10 and Multi30k (de->en) as host numpy arrays.

``load_dataset`` reads, in order: a data directory (``data_dir`` or ``$GSSP_DATA_DIR``), data
TensorFlow Datasets has already prepared locally, and, only when allowed, a checksummed
download. It never touches the network unless asked to, and fails fast with a message saying
how to provide the files. Your own data: :func:`from_arrays`, :func:`register_dataset`,
``"tfds:<builder>"`` or ``"module:load"`` in ``config.dataset`` (:mod:`gssp_jax.data.user`).
"""

from gssp_jax.data.augment import augment_crop_flip, normalize_images
from gssp_jax.data.loader import load_dataset
from gssp_jax.data.multi30k import tokenize
from gssp_jax.data.paths import resolve_data_dir
from gssp_jax.data.user import from_arrays, register_dataset
from gssp_jax.data.types import (BOS, DATASETS, EOS, PAD, UNK, DataError, ImageDataset,
                                 TokenArrays, TranslationDataset, Vocab)

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "DATASETS",
    "DataError",
    "ImageDataset",
    "TokenArrays",
    "TranslationDataset",
    "Vocab",
    "augment_crop_flip",
    "from_arrays",
    "register_dataset",
    "load_dataset",
    "normalize_images",
    "resolve_data_dir",
    "tokenize",
]
