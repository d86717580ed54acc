"""Process environment for XLA: deterministic GPU runs, and a GPU memory share per process.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, and a GPU client
reads its memory settings at the same moment; changing either afterwards has no
effect. So the project sets them before that: ``import gssp_jax`` calls
:func:`apply_deterministic_env`; the entry points (``experiments.*``,
``benchmarks.*``, ``tests/conftest.py``) import ``gssp_jax`` before anything
starts a backend.

* **Determinism.** ``--xla_gpu_deterministic_ops=true`` is XLA's switch for
  run-to-run determinism on GPU ("Guarantees run-to-run determinism on GPU" in
  its flag help). It implies ``--xla_gpu_exclude_nondeterministic_ops`` (which
  compiles scatter without atomics and keeps autotuning from picking
  non-deterministic kernels) and also turns autotuning off, so the kernel
  choice does not depend on timing noise (openxla/xla#12520). It does not touch
  precision: GPU matmuls and convolutions still run at TF32 by default, which
  is deterministic, just less exact than the CPU's float32 (the sync
  machinery's sums and means are float32 everywhere:
  ``transforms.exact_matmul``). XLA ignores GPU flags on other backends, and it
  aborts on a flag it does not know, so any backend start validates the name. ``GSSP_DETERMINISTIC=0`` opts out; a value
  the user gave ``--xla_gpu_deterministic_ops`` in ``XLA_FLAGS`` is kept.
* **Compilation cache.** The entry points (``experiments.main``, ``sweep``,
  ``launch``) keep compiled programs in jax's persistent cache under
  ``$GSSP_CACHE_DIR/xla`` (:func:`use_compilation_cache`), so a rerun, a resumed
  run and every trial of a sweep after the first skip the compilations of the
  programs they share (the simulator's executors compile one program per shape
  bucket, lazily). A hit is the executable a fresh compile gives (jax keys it by
  the program, the compile options and the backend), so results are unchanged.
  The size cap (4 GiB, least recently used out) also turns on jax's file lock,
  which processes sharing the directory need. ``GSSP_COMPILATION_CACHE=0`` opts
  out; ``JAX_COMPILATION_CACHE_DIR`` and the other two variables, if the user set
  them, are kept.
* **Memory share.** A GPU process preallocates 75 % of the card at start-up, so
  a third process on one card dies out of memory. :func:`child_env` gives each
  of ``n`` processes ``0.9 / n`` of it (``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  which is both the preallocation and the allocator's limit), unless the user
  set a fraction (either name jaxlib reads; setting both is an error there).
"""

from __future__ import annotations

import logging as py_logging
import math
import os
import sys
from typing import Mapping, MutableMapping

from absl import logging

DETERMINISTIC_FLAG = "xla_gpu_deterministic_ops"
OPT_OUT_VAR = "GSSP_DETERMINISTIC"
# jaxlib reads both names; the newer one wins and setting both raises (xla_client.py).
MEM_FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
GPU_MEMORY_TOTAL = 0.9   # what N processes share; the rest is CUDA contexts and library workspaces

_TRUE = ("", "1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def deterministic_enabled(environ: Mapping[str, str]) -> bool:
  """Whether the project should set XLA's deterministic-ops flag (``GSSP_DETERMINISTIC``).

  Raises:
    ValueError: ``GSSP_DETERMINISTIC`` is not one of the allowed spellings.
  """
  return switch(environ, OPT_OUT_VAR)


def switch(environ: Mapping[str, str], name: str) -> bool:
  """An on/off variable of the project, on when unset.

  Raises:
    ValueError: a value that is not one of the allowed spellings, naming the variable.
  """
  value = environ.get(name, "").strip().lower()
  if value not in _TRUE + _FALSE:
    raise ValueError(f"{name}={environ[name]!r} is invalid; allowed: "
                     f"1/true/yes/on (default) or 0/false/no/off")
  return value in _TRUE


def _flag_names(xla_flags: str) -> list[str]:
  """``--name=value`` / ``--name`` tokens of an ``XLA_FLAGS`` string -> their names."""
  return [token.lstrip("-").split("=", 1)[0] for token in xla_flags.split()
          if token.startswith("-")]


def deterministic_env(environ: Mapping[str, str]) -> dict[str, str]:
  """The environment changes that make GPU runs deterministic (``{}`` when none are due).

  Pure: reads ``environ`` (e.g. ``os.environ``), returns ``{name: new value}``.
  The flag is appended to the user's ``XLA_FLAGS`` (their flags are kept, in
  order); nothing changes if ``XLA_FLAGS`` already names the flag with any value
  (the user decided, or it was applied before: idempotent) or the user opted out.

  Raises:
    ValueError: an invalid ``GSSP_DETERMINISTIC``.
  """
  if not deterministic_enabled(environ):
    return {}
  return with_flag(environ, DETERMINISTIC_FLAG)


def with_flag(environ: Mapping[str, str], name: str, value: str = "true") -> dict[str, str]:
  """``{"XLA_FLAGS": ...}`` with ``--name=value`` appended to ``environ``'s (the user's flags
  kept, in order), or ``{}`` when they already name the flag with any value (the user decided,
  or it was applied before: idempotent). Pure."""
  current = environ.get("XLA_FLAGS", "")
  if name in _flag_names(current):
    return {}
  return {"XLA_FLAGS": " ".join(filter(None, [current.strip(), f"--{name}={value}"]))}


def _initialized_platforms() -> list[str] | None:
  """Platforms of the backends JAX has started; [] if none; None if it cannot tell."""
  if "jax" not in sys.modules:   # no backend can have started without jax imported
    return []
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if not xla_bridge.backends_are_initialized():
      return []
    return [backend.platform for backend in xla_bridge.backends().values()]
  except (ImportError, AttributeError):   # a jax whose private API moved
    return None


def apply_deterministic_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
  """Applies :func:`deterministic_env` to ``environ`` (default ``os.environ``); returns it.

  If a GPU backend has already started, the flag can no longer take effect:
  the changes are still written (child processes inherit them) and a warning
  says that this process may not be deterministic.
  """
  environ = os.environ if environ is None else environ
  changes = deterministic_env(environ)
  if not changes:
    return changes
  environ.update(changes)
  platforms = _initialized_platforms()
  if platforms and any(p in _GPU_PLATFORMS for p in platforms):
    logging.warning(
        "a GPU backend started before gssp_jax set XLA_FLAGS=--%s=true: this process may not be "
        "run-to-run deterministic; import gssp_jax (or set XLA_FLAGS) before using jax",
        DETERMINISTIC_FLAG)
  return changes


CACHE_OPT_OUT_VAR = "GSSP_COMPILATION_CACHE"
CACHE_MAX_BYTES = 4 << 30
# Environment variable -> (jax config option, its type).
_CACHE_OPTIONS = {
    "JAX_COMPILATION_CACHE_DIR": ("jax_compilation_cache_dir", str),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": ("jax_persistent_cache_min_compile_time_secs",
                                                   float),
    "JAX_COMPILATION_CACHE_MAX_SIZE": ("jax_compilation_cache_max_size", int),
}


def default_cache_dir() -> str:
  """Where the entry points keep compiled programs: ``$GSSP_CACHE_DIR/xla``."""
  from gssp_jax.data import paths  # pylint: disable=g-import-not-at-top (keeps import light)
  return str(paths.resolve_cache_dir(None) / "xla")


def compilation_cache_env(environ: Mapping[str, str], cache_dir: str) -> dict[str, str]:
  """The environment changes that give jax a persistent compilation cache in ``cache_dir``.

  Pure. Every program is cached, however quick to compile (the simulator's are many and
  small); a variable the user set is kept; ``{}`` if ``GSSP_COMPILATION_CACHE`` opts out.

  Raises:
    ValueError: ``GSSP_COMPILATION_CACHE`` is not one of the allowed spellings.
  """
  if not switch(environ, CACHE_OPT_OUT_VAR):
    return {}
  wanted = {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_BYTES)}
  return {k: v for k, v in wanted.items() if not environ.get(k)}


def use_compilation_cache(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
  """Applies :func:`compilation_cache_env` (``$GSSP_CACHE_DIR/xla``) here and for children.

  Writes the variables to ``environ`` (default ``os.environ``: child processes inherit
  them) and, as jax read its environment when it was imported, sets the same options in
  this process's jax config. Call it before the first compilation: jax opens its cache
  once per process. Nothing changes if this process's jax already has a cache directory
  (set in its config, e.g. by a notebook or a test session). Returns the changes.
  """
  environ = os.environ if environ is None else environ
  if environ is os.environ and "jax" in sys.modules:
    import jax  # pylint: disable=g-import-not-at-top
    if jax.config.jax_compilation_cache_dir:
      return {}
  changes = compilation_cache_env(environ, default_cache_dir())
  environ.update(changes)
  if changes and environ is os.environ:
    import jax  # pylint: disable=g-import-not-at-top
    for name, value in changes.items():
      option, kind = _CACHE_OPTIONS[name]
      jax.config.update(option, kind(value))
  return changes


def user_memory_fraction(environ: Mapping[str, str]) -> tuple[str, str] | None:
  """The ``(name, value)`` of a GPU memory fraction the user set, or None."""
  return next(((name, environ[name]) for name in MEM_FRACTION_VARS if environ.get(name)), None)


def memory_share(processes: int) -> float:
  """The fraction of a GPU each of ``processes`` processes sharing it may take.

  Rounded down to 3 decimals, so the shares never add up to more than
  ``GPU_MEMORY_TOTAL``.

  Raises:
    ValueError: ``processes`` is not an int >= 1.
  """
  if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
    raise ValueError(f"processes={processes!r} is invalid; allowed: an int >= 1")
  return math.floor(GPU_MEMORY_TOTAL / processes * 1000 + 1e-9) / 1000   # 0.9/3 is 0.29999...


def child_env(environ: Mapping[str, str], processes: int) -> dict[str, str]:
  """The full environment for one of ``processes`` child processes sharing one GPU.

  ``environ`` plus the determinism flag (:func:`deterministic_env`) and, unless
  the user set a memory fraction (kept as it is), ``XLA_PYTHON_CLIENT_MEM_FRACTION``
  = :func:`memory_share`. Preallocation stays on: each child then holds a fixed
  pool from the start, so a later child cannot starve an earlier one. On a CPU
  backend the memory variable is ignored. Pure: ``environ`` is not modified.

  Raises:
    ValueError: an invalid ``processes`` or ``GSSP_DETERMINISTIC``.
  """
  share = memory_share(processes)
  env = dict(environ)
  env.update(deterministic_env(env))
  if user_memory_fraction(env) is None:
    env[MEM_FRACTION_VARS[0]] = f"{share:.3f}"
  return env


class _QuietBackendProbe(py_logging.Filter):
  """Drops jax's INFO "Unable to initialize backend 'tpu'" (or any platform not asked for).

  jax logs it on every machine without that platform while it picks the default
  backend; nothing is wrong then. A platform asked for explicitly
  (``JAX_PLATFORMS``) still fails loudly: jax raises instead of logging.
  """

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not (record.levelno <= py_logging.INFO
                and str(record.msg).startswith("Unable to initialize backend"))


def quiet_backend_probe() -> None:
  """Installs :class:`_QuietBackendProbe` on jax's backend logger (once)."""
  logger = py_logging.getLogger("jax._src.xla_bridge")
  if not any(isinstance(f, _QuietBackendProbe) for f in logger.filters):
    logger.addFilter(_QuietBackendProbe())

