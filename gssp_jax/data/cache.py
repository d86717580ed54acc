"""Decoded datasets shared by the processes of a host: ``.npy`` files mapped read-only.

The first process that needs a dataset decodes it and writes the arrays (and a small JSON of
everything else: vocabularies, references, mean/std) into one entry directory under
``<cache_dir>/datasets/``; every process, that one included, then maps the arrays with
``np.load(mmap_mode="r")``, so the processes of one host share a single copy through the page
cache. An entry is written under a file lock (16 processes starting at once decode once; the
others wait, then map it) and appears whole or not at all (written to a temporary directory,
then renamed).

The entry's name holds a hash of the dataset name, the options that change the arrays (e.g.
Multi30k's ``max_len``), :data:`FORMAT`, and the path, size, mtime and ctime of every source
file: a changed source gets a new entry, and the stale one is removed. An entry that does not
match its manifest (a missing or truncated file, another dtype or shape) is decoded again.

Entries are only ever replaced whole, never written in place: truncating a file that a process
has mapped makes its next read of those pages a SIGBUS. Deleting entries is safe at any time
(mapped files live on until unmapped).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence

import filelock
import numpy as np
from absl import logging

from gssp_jax.data.types import ImageDataset, TokenArrays, TranslationDataset, Vocab

# Bump when a decoder's output changes (order, padding, dtype, ...) or the entry layout does:
# entries of another format are never read.
FORMAT = 1
SUBDIR = "datasets"
_META = "meta.json"
_SPLIT_FIELDS = ("src", "src_len", "tgt", "tgt_len")

Dataset = ImageDataset | TranslationDataset
Arrays = dict[str, np.ndarray]


# --- what an entry holds of each dataset type ---------------------------------------------------


def encode(ds: Dataset) -> tuple[Arrays, dict]:
  """The arrays and the JSON-able rest of ``ds``."""
  if isinstance(ds, ImageDataset):
    arrays = {k: getattr(ds, k) for k in ("train_images", "train_labels", "test_images",
                                           "test_labels")}
    return arrays, {"type": "image", "name": ds.name, "num_classes": ds.num_classes,
                    "mean": list(ds.mean), "std": list(ds.std)}
  arrays = {f"{split}_{field}": getattr(getattr(ds, split), field)
            for split in ("train", "val", "test") for field in _SPLIT_FIELDS}
  return arrays, {"type": "translation", "name": ds.name, "src_itos": list(ds.src_vocab.itos),
                  "tgt_itos": list(ds.tgt_vocab.itos),
                  "test_references": list(ds.test_references),
                  "val_references": list(ds.val_references)}


def decode(arrays: Arrays, meta: dict) -> Dataset:
  """The dataset :func:`encode` gave ``arrays`` and ``meta`` for."""
  if meta["type"] == "image":
    return ImageDataset(name=meta["name"], num_classes=int(meta["num_classes"]),
                        mean=tuple(meta["mean"]), std=tuple(meta["std"]), **arrays)
  if meta["type"] != "translation":
    raise ValueError(f"unknown dataset type {meta['type']!r}")
  splits = {split: TokenArrays(**{f: arrays[f"{split}_{f}"] for f in _SPLIT_FIELDS})
            for split in ("train", "val", "test")}
  return TranslationDataset(
      name=meta["name"], src_vocab=Vocab(tuple(meta["src_itos"])),
      tgt_vocab=Vocab(tuple(meta["tgt_itos"])), **splits,
      test_references=tuple(meta["test_references"]),
      val_references=tuple(meta["val_references"]))


# --- keys -----------------------------------------------------------------------------------------


def source_stamps(sources: Sequence[pathlib.Path]) -> list[list]:
  """``[path, size, mtime_ns, ctime_ns]`` of each source file; a directory gives all its files."""
  files = []
  for source in sources:
    source = pathlib.Path(source).absolute()
    files.extend(sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir()
                 else [source])
  stamps = []
  for path in files:
    st = path.stat()
    stamps.append([str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns])
  return stamps


def entry_key(name: str, options: Mapping, stamps: list[list]) -> str:
  """A short hash of everything that decides the decoded arrays."""
  text = json.dumps({"format": FORMAT, "name": name, "options": dict(options),
                     "sources": stamps}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:20]


# --- reading and writing an entry ----------------------------------------------------------------


def _map(path: pathlib.Path, dtype: str, shape: list[int]) -> np.ndarray:
  """A read-only ndarray over the mapped ``.npy`` file, checked against the manifest."""
  if 0 in shape:  # numpy cannot map an empty array; there is nothing to share anyway
    array = np.load(path, allow_pickle=False)
  else:
    array = np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
  if array.dtype.str != dtype or list(array.shape) != shape:
    raise ValueError(f"{path.name} is {array.dtype.str} {list(array.shape)}, the manifest "
                     f"says {dtype} {shape}")
  array.flags.writeable = False
  return array


def read_entry(entry: pathlib.Path, key: str) -> Dataset:
  """The dataset stored in ``entry``, its arrays memory-mapped read-only.

  Raises:
    OSError, ValueError, KeyError, TypeError, AttributeError: the entry is missing, partial or
      malformed.
  """
  meta = json.loads((entry / _META).read_text(encoding="utf-8"))
  if meta.get("format") != FORMAT or meta.get("key") != key:
    raise ValueError(f"format {meta.get('format')} key {meta.get('key')}, expected format "
                     f"{FORMAT} key {key}")
  arrays = {name: _map(entry / f"{name}.npy", spec["dtype"], spec["shape"])
            for name, spec in meta["arrays"].items()}
  return decode(arrays, meta["dataset"])


def _try_read(entry: pathlib.Path, key: str, quiet: bool) -> Dataset | None:
  if not entry.is_dir():
    return None
  try:
    return read_entry(entry, key)
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    if not quiet:
      logging.warning("Ignoring damaged dataset cache %s (%s); decoding again.", entry, e)
    return None


def write_entry(entry: pathlib.Path, key: str, ds: Dataset, extra: Mapping) -> None:
  """Writes ``ds`` to ``entry`` atomically, replacing whatever is there (call under the lock)."""
  arrays, dataset_meta = encode(ds)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.", suffix=".tmp"))
  try:
    for name, array in arrays.items():
      np.save(tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
    meta = {"format": FORMAT, "key": key, **extra, "dataset": dataset_meta,
            "arrays": {name: {"dtype": a.dtype.str, "shape": list(a.shape)}
                       for name, a in arrays.items()}}
    (tmp / _META).write_text(json.dumps(meta), encoding="utf-8")
    if entry.exists():  # damaged: move it aside first (a rename onto a full directory fails)
      _remove(entry)
    os.replace(tmp, entry)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _remove(entry: pathlib.Path) -> None:
  """Removes an entry directory; processes that mapped its files keep their mappings."""
  trash = pathlib.Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.",
                                        suffix=".old"))
  os.replace(entry, trash / "entry")
  shutil.rmtree(trash, ignore_errors=True)


def _remove_stale(entry: pathlib.Path, name: str, options: Mapping, stamps: list[list]) -> None:
  """Removes the entries of the same dataset, options and source paths but older sources."""
  paths = [s[0] for s in stamps]
  for other in entry.parent.glob(f"{name}-*"):
    if other == entry or not other.is_dir():
      continue
    try:
      meta = json.loads((other / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
      continue  # a damaged entry of unknown origin is left alone: it may be another's
    if meta.get("options") == dict(options) and [s[0] for s in meta.get("sources", [])] == paths:
      logging.info("Removing stale dataset cache %s (its sources changed)", other)
      _remove(other)


# --- the one entry point -------------------------------------------------------------------------


def _lock(entry: pathlib.Path) -> filelock.FileLock:
  entry.parent.mkdir(parents=True, exist_ok=True)
  lock = filelock.FileLock(str(entry.parent / f"{entry.name}.lock"))
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    logging.info("Waiting for another process to write the dataset cache %s", entry)
    lock.acquire()
  return lock


def cached_dataset(name: str, options: Mapping, sources: Sequence[pathlib.Path],
                   cache_dir: pathlib.Path, build: Callable[[], Dataset]) -> Dataset:
  """``build()``'s dataset, decoded once per host and memory-mapped from the cache.

  Args:
    name: dataset name, the start of the entry's directory name.
    options: JSON-able options that change the decoded arrays (e.g. ``max_len``).
    sources: the files (or directories) ``build`` reads; their stamps are part of the key.
    cache_dir: the cache directory; entries go to ``<cache_dir>/datasets/``.
    build: decodes the dataset from ``sources``; its errors propagate and nothing is written.

  Returns:
    The dataset with its arrays read-only and memory-mapped; if the cache cannot be written (a
    read-only directory), ``build()``'s in-memory dataset, with a warning.
  """
  stamps = source_stamps(sources)
  key = entry_key(name, options, stamps)
  entry = cache_dir / SUBDIR / f"{name}-{key}"
  ds = _try_read(entry, key, quiet=True)
  if ds is not None:
    logging.info("Mapped %s from the dataset cache %s", name, entry)
    return ds
  try:
    lock = _lock(entry)
  except OSError as e:
    logging.warning("Cannot lock the dataset cache %s (%s); decoding %s in this process only.",
                    entry, e, name)
    return build()
  try:
    ds = _try_read(entry, key, quiet=False)  # written by another process while this one waited
    if ds is not None:
      logging.info("Mapped %s from the dataset cache %s", name, entry)
      return ds
    logging.info("Decoding %s once into the dataset cache %s", name, entry)
    built = build()
    if source_stamps(sources) != stamps:  # changed while decoding: the key would not match
      logging.warning("%s changed while it was decoded; not caching it.", name)
      return built
    try:
      write_entry(entry, key, built, {"name": name, "options": dict(options), "sources": stamps})
      _remove_stale(entry, name, options, stamps)
    except OSError as e:  # an unwritable cache costs memory and time, not correctness
      logging.warning("Could not write the dataset cache %s (%s).", entry, e)
      return built
    ds = _try_read(entry, key, quiet=False)
    return built if ds is None else ds
  finally:
    lock.release()
