"""Orbax checkpoints of the full training state plus the host-side loop position."""

from __future__ import annotations

import os
import pickle
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


class HostStates:
  """Host-state files beside a :class:`Checkpointer`'s steps: ``<directory>/<prefix><step>.pkl``.

  An executor whose state is partly on the host (the simulator, the real
  runtime's server) writes one file per checkpoint step, after Orbax's, and
  resumes from the newest step that has both.
  """

  def __init__(self, directory: str, prefix: str):
    self.directory, self.prefix = directory, prefix

  def path(self, step: int) -> str:
    return os.path.join(self.directory, f"{self.prefix}{step}.pkl")

  def latest(self, checkpointer: Checkpointer) -> int | None:
    """The newest step with its host file (a crash between the two writes leaves a device
    checkpoint without one; the older complete step is used instead)."""
    return next((step for step in sorted(checkpointer.all_steps(), reverse=True)
                 if os.path.exists(self.path(step))), None)

  def load(self, step: int) -> Any:
    with open(self.path(step), "rb") as f:
      return pickle.load(f)

  def write(self, step: int, data: bytes, checkpointer: Checkpointer) -> None:
    """Writes ``data`` atomically for ``step``; drops the files of steps Orbax no longer keeps."""
    tmp = self.path(step) + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, self.path(step))
    kept = checkpointer.all_steps()
    for name in os.listdir(self.directory):
      number = name[len(self.prefix):-len(".pkl")]
      if (name.startswith(self.prefix) and name.endswith(".pkl") and number.isdigit()
          and int(number) not in kept):
        os.remove(os.path.join(self.directory, name))
