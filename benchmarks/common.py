"""What the benchmarks share: model shapes and widths, and a line naming the backend."""

import os

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
