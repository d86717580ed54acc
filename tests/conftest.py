"""Shared fixtures. Tests never download: data comes from $GSSP_DATA_DIR or ../shared/data."""

import atexit
import os
import pathlib
import shutil
import tempfile

# Importing gssp_jax sets XLA's deterministic-ops flag (gssp_jax.xla_env) before any test
# starts a jax backend, so the bit-for-bit rerun and resume tests hold on a GPU too.
import gssp_jax  # noqa: F401  # pylint: disable=unused-import
import jax
import pytest

from gssp_jax import xla_env

REPO = pathlib.Path(__file__).resolve().parent.parent


_SHARED_CACHE_ENV = "GSSP_TEST_SESSION_XLA_CACHE"


def _use_a_session_compilation_cache() -> None:
  """Compiles each distinct XLA program once per test session, in every process of it.

  Most of the suite's time is compilation: a test builds a training run's jitted
  functions afresh (new closures, so jax's in-memory caches miss), and the runs of
  one test (whole vs split, rounds vs levels, a rerun), of many tests, of both
  pytest-xdist workers and of the command lines, sweeps, meshes and notebook
  kernels the tests start compile the very same programs. jax's persistent cache
  keys an executable by its HLO, compile options and backend, so a hit returns
  exactly the executable a fresh compile would (the bit-for-bit tests still
  compare identical programs) and shares no run state. One fresh directory per
  session: the first process (xdist's controller) makes it, names it in the
  environment for the workers and subprocesses, and removes it at exit; nothing is
  kept across sessions. No size cap, so jax takes no file lock; an entry read while
  another process is still writing it fails its decompression, which jax reports
  as a warning before it compiles the program itself. Measured on this 2-core
  machine: tests/test_sim.py 232 -> 198 s; the sweep, notebook, CLI and interrupt
  tests 317 -> 208 s (docs/log/performance-2026-11.md). GSSP_TEST_COMPILATION_CACHE=0 turns it
  off. It must be set before the first compilation: jax decides once per process
  whether to use it.
  """
  if not xla_env.switch(os.environ, "GSSP_TEST_COMPILATION_CACHE"):
    return
  path = os.environ.get(_SHARED_CACHE_ENV)
  if not path:   # the first process of the session (pytest-xdist's controller) makes it
    path = tempfile.mkdtemp(prefix="gssp_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[_SHARED_CACHE_ENV] = path
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: most of the suite's programs are small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  # The suite's subprocesses (command lines, sweeps' trials, meshes, notebook kernels) read
  # and write it too. No size cap, so jax takes no file lock.
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": path,
                     "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})


_use_a_session_compilation_cache()

_FAST_COMPILE_FLAG = "xla_llvm_disable_expensive_passes"


def _compile_without_llvms_expensive_passes() -> None:
  """Skips LLVM's expensive optimization passes in XLA:CPU, in every process of the session.

  Compilation is most of the suite's time, and most of a CPU compile is LLVM's optimizer.
  Without fast-math (XLA:CPU's default) LLVM may not reorder floating-point operations at any
  optimization level, so the programs compute the same bits, only less quickly: the simulated
  smoke runs of configs/mnist_lenet5_hetero.py and configs/cifar10_resnet18.py (BatchNorm,
  convolutions) gave identical metrics with and without it (2026-11-28, this 2-core VM). It
  cut a compile-bound pair of files 88 -> 67 s and the tour's BSP and HALoS commands (which run
  an epoch each) 80 -> 72 s (docs/log/performance-2026-11.md, "The test suite"). Set here,
  before any backend starts (XLA parses XLA_FLAGS once per process), and in the environment
  the suite's subprocesses inherit. The user's own setting of the flag is kept;
  GSSP_TEST_FAST_COMPILE=0 turns it off.
  """
  if xla_env.switch(os.environ, "GSSP_TEST_FAST_COMPILE"):
    os.environ.update(xla_env.with_flag(os.environ, _FAST_COMPILE_FLAG))


_compile_without_llvms_expensive_passes()

# The entry points' own persistent cache (xla_env.use_compilation_cache, size-capped, so
# file-locked) stays off in the suite's subprocesses: the session's cache above serves them
# (sharing the locked one measured slower: 29 min 13 s against 27 min 06 s,
# docs/log/performance-2026-11.md), and a test of the entry points' cache turns it on itself.
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
