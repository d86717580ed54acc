"""Checksummed download of the canonical data files into the cache directory.

Files land in ``<cache_dir>/downloads/`` in the same layout as a data directory
(``mnist/``, ``multi30k/``, ``cifar10-jpeg/`` or ``cifar-10-python.tar.gz``), so the normal
directory loaders read them. With a custom base URL the files are fetched from that layout
under the URL (a plain HTTP server in front of a data directory works); without one, from the
canonical public mirrors.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import pathlib
import urllib.error
import urllib.request

from absl import logging

from gssp_jax.data import checksums, cifar10, mnist, multi30k, paths
from gssp_jax.data.types import DataError

MNIST_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"
CIFAR10_PYTHON_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
TIMEOUT_S = 10.0
_BLOCK = 1 << 20


def downloads_dir(cache_dir: pathlib.Path) -> pathlib.Path:
  return cache_dir / "downloads"


def resolve_base_url(download_url: str | None) -> str | None:
  """``download_url`` if non-empty, else ``$GSSP_DATA_URL``, else None (canonical mirrors)."""
  url = download_url or os.environ.get(paths.DATA_URL_ENV) or None
  return url.rstrip("/") if url else None


def plan(name: str, base_url: str | None) -> list[tuple[str, str, str, str]]:
  """(url, relative destination, algorithm, expected digest) for every file of ``name``."""
  if name == "mnist":
    rels = [f"mnist/{f}.gz" for f in mnist.FILE_NAMES]
    canonical = {rel: MNIST_URL + rel.split("/")[1] for rel in rels}
  elif name == "multi30k":
    rels = [f"multi30k/{f}.gz" for f in multi30k.FILE_NAMES]
    canonical = {rel: MULTI30K_URL + rel.split("/")[1] for rel in rels}
  elif name == "cifar10":
    if base_url is None:
      return [(CIFAR10_PYTHON_URL, cifar10.PYTHON_TARBALL, "md5", checksums.CIFAR10_PYTHON_MD5)]
    rels = [f"{cifar10.JPEG_DIR}/{cifar10.JPEG_TARBALL}"]
    canonical = {}
  else:
    raise ValueError(f"no download plan for dataset {name!r}")
  return [(f"{base_url}/{rel}" if base_url else canonical[rel], rel, "sha256",
           checksums.FILE_SHA256[rel]) for rel in rels]


def _digest(path: pathlib.Path, algorithm: str) -> str:
  h = hashlib.new(algorithm)
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_BLOCK), b""):
      h.update(block)
  return h.hexdigest()


def fetch(url: str, dest: pathlib.Path, algorithm: str, expected: str,
          timeout: float = TIMEOUT_S) -> None:
  """Downloads ``url`` to ``dest`` unless a verified copy is there; verifies the digest.

  The download goes to a temporary file renamed onto ``dest`` only once verified, so ``dest``
  never holds a partial or wrong file. No retries: a failure is reported at once.

  Raises:
    DataError: the download fails or its digest differs from ``expected``.
  """
  if dest.is_file() and _digest(dest, algorithm) == expected:
    return
  logging.info("Downloading %s -> %s", url, dest)
  h = hashlib.new(algorithm)
  with paths.atomic_output(dest) as tmp:
    try:
      with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
        for block in iter(lambda: response.read(_BLOCK), b""):
          h.update(block)
          out.write(block)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
      raise DataError(
          f"download of {url} failed ({e})") from e
    if h.hexdigest() != expected:
      raise DataError(
          f"{dest.name} downloaded from {url} has {algorithm} {h.hexdigest()}, expected "
          f"{expected}: the server sent a corrupt or different file. Nothing was kept; fix the "
          "source or provide the file locally.")


def download(name: str, cache_dir: pathlib.Path, download_url: str | None = None) -> pathlib.Path:
  """Fetches ``name``'s files into ``<cache_dir>/downloads``; returns that data directory."""
  root = downloads_dir(cache_dir)
  for url, rel, algorithm, expected in plan(name, resolve_base_url(download_url)):
    fetch(url, root / rel, algorithm, expected)
  return root
