"""The host half of the level-batched executor: the schedule as fixed-shape rows, cut into pieces.

The simulator's host (protocol, timeline, accounting) emits, event by event,
rounds and the jobs of the workers each round released. The device can run a
job as soon as the weights its worker pulled are in place, and must run it
before its worker's gradient is read (it arrives) or its weights overwritten
(it pulls again). :class:`Cutter` turns that rule into *pieces*, incrementally:
a piece's jobs are computed together (``vmap``), then its rounds run in order.
A job dispatched by one of a piece's rounds waits for the next piece
(``fresh``); a round that touches a fresh worker, a piece with no job or round
slot left, a second job for a fresh worker and a new worker -> replica route
each close the piece.

:class:`Planner` notes where each round and job goes (its piece and slot) as
it comes, and writes a chunk's rows only when its ``L`` pieces are complete:
one ``np.stack`` per field per chunk instead of a dozen small writes per
round. A chunk's rows have fixed widths (``chunk.Shape``): job slots padded
with the distinct out-of-range workers ``W, W + 1, ...``, round slots with
empty rounds, ids with ``W + i``/``R + i``. A round that pulls more workers
than ``Kp`` fills several slots (the rest pull-only, which changes nothing
else: a round with no arrival and no application leaves every replica as it
is). The executor dispatches each chunk as one device call (``sim/chunk.py``)
and plans the next while the device runs it.

Everything here is deterministic in its inputs, so the pieces, and with them
the float sums of every ``vmap``, are the same on every run and after a resume
(what is noted but not run is saved with the checkpoint:
:meth:`Planner.state_dict`), whatever the number of pieces per chunk.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import NamedTuple

import numpy as np

from gssp_jax.sim import chunk as chunk_lib
from gssp_jax.sync import rounds as rounds_lib

# The round fields a slot carries besides its ids, with their padding value (an empty round).
_REPLICA_FIELDS, _GROUP_FIELDS = chunk_lib.REPLICA_PADDING, chunk_lib.GROUP_PADDING
_DTYPES = {"applies": bool, "adopt": np.int32, "average": np.int32, "stats_mean": np.int32,
           "adopt_weight": np.float32, "forward": bool, "deliver": bool, "route": np.int32,
           "aggregate": bool, "learning_rate": np.float32}
_JOB_FIELDS = ("workers", "idx", "iters", "ratios", "flushes", "steps")
_PIECE = operator.itemgetter(0)   # a noted round's or job's piece


class Chunk(NamedTuple):
  """One device call's rows (host arrays).

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
  """The piece-cutting rule alone: which piece a round or a job goes to (host, plain Python).

  Attributes:
    current: workers with a job among the open piece's jobs.
    fresh: workers with a job dispatched by the open piece's rounds.
    used: device round slots used in the open piece.
  """

  def __init__(self, num_workers: int, job_slots: int, round_slots: int | None,
               on_cut=lambda: None):
    self.W, self.J, self.Rr = num_workers, job_slots, round_slots
    self.on_cut = on_cut   # called after each cut (the planner opens its next piece)
    self.current: set = set()
    self.fresh: set = set()
    self.used = 0

  def cut(self) -> None:
    """Closes the open piece: its fresh jobs become the next piece's jobs."""
    self.current, self.fresh, self.used = self.fresh, set(), 0
    self.on_cut()

  def place_round(self, touched: list, slots: int) -> None:
    """Makes room for a round touching the workers ``touched`` over ``slots`` device rounds."""
    if (self.fresh and not self.fresh.isdisjoint(touched)) or (
        self.Rr is not None and self.used + slots > self.Rr):
      self.cut()

  def take_round(self, slots: int) -> None:
    self.used += slots

  def place_jobs(self, workers: list) -> tuple[bool, int]:
    """Where the next of ``workers``' jobs go: ``(into the open piece's own jobs, how many)``.

    The open piece takes jobs itself while it has no round yet (they precede
    every round to come) and has room; else they are fresh (computed at the
    next piece's start, after this one's rounds: also right for a job
    dispatched before any of them). Cuts where a fresh job would meet another
    of its worker's, or fresh jobs would exceed ``J``.
    """
    if (self.used == 0 and not self.fresh and len(self.current) < self.J
        and self.current.isdisjoint(workers)):
      return True, min(len(workers), self.J - len(self.current))
    if not self.fresh.isdisjoint(workers) or len(self.fresh) == self.J:
      self.cut()
      return self.place_jobs(workers)
    return False, min(len(workers), self.J - len(self.fresh))

  def take_jobs(self, workers: list, own: bool) -> int:
    """Notes ``workers``' jobs; returns the first of their slots."""
    into = self.current if own else self.fresh
    first = len(into)
    into.update(workers)
    return first

  def state_dict(self) -> dict:
    return {"current": self.current, "fresh": self.fresh, "used": self.used}

  def load_state_dict(self, state: dict) -> None:
    self.current, self.fresh = set(state["current"]), set(state["fresh"])
    self.used = state["used"]


class Planner:
  """Rounds and jobs in, :class:`Chunk`\\ s out (host NumPy; see the module docstring).

  Args:
    shape: the run's ``chunk.Shape``.
    num_workers, num_replicas, num_groups: W, R, G.
    job_shape: one job's ``idx`` shape: ``(B,)``, or ``(H_max, B)`` for local-update jobs.
    local: jobs carry ``steps`` (local-update schemes).
    route: the protocol's first worker -> replica route.
    make_jobs: ``(workers [n], ks [n]) -> executor.Jobs``: the fields of the jobs
      noted by :meth:`add_job_numbers` (job ``ks[i]`` of worker ``workers[i]``),
      made for a whole chunk at once when it is written.
    round_fields: the optional round fields the protocol sets
      (``Protocol.round_fields``); the others keep their empty value in every slot.
    one_exchange: the protocol's ``Protocol.one_exchange_per_round``, checked on every
      round as its chunk is written (GSSP's chunk rounds rely on it).
  """

  def __init__(self, shape: chunk_lib.Shape, *, num_workers: int, num_replicas: int,
               num_groups: int, job_shape: tuple, local: bool, route: np.ndarray,
               make_jobs=None, round_fields=rounds_lib.OPTIONAL_FIELDS,
               one_exchange: bool = False):
    self.shape = chunk_lib.check_shape(shape, num_workers, num_replicas)
    if shape.rounds * shape.pulls < num_workers:
      raise ValueError(f"chunk shape rounds={shape.rounds} x pulls={shape.pulls} is invalid "
                       f"for {num_workers} workers; allowed: a product >= {num_workers}, so "
                       "that a round in which everyone pulls fits one piece")
    self.W, self.R, self.G = num_workers, num_replicas, num_groups
    self.job_shape, self.local = tuple(job_shape), bool(local)
    self.make_jobs = make_jobs
    self.round_fields = tuple(round_fields)
    self.one_exchange = bool(one_exchange)
    self.cutter = Cutter(num_workers, shape.jobs, shape.rounds, self._after_cut)
    self.piece = 0                   # the open piece, counted from the chunk's first
    self.routes = [np.asarray(route, np.int32).copy()]
    self._route_key = self.routes[-1].tobytes()
    self._route_seen = None          # the read-only route array last seen to equal _route_key
    # What is noted, in piece order (pieces only grow: a job goes to the open piece or the
    # next, and the open piece takes no job of its own once it has a fresh one).
    self.rounds: list = []           # (piece, slot, slots, round, learning rate, route,
                                     #  arrived ids, pulled ids)
    self.jobs: list = []             # (piece, first slot, workers, job numbers, fields)
    self.ready: list[Chunk] = []     # complete chunks, oldest first
    self.totals = {"pieces": 0, "jobs": 0, "rounds": 0, "round_slots": 0}

  # -- input -------------------------------------------------------------------------------

  def add_round(self, rnd, learning_rate: float, pulls: list | None = None) -> None:
    """Notes protocol round ``rnd`` (a ``sync.Round``) at ``learning_rate``.

    ``pulls``: ``rnd``'s pulling workers, ascending, where the caller has them already.

    Raises:
      ValueError: more arrivals or touched replicas than the shape's slots
        (``chunk.Shape.arrivals``/``replicas``, the protocol's declared bounds).
    """
    s = self.shape
    arrived = rnd.arrived.nonzero()[0].tolist()
    if pulls is None:
      pulls = rnd.pulls.nonzero()[0].tolist()
    if len(arrived) > s.arrivals:
      self._over_bounds(rnd, "arrivals", len(arrived), s.arrivals)
    slots = max(1, -(-len(pulls) // s.pulls))
    groups, changed = rnd.groups, False
    if groups is not self._route_seen:   # protocols share one route array until they regroup
      key = groups.tobytes()
      changed = key != self._route_key
      if changed and self.cutter.used:
        self.cutter.cut()   # a new route (a regrouping) starts a piece, wherever the chunk is
    self.cutter.place_round(arrived + pulls, slots)
    if changed:
      self._new_route(groups, key)
    if groups is not self._route_seen:
      self._route_seen = None if groups.flags.writeable else groups
    self.rounds.append((self.piece, self.cutter.used, slots, rnd, learning_rate,
                        len(self.routes) - 1, arrived, pulls))
    self.cutter.take_round(slots)
    self.totals["rounds"] += 1
    self.totals["round_slots"] += slots

  @staticmethod
  def _check_one_exchange(rounds: list, fields: dict) -> None:
    """Every round exchanges one group at most (``Protocol.one_exchange_per_round``); checked
    as a chunk's rows are written, before the device runs any of them."""
    if "forward" not in fields or "deliver" not in fields:
      return   # a protocol that sets neither never exchanges
    exchanging = fields["forward"] | fields["deliver"]
    bad = np.flatnonzero(exchanging.sum(1) > 1)
    if bad.size:
      rnd = rounds[int(bad[0])]
      raise ValueError(f"the round at virtual time {rnd.time} exchanges groups "
                       f"{np.flatnonzero(exchanging[bad[0]]).tolist()}; this protocol "
                       "declares one exchanging group per round "
                       "(Protocol.one_exchange_per_round), which the level executor's rounds "
                       "rely on")

  def _over_bounds(self, rnd, what: str, count: int, bound: int):
    raise ValueError(
        f"a round at time {rnd.time:.6g} has {count} {what}; allowed: at most {bound} (the "
        "bound its protocol declares, Protocol.round_bounds)")

  def add_jobs(self, workers, idx, iters, ratios, flushes, steps=None) -> None:
    """Notes the jobs of ``workers`` (distinct), dispatched after the rounds added so far."""
    self._add_jobs(workers, None, (idx, iters, ratios, flushes, steps if self.local else None))

  def add_job_numbers(self, workers, ks, ids: list | None = None) -> None:
    """Notes job ``ks[i]`` of each of ``workers`` (distinct); ``make_jobs`` makes its fields.
    ``ids``: ``workers`` as a list, where the caller has it already."""
    self._add_jobs(workers, np.asarray(ks, np.int64), None, ids)

  def _add_jobs(self, workers, ks, fields, ids: list | None = None) -> None:
    workers = np.asarray(workers, np.int64)
    if ids is None:
      ids = workers.tolist()
    if len(ids) > 1 and len(set(ids)) != len(ids):
      raise ValueError(f"a step's jobs must be for distinct workers; got workers={ids}")
    start, n = 0, len(ids)
    while start < n:
      rest = ids[start:] if start else ids
      own, count = self.cutter.place_jobs(rest)
      first = self.cutter.take_jobs(rest[:count] if count < len(rest) else rest, own)
      if count == n:   # all of them at once (the common case): no slices
        noted = (workers, ks, None if fields is None else tuple(
            None if f is None else np.asarray(f) for f in fields))
      else:
        part = slice(start, start + count)
        noted = (workers[part], None if ks is None else ks[part],
                 None if fields is None else tuple(
                     None if f is None else np.asarray(f)[part] for f in fields))
      self.jobs.append((self.piece + (not own), first, *noted))
      self.totals["jobs"] += count
      start += count

  # -- pieces and chunks -------------------------------------------------------------------

  def _after_cut(self) -> None:
    """The cutter closed the open piece: the next one opens (a full chunk is emitted)."""
    self.piece += 1
    self.totals["pieces"] += 1
    if self.piece == self.shape.pieces:
      self._emit(self.shape.pieces)

  def _new_route(self, groups: np.ndarray, key: bytes) -> None:
    """Adds a route to the chunk's table (a full table first ends the chunk: the open
    piece, cut at the route change, starts the next one)."""
    if len(self.routes) == self.shape.routes:
      if self.piece:
        self._emit(self.piece)
      self.routes = []   # no round of this chunk uses the old ones
    self.routes.append(np.asarray(groups, np.int32).copy())
    self._route_key = key

  def _emit(self, count: int) -> None:
    """Queues the first ``count`` pieces as a chunk; what is noted after them moves up."""
    # Both lists are noted in piece order, so the first ``count`` pieces' are a prefix.
    k = bisect.bisect_left(self.rounds, count, key=_PIECE)
    rounds, self.rounds = self.rounds[:k], [(p - count, *rest) for p, *rest in self.rounds[k:]]
    k = bisect.bisect_left(self.jobs, count, key=_PIECE)
    jobs, self.jobs = self.jobs[:k], [(p - count, *rest) for p, *rest in self.jobs[k:]]
    self.ready.append(self._rows(rounds, jobs, count))
    self.piece -= count
    if not self.rounds:   # else (a resume into smaller chunks) they index the same table
      self.routes = self.routes[-1:]   # the route in force goes on

  def _rows(self, rounds: list, jobs: list, count: int) -> Chunk:
    """A chunk's rows from what was noted in its pieces (see :class:`Chunk`)."""
    s, W, R, G = self.shape, self.W, self.R, self.G
    L, J, Rr = s.pieces, s.jobs, s.rounds
    out_jobs = {"workers": np.broadcast_to(chunk_lib.padded_ids(J, W), (L, J)).copy(),
                "idx": np.zeros((L, J, *self.job_shape), np.int32),
                "iters": np.zeros((L, J), np.int32),
                "ratios": np.ones((L, J), np.float32),
                "flushes": np.zeros((L, J), bool)}
    if self.local:
      out_jobs["steps"] = np.zeros((L, J), np.int32)
    for given in (False, True):   # jobs made here (by make_jobs), then jobs given their fields
      part = [j for j in jobs if (j[4] is not None) == given]
      if not part:
        continue
      sizes = np.array([len(j[2]) for j in part])
      piece = np.repeat([j[0] for j in part], sizes)
      slot = _spans(np.array([j[1] for j in part]), sizes)
      workers = np.concatenate([j[2] for j in part])
      if given:
        fields = [None if part[0][4][i] is None else np.concatenate([j[4][i] for j in part])
                  for i in range(len(_JOB_FIELDS) - 1)]
      else:
        fields = list(self.make_jobs(workers, np.concatenate([j[3] for j in part]))[1:])
      for name, values in zip(_JOB_FIELDS, [workers, *fields]):
        if name in out_jobs:
          out_jobs[name][piece, slot] = values
    out_rounds = {"arrive_ids": _padded(L, Rr, s.arrivals, W),
                  "pull_ids": _padded(L, Rr, s.pulls, W),
                  "replica_ids": _padded(L, Rr, s.replicas, R),
                  **{name: np.full((L, Rr), fill, _DTYPES[name])
                     for name, fill in chunk_lib.SLOT_PADDING.items()}}
    for fields, width in ((_REPLICA_FIELDS, R), (_GROUP_FIELDS, G)):
      for name, fill in fields.items():
        out_rounds[name] = np.full((L, Rr, width), fill, _DTYPES[name])
    if rounds:
      self._round_rows(rounds, out_rounds)
    routes = self.routes + [self.routes[-1]] * (s.routes - len(self.routes))
    return Chunk(out_jobs, out_rounds, np.stack(routes), count)

  def _round_rows(self, rounds: list, out: dict) -> None:
    """Writes the noted ``rounds`` into ``out``'s slots (one vectorised write per field)."""
    s = self.shape
    piece = np.array([r[0] for r in rounds])
    slot = np.array([r[1] for r in rounds])
    slots = np.array([r[2] for r in rounds])
    objs = [r[3] for r in rounds]
    every_piece, every_slot = np.repeat(piece, slots), _spans(slot, slots)
    out["learning_rate"][every_piece, every_slot] = np.repeat([r[4] for r in rounds], slots)
    out["route"][every_piece, every_slot] = np.repeat([r[5] for r in rounds], slots)
    optional = [n for n in rounds_lib.OPTIONAL_FIELDS if n in self.round_fields]
    fields = rounds_lib.stack_fields(objs, ["applies", *optional], self.round_fields)
    if self.one_exchange:
      self._check_one_exchange(objs, fields)
    for name in ("applies", *optional):   # the others keep their empty value
      out[name][piece, slot] = fields[name]
    k, w, rank = _listed_ranks([r[6] for r in rounds])
    out["arrive_ids"][piece[k], slot[k], rank] = w
    k, w, rank = _listed_ranks([r[7] for r in rounds])
    out["pull_ids"][piece[k], slot[k] + rank // s.pulls, rank % s.pulls] = w
    touched = fields["applies"].copy()
    for name in ("average", "adopt"):
      if name in fields:
        touched |= fields[name] >= 0
    k, r, rank = _ranks(touched)
    if rank.size and rank.max() >= s.replicas:
      bad = int(k[rank.argmax()])
      self._over_bounds(objs[bad], "touched replicas", int(touched[bad].sum()), s.replicas)
    out["replica_ids"][piece[k], slot[k], rank] = r

  def flush(self, jobs: bool = False) -> None:
    """Queues everything added so far as chunks (the last one padded).

    ``jobs``: the open piece's pending jobs run too (at the end of a step list);
    else they wait, as the first jobs of the next chunk.
    """
    if self.cutter.used:
      self.cutter.cut()
    while jobs and (self.cutter.current or self.cutter.fresh):   # fresh ones: one piece more
      self.cutter.cut()
    if self.piece:
      self._emit(self.piece)

  def unrun(self) -> dict[str, int]:
    """What is noted but not yet in a chunk (counted in ``totals``): ``pieces`` cut and not
    emitted, and the ``jobs`` and ``rounds`` in those and the open piece."""
    return {"pieces": self.piece, "jobs": sum(len(job[2]) for job in self.jobs),
            "rounds": len(self.rounds)}

  def empty_chunk(self) -> Chunk:
    """A chunk of padding only (its shapes are every chunk's)."""
    return self._rows([], [], 0)

  def take(self) -> list[Chunk]:
    """The complete chunks, oldest first (they leave the planner)."""
    out, self.ready = self.ready, []
    return out

  # -- checkpoints -------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """What is noted but not run, for an exact resume (taken when no complete chunk waits)."""
    if self.ready:
      raise RuntimeError("the planner's complete chunks must run before its state is taken")
    return {"cutter": self.cutter.state_dict(), "piece": self.piece, "routes": self.routes,
            "rounds": self.rounds, "jobs": self.jobs, "totals": self.totals}

  def load_state_dict(self, state: dict) -> None:
    """Resumes from :meth:`state_dict`, also one taken with another number of pieces per chunk
    (``levels_per_call`` may change on resume): the same pieces, in chunks of this size."""
    self.cutter.load_state_dict(state["cutter"])
    self.totals = dict(state["totals"])
    self.piece, self.routes = state["piece"], [np.asarray(r) for r in state["routes"]]
    self._route_key = self.routes[-1].tobytes()
    self._route_seen = None
    self.rounds = [_with_ids(tuple(r)) for r in state["rounds"]]
    self.jobs = [tuple(j) for j in state["jobs"]]
    while self.piece >= self.shape.pieces:   # fewer pieces per chunk than when saved
      self._emit(self.shape.pieces)


def _padded(pieces: int, slots: int, width: int, num: int) -> np.ndarray:
  """``[pieces, slots, width]`` ids all padding: ``num, num + 1, ...`` along the last axis."""
  return np.broadcast_to(chunk_lib.padded_ids(width, num), (pieces, slots, width)).copy()


def _spans(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """``[starts[0], .., starts[0] + lengths[0] - 1, starts[1], ...]``."""
  offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
  return np.repeat(starts, lengths) + offsets


def _listed_ranks(ids: list[list[int]]):
  """:func:`_ranks` of the masks whose True columns are ``ids`` (one ascending list per row)."""
  counts = np.fromiter(map(len, ids), np.int64, len(ids))
  k = np.repeat(np.arange(len(ids)), counts)
  w = np.fromiter(itertools.chain.from_iterable(ids), np.int64, k.size)
  return k, w, np.arange(k.size) - np.repeat(np.cumsum(counts) - counts, counts)


def _with_ids(noted: tuple) -> tuple:
  """A noted round with its arrived and pulled ids (a checkpoint from before they were noted
  holds the round alone)."""
  if len(noted) == 6:
    rnd = noted[3]
    noted += (rnd.arrived.nonzero()[0].tolist(), rnd.pulls.nonzero()[0].tolist())
  return noted


def _ranks(masks: np.ndarray):
  """``(row, column, rank within its row)`` of every True of a ``[n, W]`` mask, row-major."""
  k, w = np.nonzero(masks)
  counts = masks.sum(1)
  return k, w, np.arange(k.size) - np.repeat(np.cumsum(counts) - counts, counts)
