"""Shared fixtures. Tests never download: data comes from $GSSP_DATA_DIR or ../shared/data."""

import os
import pathlib

# Importing gssp_jax sets XLA's deterministic-ops flag (gssp_jax.xla_env) before any test
# starts a jax backend, so the bit-for-bit rerun and resume tests hold on a GPU too.
import gssp_jax  # pylint: disable=unused-import
import jax
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


@pytest.fixture
def highest_precision():
  """Float32 matmuls and convolutions for tests about exactness (two ways to compute the same).

  A GPU computes them at TF32 by default (10-bit mantissa, errors ~1e-3 relative), which
  breaks 1e-4 equivalence checks that hold at float32; the CPU already computes at float32,
  so there this changes nothing and the tolerances stay as tight as they were.
  """
  with jax.default_matmul_precision("highest"):
    yield
