"""Orbax checkpoints of the full training state plus the host-side loop position."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves ``(state, meta)`` at an update count; restores the latest exactly.

  ``state`` is any pytree (the device state; saved from a host copy so that the
  next jitted chunk may donate its buffers while Orbax writes). ``meta`` is a
  JSON-able dict with the host-side loop position (accumulators, timers).
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    self._manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Saves at ``step`` unless that step is already saved (the state is then the same)."""
    if step == self._manager.latest_step():
      return
    args = ocp.args.Composite(state=ocp.args.StandardSave(jax.device_get(state)),
                              meta=ocp.args.JsonSave(meta))
    self._manager.save(step, args=args)

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
