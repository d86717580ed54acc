"""What a run asks of JAX on its hot path: eager operations and compilations, counted.

On an accelerator every eager operation is a dispatch the device waits for,
and every compilation after the start is seconds lost; neither shows on a CPU
timer. The level executor promises none of the first between evaluations and
a handful of the second per run; the tests and ``benchmarks/sim_overhead.py``
hold it to that with these counters (transfers are watched by
``jax.transfer_guard``, which JAX provides).
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax
from jax._src import core as jax_core   # the eager interpreter: no public hook counts its ops

# Primitives that are not eager computation: a jitted call's own dispatch, an explicit transfer.
_NOT_EAGER = frozenset({"pjit", "jit", "device_put"})

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class EagerOps:
  """Counts primitives run eagerly (op by op, outside any jitted program) while active.

  ``names`` lists them in order. Counting wraps JAX's eager interpreter
  (``EvalTrace.process_primitive``); a jitted call whose program is cached
  never reaches it, a first call does as one ``pjit``, which is not counted.
  """

  _lock = threading.Lock()

  def __init__(self):
    self.names: list[str] = []

  @property
  def count(self) -> int:
    return len(self.names)

  @contextlib.contextmanager
  def active(self):
    with self._lock:
      original = jax_core.EvalTrace.process_primitive
      names = self.names

      def process_primitive(trace, primitive, args, params, /):
        if primitive.name not in _NOT_EAGER:
          names.append(primitive.name)
        return original(trace, primitive, args, params)
      jax_core.EvalTrace.process_primitive = process_primitive
      try:
        yield self
      finally:
        jax_core.EvalTrace.process_primitive = original


class Compilations:
  """XLA compilations (``jax.monitoring``'s backend-compile events) from its creation on.

  ``times`` holds each compilation's end (``time.perf_counter``) and seconds.
  JAX offers no way to remove a listener, so one instance stays registered;
  :meth:`since` reads the events after a mark.
  """

  def __init__(self):
    self.times: list[tuple[float, float]] = []
    jax.monitoring.register_event_duration_secs_listener(self._listen)

  def _listen(self, event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE:
      self.times.append((time.perf_counter(), float(duration)))

  def mark(self) -> int:
    return len(self.times)

  def since(self, mark: int) -> list[tuple[float, float]]:
    return self.times[mark:]


_COMPILATIONS = None


def compilations() -> Compilations:
  """The process's one :class:`Compilations` (registered on first use)."""
  global _COMPILATIONS
  if _COMPILATIONS is None:
    _COMPILATIONS = Compilations()
  return _COMPILATIONS
