"""DS-Sync on the device: every worker its own replica; the averaging is a parameter operation
(``rounds.apply_round``)."""

from __future__ import annotations

import numpy as np
import optax

from gssp_jax.sync import transforms


def dssync(num_workers: int, *, scale: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """DS-Sync: no server; every worker applies its own gradient to its own replica (R = W).

  Averaging inside the round's groups is a parameter operation done after the
  optimizer step (``rounds.apply_round`` with the ``average`` field).
  """
  return transforms.server_sync(num_workers, num_replicas=num_workers,
                     assignment=np.arange(num_workers), scale=scale, name="dssync")
