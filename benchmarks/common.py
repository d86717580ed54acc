"""What the benchmarks share: model shapes and widths, and a line naming the backend."""

import os
import sys

import jax

from gssp_jax import xla_env

SHAPES = {"lenet5": (32, 32, 1), "resnet18": (32, 32, 3), "vgg19": (32, 32, 3)}   # dataset input
CNNS = ("resnet18", "vgg19")   # the models with a channel multiplier (``width``)


def model_kwargs(name: str, width: float) -> dict:
  """Constructor arguments for ``name`` at ``width``.

  Raises:
    ValueError: a width other than 1 for a model without one, or not > 0.
  """
  if not width > 0:
    raise ValueError(f"width={width!r} is invalid; allowed: a number > 0")
  if name in CNNS:
    return {"width": width}
  if width != 1.0:
    raise ValueError(f"width={width!r} is invalid for {name!r}; allowed: 1.0 "
                     f"(only {', '.join(CNNS)} have a width)")
  return {}


def describe_backend() -> str:
  """jax version, backend, device kind, the determinism flag as set, matmul precision."""
  device = jax.devices()[0]
  determinism = next((t for t in os.environ.get("XLA_FLAGS", "").split()
                      if xla_env.DETERMINISTIC_FLAG in t), f"no --{xla_env.DETERMINISTIC_FLAG}")
  return (f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.device_count()} x {device.device_kind}; XLA_FLAGS: {determinism}; "
          f"matmul precision {jax.config.jax_default_matmul_precision or 'default'}")


ALLOCATORS = ("launcher", "glibc")


def run_with_allocator(module: str, allocator: str) -> None:
  """Re-executes this benchmark unless its malloc settings are ``allocator``'s.

  ``launcher``: the settings the launcher gives every process of a real run
  (``launch.ALLOCATOR_ENV``); ``glibc``: glibc's defaults. They are read at a
  process's start, so a process without them starts again with them (its
  ``multiprocessing`` children inherit them).
  """
  from gssp_jax.runtime import launch  # pylint: disable=g-import-not-at-top
  if allocator not in ALLOCATORS:
    raise ValueError(f"--allocator={allocator!r} is invalid; allowed: {', '.join(ALLOCATORS)}")
  env = dict(os.environ)
  if allocator == "launcher":
    if all(env.get(k) == v for k, v in launch.ALLOCATOR_ENV.items()):
      return
    env.update(launch.ALLOCATOR_ENV)
  else:
    if not any(k in env for k in launch.ALLOCATOR_ENV):
      return
    for k in launch.ALLOCATOR_ENV:
      env.pop(k)
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
