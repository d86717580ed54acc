"""One simulation over several local devices (``config.devices``): a piece's job slots split.

With ``D`` devices the level executor's state, training arrays and chunk plans are
replicated on all of them; each piece's ``J`` job slots are split ``J / D`` per device
(``chunk.map_jobs`` under ``jax.shard_map``), computed exactly as on one device, and their
results gathered, one ``all_gather`` per job output per piece; every round then runs on
every device on the same values. So the plan, and the results, are those of one device.
Each device holds the whole state: memory is not split yet.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

AXIS = "jobs"


def count(value: int, available: int) -> int:
  """Devices a run uses: ``config.devices`` (0: all ``available``).

  Raises:
    ValueError: not an int >= 0, or more than ``available``.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"config.devices={value!r} is invalid; allowed: 0 (all {available} local "
                     f"devices) or 1..{available}")
  if value > available:
    raise ValueError(f"config.devices={value} is invalid: this process has {available} local "
                     f"{jax.default_backend()} device(s); allowed: 0 (all) or 1..{available}")
  return int(value) or available


def check_slots(devices: int, job_slots: int) -> None:
  """Raises ValueError unless a piece's ``job_slots`` split evenly over ``devices``."""
  if job_slots % devices:
    raise ValueError(f"config.devices={devices} cannot split a piece's {job_slots} job slots "
                     f"evenly; allowed: a device count that divides them, or set "
                     f"config.level_job_slots to a multiple of {devices}")


def mesh_for(devices: int) -> jax.sharding.Mesh | None:
  """A one-axis mesh of the first ``devices`` local devices; None for one (no mesh at all)."""
  if devices == 1:
    return None
  return jax.sharding.Mesh(np.asarray(jax.local_devices()[:devices]), (AXIS,))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def place(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
  """``tree`` (host or device values) on the device, replicated on every device of ``mesh``
  (None: ``jax.device_put``'s default device; a device value stays where it is)."""
  return jax.device_put(tree) if mesh is None else jax.device_put(tree, replicated(mesh))
