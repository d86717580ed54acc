"""BSP, ASP, SSP and DSSP on the device: the server's core (``transforms.server_sync``), each
with its own argument checks; what sets them apart is their protocol (``protocol.py``)."""

from __future__ import annotations

import optax

from gssp_jax.sync import arguments
from gssp_jax.sync import transforms


def bsp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """BSP: a round is every worker's gradient; the server applies their scaled sum (the mean)."""
  return transforms.server_sync(num_workers, scale=scale, name="bsp")


def asp(num_workers: int, *, scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """ASP: each arrived gradient is applied at once; the protocol never blocks anyone."""
  return transforms.server_sync(num_workers, scale=scale, name="asp")


def ssp(num_workers: int, staleness: int = 3, *,
        scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """SSP(s): ASP's server; the protocol keeps every worker within ``s`` clocks of the slowest."""
  arguments.check_int("ssp", "staleness", staleness, 0)
  return transforms.server_sync(num_workers, scale=scale, name="ssp")


def dssp(num_workers: int, staleness_range=(3, 15), *,
         scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """DSSP([s_L, s_U]): SSP's server; the protocol picks each threshold in ``[s_L, s_U]``."""
  arguments.check_staleness_range("dssp", staleness_range)
  return transforms.server_sync(num_workers, scale=scale, name="dssp")
