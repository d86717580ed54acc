"""One simulation over several local devices (``config.devices``): a piece's job slots split.

With ``D`` devices the level executor's training arrays and chunk plans are replicated on all
of them; each piece's ``J`` job slots are split ``J / D`` per device (``chunk.map_jobs`` under
``jax.shard_map``), computed exactly as on one device, and their results gathered, one
``all_gather`` per job output per piece; every round then runs on every device on the same
values. So the plan, and the results, are those of one device.

Memory, by owner (:func:`state_shardings`): the per-worker buffers that only the jobs read
(:data:`OWNED`: the weights each worker pulled, its compressor's and its inner optimizer's
state) are split over the devices by rows, worker ``w`` on device ``w // (W / D)``. XLA's
partitioner turns a piece's reads of its jobs' rows into a fixed number of exchanges per
piece, and a round's write of a pulled row (``rounds.pull_rows`` reads no row) into a write on
its owner alone: no collective inside the round loop. The outstanding gradients and the
workers' statistics (which rounds read), the replicas and the rest stay on every device. A
worker count that ``D`` does not divide, or a mesh across processes, keeps every buffer whole.

Across processes (``sim/hosts.py``) the mesh is every process's devices, all of them: a
process with none in the mesh could not take part in its programs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

AXIS = "jobs"


def count(value: int, available: int, processes: int = 1) -> int:
  """Devices a run uses: ``config.devices`` (0: all ``available``, every process's).

  Raises:
    ValueError: not an int >= 0, or more than ``available``; across ``processes`` > 1, not all.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"config.devices={value!r} is invalid; allowed: 0 (all {available} local "
                     f"devices) or 1..{available}")
  if processes > 1 and value not in (0, available):
    raise ValueError(f"config.devices={value} is invalid across {processes} processes: the "
                     f"simulation uses every process's devices; allowed: 0 or {available} (all)")
  if value > available:
    raise ValueError(f"config.devices={value} is invalid: this process has {available} local "
                     f"{jax.default_backend()} device(s); allowed: 0 (all) or 1..{available}")
  return int(value) or available


def available() -> int:
  """Devices a run may use: this process's, or every process's across ``jax.distributed``."""
  return jax.device_count()


def check_slots(devices: int, job_slots: int) -> None:
  """Raises ValueError unless a piece's ``job_slots`` split evenly over ``devices``."""
  if job_slots % devices:
    raise ValueError(f"config.devices={devices} cannot split a piece's {job_slots} job slots "
                     f"evenly; allowed: a device count that divides them, or set "
                     f"config.level_job_slots to a multiple of {devices}")


def mesh_for(devices: int) -> jax.sharding.Mesh | None:
  """A one-axis mesh of the first ``devices`` devices (process by process); None for one (no
  mesh at all)."""
  if devices == 1 and jax.process_count() == 1:
    return None
  return jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), (AXIS,))


def replicated(mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


# The level state's per-worker fields split by owner over the devices (``executor.SimState``).
OWNED = ("worker_params", "comp_state", "inner_state")


def state_shardings(state: Any, mesh: jax.sharding.Mesh | None, num_workers: int) -> Any:
  """A prefix of ``state`` (an ``executor.SimState``) with each field's sharding on ``mesh``:
  :data:`OWNED` split by rows (``[W, ...]`` leaves, ``W`` a multiple of the devices), the
  rest replicated; every field replicated where the devices do not divide ``num_workers``, and
  across processes (``sim/hosts.py``: each process then holds the whole state, as its
  checkpoint and its evaluation read it). None for no mesh (one device)."""
  if mesh is None:
    return None
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))
  whole = replicated(mesh)
  split = splits_owned(mesh, num_workers)
  return state.replace(**{f.name: rows if split and f.name in OWNED else whole
                          for f in dataclasses.fields(state)})


def splits_owned(mesh: jax.sharding.Mesh | None, num_workers: int) -> bool:
  """Whether :data:`OWNED` is split over ``mesh`` by owner (:func:`state_shardings`)."""
  return (mesh is not None and mesh.size > 1 and num_workers % mesh.size == 0
          and jax.process_count() == 1)


def place_state(state: Any, mesh: jax.sharding.Mesh | None, num_workers: int) -> Any:
  """The level state on ``mesh`` (:func:`place` with :func:`state_shardings`)."""
  return place(state, mesh, state_shardings(state, mesh, num_workers))


def shaped_state(state: Any, mesh: jax.sharding.Mesh | None, num_workers: int) -> Any:
  """An abstract level state (``jax.ShapeDtypeStruct`` leaves) with the shardings
  :func:`place_state` would give it, so that a program compiled for it is the run's."""
  shardings = state_shardings(state, mesh, num_workers)
  if shardings is None:
    return state
  is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
  return jax.tree.map(
      lambda sharding, sub: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub),
      shardings, state, is_leaf=is_sharding)


def place(tree: Any, mesh: jax.sharding.Mesh | None, shardings: Any = None) -> Any:
  """``tree`` (host or device values) on the device: as ``shardings`` (a prefix of ``tree``,
  e.g. :func:`state_shardings`) says, else replicated on every device of ``mesh`` (None:
  ``jax.device_put``'s default device; a device value stays where it is). A mesh across
  processes takes host values (each process passes the same)."""
  if mesh is None:
    return jax.device_put(tree)
  if not replicated(mesh).is_fully_addressable:
    tree = jax.device_get(tree)
  return jax.device_put(tree, replicated(mesh) if shardings is None else shardings)


def local(tree: Any) -> Any:
  """``tree`` with every replicated array spanning other processes as this process's copy
  (on its first device), for programs this process runs alone (evaluation)."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x.addressable_data(0)
    return x
  return jax.tree.map(one, tree)
