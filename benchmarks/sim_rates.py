"""What the simulator benchmarks share: a benchmark run's config, and its rates as run and steady.

``simulated`` runs a config through ``train_and_evaluate`` and times it between its first
and last evaluation (``benchmarks.sim_efficiency``'s docstring says how); ``CompileClock``
and ``PhaseClock`` take the compilations and checkpoint saves inside that span apart.
"""

import contextlib
import json
import os
import tempfile
import threading
import time

from configs import cifar10_resnet18
from configs import cifar10_vgg19
from configs import mnist_lenet5
from gssp_jax import config as config_lib
from gssp_jax.sim import simulate
from gssp_jax.sync import local as local_lib
from gssp_jax import executors
from gssp_jax.train import loop
from gssp_jax.base import tasks

from benchmarks import common

CONFIGS = {"lenet5": mnist_lenet5, "resnet18": cifar10_resnet18, "vgg19": cifar10_vgg19}


def run_config(name: str, width: float, executor: str | None, scheme: str, workers: int,
               epochs: float, levels_per_call: int = 0, job_batch: int = 0,
               job_slots: int = 0):
  """The config a simulated run uses: the model's config file with the benchmark's changes.

  Raises:
    ValueError: an executor given where the config has no ``executor`` key.
  """
  config = CONFIGS[name].get_config()
  if name in common.CNNS:
    config.model_args.width = width
  else:
    common.model_kwargs(name, width)   # rejects a width LeNet-5 does not have
  config.num_workers = workers
  config.sync.scheme = scheme
  config.sync.num_groups = 4
  config.cluster.profile = "tiers"
  config.cluster.base_time = 0.01
  config.data.test_size = 500
  config.train.num_epochs = epochs
  config.train.eval_every = epochs / 4
  if executor is not None:   # only when asked: a tree without the key keeps working
    try:
      config_lib.override(config, {"executor": executor})
    except KeyError as e:
      raise ValueError(f"--executor={executor!r}: this version's config has no `executor` "
                       "key; leave --executor out") from e
  if levels_per_call:
    config.levels_per_call = levels_per_call
  if job_batch:
    config.level_job_batch = job_batch
  if job_slots:
    config.level_job_slots = job_slots
  if levels_per_call or job_batch or job_slots:
    executors.validate_levels_per_call(config)
  return config


class CompileClock:
  """Time spent compiling, from ``jax.monitoring``: tracing, lowering and XLA's compilation.

  Each event is an interval ending when it is reported; nested ones (a jit traced
  inside another's trace) overlap, so time is the union of the intervals.
  """

  def __init__(self):
    self.intervals: list[tuple[float, float]] = []   # (start, end) in perf_counter seconds
    self.backend_ends: list[float] = []

  def __call__(self, event: str, duration: float, **_) -> None:
    if event.startswith(COMPILE_EVENT_PREFIX):
      end = time.perf_counter()
      self.intervals.append((end - duration, end))
      if event == BACKEND_COMPILE_EVENT:
        self.backend_ends.append(end)

  def between(self, start: float, end: float) -> tuple[int, float]:
    """(XLA compilations that ended in [start, end], seconds of compile work inside it)."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in self.intervals
                     if b > start and a < end)
    total, reach = 0.0, start
    for a, b in clipped:
      total += max(0.0, b - max(a, reach))
      reach = max(reach, b)
    return sum(start <= t <= end for t in self.backend_ends), total


# jax/_src/dispatch.py: trace, lower to MLIR, XLA compile.
COMPILE_EVENT_PREFIX = "/jax/core/compile/"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _eval_times(path: str, done: threading.Event, out: list) -> None:
  """Appends to ``out`` the perf_counter at which ``path`` gained each line."""
  seen = 0
  while not done.is_set():
    if os.path.exists(path):
      with open(path) as f:
        n = sum(1 for line in f if line.endswith("\n"))
      out.extend([time.perf_counter()] * (n - seen))
      seen = max(seen, n)
    time.sleep(0.01)


class PhaseClock:
  """Wall intervals of some methods (wrapped while ``wrapped()`` is open), by name.

  The simulator's checkpoint saves (``Simulation.save``) and the model's evaluations
  (the tasks' ``evaluate``: the test set's forward passes, not the device work queued
  before it, which ``Simulation.evaluate`` waits for first).
  """

  def __init__(self, methods):
    self.methods = list(methods)          # (class, method name, label)
    self.intervals: dict[str, list[tuple[float, float]]] = {m[2]: [] for m in self.methods}

  @contextlib.contextmanager
  def wrapped(self):
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in self.methods]
    try:
      for cls, name, label in self.methods:
        setattr(cls, name, self._timed(label, cls.__dict__[name]))
      yield self
    finally:
      for cls, name, original in originals:
        setattr(cls, name, original)

  def _timed(self, label, method):
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return method(*args, **kwargs)
      finally:
        self.intervals[label].append((start, time.perf_counter()))
    return timed

  def between(self, label: str, start: float, end: float) -> float:
    """Seconds of ``label``'s intervals inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.intervals[label])


def _phases() -> PhaseClock:
  return PhaseClock([(simulate.Simulation, "save", "save"),
                     (tasks.ClassificationTask, "evaluate", "evaluate"),
                     (tasks.TranslationTask, "evaluate", "evaluate")])


def samples_per_push(config) -> int:
  """Training samples behind one push: ``batch_size``, times ``local.steps`` for a local-update
  scheme (each local step is a gradient on a batch).

  Raises:
    ValueError: ``local.dylu``, where a push's steps differ by worker.
  """
  if not local_lib.is_local(config.sync.scheme):
    return config.batch_size
  if config.local.dylu:
    raise ValueError("local.dylu=True: a push's local steps differ by worker; measure with "
                     "local.dylu=False")
  return config.local.steps * config.batch_size


def simulated(config, clock: CompileClock) -> dict:
  """Runs ``config``; returns its rates between its first and last evaluation.

  Keys: ``rate`` (simulated samples/s as run), ``steady`` (the same without the XLA
  compilations and the checkpoint saves inside that span: what the simulator
  itself does), ``compiles`` and ``compile_s`` (those compilations),
  ``save_s`` and ``eval_s`` (seconds of checkpoint saves and of evaluations in the
  span), ``first`` (seconds from the call to the first evaluation).
  """
  phases = _phases()
  with tempfile.TemporaryDirectory() as workdir:
    path, times, done = os.path.join(workdir, "metrics.jsonl"), [], threading.Event()
    start = time.perf_counter()
    watcher = threading.Thread(target=_eval_times, args=(path, done, times), daemon=True)
    watcher.start()
    try:
      with phases.wrapped():
        loop.train_and_evaluate(config, workdir)
    finally:
      done.set()
      watcher.join()
    lines = [json.loads(l) for l in open(path)]
  first, last = lines[0], lines[-1]
  samples = (last["pushes"] - first["pushes"]) * samples_per_push(config)
  span = last["wall_time"] - first["wall_time"]
  compiles, compile_s = clock.between(times[0], times[-1]) if times else (0, 0.0)
  save_s = phases.between("save", times[0], times[-1]) if times else 0.0
  eval_s = phases.between("evaluate", times[0], times[-1]) if times else 0.0
  return {"rate": samples / span, "steady": samples / max(span - compile_s - save_s, 1e-9),
          "compiles": compiles, "compile_s": compile_s, "save_s": save_s, "eval_s": eval_s,
          "first": times[0] - start if times else float("nan")}
