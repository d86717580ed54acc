"""The host half of the level-batched executor: the schedule as fixed-shape rows, cut into pieces.

The simulator's host (protocol, timeline, accounting) emits, event by event,
rounds and the jobs of the workers each round released. The device can run a
job as soon as the weights its worker pulled are in place, and must run it
before its worker's gradient is read (it arrives) or its weights overwritten
(it pulls again). :class:`Cutter` turns that rule into *pieces*, incrementally:
a piece's jobs are computed together (``vmap``), then its rounds run in order.
A job dispatched by one of a piece's rounds waits for the next piece
(``fresh``); a round that touches a fresh worker, a piece with no job or round
slot left, and a second job for a fresh worker each close the piece.

:class:`Planner` writes each piece straight into preallocated NumPy rows of
fixed width (``chunk.Shape``): job slots padded with the distinct out-of-range
workers ``W, W + 1, ...``, round slots with empty rounds, ids with
``W + i``/``R + i``. ``L`` pieces make a :class:`Chunk`, one device call
(``sim/chunk.py``); the executor dispatches it and plans the next while the
device runs it. A round that pulls more workers than ``Kp`` becomes several
device rounds (the rest pull-only, which changes nothing else: a round with
no arrival and no application leaves every replica as it is).

Everything here is deterministic in its inputs, so the pieces, and with them
the float sums of every ``vmap``, are the same on every run and after a resume
(the rows not yet run are saved with the checkpoint: :meth:`Planner.state_dict`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from gssp_jax.sim import chunk as chunk_lib

# The round fields a slot carries besides its ids, with their padding value (an empty round).
_REPLICA_FIELDS = {"applies": False, "adopt": -1, "average": -1, "stats_mean": -1,
                   "adopt_weight": 1.0}
_GROUP_FIELDS = {"forward": False, "deliver": False}
_DTYPES = {"applies": bool, "adopt": np.int32, "average": np.int32, "stats_mean": np.int32,
           "adopt_weight": np.float32, "forward": bool, "deliver": bool}


class Chunk(NamedTuple):
  """One device call's rows (host arrays) and what they hold.

  Attributes:
    jobs: ``workers``, ``idx``, ``iters``, ``ratios``, ``flushes`` (and
      ``steps`` for local-update jobs), each ``[L, J, ...]``.
    rounds: ``arrive_ids [L, Rr, Ka]``, ``pull_ids [L, Rr, Kp]``,
      ``replica_ids [L, Rr, Kr]``, ``route [L, Rr]`` (a row of ``routes``),
      ``applies``, ``adopt``, ``average``, ``stats_mean``, ``adopt_weight``
      ``[L, Rr, R]``, ``forward``, ``deliver`` ``[L, Rr, G]``,
      ``aggregate [L, Rr]`` and ``learning_rate [L, Rr]``.
    routes: ``[Q, W]`` the worker -> replica routes its rounds use.
    pieces: pieces holding something (the rest are padding).
  """
  jobs: dict
  rounds: dict
  routes: np.ndarray
  pieces: int

  def device_tree(self) -> dict:
    """What ``chunk.make_chunk_fn``'s program takes."""
    return {"jobs": self.jobs, "rounds": self.rounds, "routes": self.routes}


class Cutter:
  """The piece-cutting rule alone: which piece a round or a job goes to (host, pure state).

  Attributes:
    current: ``[W]`` bool, workers with a job among the open piece's jobs.
    fresh: ``[W]`` bool, workers with a job dispatched by the open piece's rounds.
    num_current, num_fresh: their counts.
    used: device round slots used in the open piece.
  """

  def __init__(self, num_workers: int, job_slots: int, round_slots: int | None,
               on_cut=lambda: None):
    self.W, self.J, self.Rr = num_workers, job_slots, round_slots
    self.on_cut = on_cut   # called after each cut (the planner opens its next row)
    self.current = np.zeros([num_workers], bool)
    self.fresh = np.zeros([num_workers], bool)
    self.num_current = self.num_fresh = self.used = 0

  def cut(self) -> None:
    """Closes the open piece: its fresh jobs become the next piece's jobs."""
    self.current, self.fresh = self.fresh, self.current
    self.fresh[:] = False
    self.num_current, self.num_fresh, self.used = self.num_fresh, 0, 0
    self.on_cut()

  def place_round(self, touched: np.ndarray, slots: int) -> None:
    """Makes room for a round touching ``touched`` (ids) over ``slots`` device rounds."""
    if (self.num_fresh and self.fresh[touched].any()) or (
        self.Rr is not None and self.used + slots > self.Rr):
      self.cut()

  def take_round(self, slots: int) -> None:
    self.used += slots

  def place_jobs(self, workers: np.ndarray) -> tuple[bool, int]:
    """Where the next of ``workers``' jobs go: ``(into the open piece's own jobs, how many)``.

    The open piece takes jobs itself while it has no round yet (they precede
    every round to come); else they are fresh. Cuts where a job would meet
    another of its worker's, or a piece would exceed ``J`` jobs.
    """
    if self.used == 0:
      if self.num_current and self.current[workers].any() or self.num_current == self.J:
        self.cut()
        return self.place_jobs(workers)
      return True, min(workers.size, self.J - self.num_current)
    if (self.num_fresh and self.fresh[workers].any()) or self.num_fresh == self.J:
      self.cut()
      return self.place_jobs(workers)
    return False, min(workers.size, self.J - self.num_fresh)

  def take_jobs(self, workers: np.ndarray, own: bool) -> None:
    if own:
      self.current[workers] = True
      self.num_current += workers.size
    else:
      self.fresh[workers] = True
      self.num_fresh += workers.size

  def state_dict(self) -> dict:
    return {k: getattr(self, k) for k in ("current", "fresh", "num_current", "num_fresh", "used")}

  def load_state_dict(self, state: dict) -> None:
    for k, v in state.items():
      setattr(self, k, v)


class Planner:
  """Rounds and jobs in, :class:`Chunk`s out (host NumPy; see the module docstring).

  Args:
    shape: the run's ``chunk.Shape``.
    num_workers, num_replicas, num_groups: W, R, G.
    job_shape: one job's ``idx`` shape: ``(B,)``, or ``(H_max, B)`` for local-update jobs.
    local: jobs carry ``steps`` (local-update schemes).
    route: the protocol's first worker -> replica route.
  """

  def __init__(self, shape: chunk_lib.Shape, *, num_workers: int, num_replicas: int,
               num_groups: int, job_shape: tuple, local: bool, route: np.ndarray):
    self.shape = chunk_lib.check_shape(shape, num_workers, num_replicas)
    if shape.rounds * shape.pulls < num_workers:
      raise ValueError(f"chunk shape rounds={shape.rounds} x pulls={shape.pulls} is invalid "
                       f"for {num_workers} workers; allowed: a product >= {num_workers}, so "
                       "that a round in which everyone pulls fits one piece")
    self.W, self.R, self.G = num_workers, num_replicas, num_groups
    self.job_shape, self.local = tuple(job_shape), bool(local)
    self.cutter = Cutter(num_workers, shape.jobs, shape.rounds, self._after_cut)
    self.piece = 0                  # the open piece's row in the buffers
    self.routes = [np.asarray(route, np.int32).copy()]
    self.ready: list[Chunk] = []    # complete chunks, oldest first
    self.totals = {"pieces": 0, "jobs": 0, "rounds": 0, "round_slots": 0}
    self._rows = self._new_rows()

  # -- the rows ----------------------------------------------------------------------------

  def _new_rows(self) -> dict:
    """Empty buffers for one chunk: ``L + 1`` job rows (the last: the next chunk's first)."""
    s, W, R, G = self.shape, self.W, self.R, self.G
    L, J, Rr = s.pieces, s.jobs, s.rounds
    jobs = {"workers": np.broadcast_to(chunk_lib.padded_ids(J, W), (L + 1, J)).copy(),
            "idx": np.zeros((L + 1, J, *self.job_shape), np.int32),
            "iters": np.zeros((L + 1, J), np.int32),
            "ratios": np.ones((L + 1, J), np.float32),
            "flushes": np.zeros((L + 1, J), bool)}
    if self.local:
      jobs["steps"] = np.zeros((L + 1, J), np.int32)
    rounds = {"arrive_ids": np.broadcast_to(chunk_lib.padded_ids(s.arrivals, W),
                                            (L, Rr, s.arrivals)).copy(),
              "pull_ids": np.broadcast_to(chunk_lib.padded_ids(s.pulls, W),
                                          (L, Rr, s.pulls)).copy(),
              "replica_ids": np.broadcast_to(chunk_lib.padded_ids(s.replicas, R),
                                             (L, Rr, s.replicas)).copy(),
              "route": np.zeros((L, Rr), np.int32),
              "aggregate": np.zeros((L, Rr), bool),
              "learning_rate": np.zeros((L, Rr), np.float32)}
    for fields, width in ((_REPLICA_FIELDS, R), (_GROUP_FIELDS, G)):
      for name, fill in fields.items():
        rounds[name] = np.full((L, Rr, width), fill, _DTYPES[name])
    return {"jobs": jobs, "rounds": rounds}

  def _route_index(self, groups: np.ndarray) -> int:
    """The row of ``routes`` equal to ``groups``; a new route is added (a full table ends the
    chunk: the open piece, cut at the route change, starts the next one)."""
    if np.array_equal(self.routes[-1], groups):
      return len(self.routes) - 1
    if len(self.routes) == self.shape.routes:
      if self.piece:
        self._emit(carry=True)
      self.routes = []
    self.routes.append(np.asarray(groups, np.int32).copy())
    return len(self.routes) - 1

  # -- input -------------------------------------------------------------------------------

  def add_round(self, rnd, learning_rate: float) -> None:
    """Adds protocol round ``rnd`` (a ``sync.Round``) at ``learning_rate``.

    Raises:
      ValueError: more arrivals or touched replicas than the shape's slots
        (``chunk.Shape.arrivals``/``replicas``, the protocol's declared bounds).
    """
    s = self.shape
    arrived = np.flatnonzero(rnd.arrived)
    pulls = np.flatnonzero(rnd.pulls)
    replicas = np.flatnonzero(rnd.applies | (rnd.average >= 0) | (rnd.adopt >= 0))
    if arrived.size > s.arrivals or replicas.size > s.replicas:
      raise ValueError(
          f"a round at time {rnd.time:.6g} has {arrived.size} arrivals and touches "
          f"{replicas.size} replicas; allowed: at most {s.arrivals} and {s.replicas} (the "
          "bounds its protocol declares, Protocol.round_bounds)")
    slots = max(1, -(-pulls.size // s.pulls))
    touched = np.concatenate([arrived, pulls]) if pulls.size else arrived
    if self.cutter.used and not np.array_equal(self.routes[-1], rnd.groups):
      self.cutter.cut()   # a new route (a regrouping) starts a piece, wherever the chunk is
    self.cutter.place_round(touched, slots)
    route = self._route_index(rnd.groups)
    rows, p, first = self._rows["rounds"], self.piece, self.cutter.used
    rows["arrive_ids"][p, first, :arrived.size] = arrived
    rows["replica_ids"][p, first, :replicas.size] = replicas
    for name in _REPLICA_FIELDS:
      rows[name][p, first] = getattr(rnd, name)
    for name in _GROUP_FIELDS:
      rows[name][p, first] = getattr(rnd, name)
    rows["aggregate"][p, first] = rnd.aggregate
    rows["route"][p, first:first + slots] = route
    rows["learning_rate"][p, first:first + slots] = learning_rate
    for i in range(slots):   # the pulls beyond the first slot's go in pull-only slots after it
      part = pulls[i * s.pulls:(i + 1) * s.pulls]
      rows["pull_ids"][p, first + i, :part.size] = part
    self.cutter.take_round(slots)
    self.totals["rounds"] += 1
    self.totals["round_slots"] += slots

  def add_jobs(self, workers, idx, iters, ratios, flushes, steps=None) -> None:
    """Adds the jobs of ``workers`` (distinct), dispatched after the rounds added so far."""
    workers = np.asarray(workers, np.int64)
    if np.unique(workers).size != workers.size:
      raise ValueError(f"a step's jobs must be for distinct workers; got workers="
                       f"{workers.tolist()}")
    fields = {"workers": workers, "idx": idx, "iters": iters, "ratios": ratios,
              "flushes": flushes}
    if self.local:
      fields["steps"] = steps
    start = 0
    while start < workers.size:
      own, count = self.cutter.place_jobs(workers[start:])
      row = self.piece if own else self.piece + 1
      first = self.cutter.num_current if own else self.cutter.num_fresh
      part = slice(start, start + count)
      for name, values in fields.items():
        self._rows["jobs"][name][row, first:first + count] = np.asarray(values)[part]
      self.cutter.take_jobs(workers[part], own)
      self.totals["jobs"] += count
      start += count

  # -- pieces and chunks -------------------------------------------------------------------

  def _after_cut(self) -> None:
    """The cutter closed the open piece: the next row opens (a full chunk is emitted)."""
    self.piece += 1
    self.totals["pieces"] += 1
    if self.piece == self.shape.pieces:
      self._emit(carry=True)

  def _emit(self, carry: bool) -> None:
    """Queues the pieces before the open one as a chunk; the open one moves to a new buffer.

    ``carry``: the open piece's jobs (it has no rounds yet) start the next chunk.
    """
    old, new = self._rows, self._new_rows()
    p = self.piece
    if carry:
      for name, values in old["jobs"].items():
        new["jobs"][name][0] = values[p]
        values[p] = new["jobs"][name][self.shape.pieces]   # padding again in the old chunk
    jobs = {k: v[:self.shape.pieces] for k, v in old["jobs"].items()}
    self.ready.append(Chunk(jobs, old["rounds"], np.stack(self._padded_routes()), p))
    self._rows, self.piece = new, 0
    self.routes = self.routes[-1:]   # the route in force goes on

  def _padded_routes(self) -> list:
    return self.routes + [self.routes[-1]] * (self.shape.routes - len(self.routes))

  def flush(self, jobs: bool = False) -> None:
    """Queues everything added so far as chunks (the last one padded).

    ``jobs``: the open piece's pending jobs run too (at the end of a step list);
    else they wait, as the first jobs of the next chunk.
    """
    if self.cutter.used:
      self.cutter.cut()
    if jobs and self.cutter.num_current:
      self.cutter.cut()
    if self.piece:
      self._emit(carry=True)

  def take(self) -> list[Chunk]:
    """The complete chunks, oldest first (they leave the planner)."""
    out, self.ready = self.ready, []
    return out

  # -- checkpoints -------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """The rows not yet run, for an exact resume (taken when no complete chunk waits)."""
    if self.ready:
      raise RuntimeError("the planner's complete chunks must run before its state is taken")
    return {"cutter": self.cutter.state_dict(), "piece": self.piece, "routes": self.routes,
            "rows": self._rows, "totals": self.totals}

  def load_state_dict(self, state: dict) -> None:
    """Resumes from :meth:`state_dict`, also one taken with another number of pieces per chunk
    (``levels_per_call`` may change on resume): the same pieces, laid into chunks of this size."""
    self.cutter.load_state_dict(state["cutter"])
    self.totals = dict(state["totals"])
    rows, routes, last = state["rows"], list(state["routes"]), state["piece"]
    if rows["rounds"]["route"].shape[0] == self.shape.pieces:
      self._rows, self.piece, self.routes = rows, last, routes
      return
    self._rows, self.piece, self.routes = self._new_rows(), 0, routes
    for i in range(last + 1):   # closed pieces, then the open one (and its fresh jobs)
      for name, values in rows["jobs"].items():
        self._rows["jobs"][name][self.piece:self.piece + 1 + (i == last)] = values[i:i + 1 + (
            i == last)]
      for name, values in rows["rounds"].items():
        self._rows["rounds"][name][self.piece] = values[i]
      if i < last:
        self.piece += 1
        if self.piece == self.shape.pieces:
          self._emit(carry=False)
          self.routes = routes   # every piece here indexes the saved table
