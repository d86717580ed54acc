"""Ctrl-C and SIGTERM as a request to checkpoint and stop, as Orbax users expect.

Inside :func:`deferred`, the first SIGINT or SIGTERM only records the request:
the executor stops at its next consistent point (between chunks of updates, or
after a simulated push), the loop saves a checkpoint there, writes
``interrupted`` and how to resume, and raises ``KeyboardInterrupt``. A second
signal raises ``KeyboardInterrupt`` at once (nothing is saved beyond the last
checkpoint). In a notebook the kernel's interrupt button sends SIGINT, so it
checkpoints the same way.

:func:`deferred` nests: only the outermost one sets the handlers and clears the
request, so a request that arrives as an inner run ends (too late for it to act
on) is still there for the caller around it, e.g. a sweep that runs its trials
one after another and must not start the next one.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from absl import logging

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
  """A run stopped by a signal after saving its checkpoint: where it is, to say how to resume.

  Attributes:
    signal_name: ``SIGINT`` or ``SIGTERM``.
    checkpoints: the directory of the run's checkpoints.
    position: e.g. ``"pushes 2470"`` (the checkpoint's step), or ``""`` when not known.
  """

  def __init__(self, signal_name: str, checkpoints: str, position: str = ""):
    super().__init__(signal_name)
    self.signal_name, self.checkpoints, self.position = signal_name, checkpoints, position

  def __str__(self) -> str:
    at = f" at {self.position}" if self.position else ""
    return f"interrupted by {self.signal_name}{at}; its checkpoint is in {self.checkpoints}"
_requested: list[str] = []   # the signal's name once one arrived inside `deferred`
_depth = [0]   # how many `deferred` are open (the main thread's; see `deferred`)


def requested() -> str | None:
  """The name of the signal that asked the run to stop (``SIGINT``, ``SIGTERM``), or None."""
  return _requested[0] if _requested else None


def request(name: str = "SIGINT") -> None:
  """Asks the run to stop at its next consistent point, as a first signal does."""
  if not _requested:
    _requested.append(name)


def _handler(signum, frame):
  del frame
  name = signal.Signals(signum).name
  if _requested:
    raise KeyboardInterrupt(f"{name} again: stopping at once")
  request(name)
  logging.warning("%s: saving a checkpoint at the next consistent point, then stopping (send it"
                  " again to stop at once)", name)


@contextlib.contextmanager
def deferred():
  """While inside, SIGINT and SIGTERM ask for a checkpoint and a stop (see the module docstring).

  Only the outermost one sets the handlers and clears the request, on entry and on exit; an
  inner one leaves both to it. Outside the main thread (where handlers cannot be set) the
  outermost one only clears the request; :func:`request` still works there.
  """
  if _depth[0]:
    _depth[0] += 1
    try:
      yield
    finally:
      _depth[0] -= 1
    return
  _requested.clear()
  main = threading.current_thread() is threading.main_thread()
  previous = {s: signal.signal(s, _handler) for s in _SIGNALS} if main else {}
  _depth[0] = 1
  try:
    yield
  finally:
    _depth[0] = 0
    for s, handler in previous.items():
      signal.signal(s, signal.SIG_DFL if handler is None else handler)   # None: set outside Python
    _requested.clear()
