"""One simulation across several processes (hosts) with ``jax.distributed``.

Every process runs the same simulation: the same config, data, timeline and deterministic
planner, so each plans the same chunks in the same order and calls the same compiled
programs. The ``levels`` executor's mesh (``sim/devices.py``) then spans every process's
devices: a piece's job slots are split over all of them and their results gathered (gloo on
CPUs, NCCL on GPUs), and every round runs on every device, so each process holds the same
replicated state and reads it back locally (no collective to read a metric or save a step).

What must agree, and how (the rest follows from the same inputs):

* anything measured on one host: ``cluster.calibrate``'s base time is process 0's
  (:func:`agree_value`);
* when to stop and when to save: a signal, or ``train.checkpoint_every_seconds`` by one
  process's clock, is acted on by all at the next evaluation (:func:`agree_any`); between
  evaluations a process does not stop on its own (it would leave the others in a collective);
* where a resumed run starts: process 0 alone keeps checkpoints, and a resumed run's state
  is what it restored, sent to every process (:func:`share_bytes`; no shared file system).

Each process writes its own copy of the run's metrics, summary and log: process 0 the
workdir, process ``i`` ``workdir/process_<i>`` (:func:`process_workdir`).
"""

from __future__ import annotations

import os

import jax
import numpy as np


def processes() -> int:
  """How many processes the run spans (1 without ``jax.distributed``)."""
  return jax.process_count()


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               timeout: int = 300) -> None:
  """Joins a ``jax.distributed`` cluster of ``num_processes`` (process ``process_id``).

  The coordinator (process 0) binds exactly ``coordinator_address`` (jax's default is every
  interface, and its coordination service has no authentication: keep it on a private
  network or loopback). CPU devices gather through gloo.

  Raises:
    ValueError: an address without a port, fewer than 2 processes, or an id out of range
      (before anything is started).
  """
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 2:
    raise ValueError(f"num_processes={num_processes!r} is invalid; allowed: an int >= 2 (one "
                     f"process needs no coordinator)")
  if (isinstance(process_id, bool) or not isinstance(process_id, int)
      or not 0 <= process_id < num_processes):
    raise ValueError(f"process_id={process_id!r} is invalid; allowed: 0..{num_processes - 1}")
  host, _, port = coordinator_address.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator_address={coordinator_address!r} is invalid; allowed: "
                     f"host:port (e.g. 127.0.0.1:1234)")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             coordinator_bind_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=timeout)


def process_workdir(workdir: str) -> str:
  """Where this process writes: ``workdir`` for process 0, ``workdir/process_<i>`` for i > 0."""
  index = jax.process_index()
  return workdir if index == 0 else os.path.join(workdir, f"process_{index}")


def _gathered(values: np.ndarray) -> np.ndarray:
  """Every process's ``values`` (int32, one row per process)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))


def agree_any(flag: bool) -> bool:
  """True on every process if it is on any (one collective; ``flag`` itself on one process)."""
  if processes() == 1:
    return bool(flag)
  return bool(_gathered(np.asarray([int(bool(flag))])).any())


def agree_value(value: float) -> float:
  """Process 0's ``value`` on every process, bit for bit (``value`` itself on one process)."""
  if processes() == 1:
    return float(value)
  bits = np.asarray([value], np.float64).view(np.int32)
  return float(_gathered(bits).reshape(processes(), 2)[0].view(np.float64)[0])


def share_bytes(data: bytes | None) -> bytes | None:
  """Process 0's ``data`` (None: nothing) on every process, exactly (``data`` on one process).

  Two collectives: its length, then its bytes as int32 words that the other processes add
  zeros to (``multihost_utils.broadcast_one_to_all``: exact in integers).
  """
  if processes() == 1:
    return data
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  first = jax.process_index() == 0
  size = -1 if data is None or not first else len(data)
  size = int(multihost_utils.broadcast_one_to_all(np.asarray([size], np.int32))[0])
  if size < 0:
    return None
  words = np.zeros([(size + 3) // 4], np.int32)
  if first:
    words.view(np.uint8)[:size] = np.frombuffer(data, np.uint8)
  words = np.asarray(multihost_utils.broadcast_one_to_all(words), np.int32)
  return words.view(np.uint8)[:size].tobytes()


def tree_bytes(tree) -> bytes:
  """The raw bytes of ``tree``'s leaves (host arrays), one after another."""
  return b"".join(np.ascontiguousarray(x).tobytes() for x in jax.tree.leaves(tree))


def tree_from_bytes(data: bytes, template):
  """:func:`tree_bytes`'s inverse, shaped as ``template`` (arrays or shape-dtype structs)."""
  leaves, treedef = jax.tree.flatten(template)
  out, start = [], 0
  for leaf in leaves:
    dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
    size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    out.append(np.frombuffer(data[start:start + size], dtype).reshape(shape).copy())
    start += size
  if start != len(data):
    raise ValueError(f"{len(data)} bytes sent for a state of {start}")
  return jax.tree.unflatten(treedef, out)
