r"""Where the level executor's device time goes: per-chunk time, slot fill and the top kernels.

    python -m benchmarks.chunk_profile [--model=lenet5|resnet18|vgg19] [--schemes=gssp] \
        [--workers=16] [--epochs=0.5] [--skip=3] [--trace=2] [--top=20] \
        [--user_model=benchmarks/tiny_model.py:Linear]

``--model``, ``--width``, ``--schemes``, ``--workers``, ``--epochs`` and
``--level_job_batch``, ``--level_job_slots`` are ``benchmarks.sim_efficiency``'s flags (the
first scheme, worker count, job batch and job slots are used).

Runs one simulated training run (``benchmarks.sim_efficiency``'s config:
``tiers`` cluster, 4 groups, ``executor='levels'``) and times each chunk call
to completion (the call and a wait on its result: this serialises host and
device, so it measures the device's time per chunk, not the run's rate). It
prints:

* the chunk shape and how full its slots were: jobs per piece over ``J``,
  rounds per piece over ``Rr`` (padded slots cost what full ones do);
* the median chunk time, per piece and per job;
* for ``--trace`` chunks after the first ``--skip``, a ``jax.profiler`` trace
  summarised per device stream (on a CPU, per XLA thread): the kernels with
  the most time, their count and total milliseconds;
* the same trace's kernels grouped by how many times each ran: a kernel of a
  piece's round loop runs once per round slot, one of its jobs once per piece
  (on a CPU the pieces are unrolled, so each piece's kernels have names of
  their own), which splits the time between the rounds and the jobs.

``--user_model`` names a model by file instead of ``--model``'s (on ``--model``'s data):
``benchmarks/tiny_model.py:Linear`` is the near-free model of ``benchmarks.serial_loop``.

It is the diagnostic behind docs/PERFORMANCE.md's "The level executor on an
H100": a round whose kernels are passes over whole ``[G, P]`` buffers shows as
a few fusions with the round count (``Rr`` per piece) as their count.
"""

from __future__ import annotations

import collections
import glob
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from gssp_jax.sim import levels
from gssp_jax.train import loop

from benchmarks import common
from benchmarks import sim_efficiency  # noqa: F401  (its flags)
from benchmarks import sim_rates


def _define_flags() -> None:
  """Flags of its own, defined only when run as a program (the tests import this module)."""
  flags.DEFINE_integer("skip", 3, "chunks before the traced ones (compilation, warm-up)")
  flags.DEFINE_integer("trace", 2, "chunks traced with jax.profiler (0: none)")
  flags.DEFINE_integer("top", 20, "kernels listed per stream")
  flags.DEFINE_string("user_model", None, "a model by file (path.py:Class) instead of --model's")


class ChunkClock:
  """Wraps each ``LevelRunner``'s chunk program: times every call to completion and traces
  calls ``skip .. skip + trace - 1`` into ``trace_dir`` (the runner is kept in ``runners``)."""

  def __init__(self, skip: int, trace: int, trace_dir: str):
    self.skip, self.trace, self.trace_dir = skip, trace, trace_dir
    self.times: list[float] = []
    self.runners: list[levels.LevelRunner] = []

  def wrap(self, runner: levels.LevelRunner) -> None:
    self.runners.append(runner)
    program = runner.chunk_fn

    def timed(*args):
      i = len(self.times)
      if self.trace and i == self.skip:
        jax.profiler.start_trace(self.trace_dir)
      start = time.perf_counter()
      out = jax.block_until_ready(program(*args))
      self.times.append(time.perf_counter() - start)
      if self.trace and i == self.skip + self.trace - 1:
        jax.profiler.stop_trace()
      return out
    runner.chunk_fn = timed


def profile_run(config, clock: ChunkClock, workdir: str) -> levels.LevelRunner:
  """Runs ``config`` with every level runner's chunk program wrapped by ``clock``."""
  init = levels.LevelRunner.__init__

  def wrapped_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    clock.wrap(self)
  levels.LevelRunner.__init__ = wrapped_init
  try:
    loop.train_and_evaluate(config, workdir)
  finally:
    levels.LevelRunner.__init__ = init
  if not clock.runners:
    raise RuntimeError("the run built no level runner (is config.executor 'levels'?)")
  return clock.runners[-1]


def fill(runner: levels.LevelRunner) -> dict:
  """Slot use of a finished run's pieces that ran: pieces, jobs and rounds per piece, and their
  fractions.

  What the planner has noted but not run is left out: at the run's end, the jobs its last
  pulls released wait for a next chunk (a short run at 256 workers read 114 % of the job slots
  when they were counted).
  """
  totals, unrun, shape = runner.planner.totals, runner.planner.unrun(), runner.shape
  ran, jobs, rounds = (totals[k] - unrun[k] for k in ("pieces", "jobs", "rounds"))
  pieces = max(ran, 1)
  return {"pieces": ran, "chunks": runner.chunks,
          "jobs_per_piece": jobs / pieces, "job_fill": jobs / (pieces * shape.jobs),
          "rounds_per_piece": rounds / pieces, "round_fill": rounds / (pieces * shape.rounds)}


def kernel_table(trace_dir: str, top: int) -> list[tuple[str, int, list]]:
  """``[(stream, events, [(ms, count, name), ...]), ...]`` of the newest trace in ``trace_dir``.

  Device planes (``/device:...``) when the trace has any, else the host's XLA
  threads (a CPU run); the top ``top`` names by total time per line.
  """
  paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
  if not paths:
    return []
  data = jax.profiler.ProfileData.from_file(paths[-1])
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  if not planes:
    planes = [p for p in data.planes if p.name == "/host:CPU"]
  out = []
  for plane in planes:
    for line in plane.lines:
      if plane.name.startswith("/host:") and not line.name.startswith("tf_XLA"):
        continue   # the host's Python and client threads: not the compiled program's work
      agg = collections.defaultdict(lambda: [0.0, 0])
      for event in line.events:
        agg[event.name][0] += event.duration_ns / 1e6
        agg[event.name][1] += 1
      if not agg:
        continue
      rows = sorted(((ms, n, name) for name, (ms, n) in agg.items()), reverse=True)[:top]
      out.append((f"{plane.name} {line.name}", sum(n for _, n in agg.values()), rows))
  return out


def by_count(trace_dir: str) -> list[tuple[int, int, int, float]]:
  """``[(runs, kernels, events, ms), ...]`` of the newest trace in ``trace_dir``: its kernels
  (over every stream; completion markers, the executor's own spans and loops, whose spans hold
  their bodies' kernels, left out) grouped by how many times each ran, most events first."""
  groups: dict[int, list] = collections.defaultdict(lambda: [0, 0, 0.0])
  totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for _, _, rows in kernel_table(trace_dir, top=10**9):
    for ms, n, name in rows:
      if name.startswith(("end: ", "ThunkExecutor", "ThreadpoolListener", "while")):
        continue
      totals[name][0] += n
      totals[name][1] += ms
  for n, ms in totals.values():
    groups[n][0] += 1
    groups[n][1] += n
    groups[n][2] += ms
  return sorted(((n, k, e, ms) for n, (k, e, ms) in groups.items()), key=lambda r: -r[2])


def main(argv):
  del argv
  f = flags.FLAGS
  print(common.describe_backend())
  scheme, workers = f.schemes[0], int(f.workers[0])
  config = sim_rates.run_config(f.model, f.width, "levels", scheme, workers, f.epochs,
                                job_batch=int(f.level_job_batch[0]),
                                job_slots=int(f.level_job_slots[0]))
  if f.user_model:
    config.model = f.user_model
  with tempfile.TemporaryDirectory() as workdir:
    clock = ChunkClock(f.skip, f.trace, f"{workdir}/trace")
    runner = profile_run(config, clock, f"{workdir}/run")
    stats = fill(runner)
    times = np.asarray(clock.times[min(f.skip, len(clock.times) - 1):])
    print(f"model {f.user_model or f.model}, scheme {scheme}, {workers} workers: "
          f"{levels.describe(runner.shape, runner.job_batch, runner.unroll_pieces)}")
    print(f"{stats['pieces']} pieces in {stats['chunks']} chunks; jobs per piece "
          f"{stats['jobs_per_piece']:.2f} ({stats['job_fill']:.0%} of the slots), rounds per "
          f"piece {stats['rounds_per_piece']:.2f} ({stats['round_fill']:.0%})")
    per_chunk = float(np.median(times))
    print(f"chunk time: median {per_chunk * 1e3:.2f} ms (min {times.min() * 1e3:.2f}, max "
          f"{times.max() * 1e3:.2f}; {len(times)} chunks after the first {f.skip}); per piece "
          f"{per_chunk / runner.shape.pieces * 1e3:.3f} ms, per job "
          f"{per_chunk / runner.shape.pieces / max(stats['jobs_per_piece'], 1e-9) * 1e3:.3f} ms")
    for stream, events, rows in kernel_table(f"{workdir}/trace", f.top):
      print(f"\n{stream}: {events} events in {f.trace} chunk(s)")
      print("| ms | count | kernel |\n|---|---|---|")
      for ms, n, name in rows:
        print(f"| {ms:.3f} | {n} | {name[:100]} |")
    groups = by_count(f"{workdir}/trace")
    if groups:
      total = sum(ms for *_, ms in groups)
      print(f"\nkernels by how often they ran in the {f.trace} traced chunk(s) "
            f"({runner.shape.pieces} pieces of {runner.shape.rounds} round slots each; "
            f"{total:.2f} ms in all):")
      print("| runs | kernels | events | ms | share |\n|---|---|---|---|---|")
      for n, k, e, ms in groups[:12]:
        print(f"| {n} | {k} | {e} | {ms:.2f} | {ms / max(total, 1e-9):.0%} |")


if __name__ == "__main__":
  _define_flags()
  flags.FLAGS.set_default("schemes", ["gssp"])
  flags.FLAGS.set_default("workers", ["16"])
  flags.FLAGS.set_default("epochs", 0.5)
  app.run(main)
