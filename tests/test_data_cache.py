"""Tests of gssp_jax.data.cache: one decode per host, shared read-only through mmap."""

from __future__ import annotations

import gzip
import hashlib
import json
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from gssp_jax import data
from gssp_jax.data import cache, mnist, multi30k

REPO = pathlib.Path(__file__).resolve().parent.parent
IMAGE_FIELDS = ("train_images", "train_labels", "test_images", "test_labels")

# A process that loads MNIST once every process is ready, counting its decodes in a file.
_CHILD = r"""
import hashlib, json, mmap, os, pathlib, sys, time
from gssp_jax.data import loader, mnist

counter, ready, go = map(pathlib.Path, sys.argv[1:4])
decode = mnist.load_mnist_dir

def counted(directory):
  with open(counter, "a") as f:
    f.write(f"{os.getpid()}\n")
  time.sleep(1)  # holds the lock a while longer: the other process surely starts meanwhile
  return decode(directory)

def mapped(a):
  while a is not None and not isinstance(a, mmap.mmap):
    a = getattr(a, "base", None)
  return a is not None

mnist.load_mnist_dir = counted
ready.touch()
while not go.exists():
  time.sleep(0.01)
start = time.time()
ds = loader.load_dataset("mnist")
print(start, time.time())
print(json.dumps({k: [hashlib.sha256(getattr(ds, k)).hexdigest(), getattr(ds, k).dtype.str,
                      list(getattr(ds, k).shape), getattr(ds, k).flags.writeable,
                      mapped(getattr(ds, k))]
                  for k in ("train_images", "train_labels", "test_images", "test_labels")}))
"""


def _is_mapped(array: np.ndarray) -> bool:
  base = array
  while base is not None and not isinstance(base, mmap.mmap):
    base = getattr(base, "base", None)
  return base is not None


def _digest(ds) -> dict:
  return {k: [hashlib.sha256(getattr(ds, k)).hexdigest(), getattr(ds, k).dtype.str,
              list(getattr(ds, k).shape), False, True] for k in IMAGE_FIELDS}


def _assert_same_images(ds, expected) -> None:
  for k in IMAGE_FIELDS:
    a, b = getattr(ds, k), getattr(expected, k)
    assert a.dtype == b.dtype and a.shape == b.shape, k
    np.testing.assert_array_equal(a, b)
  assert ds.mean == expected.mean and ds.std == expected.std and ds.num_classes == 10


def _entries(cache_dir: pathlib.Path, name: str) -> list[pathlib.Path]:
  return [p for p in (cache_dir / "datasets").glob(f"{name}-*") if p.is_dir()]


@pytest.fixture
def count_mnist_decodes(monkeypatch):
  """A list that grows by one on every MNIST decode in this process."""
  calls, decode = [], mnist.load_mnist_dir
  monkeypatch.setattr(mnist, "load_mnist_dir", lambda d: calls.append(d) or decode(d))
  return calls


@pytest.fixture(scope="module")
def direct_mnist(data_dir):
  """MNIST decoded from the files, bypassing the cache."""
  return mnist.load_mnist_dir(pathlib.Path(data_dir) / "mnist")


def test_processes_decode_once_and_share_mapped_arrays(data_dir, tmp_path, direct_mnist):
  env = {**os.environ, "GSSP_DATA_DIR": data_dir, "GSSP_CACHE_DIR": str(tmp_path / "cache"),
         "JAX_PLATFORMS": "cpu"}
  counter, go = tmp_path / "decodes.txt", tmp_path / "go"
  readies = [tmp_path / f"ready{i}" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(counter), str(r), str(go)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for r in readies]
  try:
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in readies):  # both imported: start them together
      assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
      time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert len(counter.read_text().split()) == 1  # one process decoded, the other mapped it
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  spans = [[float(t) for t in out.strip().splitlines()[-2].split()] for out, _ in outs]
  assert max(s for s, _ in spans) < min(e for _, e in spans)  # the two loads overlapped
  assert results[0] == results[1] == _digest(direct_mnist)  # read-only and mapped, in both
  assert len(_entries(tmp_path / "cache", "mnist")) == 1


def test_load_maps_the_entry_read_only(data_dir, tmp_path, direct_mnist, count_mnist_decodes):
  first = data.load_dataset("mnist", data_dir, cache_dir=str(tmp_path))
  again = data.load_dataset("mnist", data_dir, cache_dir=str(tmp_path))
  assert len(count_mnist_decodes) == 1
  for ds in (first, again):  # the decoding process maps the entry too
    _assert_same_images(ds, direct_mnist)
    assert all(_is_mapped(getattr(ds, k)) for k in IMAGE_FIELDS)
    with pytest.raises(ValueError, match="read-only"):
      ds.train_images[0, 0, 0, 0] = 1


def test_changed_source_is_decoded_again(data_dir, tmp_path, direct_mnist, count_mnist_decodes):
  d = tmp_path / "data" / "mnist"
  d.mkdir(parents=True)
  for name in mnist.FILE_NAMES:
    shutil.copyfile(pathlib.Path(data_dir) / "mnist" / f"{name}.gz", d / f"{name}.gz")
  load = lambda: data.load_dataset("mnist", str(d.parent), cache_dir=str(tmp_path / "cache"))
  load()
  (old,) = _entries(tmp_path / "cache", "mnist")
  touched = d / "train-labels-idx1-ubyte.gz"
  st = touched.stat()
  os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, newer mtime
  _assert_same_images(load(), direct_mnist)
  assert len(count_mnist_decodes) == 2
  assert _entries(tmp_path / "cache", "mnist") != [old]  # the stale entry is replaced
  assert len(_entries(tmp_path / "cache", "mnist")) == 1
  # Another valid label: only the content checksum tells; a stale cache would hide it.
  content = bytearray(gzip.decompress((d / "t10k-labels-idx1-ubyte.gz").read_bytes()))
  content[100] = (content[100] + 1) % 10
  (d / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(content)))
  with pytest.raises(data.DataError, match=r"t10k-labels-idx1-ubyte\.gz.*checksum"):
    load()


def test_truncated_cache_file_is_rebuilt(data_dir, tmp_path, direct_mnist, count_mnist_decodes):
  data.load_dataset("mnist", data_dir, cache_dir=str(tmp_path))
  (entry,) = _entries(tmp_path, "mnist")
  images = entry / "train_images.npy"
  size = images.stat().st_size
  with open(images, "r+b") as f:
    f.truncate(size // 2)
  _assert_same_images(data.load_dataset("mnist", data_dir, cache_dir=str(tmp_path)),
                      direct_mnist)
  assert len(count_mnist_decodes) == 2 and images.stat().st_size == size


def _tiny(seed: int = 0) -> data.ImageDataset:
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (6, 32, 32, 1), dtype=np.uint8)
  return data.ImageDataset("tiny", images, np.arange(6, dtype=np.int32) % 3, images[:2],
                           np.zeros(2, np.int32), 3, (0.5,), (0.25,))


def _damage_missing_file(entry):
  (entry / "test_labels.npy").unlink()


def _damage_wrong_shape(entry):
  np.save(entry / "train_labels.npy", np.zeros(5, np.int32))


def _damage_wrong_dtype(entry):
  np.save(entry / "train_labels.npy", np.zeros(6, np.int64))


def _damage_garbage_manifest(entry):
  (entry / "meta.json").write_text("{not json")


def _damage_manifest_not_a_dict(entry):
  (entry / "meta.json").write_text("[]")


def _damage_garbage_array(entry):
  (entry / "train_images.npy").write_bytes(b"\x93NUMPY garbage")


@pytest.mark.parametrize("damage", [_damage_missing_file, _damage_wrong_shape, _damage_wrong_dtype,
                                    _damage_garbage_manifest, _damage_manifest_not_a_dict,
                                    _damage_garbage_array])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
  source = tmp_path / "source.bin"
  source.write_bytes(b"x")
  builds = []
  build = lambda: builds.append(1) or _tiny()
  load = lambda: cache.cached_dataset("tiny", {}, [source], tmp_path / "cache", build)
  load()
  (entry,) = _entries(tmp_path / "cache", "tiny")
  damage(entry)
  ds = load()
  assert len(builds) == 2
  for k in IMAGE_FIELDS:
    np.testing.assert_array_equal(getattr(ds, k), getattr(_tiny(), k))
    assert getattr(ds, k).dtype == getattr(_tiny(), k).dtype
  load()
  assert len(builds) == 2  # the rebuilt entry is good
  assert not list((tmp_path / "cache" / "datasets").glob(".*"))


def test_unwritable_cache_decodes_in_memory(tmp_path):
  source = tmp_path / "source.bin"
  source.write_bytes(b"x")
  blocked = tmp_path / "a_file"
  blocked.write_bytes(b"")  # the cache directory cannot be created under a file
  ds = cache.cached_dataset("tiny", {}, [source], blocked, _tiny)
  np.testing.assert_array_equal(ds.train_images, _tiny().train_images)


def test_build_error_writes_nothing(tmp_path):
  source = tmp_path / "source.bin"
  source.write_bytes(b"x")

  def broken():
    raise data.DataError("bad source")

  with pytest.raises(data.DataError, match="bad source"):
    cache.cached_dataset("tiny", {}, [source], tmp_path / "cache", broken)
  assert not _entries(tmp_path / "cache", "tiny")


def test_multi30k_cached_equals_direct_and_max_len_has_its_own_entry(data_dir, tmp_path):
  direct = multi30k.load_multi30k_dir(pathlib.Path(data_dir) / "multi30k", 5, 2)
  for _ in range(2):  # decoded, then mapped
    ds = data.load_dataset("multi30k", data_dir, max_len=5, cache_dir=str(tmp_path))
    for split in ("train", "val", "test"):
      for field in ("src", "src_len", "tgt", "tgt_len"):
        a, b = getattr(getattr(ds, split), field), getattr(getattr(direct, split), field)
        assert a.dtype == b.dtype and a.shape == b.shape and _is_mapped(a)
        np.testing.assert_array_equal(a, b)
    assert ds.src_vocab == direct.src_vocab and ds.tgt_vocab == direct.tgt_vocab
    assert ds.test_references == direct.test_references
    assert ds.val_references == direct.val_references
  data.load_dataset("multi30k", data_dir, max_len=6, cache_dir=str(tmp_path))
  assert len(_entries(tmp_path, "multi30k")) == 2  # another max_len is another entry, not stale
