"""Shared fixtures. Tests never download: data comes from $GSSP_DATA_DIR or ../shared/data."""

import os
import pathlib

# Before anything starts a jax backend: XLA's deterministic-ops flag, so the bit-for-bit
# rerun and resume tests hold on a GPU too (on the CPU XLA ignores the GPU flag).
from gssp_jax import xla_env

xla_env.apply_deterministic_env()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

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


@pytest.fixture
def highest_precision():
  """Float32 matmuls and convolutions for tests about exactness (two ways to compute the same).

  A GPU computes them at TF32 by default (10-bit mantissa, errors ~1e-3 relative), which
  breaks 1e-4 equivalence checks that hold at float32; the CPU already computes at float32,
  so there this changes nothing and the tolerances stay as tight as they were.
  """
  with jax.default_matmul_precision("highest"):
    yield
