"""What a run ran on: package versions, the CPU and accelerator models, the code's commit.

Logged when a run starts and kept in ``summary.json`` (``environment``), so two
results can be told apart by machine and versions. A run is bit-identical on the
same machine type with the same versions (``requirements-lock.txt``); XLA's CPU
code generation depends on the CPU's instruction-set extensions (``cpu_features``;
a VM may report only "AMD EPYC" as its model), so another CPU type may differ in
the last digits, and a long training run's accuracy then by as much as another seed
(docs/RESULTS.md, "Reproducible to the digit").
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections",
            "grpcio", "msgpack", "sacrebleu")


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


# The instruction-set extensions XLA's CPU code generation targets when the host has them: two
# CPUs that report the same model name (a VM's "AMD EPYC") but differ here compile different
# vector code, which rounds differently.
_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
        "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile",
        "asimd", "sve", "sve2")


def cpu_features() -> list[str]:
  """Which of :data:`_ISA` the CPU reports (``/proc/cpuinfo``'s flags; empty where unknown)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(("flags", "Features")):
          have = set(line.split(":", 1)[1].split())
          return [name for name in _ISA if name in have]
  except OSError:
    pass
  return []


# Where a file git does not track changes what a run does: an untracked one there makes the
# tree dirty (elsewhere, notes and outputs do not).
_CODE_DIRS = ("gssp_jax", "configs", "experiments", "benchmarks")


def _commit(root: str | None = None) -> str | None:
  """The git commit of the code (with ``+dirty`` for uncommitted changes to tracked files, or
  untracked files under :data:`_CODE_DIRS`), if it is a checkout or a worktree of one
  (``root``: the checkout; default, the one this package is in)."""
  root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if not os.path.exists(os.path.join(root, ".git")):   # a directory, or a worktree's file
    return None
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    dirty = dirty or subprocess.run(
        ["git", "-C", root, "status", "--porcelain", "--untracked-files=all", "--",
         *_CODE_DIRS], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def _static() -> dict[str, Any]:
  import gssp_jax  # pylint: disable=g-import-not-at-top
  commit = _commit()
  return {"gssp_jax": gssp_jax.__version__, "commit": commit,
          "tree_clean": None if commit is None else not commit.endswith("+dirty"),
          "python": platform.python_version(), "os": platform.platform(),
          "cpu": cpu_model(), "cpu_features": cpu_features(), "cpu_count": os.cpu_count(),
          "packages": {p: _version(p) for p in PACKAGES}}


def describe() -> dict[str, Any]:
  """Versions, machine and the devices jax runs on (``summary.json``'s ``environment``)."""
  import jax  # pylint: disable=g-import-not-at-top
  devices = jax.devices()   # every process's, across jax.distributed (sim/hosts.py)
  return {**_static(), "backend": jax.default_backend(),
          "devices": sorted({d.device_kind for d in devices}), "num_devices": len(devices),
          "num_processes": jax.process_count(), "process_index": jax.process_index()}


def one_line(env: dict[str, Any]) -> str:
  """The environment as the log's opening line."""
  pkgs = env["packages"]
  return (f"environment: gssp_jax {env['gssp_jax']} ({env['commit'] or 'no git checkout'}), "
          f"python {env['python']}, jax {pkgs['jax']}, jaxlib {pkgs['jaxlib']}, flax "
          f"{pkgs['flax']}, optax {pkgs['optax']}; {env['backend']}: {env['num_devices']} x "
          f"{', '.join(env['devices'])}{_processes(env)}; CPU {env['cpu']} "
          f"({env['cpu_count']} cores; "
          f"{' '.join(env.get('cpu_features') or ['features unknown'])})")


def _processes(env: dict[str, Any]) -> str:
  """`` over N processes (this one i)`` for a run across processes; empty for one."""
  count = env.get("num_processes", 1)
  return f" over {count} processes (this one {env['process_index']})" if count > 1 else ""
