"""Where data and caches live, and safe file reading and writing."""

from __future__ import annotations

import contextlib
import gzip
import os
import pathlib
import tempfile
import zlib
from collections.abc import Iterator

from gssp_jax.data.types import DataError

DATA_DIR_ENV = "GSSP_DATA_DIR"
CACHE_DIR_ENV = "GSSP_CACHE_DIR"
DATA_URL_ENV = "GSSP_DATA_URL"
DEFAULT_CACHE_DIR = "~/.cache/gssp_jax"


def resolve_data_dir(data_dir: str | os.PathLike | None) -> pathlib.Path | None:
  """The data directory: ``data_dir`` if non-empty, else ``$GSSP_DATA_DIR``, else None.

  Raises:
    DataError: the chosen directory does not exist or is not a directory.
  """
  if data_dir is not None and str(data_dir) != "":
    source, value = "data_dir", str(data_dir)
  elif os.environ.get(DATA_DIR_ENV):
    source, value = f"${DATA_DIR_ENV}", os.environ[DATA_DIR_ENV]
  else:
    return None
  path = pathlib.Path(value).expanduser().resolve()
  if not path.is_dir():
    what = "is not a directory" if path.exists() else "does not exist"
    # An explicit setting that points nowhere is an error rather than a silent fall-through
    # (it is usually a typo or a relative path from another directory); say both ways out.
    unset = (f"unset it (`unset {DATA_DIR_ENV}`)" if source.startswith("$")
             else "leave it empty (--config.data_dir=)")
    raise DataError(
        f"{source}={value!r} {what} ({path}; relative paths start at the current directory). "
        f"Point it at a folder holding mnist/, multi30k/ and cifar10-jpeg/ (or "
        f"cifar-10-batches-py/), or {unset} to get the data from prepared TensorFlow Datasets "
        f"or the checksummed download (data_download, on by default).")
  return path


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> pathlib.Path:
  """The cache directory: ``cache_dir`` if non-empty, else ``$GSSP_CACHE_DIR``, else ~/.cache.

  The directory is not created here; writers create it when they first need it.
  """
  value = str(cache_dir) if cache_dir else os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
  return pathlib.Path(value).expanduser().resolve()


def find_file(directory: pathlib.Path, name: str) -> pathlib.Path | None:
  """``directory/name.gz`` if present, else ``directory/name``, else None."""
  for candidate in (directory / f"{name}.gz", directory / name):
    if candidate.is_file():
      return candidate
  return None


def read_maybe_gzip(path: pathlib.Path) -> bytes:
  """The content of ``path``, decompressed if it ends in ``.gz``.

  Raises:
    DataError: the file cannot be read, or is a truncated or corrupt gzip stream.
  """
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e}).") from e
  if path.suffix != ".gz":
    return raw
  try:
    return gzip.decompress(raw)
  except EOFError as e:
    raise DataError(
        f"{path}: truncated gzip file ({len(raw)} bytes; {e}). The copy is incomplete; "
        "copy or download it again.") from e
  except (OSError, zlib.error) as e:
    raise DataError(f"{path}: corrupt gzip file ({e}); copy or download it again.") from e


@contextlib.contextmanager
def atomic_output(path: pathlib.Path) -> Iterator[pathlib.Path]:
  """Yields a temporary path beside ``path``; renames it onto ``path`` if the block succeeds.

  Readers never see a half-written file, and a crash leaves at most a stray ``.tmp`` file.
  """
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  os.close(fd)
  tmp_path = pathlib.Path(tmp)
  try:
    yield tmp_path
    os.replace(tmp_path, path)
  finally:
    tmp_path.unlink(missing_ok=True)
