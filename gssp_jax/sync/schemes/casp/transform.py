"""CASP on the device: the server's core; its communities are its protocol's (``protocol.py``)."""

from __future__ import annotations

import optax

from gssp_jax.sync import transforms


def casp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """CASP: a round is one community's gradients, applied as one scaled sum."""
  return transforms.server_sync(num_workers, scale=scale, name="casp")
