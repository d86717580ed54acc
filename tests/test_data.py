"""Tests of gssp_jax.data. No network: downloads are served from a loopback HTTP server."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import http.server
import io
import os
import pathlib
import pickle
import shutil
import tarfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from gssp_jax import data
from gssp_jax.data import cifar10_jpeg, mnist, multi30k
from gssp_jax.data import BOS, EOS, PAD, UNK, DataError, Vocab

MNIST_FILES = [f + ".gz" for f in mnist.FILE_NAMES]


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path):
  """No test sees a real TFDS directory or cache, or an inherited download URL."""
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds_empty"))
  monkeypatch.setenv("GSSP_CACHE_DIR", str(tmp_path / "cache_env"))
  monkeypatch.delenv("GSSP_DATA_URL", raising=False)


@pytest.fixture(scope="module")
def mnist_ds(data_dir):
  return data.load_dataset("mnist", data_dir)


@pytest.fixture(scope="module")
def m30k(data_dir):
  return data.load_dataset("multi30k", data_dir)


def _copy_mnist(src_dir, dest) -> pathlib.Path:
  """A writable MNIST folder: symlinks to the real files, to be replaced one by one."""
  dest.mkdir(parents=True)
  for name in MNIST_FILES:
    (dest / name).symlink_to(pathlib.Path(src_dir) / "mnist" / name)
  return dest


def _replace(path: pathlib.Path, content: bytes) -> None:
  path.unlink()
  path.write_bytes(content)


# --- resolution -------------------------------------------------------------------------------


def test_resolve_data_dir(monkeypatch, tmp_path):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  assert data.resolve_data_dir(None) is None
  assert data.resolve_data_dir("") is None
  monkeypatch.setenv("GSSP_DATA_DIR", str(tmp_path))
  assert data.resolve_data_dir(None) == tmp_path.resolve()
  assert data.resolve_data_dir("") == tmp_path.resolve()
  other = tmp_path / "other"
  other.mkdir()
  assert data.resolve_data_dir(str(other)) == other.resolve()
  with pytest.raises(DataError, match="nope"):
    data.resolve_data_dir(str(tmp_path / "nope"))
  monkeypatch.setenv("GSSP_DATA_DIR", str(tmp_path / "missing_env"))
  with pytest.raises(DataError, match="GSSP_DATA_DIR.*missing_env"):
    data.resolve_data_dir(None)


def test_unknown_dataset_names_value_and_choices():
  with pytest.raises(ValueError, match="'imagenet'.*mnist, cifar10, multi30k"):
    data.load_dataset("imagenet")
  assert data.DATASETS == ("mnist", "cifar10", "multi30k")


# --- MNIST ------------------------------------------------------------------------------------


def test_mnist_arrays(mnist_ds):
  ds = mnist_ds
  assert isinstance(ds, data.ImageDataset) and ds.name == "mnist" and ds.num_classes == 10
  assert ds.train_images.shape == (60000, 32, 32, 1) and ds.train_images.dtype == np.uint8
  assert ds.test_images.shape == (10000, 32, 32, 1) and ds.test_images.dtype == np.uint8
  assert ds.train_labels.shape == (60000,) and ds.train_labels.dtype == np.int32
  assert ds.test_labels.shape == (10000,) and ds.test_labels.dtype == np.int32
  assert ds.train_labels[0] == 5 and ds.test_labels[0] == 7
  for labels in (ds.train_labels, ds.test_labels):
    assert labels.min() == 0 and labels.max() == 9
  for imgs in (ds.train_images, ds.test_images):  # 2-pixel zero border from 28 -> 32
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert not imgs[:, border].any()
    assert imgs[:, 2:30, 2:30].max() == 255
  with pytest.raises(dataclasses.FrozenInstanceError):
    ds.name = "other"


def test_mnist_mean_std(mnist_ds):
  total = total_sq = 0.0
  for chunk in np.array_split(mnist_ds.train_images, 10):  # float64 in chunks: less memory
    x = chunk.astype(np.float64) / 255.0
    total, total_sq = total + x.sum(), total_sq + (x * x).sum()
  mean = total / mnist_ds.train_images.size
  np.testing.assert_allclose(mnist_ds.mean, [mean], rtol=1e-9)
  np.testing.assert_allclose(mnist_ds.std, [np.sqrt(total_sq / mnist_ds.train_images.size
                                                    - mean ** 2)], rtol=1e-7)
  assert 0.09 < mnist_ds.mean[0] < 0.11  # padded images: lower than the 28x28 0.1307


def test_mnist_files_directly_in_data_dir(data_dir, tmp_path, mnist_ds):
  flat = _copy_mnist(data_dir, tmp_path / "flat")
  ds = data.load_dataset("mnist", str(flat))
  np.testing.assert_array_equal(ds.test_images, mnist_ds.test_images)


def test_mnist_truncated_gzip(data_dir, tmp_path):
  d = _copy_mnist(data_dir, tmp_path / "d")
  raw = (d / "t10k-images-idx3-ubyte.gz").read_bytes()
  _replace(d / "t10k-images-idx3-ubyte.gz", raw[: len(raw) // 2])
  with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\.gz.*truncated"):
    data.load_dataset("mnist", str(d))


def test_mnist_truncated_payload(data_dir, tmp_path):
  d = _copy_mnist(data_dir, tmp_path / "d")
  content = gzip.decompress((d / "t10k-labels-idx1-ubyte.gz").read_bytes())
  _replace(d / "t10k-labels-idx1-ubyte.gz", gzip.compress(content[:-100]))
  with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz.*truncated"):
    data.load_dataset("mnist", str(d))


def test_mnist_wrong_magic(data_dir, tmp_path):
  d = _copy_mnist(data_dir, tmp_path / "d")
  content = gzip.decompress((d / "train-labels-idx1-ubyte.gz").read_bytes())
  # An image file's magic in the labels file, as if the two were swapped.
  _replace(d / "train-labels-idx1-ubyte.gz", gzip.compress(b"\x00\x00\x08\x03" + content[4:]))
  with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz.*magic.*2051.*2049"):
    data.load_dataset("mnist", str(d))


def test_mnist_checksum_mismatch(data_dir, tmp_path):
  d = _copy_mnist(data_dir, tmp_path / "d")
  content = bytearray(gzip.decompress((d / "t10k-labels-idx1-ubyte.gz").read_bytes()))
  content[100] = (content[100] + 1) % 10  # still a valid label, so only the checksum notices
  _replace(d / "t10k-labels-idx1-ubyte.gz", gzip.compress(bytes(content)))
  with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz.*checksum"):
    data.load_dataset("mnist", str(d))


def test_mnist_recompressed_copy_is_accepted(data_dir, tmp_path, mnist_ds):
  d = _copy_mnist(data_dir, tmp_path / "d")
  content = gzip.decompress((d / "t10k-labels-idx1-ubyte.gz").read_bytes())
  (d / "t10k-labels-idx1-ubyte.gz").unlink()
  (d / "t10k-labels-idx1-ubyte").write_bytes(content)  # unpacked: same content, other bytes
  ds = data.load_dataset("mnist", str(d))
  np.testing.assert_array_equal(ds.test_labels, mnist_ds.test_labels)


def test_mnist_missing_file(data_dir, tmp_path):
  d = _copy_mnist(data_dir, tmp_path / "d")
  (d / "train-labels-idx1-ubyte.gz").unlink()
  with pytest.raises(DataError, match=r"missing MNIST file .*train-labels-idx1-ubyte\.gz"):
    data.load_dataset("mnist", str(d))


# --- Multi30k ---------------------------------------------------------------------------------


def test_tokenize():
  assert data.tokenize("Zwei junge weiße Männer, im Freien.") == [
      "zwei", "junge", "weiße", "männer", ",", "im", "freien", "."]
  assert data.tokenize("GROẞE Straße!") == ["große", "straße", "!"]
  decomposed = "Mu\u0308ller"  # u + combining diaeresis
  assert data.tokenize(decomposed) == data.tokenize("Müller") == ["müller"]
  assert data.tokenize("A man's 3-wheeled bike.") == [
      "a", "man", "'", "s", "3", "-", "wheeled", "bike", "."]
  s = "Ein Mädchen (in Rosa) klettert — schnell!"
  assert data.tokenize(s) == data.tokenize(s) and data.tokenize("") == []


def test_vocab_build_encode_decode():
  corpus = [["b", "a", "c"], ["a", "b"], ["a", "d"], ["b"]]
  vocab = Vocab.build(corpus, min_freq=2)
  assert vocab.itos == ("<pad>", "<unk>", "<bos>", "<eos>", "a", "b")  # a:3, b:3 tie -> by token
  assert len(vocab) == 6 and vocab.stoi["b"] == 5
  assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
  assert vocab.encode(["a", "zzz", "b"]) == [4, UNK, 5]
  assert vocab.decode([BOS, 4, UNK, 5, EOS, 4, PAD]) == ["a", "<unk>", "b"]
  assert vocab.decode(np.array([BOS, 4, EOS, PAD]), strip_special=False) == [
      "<bos>", "a", "<eos>", "<pad>"]
  assert Vocab.build(corpus, min_freq=1).itos[4:] == ("a", "b", "c", "d")
  assert Vocab.build(list(reversed(corpus)), min_freq=1) == Vocab.build(corpus, min_freq=1)


def test_multi30k_counts_and_arrays(m30k):
  assert isinstance(m30k, data.TranslationDataset) and m30k.name == "multi30k"
  for split, n in (("train", 29000), ("val", 1014), ("test", 1000)):
    arrays = getattr(m30k, split)
    assert len(arrays) == n
    for a in (arrays.src, arrays.src_len, arrays.tgt, arrays.tgt_len):
      assert a.dtype == np.int32 and a.shape[0] == n
    rows = np.arange(n)
    assert (arrays.tgt[:, 0] == BOS).all()
    assert (arrays.tgt[rows, arrays.tgt_len - 1] == EOS).all()
    assert (arrays.src[rows, arrays.src_len - 1] == EOS).all()
    assert not (arrays.src == BOS).any()
    assert arrays.src.shape[1] == arrays.src_len.max()  # padded to the split's longest
    assert arrays.tgt.shape[1] == arrays.tgt_len.max()
    positions = np.arange(arrays.tgt.shape[1])
    assert (arrays.tgt[positions >= arrays.tgt_len[:, None]] == PAD).all()
    assert (arrays.tgt[positions < arrays.tgt_len[:, None]] != PAD).all()
  assert len(m30k.test_references) == 1000 and len(m30k.val_references) == 1014
  assert m30k.test_references[0] == "a man in an orange hat starring at something ."


def test_multi30k_vocab_specials_and_min_freq(m30k, data_dir):
  en, _, _ = multi30k.read_lines(pathlib.Path(data_dir) / "multi30k", "train.en")
  counts = {}
  for line in en:
    for t in data.tokenize(line):
      counts[t] = counts.get(t, 0) + 1
  vocab = m30k.tgt_vocab
  assert vocab.itos[:4] == ("<pad>", "<unk>", "<bos>", "<eos>")
  expected = sorted((t for t, c in counts.items() if c >= 2), key=lambda t: (-counts[t], t))
  assert list(vocab.itos[4:]) == expected
  assert vocab.itos[4] == "a"
  assert len(m30k.src_vocab) > len(vocab) > 5000


def test_multi30k_round_trip(m30k):
  tokens = m30k.test_references[5].split()
  ids = m30k.tgt_vocab.encode(tokens)
  expected = [t if t in m30k.tgt_vocab.stoi else "<unk>" for t in tokens]
  assert m30k.tgt_vocab.decode(ids) == expected
  assert m30k.tgt_vocab.decode(m30k.test.tgt[5]) == expected
  assert m30k.tgt_vocab.decode([BOS] + ids + [EOS, PAD, PAD]) == expected


def test_multi30k_max_len(data_dir, m30k):
  short = data.load_dataset("multi30k", data_dir, max_len=5)
  assert short.train.src_len.max() == 6 and short.train.tgt_len.max() == 7
  assert short.train.src.shape[1] == 6 and short.test.tgt.shape[1] == 7
  np.testing.assert_array_equal(short.test.tgt[:, :6], m30k.test.tgt[:, :6])
  assert short.test_references == m30k.test_references  # references are never cut
  with pytest.raises(ValueError, match="max_len"):
    data.load_dataset("multi30k", data_dir, max_len=-1)


def test_multi30k_line_count_mismatch(data_dir, tmp_path):
  d = tmp_path / "multi30k"
  d.mkdir()
  for src in (pathlib.Path(data_dir) / "multi30k").glob("*.gz"):
    shutil.copyfile(src, d / src.name)  # copyfile: the originals may be read-only
  lines = gzip.decompress((d / "val.de.gz").read_bytes()).split(b"\n")
  (d / "val.de.gz").write_bytes(gzip.compress(b"\n".join(lines[1:])))
  with pytest.raises(DataError, match=r"val\.de\.gz has 1013 lines but .*val\.en\.gz has 1014"):
    data.load_dataset("multi30k", str(tmp_path))


# --- CIFAR-10 ---------------------------------------------------------------------------------


def _jpeg(image: np.ndarray) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, "JPEG", quality=95)
  return buf.getvalue()


def _synthetic_cifar(per_class: int, seed: int) -> dict[str, np.ndarray]:
  """Solid-colour images (they survive JPEG almost exactly), in label order."""
  rng = np.random.default_rng(seed)
  out = {}
  for split in ("train", "test"):
    colors = rng.integers(0, 256, (10 * per_class, 3), dtype=np.uint8)
    out[f"{split}_images"] = np.broadcast_to(colors[:, None, None, :], (10 * per_class, 32, 32, 3))
    out[f"{split}_labels"] = np.repeat(np.arange(10, dtype=np.int32), per_class)
  return out


def _members(arrays, per_class):
  members = []
  for split in ("train", "test"):
    for i, (img, label) in enumerate(zip(arrays[f"{split}_images"], arrays[f"{split}_labels"])):
      members.append((f"{split}/{cifar10_jpeg.CLASSES[label]}/{i % per_class:04d}.jpg", _jpeg(img)))
  return members


def _write_tar(path: pathlib.Path, members, seed=0) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  order = np.random.default_rng(seed).permutation(len(members))  # archive order is arbitrary
  with tarfile.open(path, "w:gz") as tar:
    for name, content in [members[i] for i in order] + [("README.txt", b"not an image")]:
      info = tarfile.TarInfo(name)
      info.size = len(content)
      tar.addfile(info, io.BytesIO(content))


def _assert_close_to(ds, arrays, per_class=2):
  """``ds`` holds ``arrays`` (written by _members) in the loader's fixed mixed order."""
  for split in ("train", "test"):
    labels = arrays[f"{split}_labels"]
    names = [f"{i % per_class:04d}.jpg" for i in range(len(labels))]
    order = cifar10_jpeg.mixed_order(split, labels, names)
    np.testing.assert_array_equal(getattr(ds, f"{split}_labels"), labels[order])
    diff = np.abs(getattr(ds, f"{split}_images").astype(int) - arrays[f"{split}_images"][order])
    assert diff.max() <= 4


def test_cifar_jpeg_order_mixes_the_classes():
  """A prefix (data.train_size) of the class-by-class JPEG layout must hold every class."""
  labels = np.repeat(np.arange(10), 1000)
  names = [f"{i % 1000:04d}.jpg" for i in range(10_000)]
  order = cifar10_jpeg.mixed_order("test", labels, names)
  assert sorted(order.tolist()) == list(range(10_000))
  counts = np.bincount(labels[order][:1000], minlength=10)
  assert counts.min() >= 70 and counts.max() <= 130, counts
  shuffled = np.random.default_rng(0).permutation(10_000)   # any input order, the same result
  again = cifar10_jpeg.mixed_order("test", labels[shuffled], [names[i] for i in shuffled])
  np.testing.assert_array_equal(shuffled[again], order)


def _entries(cache: pathlib.Path, name: str) -> list[pathlib.Path]:
  return [p for p in (cache / "datasets").glob(f"{name}-*") if p.is_dir()]


def test_cifar_jpeg_tarball_cache_and_invalidation(tmp_path, monkeypatch):
  root, cache = tmp_path / "data", tmp_path / "cache"
  arrays = _synthetic_cifar(per_class=2, seed=0)
  tar_path = root / "cifar10-jpeg" / "cifar10_jpg.tar.gz"
  _write_tar(tar_path, _members(arrays, 2))
  ds = data.load_dataset("cifar10", str(root), cache_dir=str(cache))
  assert ds.name == "cifar10" and ds.num_classes == 10
  assert ds.train_images.shape == (20, 32, 32, 3) and ds.test_images.shape == (20, 32, 32, 3)
  assert ds.train_images.dtype == np.uint8 and ds.train_labels.dtype == np.int32
  _assert_close_to(ds, arrays)
  np.testing.assert_allclose(ds.mean, (ds.train_images / 255.0).mean(axis=(0, 1, 2)))
  (entry,) = _entries(cache, "cifar10")
  cached = entry / "train_images.npy"
  mtime = cached.stat().st_mtime_ns

  def no_decoding(*args):
    raise AssertionError("decoded although cached")

  with monkeypatch.context() as m:
    m.setattr(cifar10_jpeg, "decode_image", no_decoding)
    again = data.load_dataset("cifar10", str(root), cache_dir=str(cache))
  np.testing.assert_array_equal(again.train_images, ds.train_images)
  assert cached.stat().st_mtime_ns == mtime

  # A damaged cache is rebuilt, not trusted. Replaced rather than written in place: ds maps
  # the file, and truncating a mapped file makes reading its pages a SIGBUS.
  cached.unlink()
  cached.write_bytes(b"garbage")
  np.testing.assert_array_equal(
      data.load_dataset("cifar10", str(root), cache_dir=str(cache)).train_images, ds.train_images)
  assert cached.stat().st_size > 1000

  changed = _synthetic_cifar(per_class=3, seed=1)
  _write_tar(tar_path, _members(changed, 3))
  ds3 = data.load_dataset("cifar10", str(root), cache_dir=str(cache))
  assert ds3.train_images.shape == (30, 32, 32, 3)
  _assert_close_to(ds3, changed, per_class=3)
  assert len(_entries(cache, "cifar10")) == 1 and _entries(cache, "cifar10") != [entry]  # stale
  assert not list((cache / "datasets").glob(".*"))  # no temporary left behind


def test_cifar_jpeg_extracted_tree(tmp_path):
  arrays = _synthetic_cifar(per_class=1, seed=2)
  for name, content in _members(arrays, 1):
    path = tmp_path / "cifar10-jpeg" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
  ds = data.load_dataset("cifar10", str(tmp_path), cache_dir=str(tmp_path / "cache"))
  _assert_close_to(ds, arrays, per_class=1)
  shutil.rmtree(tmp_path / "cifar10-jpeg" / "test")
  with pytest.raises(DataError, match=r"cifar10-jpeg: missing test/"):
    data.load_dataset("cifar10", str(tmp_path), cache_dir=str(tmp_path / "cache"))


def test_cifar_jpeg_wrong_shape_names_member(tmp_path):
  members = _members(_synthetic_cifar(per_class=1, seed=3), 1)
  members[4] = ("train/deer/0000.jpg", _jpeg(np.zeros((16, 16, 3), np.uint8)))
  _write_tar(tmp_path / "cifar10-jpeg" / "cifar10_jpg.tar.gz", members)
  with pytest.raises(DataError, match=r"train/deer/0000\.jpg.*16x16.*32x32x3"):
    data.load_dataset("cifar10", str(tmp_path), cache_dir=str(tmp_path / "cache"))


def _write_pickle_batches(directory: pathlib.Path, per_batch: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(4)
  directory.mkdir(parents=True)
  images, labels = {"train": [], "test": []}, {"train": [], "test": []}
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    imgs = rng.integers(0, 256, (per_batch, 32, 32, 3), dtype=np.uint8)
    lbls = rng.integers(0, 10, per_batch).tolist()
    batch = {b"batch_label": name.encode(), b"labels": lbls, b"filenames": [b"x.png"] * per_batch,
             b"data": imgs.transpose(0, 3, 1, 2).reshape(per_batch, -1)}  # official CHW rows
    (directory / name).write_bytes(pickle.dumps(batch, protocol=2))
    split = "test" if name == "test_batch" else "train"
    images[split].append(imgs)
    labels[split].append(lbls)
  return {f"{s}_{k}": np.concatenate(v[s]) for k, v in (("images", images), ("labels", labels))
          for s in ("train", "test")}


class _Evil:

  def __reduce__(self):
    return (os.system, ("echo pwned",))


def test_cifar_python_pickles(tmp_path):
  root = tmp_path / "data"
  expected = _write_pickle_batches(root / "cifar-10-batches-py", per_batch=3)
  # A JPEG tree is present too: the official pickles take precedence.
  (root / "cifar10-jpeg").mkdir()
  ds = data.load_dataset("cifar10", str(root), cache_dir=str(tmp_path / "cache"))
  assert ds.train_images.shape == (15, 32, 32, 3) and ds.test_images.shape == (3, 32, 32, 3)
  for key, value in expected.items():
    np.testing.assert_array_equal(getattr(ds, key), value)

  tar_root = tmp_path / "tar"
  tar_root.mkdir()
  with tarfile.open(tar_root / "cifar-10-python.tar.gz", "w:gz") as tar:
    tar.add(root / "cifar-10-batches-py", arcname="cifar-10-batches-py")
  from_tar = data.load_dataset("cifar10", str(tar_root), cache_dir=str(tmp_path / "cache"))
  np.testing.assert_array_equal(from_tar.train_images, ds.train_images)

  (root / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps({b"data": _Evil()}))
  with pytest.raises(DataError, match=r"test_batch.*not allowed"):
    data.load_dataset("cifar10", str(root), cache_dir=str(tmp_path / "cache"))
  (root / "cifar-10-batches-py" / "data_batch_3").unlink()
  with pytest.raises(DataError, match=r"missing data_batch_3"):
    data.load_dataset("cifar10", str(root), cache_dir=str(tmp_path / "cache"))


@pytest.mark.slow
def test_cifar_real_jpeg_tarball(data_dir, tmp_path):
  start = time.perf_counter()
  ds = data.load_dataset("cifar10", data_dir, cache_dir=str(tmp_path))
  first = time.perf_counter() - start
  start = time.perf_counter()
  cached = data.load_dataset("cifar10", data_dir, cache_dir=str(tmp_path))
  second = time.perf_counter() - start
  print(f"\nreal CIFAR-10 JPEG load: first (decode) {first:.1f} s, cached {second:.2f} s")
  assert ds.train_images.shape == (50000, 32, 32, 3) and ds.test_images.shape == (10000, 32, 32, 3)
  assert (np.bincount(ds.train_labels, minlength=10) == 5000).all()
  assert (np.bincount(ds.test_labels, minlength=10) == 1000).all()
  np.testing.assert_array_equal(cached.test_images, ds.test_images)
  np.testing.assert_allclose(ds.mean, (0.4914, 0.4822, 0.4465), atol=0.01)  # published values
  assert second < first


# --- download, TFDS and the no-data case ------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):

  def log_message(self, *args):
    pass


class _Server:
  """A loopback HTTP server over ``directory``, in a thread."""

  def __init__(self, directory):
    handler = functools.partial(_QuietHandler, directory=str(directory))
    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._server.shutdown()
    self._server.server_close()
    self._thread.join()


def test_download_from_mirror(data_dir, tmp_path, monkeypatch, mnist_ds, m30k):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  cache = tmp_path / "cache"
  kwargs = dict(allow_download=True, cache_dir=str(cache))
  with _Server(data_dir) as server:
    ds = data.load_dataset("mnist", None, download_url=server.url, **kwargs)
    tr = data.load_dataset("multi30k", None, download_url=server.url + "/", **kwargs)
  for key in ("train_images", "train_labels", "test_images", "test_labels"):
    np.testing.assert_array_equal(getattr(ds, key), getattr(mnist_ds, key))
  assert ds.mean == mnist_ds.mean
  assert tr.src_vocab == m30k.src_vocab and tr.tgt_vocab == m30k.tgt_vocab
  np.testing.assert_array_equal(tr.train.tgt, m30k.train.tgt)
  assert tr.test_references == m30k.test_references
  downloads = cache / "downloads"
  assert sorted(p.name for p in (downloads / "mnist").iterdir()) == sorted(MNIST_FILES)
  assert not list(downloads.rglob("*.tmp"))
  # Server gone: verified files already in the cache are used without any request.
  again = data.load_dataset("mnist", None, download_url=server.url, **kwargs)
  np.testing.assert_array_equal(again.test_labels, mnist_ds.test_labels)


def test_download_checksum_mismatch(data_dir, tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  served = tmp_path / "served" / "multi30k"
  served.mkdir(parents=True)
  for src in (pathlib.Path(data_dir) / "multi30k").glob("*.gz"):
    shutil.copyfile(src, served / src.name)
  raw = bytearray((served / "val.en.gz").read_bytes())
  raw[-20] ^= 0xFF
  (served / "val.en.gz").write_bytes(bytes(raw))
  cache = tmp_path / "cache"
  with _Server(served.parent) as server:
    with pytest.raises(DataError, match=r"val\.en\.gz .*sha256"):
      data.load_dataset("multi30k", None, allow_download=True, download_url=server.url,
                        cache_dir=str(cache))
  assert not (cache / "downloads" / "multi30k" / "val.en.gz").exists()
  assert not list(cache.rglob("*.tmp"))


def test_download_cifar_jpeg_checksum_mismatch(tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  served = tmp_path / "served"
  _write_tar(served / "cifar10-jpeg" / "cifar10_jpg.tar.gz",
             _members(_synthetic_cifar(per_class=1, seed=5), 1))
  with _Server(served) as server:
    with pytest.raises(DataError, match=r"cifar10_jpg\.tar\.gz .*sha256 .*expected d34c68f6"):
      data.load_dataset("cifar10", None, allow_download=True, download_url=server.url,
                        cache_dir=str(tmp_path / "cache"))


def test_download_unreachable_fails_fast(tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  with _Server(tmp_path) as server:
    url = server.url  # a port that is closed once the server has stopped
  start = time.perf_counter()
  with pytest.raises(DataError, match=r"download of http://127\.0\.0\.1:\d+/mnist/.* failed"):
    data.load_dataset("mnist", allow_download=True, download_url=url,
                      cache_dir=str(tmp_path / "cache"))
  assert time.perf_counter() - start < 5


def test_download_plan_uses_canonical_mirrors():
  from gssp_jax.data import download  # pylint: disable=g-import-not-at-top
  urls = [p[0] for p in download.plan("mnist", None)]
  assert urls[0] == "https://storage.googleapis.com/cvdf-datasets/mnist/train-images-idx3-ubyte.gz"
  assert download.plan("cifar10", None) == [(
      "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz", "md5",
      "c58f30108f718f92721af3b95e74349a")]
  assert download.plan("cifar10", "http://m")[0][:2] == (
      "http://m/cifar10-jpeg/cifar10_jpg.tar.gz", "cifar10-jpeg/cifar10_jpg.tar.gz")
  assert all(u.startswith(download.MULTI30K_URL) for u, *_ in download.plan("multi30k", None))


@pytest.mark.parametrize("name", data.DATASETS)
def test_no_data_fails_fast_with_instructions(name, tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  start = time.perf_counter()
  with pytest.raises(DataError) as info:
    data.load_dataset(name, cache_dir=str(tmp_path / "cache"))
  assert time.perf_counter() - start < 5
  message = str(info.value)
  for needle in ("GSSP_DATA_DIR", "--config.data_dir=DIR", "data_download=True", name):
    assert needle in message


def test_data_dir_without_the_dataset_says_where_it_looked(tmp_path, monkeypatch):
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  with pytest.raises(DataError, match=f"data directory {tmp_path}: none of the mnist files"):
    data.load_dataset("mnist", str(tmp_path), cache_dir=str(tmp_path / "cache"))


def test_prepared_tfds_dataset_is_used(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("array_record")
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  tfds_dir = tmp_path / "tfds"
  monkeypatch.setenv("TFDS_DATA_DIR", str(tfds_dir))

  class Mnist(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Stands in for a prepared MNIST; plain Tensor features need no TensorFlow to write."""
    VERSION = tfds.core.Version("3.0.1")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
          "label": tfds.features.ClassLabel(num_classes=10)}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(6), "test": self._generate_examples(3)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {"image": np.full((28, 28, 1), 10 * i + 1, np.uint8), "label": i}

  Mnist(data_dir=str(tfds_dir), file_format="array_record").download_and_prepare()
  ds = data.load_dataset("mnist", cache_dir=str(tmp_path / "cache"))
  assert ds.train_images.shape == (6, 32, 32, 1) and ds.test_images.shape == (3, 32, 32, 1)
  order = np.argsort(ds.train_labels)
  np.testing.assert_array_equal(ds.train_labels[order], np.arange(6))
  np.testing.assert_array_equal(ds.train_images[order, 16, 16, 0], 10 * np.arange(6) + 1)
  assert not ds.train_images[:, :2].any()


# --- augmentation -----------------------------------------------------------------------------


def _random_images(n, h=8, w=8, c=2, seed=0):
  # Values 1..255: a zero in the output can only come from the padding.
  return np.random.default_rng(seed).integers(1, 256, (n, h, w, c), dtype=np.uint8)


def test_augment_shape_dtype_determinism_and_jit():
  images = jnp.asarray(_random_images(16))
  key = jax.random.key(0)
  out = data.augment_crop_flip(key, images)
  assert out.shape == images.shape and out.dtype == images.dtype
  np.testing.assert_array_equal(out, data.augment_crop_flip(key, images))
  assert not np.array_equal(out, data.augment_crop_flip(jax.random.key(1), images))
  jitted = jax.jit(data.augment_crop_flip, static_argnames="pad")
  np.testing.assert_array_equal(jitted(key, images, pad=4), out)
  floats = images.astype(jnp.float32)
  out_f = data.augment_crop_flip(jax.random.PRNGKey(0), floats, pad=2)
  assert out_f.dtype == jnp.float32 and out_f.shape == floats.shape


def test_augment_flip_probability():
  images = _random_images(4000, 4, 4, 1)
  out = np.asarray(data.augment_crop_flip(jax.random.key(3), jnp.asarray(images), pad=0))
  same = (out == images).all(axis=(1, 2, 3))
  flipped = (out == images[:, :, ::-1]).all(axis=(1, 2, 3))
  assert (same | flipped).all()
  asymmetric = ~(images == images[:, :, ::-1]).all(axis=(1, 2, 3))  # else a flip is invisible
  rate = flipped[asymmetric].mean()
  assert 0.46 < rate < 0.54


def test_augment_crop_is_a_shift_of_the_padded_image():
  pad, images = 3, _random_images(64)
  out = np.asarray(data.augment_crop_flip(jax.random.key(7), jnp.asarray(images), pad=pad))
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  matched = np.zeros(len(images), bool)
  offsets = set()
  for y in range(2 * pad + 1):
    for x in range(2 * pad + 1):
      crop = padded[:, y:y + 8, x:x + 8]
      hit = ((out == crop).all(axis=(1, 2, 3)) | (out == crop[:, :, ::-1]).all(axis=(1, 2, 3)))
      matched |= hit
      if hit.any():
        offsets.add((y, x))
  assert matched.all(), "some outputs are not a (flipped) crop of the padded image"
  assert len(offsets) > 10  # offsets really vary across images


def test_normalize_images():
  images = np.array([[[[0, 255, 51]]]], np.uint8)
  mean, std = (0.5, 0.5, 0.2), (0.5, 0.25, 0.1)
  expected = (images / 255.0 - np.array(mean)) / np.array(std)
  out = jax.jit(data.normalize_images)(images, mean, std)
  assert out.dtype == jnp.float32 and out.shape == images.shape
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_a_missing_data_dir_says_how_to_fix_it(tmp_path, monkeypatch):
  # An explicit setting that points nowhere (e.g. the CI layout's ../shared/data elsewhere).
  monkeypatch.setenv("GSSP_DATA_DIR", "../no_such_shared/data")
  with pytest.raises(DataError) as info:
    data.resolve_data_dir(None)
  message = str(info.value)
  assert "$GSSP_DATA_DIR='../no_such_shared/data' does not exist" in message
  assert "`unset GSSP_DATA_DIR`" in message and "download (data_download, on by default)" in message
  monkeypatch.delenv("GSSP_DATA_DIR")
  with pytest.raises(DataError, match=r"data_dir='/no/such/dir' does not exist .* or leave it "
                                      r"empty \(--config.data_dir=\) to get the data from"):
    data.resolve_data_dir("/no/such/dir")
