"""Orbax checkpoints of the full training state plus the host-side loop position.

A step holds up to three items: ``state`` (the device pytree), ``meta`` (JSON:
the loop position) and ``host`` (the simulator's or the real runtime's host
state as versioned JSON, ``host_state.py``). All three are written in one
Orbax step, so a step is complete or absent.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

from gssp_jax import host_state as host_state_lib


# Orbax's asynchronous saves in one process collide when two managers write at once (measured:
# two parameter shards of one process saving the same step: "Directory not empty"), so saves
# that may run on several threads go through save_and_wait, one at a time per process.
_SAVE_LOCK = threading.Lock()


class Checkpointer:
  """Saves ``(state, meta)`` at an update count; restores the latest exactly.

  ``state`` is any pytree (the device state; saved from a host copy so that the
  next jitted chunk may donate its buffers while Orbax writes). ``meta`` is a
  JSON-able dict with the host-side loop position (accumulators, timers).
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    if jax.process_count() == 1:
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    else:
      # Across jax.distributed processes (sim/hosts.py) process 0 alone keeps the checkpoints
      # (no barrier with the others, no shared file system), and sends what it restores.
      if jax.process_index() != 0:
        raise ValueError(f"process {jax.process_index()} has no checkpoints: across processes "
                         f"process 0 keeps them (gssp_jax/sim/hosts.py)")
      os.makedirs(directory, exist_ok=True)   # Orbax creates none for such a manager
      only_0 = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=False,
                                             multiprocessing_options=only_0)
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict, host: Any = None) -> None:
    """Saves at ``step`` unless that step is already saved (the state is then the same).

    ``host``: host state (``host_state.to_tree``'s types), saved as the ``host`` item.
    """
    if step == self._manager.latest_step():
      return
    items = {"state": ocp.args.StandardSave(jax.device_get(state)),
             "meta": ocp.args.JsonSave(meta)}
    if host is not None:
      items["host"] = ocp.args.JsonSave(host_state_lib.encode(host))
    self._manager.save(step, args=ocp.args.Composite(**items))

  def save_and_wait(self, step: int, state: Any, meta: dict, host: Any = None) -> None:
    """:meth:`save`, then :meth:`wait`; one such save at a time in a process (thread-safe)."""
    with _SAVE_LOCK:
      self.save(step, state, meta, host=host)
      self.wait()

  def restore_host(self, step: int) -> Any:
    """The host state saved at ``step``.

    Raises:
      host_state.HostStateError: the step has no host state (a checkpoint of
        an older gssp_jax, which pickled it beside the step) or another version.
    """
    where = f"the checkpoint at step {step} in {self.directory}"
    if not os.path.isdir(os.path.join(self.directory, str(step), "host")):
      legacy = glob.glob(os.path.join(self.directory, "*.pkl"))
      hint = (f": it was written by an older gssp_jax, whose host state is a pickle"
              f" ({os.path.basename(legacy[0])}), which is not loaded because loading a pickle"
              " runs code. Start the run again in a new workdir" if legacy else "")
      raise host_state_lib.HostStateError(f"{where} has no host state{hint}")
    restored = self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
    return host_state_lib.decode(restored.host, where)

  def restore(self, step: int, template: Any) -> tuple[Any, dict]:
    """Restores ``step`` (any kept step, not only the latest)."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(jax.device_get(template)),
                              meta=ocp.args.JsonRestore())
    restored = self._manager.restore(step, args=args)
    return restored.state, restored.meta

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def wait(self) -> None:
    """Blocks until pending saves are on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
