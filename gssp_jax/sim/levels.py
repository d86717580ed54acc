"""The level-batched executor (``config.executor='levels'``): the schedule as data, run in chunks.

The per-round executor (``executor.make_round_runner``) dispatches one device
call per round and per set of jobs and is the reference: this one must give
the same state, to float tolerance. It exists for accelerators, where a call
per round leaves the device idle: here the host plans (``sim/planner.py``)
fixed-shape chunks of many dependency pieces and the device runs each as one
compiled program (``sim/chunk.py``), while the host plans the next.

* Host: each round and the jobs it releases are written as rows of
  preallocated arrays and cut into pieces as they come; a chunk is dispatched
  when its ``L`` pieces are full, at an evaluation and before a checkpoint.
  The host waits only on the chunk before the one it just dispatched, so at
  most two are queued. Between evaluations nothing is read back from the
  device and no eager operation runs.
* Device: one program per run (every shape is fixed), a ``lax.scan`` over
  pieces (on a CPU the pieces unrolled: :func:`unrolled_for`), each a ``vmap``
  of its jobs (on a CPU one job at a time, unrolled) then a ``lax.scan`` of its
  rounds, with masks and padding instead of conditionals, on flat ``[W, P]``
  buffers.

:func:`choose_shape` sizes the pieces from the run's own opening (a dry run of
its timeline, deterministic, so a resumed run picks the same shape).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
import optax

from gssp_jax.sim import chunk as chunk_lib
from gssp_jax.sim import devices as devices_lib
from gssp_jax.sim import executor
from gssp_jax.sim import flat as flat_lib
from gssp_jax.sim import planner as planner_lib
from gssp_jax.sync import rounds as rounds_lib

MAX_JOB_SLOTS = 64     # default cap of J: a piece's jobs are one vmap (its activations in memory)
MAX_PIECES = 64        # L: pieces per device call, at most
DEFAULT_PIECES = 16    # L when the config leaves it to the run (levels_per_call=0)
UNROLLED_PIECES = 2    # the same where pieces are unrolled (a CPU: unrolled_for), L x J jobs traced
JOB_FILL = 0.8         # where a padded job slot costs a whole gradient: the opening fills this much
MIN_JOB_SLOTS = 4      # ... of J's slots, J halved down to this (job_slots_filled)


class LevelRunner:
  """Plans chunks from rounds and jobs and runs them, one device call each (see the module).

  Args:
    layout: the model's ``flat.Layout``.
    loss_fn: ``(params, model_state, batch, rng) -> (loss, new model state)``.
    compressor: the one-worker compressor, or None.
    tx: the sync chain, built on flat ``[P]`` weights.
    dense_bytes, stats_bytes: bytes of a dense push and of the statistics it carries.
    num_workers, num_replicas, num_groups: W, R, G.
    shape: the run's ``chunk.Shape``.
    job_shape: one job's batch-index shape, ``(B,)`` or ``(H_max, B)``.
    route: the protocol's first route.
    grad_clip: ``optimizer.grad_clip``.
    local: the local-update job, or None.
    make_jobs: ``(workers, job numbers) -> executor.Jobs`` (``Planner``'s).
    round_fields: the protocol's ``Protocol.round_fields`` (``Planner``'s).
    one_exchange: the protocol's ``Protocol.one_exchange_per_round`` (``Planner``'s).
    job_batch: job slots one ``vmap`` computes together (``chunk.jobs_body``; 0: all).
    unroll_pieces: the chunk's pieces unrolled (``chunk.make_chunk_fn``; :func:`unrolled_for`),
      and each piece's round loop stopped after its last used slot (``used_rounds_only``).
    mesh: the devices a piece's jobs are split over (``sim/devices.py``), or None for one; the
      arrays passed in must be replicated on it (``devices.place``), the state placed as
      ``state_sharding`` says (``devices.state_shardings``; None: replicated).
    state_sharding: the state's shardings on ``mesh`` (``devices.place_state``).
  """

  def __init__(self, *, layout: flat_lib.Layout, loss_fn: Callable, compressor,
               tx: optax.GradientTransformationExtraArgs, dense_bytes: int, stats_bytes: int,
               num_workers: int, num_replicas: int, num_groups: int, shape: chunk_lib.Shape,
               job_shape: tuple, route: np.ndarray, grad_clip: float = 0.0,
               local: executor.LocalJob | None = None, make_jobs=None,
               round_fields=rounds_lib.OPTIONAL_FIELDS, one_exchange: bool = False,
               job_batch: int = 0, unroll_pieces: bool = False, mesh=None,
               state_sharding=None):
    self.shape, self.job_batch, self.unroll_pieces = shape, int(job_batch), unroll_pieces
    self.mesh = mesh
    self.traces = 0
    self.planner = planner_lib.Planner(shape, num_workers=num_workers,
                                       num_replicas=num_replicas, num_groups=num_groups,
                                       job_shape=job_shape, local=local is not None, route=route,
                                       make_jobs=make_jobs, round_fields=round_fields,
                                       one_exchange=one_exchange)

    def count():
      self.traces += 1
    # One int32 buffer crosses to the device per chunk (its layout from an empty chunk).
    self.packing = chunk_lib.packing_of(self.planner.empty_chunk().device_tree())
    self.chunk_fn = chunk_lib.make_chunk_fn(layout, loss_fn, compressor, tx, dense_bytes,
                                            stats_bytes, num_workers, num_replicas, shape,
                                            grad_clip=grad_clip, local=local, on_trace=count,
                                            packing=self.packing, job_batch=job_batch,
                                            unroll_pieces=unroll_pieces, mesh=mesh,
                                            state_sharding=state_sharding,
                                            round_fields=round_fields, num_groups=num_groups,
                                            used_rounds_only=unroll_pieces)
    self._previous = None   # the done-token of the chunk before the one in flight
    self.chunks = 0

  def add(self, rnd, learning_rate: float, workers: np.ndarray, ks: np.ndarray) -> None:
    """Round ``rnd`` (None: no round) at ``learning_rate``, then job ``ks[i]`` of each of
    ``workers`` (``rnd``'s pulling workers, ascending; ``make_jobs`` makes their jobs when
    their chunk is written)."""
    ids = workers.tolist()
    if rnd is not None:
      self.planner.add_round(rnd, learning_rate, ids)
    if ids:
      self.planner.add_job_numbers(workers, ks, ids)

  def state_dict(self) -> dict:
    """The planner's state and the shape it plans with (a resumed run keeps its slots)."""
    return {"planner": self.planner.state_dict(), "shape": list(self.shape)}

  def load_state_dict(self, state: dict) -> None:
    if state.get("steps"):
      raise ValueError("this checkpoint holds steps of the per-round runner; resume it with "
                       "config.executor='rounds'")
    if "planner" in state:
      self.planner.load_state_dict(state["planner"])

  def run_ready(self, state: executor.SimState, arrays) -> executor.SimState:
    """Dispatches every complete chunk; waits only for the one before the last dispatched."""
    if not self.planner.ready:   # most rounds complete no chunk
      return state
    for chunk in self.planner.take():
      plan = chunk_lib.pack(self.packing, chunk.device_tree())
      state, done = self.chunk_fn(state, arrays, devices_lib.place(plan, self.mesh))
      if self._previous is not None:
        self._previous.block_until_ready()
      self._previous = done
      self.chunks += 1
    return state

  def flush(self, state: executor.SimState, arrays, *, jobs: bool = False) -> executor.SimState:
    """Runs everything planned so far (``jobs``: the pending jobs too; see ``Planner.flush``)."""
    self.planner.flush(jobs=jobs)
    return self.run_ready(state, arrays)


def add_step(planner: planner_lib.Planner, step: executor.Step) -> None:
  """Adds an ``executor.Step`` (a round's args and the jobs it released) to ``planner``."""
  if step.args is not None:
    planner.add_round(_RoundView(step.args), float(step.args.get("learning_rate", 1.0)))
  if step.jobs is not None and np.asarray(step.jobs.workers).size:
    jobs = step.jobs
    planner.add_jobs(jobs.workers, jobs.idx, jobs.iters, jobs.ratios, jobs.flushes, jobs.steps)


class _RoundView:
  """A round's args dict seen as a ``sync.Round`` (the fields ``Planner.add_round`` reads)."""

  def __init__(self, args: dict):
    self.__dict__.update({k: np.asarray(v) for k, v in args.items()})
    self.time = 0.0


def make_step_runner(layout: flat_lib.Layout, loss_fn: Callable, compressor,
                     tx: optax.GradientTransformationExtraArgs, dense_bytes: int,
                     stats_bytes: int, num_workers: int, num_replicas: int, num_groups: int,
                     shape: chunk_lib.Shape, job_shape: tuple, route: np.ndarray, *,
                     grad_clip: float = 0.0, local: executor.LocalJob | None = None,
                     job_batch: int = 0, unroll_pieces: bool = False,
                     round_fields=rounds_lib.OPTIONAL_FIELDS, one_exchange: bool = False):
  """``(state, arrays, steps) -> state`` over a flat state: ``executor.make_round_runner``'s contract.

  The jobs still pending after the last step run before it returns, so its
  state is comparable with the per-round runner's after the same steps (the
  equivalence tests). ``run.runner`` is the :class:`LevelRunner`; ``round_fields`` and
  ``one_exchange`` are its (the steps' protocol's).
  """
  runner = LevelRunner(layout=layout, loss_fn=loss_fn, compressor=compressor, tx=tx,
                       dense_bytes=dense_bytes, stats_bytes=stats_bytes,
                       num_workers=num_workers, num_replicas=num_replicas,
                       num_groups=num_groups, shape=shape, job_shape=job_shape, route=route,
                       grad_clip=grad_clip, local=local, job_batch=job_batch,
                       unroll_pieces=unroll_pieces, round_fields=round_fields,
                       one_exchange=one_exchange)

  def run(state: executor.SimState, arrays, steps: Sequence[executor.Step]):
    for step in steps:
      add_step(runner.planner, step)
      state = runner.run_ready(state, arrays)
    return runner.flush(state, arrays, jobs=True)
  run.runner = runner
  return run


def chunk_memory(runner: LevelRunner, state, arrays) -> dict[str, int]:
  """What the compiled chunk program needs on its device, in bytes (XLA's buffer assignment).

  Compiles ``runner``'s chunk program for ``state`` and ``arrays`` (arrays or
  ``jax.ShapeDtypeStruct`` shapes: nothing is allocated or run) and returns XLA's
  ``memory_analysis``: ``arguments`` (the state, the training arrays, the chunk's rows),
  ``outputs``, ``aliased`` (outputs that reuse a donated argument: the state),
  ``temporaries`` (activations, the job slots' weights and gradients, the rounds' scratch) and
  ``peak`` = arguments + outputs - aliased + temporaries, the program's footprint while it runs.
  The backend's own reserve (a GPU client preallocates a share of the card) is not in it.
  """
  plan = jax.ShapeDtypeStruct((sum(size for _, size in runner.packing.sizes),), np.int32)
  stats = runner.chunk_fn.lower(state, arrays, plan).compile().memory_analysis()
  if stats is None:
    raise ValueError(f"the {jax.default_backend()} backend reports no memory analysis")
  out = {"arguments": int(stats.argument_size_in_bytes),
         "outputs": int(stats.output_size_in_bytes),
         "aliased": int(stats.alias_size_in_bytes),
         "temporaries": int(stats.temp_size_in_bytes)}
  out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  return out


# -- sizing the pieces ----------------------------------------------------------------------


def profile(rounds: Sequence, first_jobs: np.ndarray, num_workers: int, job_slots: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Rounds per piece (unbounded), pulls per round and jobs per piece of a run's opening.

  Args:
    rounds: the opening's protocol rounds, in order (their ``arrived`` and ``pulls``).
    first_jobs: the workers whose jobs start the run.
    num_workers: W.
    job_slots: J.

  Returns:
    ``(rounds of each piece, pulls of each round, jobs of each piece)``, the pieces the
    opening closed (all of it, if it closed none).
  """
  pieces, jobs_of = [], []
  count = {"rounds": 0, "jobs": 0, "fresh": 0}   # the open piece's, and the next one's jobs

  def on_cut():
    pieces.append(count["rounds"])
    jobs_of.append(count["jobs"])
    count.update(rounds=0, jobs=count["fresh"], fresh=0)
  cutter = planner_lib.Cutter(num_workers, job_slots, None, on_cut)

  def jobs(workers: list):
    start = 0
    while start < len(workers):
      own, n = cutter.place_jobs(workers[start:])
      cutter.take_jobs(workers[start:start + n], own)
      count["jobs" if own else "fresh"] += n
      start += n
  jobs(np.asarray(first_jobs).tolist())
  pulls = []
  for rnd in rounds:
    pulled = rnd.pulls.nonzero()[0].tolist()
    cutter.place_round(rnd.arrived.nonzero()[0].tolist() + pulled, 1)
    cutter.take_round(1)
    count["rounds"] += 1
    pulls.append(len(pulled))
    if pulled:
      jobs(pulled)
  if not pieces:
    pieces, jobs_of = [count["rounds"]], [count["jobs"]]
  return (np.asarray(pieces, np.int64), np.asarray(pulls or [0], np.int64),
          np.asarray(jobs_of, np.int64))


def _power_of_two_at_least(n: float) -> int:
  return 1 << max(0, int(np.ceil(np.log2(max(n, 1.0)))))


def job_slots_for(job_slots: int, num_workers: int) -> int:
  """J, a piece's job slots: ``config.level_job_slots``, or ``min(W, MAX_JOB_SLOTS)`` for 0."""
  return int(job_slots) or min(num_workers, MAX_JOB_SLOTS)


def job_fill(rounds: Sequence, first_jobs: np.ndarray, num_workers: int, job_slots: int) -> float:
  """The share of the job slots the opening ``rounds``' pieces fill with ``job_slots`` per
  piece (:func:`profile`)."""
  jobs = profile(rounds, first_jobs, num_workers, job_slots)[2]
  return float(jobs.sum()) / (len(jobs) * job_slots)


def job_slots_filled(rounds: Sequence, first_jobs: np.ndarray, num_workers: int,
                     multiple_of: int = 1, fill: float = JOB_FILL) -> int:
  """J where a padded job slot costs a whole gradient (jobs one at a time: a CPU): the largest of
  ``min(W, MAX_JOB_SLOTS)`` halved down to ``MIN_JOB_SLOTS`` (and to multiples of
  ``multiple_of``: the devices the slots are split over) whose opening fills ``fill`` of the
  slots, else the smallest.

  Every job slot of a piece is computed, used or not. With one ``vmap`` of them all an
  accelerator computes the padding beside the jobs; one job at a time, a CPU pays a gradient
  for each, and each piece costs its own rounds' loop. At 16 workers on the tiers cluster the
  pieces of GSSP, ASP and async Local-SGD fill 64 % of 16 slots and 94 % of 8, SSP's 85 % of 16.
  Measured on a 2-core CPU (2026-12-07, ``docs/PERFORMANCE.md``, "Job slots on a CPU"): 8 slots
  for GSSP ran LeNet-5 at 0.78 of the serial loop against 0.55 with 16, and async Local-SGD at
  1.04 against 0.67; 8 for SSP gained nothing on LeNet-5 (0.87 against 0.83) and lost on a
  near-free model (0.54 against 0.78): hence ``JOB_FILL`` 0.8.
  """
  J = job_slots_for(0, num_workers)
  smallest = min(MIN_JOB_SLOTS, J)

  def can_halve(j):
    return j > smallest and max(smallest, j // 2) % multiple_of == 0
  while can_halve(J) and job_fill(rounds, first_jobs, num_workers, J) < fill:
    J = max(smallest, J // 2)
  return J


def choose_shape(rounds: Sequence, first_jobs: np.ndarray, *, num_workers: int,
                 num_replicas: int, bounds: tuple[int, int], job_slots: int = 0,
                 pieces: int = 0, rounds_per_evaluation: float | None = None,
                 default_pieces: int = DEFAULT_PIECES, padding_costs: bool = False,
                 devices: int = 1) -> chunk_lib.Shape:
  """The chunk shape for a run whose opening is ``rounds`` (see :func:`profile`).

  ``padding_costs``: an empty job slot costs a gradient, as on a CPU, where jobs run one at a
  time; otherwise (one ``vmap`` of the jobs: an accelerator) the slots are sized to hold a
  piece's jobs.

  * ``J`` (``job_slots``; 0: ``min(W, MAX_JOB_SLOTS)``, or with ``padding_costs``
    :func:`job_slots_filled`, a multiple of ``devices``).
  * ``Rr``: the 90th percentile of the opening's rounds per piece (a longer
    piece is cut in two).
  * ``Kp``: the 99th percentile of pulls per round (more pulls take further
    pull-only slots), at least ``W / Rr``: a round in which everyone pulls
    fits one piece. (Sized instead by a cost model of pull and round slots, LeNet-5's SSP
    levels ran no faster: ``docs/PERFORMANCE.md``.)
  * ``Ka``, ``Kr``: the protocol's declared bounds (``Protocol.round_bounds``).
  * ``L`` (``pieces``, 0: ``default_pieces``, fewer where an evaluation
    interval holds fewer pieces, so short runs do not pad their chunks;
    ``UNROLLED_PIECES`` where the pieces are unrolled, :func:`unrolled_for`).
  """
  W = num_workers
  if job_slots or not padding_costs:
    J = job_slots_for(job_slots, W)
  else:
    J = job_slots_filled(rounds, first_jobs, W, multiple_of=devices)
  per_piece, pulls, _ = profile(rounds, first_jobs, W, J)
  Rr = max(int(np.ceil(np.percentile(per_piece, 90))), 1)
  Kp = min(W, max(int(np.ceil(np.percentile(pulls, 99))), -(-W // Rr)))
  Ka, Kr = bounds
  L = pieces
  if not L:
    L = default_pieces
    if rounds_per_evaluation:
      pieces_per_evaluation = rounds_per_evaluation / max(float(np.mean(per_piece)), 1.0)
      L = min(L, _power_of_two_at_least(pieces_per_evaluation / 2))
  return chunk_lib.Shape(pieces=int(L), jobs=int(J), rounds=int(Rr), arrivals=int(min(Ka, W)),
                         pulls=int(Kp), replicas=int(min(Kr, num_replicas)))


def job_batch_for(job_batch: int, backend: str) -> int:
  """``config.level_job_batch`` as run: 0 (chosen by the run) is 1 on a CPU and every slot at
  once (0) on an accelerator.

  On this project's 2-core CPU one job at a time ran LeNet-5's level executor at 16 workers
  2.2x as fast as one ``vmap`` of the piece's 16 slots (``docs/log/performance-2026-11.md``,
  "Jobs one at a time"): the ``vmap`` over per-worker weights makes every convolution a grouped
  one, a slow path of XLA:CPU. On a GPU the choice is measured by ``benchmarks/sim_efficiency.py
  --level_job_batch``; until it is, an accelerator keeps the one ``vmap``.
  """
  if job_batch:
    return int(job_batch)
  return 1 if backend == "cpu" else 0


def unrolled_for(backend: str) -> bool:
  """Whether a chunk's pieces are unrolled (``chunk.make_chunk_fn``'s ``unroll_pieces``): on a
  CPU, where a convolution in a loop body takes a slow path (``chunk.map_jobs``); an
  accelerator keeps the ``lax.scan`` over pieces (a program ``L`` times smaller). The CPU's
  pieces also stop their round loops after their last used slot (``used_rounds_only``), where
  an accelerator runs every slot (a trip count that is data costs it a return to the host per
  trip)."""
  return backend == "cpu"


def describe(shape: chunk_lib.Shape, job_batch: int = 0, unrolled: bool = False) -> str:
  """One line of a chunk shape, its job batch (:func:`job_batch_for`) and whether its pieces
  are unrolled (:func:`unrolled_for`), for the run's log."""
  per_vmap = chunk_lib.jobs_per_vmap(job_batch, shape.jobs)
  batch = "all in one vmap" if per_vmap == shape.jobs else f"{per_vmap} at a time"
  return (f"{shape.pieces} pieces per call ({'unrolled' if unrolled else 'a scan'}), each "
          f"{shape.jobs} job slots ({batch}) and "
          f"{shape.rounds} round slots; per round {shape.arrivals} arrival, {shape.pulls} pull "
          f"and {shape.replicas} replica slots")
