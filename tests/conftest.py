"""Shared fixtures. Tests never download: data comes from $GSSP_DATA_DIR or ../shared/data."""

import atexit
import os
import pathlib
import shutil
import tempfile

# Importing gssp_jax sets XLA's deterministic-ops flag (gssp_jax.xla_env) before any test
# starts a jax backend, so the bit-for-bit rerun and resume tests hold on a GPU too.
import gssp_jax  # pylint: disable=unused-import
import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _use_a_session_compilation_cache() -> None:
  """Compiles each distinct XLA program once per test session, in this process.

  Most of the suite's time is compilation: a test builds a training run's jitted
  functions afresh (new closures, so jax's in-memory caches miss), and the runs of
  one test (whole vs split, rounds vs levels, a rerun) and of many tests compile
  the very same programs. jax's persistent cache keys an executable by its HLO,
  compile options and backend, so a hit returns exactly the executable a fresh
  compile would (the bit-for-bit tests still compare identical programs) and
  shares no run state. A fresh directory per session (removed at exit) keeps
  nothing across sessions. Only this process uses it: jax writes entries
  non-atomically, so the suite's subprocesses (command lines, multi-process runs)
  do not get it. GSSP_TEST_COMPILATION_CACHE=0 turns it off. It must be set
  before the first compilation: jax decides once per process whether to use it.
  """
  if os.environ.get("GSSP_TEST_COMPILATION_CACHE", "1").lower() in ("0", "false", "off", "no"):
    return
  path = tempfile.mkdtemp(prefix="gssp_jax_test_xla_cache_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: most of the suite's programs are small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_use_a_session_compilation_cache()
# The entry points' own persistent cache (xla_env.use_compilation_cache) stays off in the
# suite's subprocesses: sharing a locked file cache between them measured slower (29 min 13 s
# against 27 min 06 s, docs/PERFORMANCE.md), and a test of the cache turns it on itself.
os.environ.setdefault("GSSP_COMPILATION_CACHE", "0")


def _use_a_session_data_cache() -> None:
  """Keeps the suite's decoded datasets out of ~/.cache, unless $GSSP_CACHE_DIR says where.

  Loading a dataset writes its decoded arrays to the cache directory (gssp_jax.data.cache). A
  fresh directory per session (removed at exit) shares them across the session's tests and, as
  it is set in the environment, with their subprocesses; nothing is kept across sessions.
  """
  if os.environ.get("GSSP_CACHE_DIR"):
    return
  path = tempfile.mkdtemp(prefix="gssp_jax_test_cache_")
  atexit.register(shutil.rmtree, path, ignore_errors=True)
  os.environ["GSSP_CACHE_DIR"] = path


_use_a_session_data_cache()


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
