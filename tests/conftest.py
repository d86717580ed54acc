"""Shared fixtures. Tests never download: data comes from $GSSP_DATA_DIR or ../shared/data."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _data_dir() -> pathlib.Path | None:
  env = os.environ.get("GSSP_DATA_DIR")
  candidates = [pathlib.Path(env)] if env else []
  candidates.append(REPO.parent / "shared" / "data")
  return next((p.resolve() for p in candidates if (p / "mnist").is_dir()), None)


@pytest.fixture(scope="session")
def data_dir() -> str:
  """The offline data directory (MNIST, Multi30k, CIFAR-10 JPEG)."""
  path = _data_dir()
  if path is None:
    pytest.skip("no data directory: set GSSP_DATA_DIR (CI points it at ../shared/data)")
  return str(path)
