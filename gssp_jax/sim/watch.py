"""What a run asks of JAX on its hot path: eager operations and compilations, counted.

On an accelerator every eager operation is a dispatch the device waits for,
and every compilation after the start is seconds lost; neither shows on a CPU
timer. The level executor promises none of the first between evaluations and
a handful of the second per run; the tests and ``benchmarks/sim_overhead.py``
hold it to that with these counters (and device-to-host reads, which
``jax.transfer_guard`` does not catch on a CPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import jax
from jax._src import array as jax_array   # a device array's host value: no public hook
from jax._src import core as jax_core   # the eager interpreter: no public hook counts its ops

# Primitives that are not eager computation: a jitted call's own dispatch, an explicit transfer.
_NOT_EAGER = frozenset({"pjit", "jit", "device_put"})
# Where JAX's operations start (numpy, lax, random, nn): a call into them outside any trace runs
# an operation on the device.
_JAX_DIR = os.path.dirname(os.path.dirname(jax_core.__file__))   # .../jax
_API_DIRS = tuple(os.path.join(os.path.dirname(jax_core.__file__), d)
                  for d in ("numpy" + os.sep, "lax" + os.sep, "random.py", "nn" + os.sep,
                            "ops" + os.sep))

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class EagerOps:
  """Counts JAX operations run eagerly (op by op, outside any jitted program) while active.

  ``names`` lists them in order. Two ways in, since JAX dispatches an eager
  operation either from Python (a primitive bound outside any trace: JAX's
  eager interpreter, ``EvalTrace.process_primitive``) or through a cached
  jitted wrapper that runs in C++; the second is seen as a call into a
  Python function of JAX's numpy, lax or random API from outside JAX, with
  no trace active (a profile hook on this thread): ``x + 1``, ``x[1]``,
  ``jnp.zeros``, ``jnp.sum``, ``jax.random.key``. **Not seen**: a jitted
  ufunc called directly (``jnp.cos(x)``, ``jnp.exp(x)``), a C++ object that
  runs without a Python frame or a profile event once its program is cached.
  A jitted call of one's own whose program is cached (the chunk program)
  reaches neither; its first call traces and lowers, JAX calling itself,
  which is not counted.
  """

  _lock = threading.Lock()

  def __init__(self):
    self.names: list[str] = []

  @property
  def count(self) -> int:
    return len(self.names)

  @contextlib.contextmanager
  def active(self):
    names = self.names

    def counting(original):
      def process_primitive(trace, primitive, args, params, /):
        if primitive.name not in _NOT_EAGER:
          names.append(primitive.name)
        return original(trace, primitive, args, params)
      return process_primitive

    def profile(frame, event, arg):
      del arg
      # A JAX operation called from outside JAX (not JAX calling itself: lowering, tracing).
      if (event == "call" and frame.f_code.co_filename.startswith(_API_DIRS)
          and frame.f_back is not None
          and not frame.f_back.f_code.co_filename.startswith(_JAX_DIR)
          and jax_core.trace_state_clean()):
        names.append(frame.f_code.co_name)

    with self._lock, _patched(jax_core.EvalTrace, "process_primitive", counting):
      previous = sys.getprofile()
      sys.setprofile(profile)
      try:
        yield self
      finally:
        sys.setprofile(previous)


class HostReads:
  """Counts reads of a device array's value on the host (``float``, ``jax.device_get``,
  ``.tolist()``...) while active.

  ``jax.transfer_guard`` does not guard the CPU backend (its arrays live in
  host memory), so the tests and benchmarks count the reads themselves: those
  that go through ``jax.Array``'s cached host value (``ArrayImpl._value``).
  **Not seen** on a CPU: ``np.asarray(x)``, which reads through the buffer
  protocol, in C (on an accelerator it goes through ``_value``, and the
  transfer guard stops it too). ``shapes`` lists each read array's shape.
  """

  _lock = threading.Lock()

  def __init__(self):
    self.shapes: list[tuple] = []

  @property
  def count(self) -> int:
    return len(self.shapes)

  @contextlib.contextmanager
  def active(self):
    shapes = self.shapes

    def counting(original):
      def value(array):
        shapes.append(tuple(array.shape))
        return original.fget(array)
      return property(value)

    with self._lock, _patched(jax_array.ArrayImpl, "_value", counting):
      yield self


@contextlib.contextmanager
def _patched(owner, name: str, replace):
  """``owner.name`` set to ``replace(original)`` while open, then the original again."""
  original = getattr(owner, name)
  setattr(owner, name, replace(original))
  try:
    yield
  finally:
    setattr(owner, name, original)


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
