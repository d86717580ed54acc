"""A plain lock that knows its owner: re-entry is a bug it reports, and helpers can ask for it.

The control plane's one lock (``server.DistServer.lock``) was an ``RLock``,
which hid which helpers ran under it. :class:`OwnedLock` is a plain lock:
taking it again on the thread that holds it raises at once instead of
deadlocking (or, as an ``RLock``, silently nesting), and :meth:`OwnedLock.check`
lets a helper that must run under it say so (``tests/test_dist_hostile.py``
calls one without it). ``threading.Condition`` works over it.
"""

from __future__ import annotations

import threading


class LockNotHeld(RuntimeError):
  """A helper that needs the lock was called without it."""


class OwnedLock:
  """``threading.Lock`` with an owner: no re-entry, and :meth:`check` for helpers."""

  def __init__(self, name: str):
    self.name = name
    self._lock = threading.Lock()
    self._owner: int | None = None

  def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
    if self._owner == threading.get_ident():
      raise RuntimeError(f"{self.name} taken again by the thread that holds it (a plain lock: "
                         "a helper that runs under it must not take it)")
    got = self._lock.acquire(blocking, timeout)
    if got:
      self._owner = threading.get_ident()
    return got

  def release(self) -> None:
    self._owner = None
    self._lock.release()

  __enter__ = acquire

  def __exit__(self, *exc) -> None:
    self.release()

  def held(self) -> bool:
    """Whether the calling thread holds it."""
    return self._owner == threading.get_ident()

  def check(self, what: str) -> None:
    """Raises :class:`LockNotHeld` unless the calling thread holds the lock (``what`` needs it)."""
    if not self.held():
      raise LockNotHeld(f"{what} runs under {self.name}; it was called without it")

  # threading.Condition's hooks (its defaults would probe by acquiring, which re-entry forbids).
  def _is_owned(self) -> bool:
    return self.held()

  def _release_save(self):
    self.release()

  def _acquire_restore(self, state) -> None:
    del state
    self.acquire()
