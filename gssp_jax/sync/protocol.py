"""What every protocol shares: reactions, messages and the blocking bookkeeping.

A protocol is the host half of a scheme: plain Python and NumPy, no JAX. It is
told about events (a worker's push reached its server, a message between
servers arrived) and answers with a :class:`Reaction`: the rounds the device
must apply now, the workers released to pull and start their next iteration,
and the messages to deliver later (their delay is the cluster's business, not
the protocol's). The same objects drive the simulator's timeline and the real
multi-process runtime.

Membership. In a real cluster a worker process can crash or hang; the runtime
notices and calls :meth:`Protocol.drop`, and a restarted worker comes back
through :meth:`Protocol.rejoin`. A dropped (dead) worker counts in no wait
condition; until it rejoins its pushes are refused. Nobody leaving changes
nothing: every rule reduces to the original one when all workers are alive.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from gssp_jax import host_state
from gssp_jax.sync import rounds as rounds_lib


class Message(NamedTuple):
  """A server-to-server message: ``kind`` (e.g. "deliver", "adopt") about ``group``.

  ``carries``: workers whose pushes the message takes to their server (CASP's
  community push through its leader). Its travel is their push time, as a
  worker's own upload is, not time blocked: the timeline stops their blocked
  clock when it is sent and restarts it when it arrives.
  """
  kind: str
  group: int
  carries: tuple = ()


@dataclasses.dataclass
class Reaction:
  """What follows from one event.

  Attributes:
    rounds: rounds to apply now, in order.
    release: workers that pull now (their ``pulls`` is set in the last round)
      and start their next iteration.
    messages: messages to deliver after a delay chosen by the caller.
  """
  rounds: list = dataclasses.field(default_factory=list)
  release: list = dataclasses.field(default_factory=list)
  messages: list = dataclasses.field(default_factory=list)


class Protocol:
  """Base class: W workers, R replicas, G exchange groups, a worker -> replica route.

  Subclasses implement :meth:`on_push` and may implement :meth:`on_message`.
  Every worker starts its first iteration at time 0 with the initial weights.
  Schemes with ``supports_membership`` implement :meth:`_after_drop` (and may
  extend :meth:`_rejoin_peers`, :meth:`_after_rejoin`).

  Attributes:
    alive: ``[W]`` bool, workers not dropped (all True at start).
  """

  name = "protocol"
  # The optional round fields (rounds.OPTIONAL_FIELDS) this protocol's rounds set; the others
  # stay read-only (writing one raises) and the simulator never copies or stacks them.
  round_fields: tuple = rounds_lib.OPTIONAL_FIELDS
  # At most one group forwards or delivers in a round, and it is the same group when both do:
  # GSSP's level-executor rounds update that group's exchange rows only (GSSP's transform's
  # no_branches path); the level planner checks it on every round.
  one_exchange_per_round = False
  # Every round waits for every alive worker (a barrier: BSP, Local SGD, DiLoCo): a round is
  # then already a dependency level, and on a CPU `executors.executor_name`'s `auto` runs such a
  # scheme with `rounds` (one call a round), which the level executor's pieces only slow there.
  barrier = False
  supports_membership = False
  # Its gradients wait in aggregates, applied when a round's ``aggregate`` is set (InHAD): the
  # staleness accounting follows them (``accounting.Accounting``'s ``aggregating``).
  aggregating = False
  # Why a scheme cannot drop workers (its ValueError says it).
  membership_unsupported = "it has no rule for workers that leave"

  def __init__(self, num_workers: int, num_replicas: int = 1, num_groups: int = 1,
               route=None):
    self.num_workers = int(num_workers)
    self.num_replicas = int(num_replicas)
    self.num_groups = int(num_groups)
    self.route = (np.zeros([self.num_workers], np.int32) if route is None
                  else np.asarray(route, np.int32).copy())
    self.clock = np.zeros([self.num_workers], np.int64)   # pushes per worker
    self.blocked = np.zeros([self.num_workers], bool)     # pushed, waiting to be released
    self.__dict__.update(self._membership_defaults())

  def _membership_defaults(self) -> dict:
    """Attributes added for membership, as they are when nobody has ever left.

    Pickles from before membership existed lack them; ``__setstate__`` fills
    them in, so old checkpoints load and behave as before.
    """
    return {"alive": np.ones([self.num_workers], bool)}

  def __getstate__(self) -> dict:
    state = dict(self.__dict__)
    state.pop("_per_route_cache", None)   # derived from route (and holds closures)
    state.pop("_round_makers", None)      # closures, made again on first use
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    for key, value in self._membership_defaults().items():
      self.__dict__.setdefault(key, value)

  def per_route(self, name: str, build):
    """``build()``'s value, kept while ``route`` keeps its value (rebuilt after a regrouping):
    what a protocol derives from its route at every event (its rounds' ``groups``, a group's
    members). Not saved with the protocol."""
    key = self.route.tobytes()
    cache = self.__dict__.get("_per_route_cache")
    if cache is None or cache[0] != key:
      cache = self.__dict__["_per_route_cache"] = (key, {})
    values = cache[1]
    if name not in values:
      values[name] = build()
    return values[name]

  def new_round(self, time: float, writable: tuple | None = None) -> rounds_lib.Round:
    """An empty round (``rounds.empty_round``) routed by ``route`` as it is now.

    ``writable``: the optional fields this round may set, a subset of
    ``round_fields`` (default: all of them); the others are the shared
    read-only empty values, which cost nothing to make or to stack (GSSP's
    rounds are mostly plain pushes: they set none). Its ``groups`` is a
    read-only copy of ``route``, shared by the rounds made while ``route``
    keeps its value (one copy per regrouping, not per round).
    """
    groups = self.per_route("groups", self._read_only_route)
    writable = tuple(self.round_fields) if writable is None else tuple(writable)
    makers = self.__dict__.setdefault("_round_makers", {})   # per writable: checked once
    make = makers.get(writable)
    if make is None:
      if not set(writable) <= set(self.round_fields):
        raise ValueError(f"{self.name} round fields {writable!r} are invalid; allowed: a subset "
                         f"of its round_fields {self.round_fields!r}")
      make = makers[writable] = rounds_lib.round_maker(self.num_workers, self.num_replicas,
                                                       self.num_groups, writable)
    return make(time, groups)

  def _read_only_route(self) -> np.ndarray:
    groups = np.array(self.route, np.int32)
    groups.flags.writeable = False
    return groups

  def on_push(self, worker: int, time: float) -> Reaction:
    raise NotImplementedError

  def on_message(self, message: Message, time: float) -> Reaction:
    raise ValueError(f"{self.name} protocol got unexpected message {message!r}")

  def round_bounds(self) -> tuple[int, int]:
    """``(arrivals, replicas)``: the most workers arriving in, and replicas touched by, a round.

    A replica is touched when it applies, is averaged or adopts. The
    level-batched executor gives every round that many slots (``sim/chunk.py``)
    and refuses a round over them, so a protocol that knows tighter bounds
    declares them: its rounds then read ``arrivals`` gradients, not ``W``. The
    default, ``(W, R)``, is always right.
    """
    return self.num_workers, self.num_replicas

  def server_payloads(self, rnd: rounds_lib.Round) -> int:
    """Payloads sent between servers in ``rnd`` (the simulator counts their bytes)."""
    return self.server_payloads_of(rnd.deliver[None], rnd.adopt[None])

  def server_payloads_of(self, deliver: np.ndarray, adopt: np.ndarray) -> int:
    """:meth:`server_payloads` of many rounds at once: their ``deliver`` ``[n, G]`` and
    ``adopt`` ``[n, R]`` stacked. A protocol whose count depends on more than these
    overrides :meth:`server_payloads` instead (then it is called round by round)."""
    return int(deliver.sum() + (adopt >= 0).sum())

  def check_worker(self, worker: int) -> int:
    if not 0 <= int(worker) < self.num_workers:
      raise ValueError(f"{self.name} worker={worker!r} is invalid; allowed: "
                       f"0..{self.num_workers - 1}")
    if not self.alive[worker]:
      raise ValueError(f"{self.name} worker {worker} pushed while dropped: it must rejoin "
                       "before its next iteration")
    if self.blocked[worker]:
      raise ValueError(f"{self.name} worker {worker} pushed while blocked: it must be "
                       "released before its next iteration")
    return int(worker)

  def _check_member(self, worker, action: str, alive: bool) -> int:
    if not self.supports_membership:
      raise ValueError(f"{self.name} cannot {action} worker {worker!r}: "
                       f"{self.membership_unsupported}")
    if isinstance(worker, (bool, np.bool_)) or not isinstance(worker, (int, np.integer)) or not (
        0 <= int(worker) < self.num_workers):
      raise ValueError(f"{self.name} worker={worker!r} is invalid; allowed: "
                       f"0..{self.num_workers - 1}")
    if bool(self.alive[worker]) != alive:
      state = "was dropped" if alive else "is alive"
      raise ValueError(f"{self.name} cannot {action} worker {worker}: it {state}")
    return int(worker)

  def drop(self, worker: int, time: float) -> Reaction:
    """Drops a crashed or hung ``worker``: from now on it counts in no wait condition.

    If it was blocked it is no longer (it does not pull). Workers that its
    absence frees are released as an ordinary push would release them: one
    round (nothing applied, their ``pulls`` set) and their ids in ``release``;
    a drop that frees nobody returns no round. A push of the worker that
    reached its server but is not applied yet (BSP's barrier, GSSP-global's
    held pushes) is kept: the server does not lose what it received.

    Raises:
      ValueError: the scheme does not support membership, ``worker`` is not
        a worker id, or it is already dropped.
    """
    worker = self._check_member(worker, "drop", alive=True)
    was_blocked = bool(self.blocked[worker])
    self.alive[worker] = False
    self.blocked[worker] = False
    return self._after_drop(worker, float(time), was_blocked)

  def _after_drop(self, worker: int, time: float, was_blocked: bool) -> Reaction:
    """Releases whom ``worker``'s drop frees (it is already marked dead, not blocked)."""
    raise NotImplementedError

  def _rejoin_peers(self, worker: int) -> np.ndarray:
    """``[W]`` bool: the alive workers whose wait conditions ``worker`` takes part in."""
    peers = self.alive.copy()
    peers[worker] = False
    return peers

  def rejoin(self, worker: int, time: float) -> Reaction:
    """Brings back a dropped ``worker``: it pulls its replica's current weights and goes on.

    Returns one round in which only ``pulls[worker]`` is set, and
    ``release == [worker]``: it starts its next iteration from those weights.

    Clock rule: its clock becomes the smallest clock among the alive workers
    it is bounded with (:meth:`_rejoin_peers`: everyone for SSP and DSSP, its
    group for GSSP, counted since the last regrouping). It starts from the
    freshest weights, so it is not behind: it is not ahead of any of them
    (it may start at once, ``0 <= s``), and the slowest alive clock does not
    change, so nobody released is now over the bound and nobody waiting waits
    longer. Any lower clock would hold the others back by the difference; a
    higher one would let it run ahead of the slowest. With no such peer alive
    its clock is left as it was (nobody to be bounded with).

    Raises:
      ValueError: the scheme does not support membership, ``worker`` is not
        a worker id, or it is alive.
    """
    worker = self._check_member(worker, "rejoin", alive=False)
    peers = self._rejoin_peers(worker)
    if peers.any():
      self.clock[worker] = self._rejoin_clock(worker, peers)
    self.alive[worker] = True
    self._after_rejoin(worker, float(time))
    rnd = self.new_round(time)
    rnd.pulls[worker] = True
    return Reaction(rounds=[rnd], release=[worker])

  def _rejoin_clock(self, worker: int, peers: np.ndarray) -> int:
    return int(self.clock[peers].min())

  def _after_rejoin(self, worker: int, time: float) -> None:
    """Scheme-specific state of a rejoining worker (e.g. forget its stale push)."""


def alive_min(clock: np.ndarray, members: np.ndarray) -> int:
  """The smallest clock of ``members`` (``[W]`` bool); 0 when there is none."""
  if all_of(members):   # nobody dropped: no gather (called at every push)
    return int(least(clock))
  return int(least(clock[members])) if any_of(members) else 0


# The hot path's reductions of a few hundred values at most (the protocols' masks and clocks, at
# every push): the same results as ``.all()``, ``.any()``, ``.min()`` and ``.max()``, without
# NumPy's reduction machinery, which costs about 1.3 us a call there against 0.2-0.3 us.

def all_of(mask: np.ndarray) -> bool:
  """``mask.all()`` of a bool array."""
  return np.count_nonzero(mask) == mask.size


def any_of(mask: np.ndarray) -> bool:
  """``mask.any()`` of a bool array."""
  return np.count_nonzero(mask) > 0


def least(values: np.ndarray):
  """``values.min()`` (the first NaN where there is one, as ``min``; empty: ValueError)."""
  return values[values.argmin()]


def greatest(values: np.ndarray):
  """``values.max()`` (the first NaN where there is one, as ``max``; empty: ValueError)."""
  return values[values.argmax()]


def release_where(protocol: Protocol, rnd: rounds_lib.Round, ok: np.ndarray,
                  reaction: Reaction) -> None:
  """Releases every blocked worker with ``ok[w]``: it pulls in ``rnd``."""
  release_ids(protocol, rnd, (protocol.blocked & ok).nonzero()[0], reaction)


def release_ids(protocol: Protocol, rnd: rounds_lib.Round, free, reaction: Reaction) -> None:
  """Releases the blocked workers ``free`` (ascending ids): they pull in ``rnd``."""
  protocol.blocked[free] = False
  rnd.pulls[free] = True
  reaction.release.extend(np.asarray(free, np.int64).tolist())


# A protocol object (a user's subclass included) and its messages in flight are host state.
host_state.allow(Message)
host_state.allow_subclasses(Protocol)
# Where the protocols were before each scheme had a package of its own (2026-12-07): a
# checkpoint written then names them there.
host_state.moved("gssp_jax.sync.protocols.base", __name__)
for _scheme in ("ssp", "gssp", "inhad", "casp", "dssync", "halos"):
  host_state.moved(f"gssp_jax.sync.protocols.{_scheme}", f"gssp_jax.sync.schemes.{_scheme}.protocol")
del _scheme
