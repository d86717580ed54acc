"""GSSP: SSP(s) inside each group at its group server; asynchronous exchange between groups."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import all_of
from gssp_jax.sync.protocol import any_of
from gssp_jax.sync.protocol import least
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction
from gssp_jax.sync.protocol import release_ids
from gssp_jax.sync.protocol import release_where


# Groups of at most this many workers are released in plain Python (``_free_of_few``).
_FEW = 8
_NONE = np.zeros([0], np.int64)


class GSSPProtocol(Protocol):
  """Grouped SSP with asynchronous inter-group exchange.

  * A worker's push is applied at once by its group server. The worker may go
    on while it is at most ``s`` clocks ahead of the slowest worker **of its
    own group**; nothing outside the group ever blocks it. A clock counts the
    pushes its group server has processed since the last regrouping.
  * Every ``forward_every`` pushes (default: the group's size) the group
    server forwards the sum of those pushes: a ``forward`` round, then a
    ``Message("deliver", g)`` the caller delivers after the link's delay.
    * ``peer``: delivery applies the sum at every other group server; the
      group server does not wait for it.
    * ``global``: delivery applies it at the global server (replica ``G``),
      whose weights right after that update are kept in group ``g``'s reply
      slot (replica ``G + 1 + g``, never applied to, never pulled from) and
      sent back: a ``Message("adopt", g)``; on arrival the group server copies
      the slot. The group server waits for that round trip, as the authors'
      does: pushes that reach it meanwhile are held, unapplied (their workers
      stay blocked), and so are pulls; after the adopt, the held pushes are
      processed in arrival order like new ones. At each delivery the global
      server's BatchNorm statistics become the mean of the group servers'
      (``Round.stats_mean``), so evaluation and the adopted statistics follow
      training (the authors' code does not synchronise them at all).
    A group has at most one forward in flight; pushes that complete another
    ``forward_every`` meanwhile are forwarded as soon as the previous one
    lands, so no gradient is lost or sent twice.
  * Membership: the in-group bound uses the slowest *alive* member, so a
    dropped worker holds back nobody; the regrouping barrier waits for the
    alive workers only. Forwards count the pushes the group server processed,
    so they go on with the live members; a group whose members are all dead
    stops pushing (its partial sum stays at its server). Forwards in flight,
    the global round trip and the held pushes (a dropped worker's own
    included: it reached the server) are unaffected by a drop. A rejoining
    worker takes its group's slowest alive clock and pulls its group server's
    weights at once, also while that server waits for the global reply; its
    own push still held from before its absence is discarded (it computes
    the gradient again from the new weights).

  Args:
    num_workers: W.
    groups: ``[W]`` group id of each worker (``grouping.py`` builds it, e.g.
      by speed), ids ``0..G-1`` each used.
    staleness: s >= 0, the in-group bound.
    inter_group: ``"peer"`` or ``"global"``.
    forward_every: K >= 1, or None for each group's size.
  """

  name = "gssp"
  # Every round is one push, one message or a regrouping, each about one group (or none).
  one_exchange_per_round = True
  supports_membership = True

  def __init__(self, num_workers: int, groups, staleness: int = 3, *,
               inter_group: str = "peer", forward_every: int | None = None):
    num_workers = arguments.check_int("gssp", "num_workers", num_workers, 1)
    ids = np.asarray(groups)
    num_groups = int(ids.max()) + 1 if ids.size else 0
    route = arguments.check_assignment("gssp", "groups", groups, num_workers, max(num_groups, 1))
    if sorted(set(route.tolist())) != list(range(num_groups)):
      raise ValueError(f"gssp groups={route.tolist()!r} is invalid; allowed: every id in "
                       f"0..{num_groups - 1} used by at least one worker")
    if inter_group not in arguments.INTER_GROUP:
      raise ValueError(f"gssp inter_group={inter_group!r} is invalid; allowed: "
                       f"{', '.join(arguments.INTER_GROUP)}")
    is_global = inter_group == "global"
    # global: the group servers, the global server, one reply slot per group.
    super().__init__(num_workers, num_groups + is_global * (num_groups + 1), num_groups, route)
    self.staleness = arguments.check_int("gssp", "staleness", staleness, 0)
    self.inter_group = inter_group
    sizes = np.bincount(route, minlength=num_groups)
    self.forward_every = (sizes.astype(np.int64) if forward_every is None else np.full(
        [num_groups], arguments.check_int("gssp", "forward_every", forward_every, 1), np.int64))
    self.since_forward = np.zeros([num_groups], np.int64)
    self.in_flight = np.zeros([num_groups], bool)
    self.held: list[list[int]] = [[] for _ in range(num_groups)]   # global: pushes in arrival order
    self.baseline = np.zeros([num_workers], np.int64)   # clocks at the last regrouping
    self.next_route = None   # a regrouping waiting for its barrier
    self.regroups: list[tuple[float, list]] = []

  @property
  def round_fields(self) -> tuple:
    """``peer`` rounds forward and deliver; ``global`` ones also adopt and average statistics."""
    peer = ("forward", "deliver")
    return peer if self.inter_group == "peer" else peer + ("adopt", "stats_mean")

  @property
  def global_replica(self) -> int | None:
    """The global server's replica index (``G``), or None for ``peer``."""
    return self.num_groups if self.inter_group == "global" else None

  def reply_slot(self, group: int) -> int:
    """Replica holding the global weights sent back to ``group`` (global only)."""
    return self.num_groups + 1 + int(group)

  def request_regroup(self, groups) -> None:
    """Moves workers to new groups at the next barrier (e.g. by speed measured over an epoch).

    Every worker finishes its current iteration and waits; when all wait (and
    no held push is left), the new groups take effect and everyone pulls from
    its new group server. Group ids stay the servers' ids, so pending sums and
    forwards in flight are unaffected. SSP clocks restart: a worker is bounded
    by the pushes its new mates make from then on, not by those made elsewhere.
    """
    route = arguments.check_assignment("gssp", "groups", groups, self.num_workers,
                                        self.num_groups)
    if sorted(set(route.tolist())) != list(range(self.num_groups)):
      raise ValueError(f"gssp groups={route.tolist()!r} is invalid; allowed: every id in "
                       f"0..{self.num_groups - 1} used by at least one worker")
    self.next_route = route

  def round_bounds(self):
    """One push per round; a peer delivery applies at the other group servers, a global one at
    the global server and its reply slot."""
    return 1, (max(1, self.num_groups - 1) if self.inter_group == "peer" else 2)

  def server_payloads_of(self, deliver, adopt) -> int:
    """Server-to-server payloads sent in rounds (``deliver`` ``[n, G]``, ``adopt`` ``[n, R]``).

    peer: each delivery goes to the G - 1 other group servers; global: one sum
    to the global server per delivery and one reply (weights) per adopt.
    Copies into the reply slots stay inside the global server.
    """
    if self.inter_group == "peer":
      return int(deliver.sum()) * (self.num_groups - 1)
    return int(deliver.sum() + (adopt[:, :self.num_groups] >= 0).sum())

  def _busy(self, group: int) -> bool:
    """The group server waits for the global server's reply (global only)."""
    return self.inter_group == "global" and bool(self.in_flight[group])

  def _held_mask(self) -> np.ndarray:
    mask = np.zeros([self.num_workers], bool)
    for queue in self.held:
      mask[queue] = True
    return mask

  def _due(self, group: int) -> bool:
    """``group``'s server has processed enough pushes to forward (one in flight or not)."""
    return bool(self.since_forward[group] >= self.forward_every[group])

  def _maybe_forward(self, group: int, rnd, reaction) -> None:
    """Forwards ``group``'s pending sum if due and none is in flight (``rnd`` must have
    ``forward`` writable then: its maker asks :meth:`_due` first)."""
    if self._due(group) and not self.in_flight[group]:
      self._forward(group, rnd, reaction)

  def _forward(self, group: int, rnd, reaction) -> None:
    """Forwards ``group``'s pending sum (due, none in flight; ``rnd``'s ``forward`` writable)."""
    rnd.forward[group] = True
    self.since_forward[group] = 0
    self.in_flight[group] = True
    reaction.messages.append(Message("deliver", group))

  def _members(self, group: int) -> tuple[np.ndarray, list]:
    """The workers of ``group`` (ascending; as an array and a list), kept per route."""
    return self.per_route("members", lambda: [
        (m, m.tolist()) for m in (np.flatnonzero(self.route == g)
                                  for g in range(self.num_groups))])[group]

  def _release_group(self, group: int, rnd, reaction) -> None:
    """SSP inside ``group``: release its blocked workers within ``s`` of its slowest."""
    members, listed = self._members(group)
    if len(listed) <= _FEW:
      free = self._free_of_few(listed)
    else:
      free = self._free_of_many(members)
    if len(free) and any(self.held):   # a held push's worker waits for its group server's reply
      free = free[~self._held_mask()[free]]
    release_ids(self, rnd, free, reaction)

  def _free_of_many(self, members: np.ndarray) -> np.ndarray:
    """The blocked ``members`` within ``s`` clocks of their slowest alive one (vectorised)."""
    waiting = self.blocked[members]
    if not any_of(waiting):
      return members[:0]
    clock = self.clock[members] - self.baseline[members]   # since the last regrouping
    alive = self.alive[members]
    if all_of(alive):
      slowest = least(clock)
    else:
      slowest = least(clock[alive]) if any_of(alive) else 0
    return members[waiting & (clock - slowest <= self.staleness)]

  def _free_of_few(self, members: list) -> np.ndarray:
    """:meth:`_free_of_many` in plain Python: for a few members, 2x faster than NumPy's calls."""
    blocked = self.blocked
    waiting = [w for w in members if blocked.item(w)]
    if not waiting:
      return _NONE
    clock, baseline, alive = self.clock, self.baseline, self.alive
    alive_clocks = [clock.item(w) - baseline.item(w) for w in members if alive.item(w)]
    slowest = min(alive_clocks) if alive_clocks else 0
    limit = slowest + self.staleness
    return np.array([w for w in waiting if clock.item(w) - baseline.item(w) <= limit], np.int64)

  def _maybe_regroup(self, time, reaction) -> None:
    """The regrouping barrier: every alive worker blocked, nothing held."""
    if self.next_route is None or not all_of(self.blocked[self.alive]) or any(self.held):
      return
    self.route = self.next_route
    self.next_route = None
    self.baseline = self.clock.copy()
    self.regroups.append((float(time), self.route.tolist()))
    regroup = self.new_round(time, ())   # no arrivals; pulls routed by the new groups
    reaction.rounds.append(regroup)
    # A group server waiting for its reply serves its new members after the adopt.
    busy = np.array([self._busy(g) for g in range(self.num_groups)], bool)
    release_where(self, regroup, ~busy[self.route], reaction)

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    g = int(self.route[worker])
    self.blocked[worker] = True
    if self._busy(g):
      self.held[g].append(worker)
      return Reaction()
    return self._process(worker, time, g)

  def _process(self, worker: int, time, g: int | None = None) -> Reaction:
    """Applies ``worker``'s push at its group server ``g`` (its route's; blocked until
    released)."""
    g = int(self.route[worker]) if g is None else g
    self.clock[worker] += 1
    self.since_forward[g] += 1
    # Most pushes neither forward nor deliver: their rounds' exchange fields stay shared.
    forward = self._due(g) and not self.in_flight[g]
    rnd = self.new_round(time, ("forward",) if forward else ())
    rnd.arrived[worker] = True
    rnd.applies[g] = True
    reaction = Reaction(rounds=[rnd])
    if forward:
      self._forward(g, rnd, reaction)
    if self.next_route is not None:
      self._maybe_regroup(time, reaction)
      return reaction
    if not self._busy(g):
      self._release_group(g, rnd, reaction)
    return reaction

  def on_message(self, message, time):
    g = int(message.group)
    peer = self.inter_group == "peer"
    if message.kind == "deliver":   # the optional fields its round sets (forward: after landing)
      writable = ("deliver", "forward") if peer and self._due(g) else (
          ("deliver",) if peer else ("deliver", "stats_mean", "adopt"))
    elif message.kind == "adopt" and not peer:
      writable = ("adopt", "forward") if self._due(g) else ("adopt",)
    else:
      return super().on_message(message, time)
    rnd = self.new_round(time, writable)
    reaction = Reaction(rounds=[rnd])
    if message.kind == "deliver" and peer:
      rnd.deliver[g] = True
      rnd.applies[:self.num_groups] = True
      rnd.applies[g] = False
      self.in_flight[g] = False
      self._maybe_forward(g, rnd, reaction)
    elif message.kind == "deliver":
      rnd.deliver[g] = True
      rnd.applies[self.num_groups] = True
      rnd.stats_mean[self.num_groups] = self.num_groups
      # Adoption runs after the update: the slot keeps the weights as they leave.
      rnd.adopt[self.reply_slot(g)] = self.num_groups
      reaction.messages.append(Message("adopt", g))
    else:   # adopt (global)
      rnd.adopt[g] = self.reply_slot(g)
      self.in_flight[g] = False
      self._maybe_forward(g, rnd, reaction)
      if self.next_route is None and not self._busy(g):
        self._release_group(g, rnd, reaction)
      # The held pushes, in arrival order, after the new weights; one may
      # forward again, and the rest then wait for that reply.
      while self.held[g] and not self._busy(g):
        more = self._process(self.held[g].pop(0), time)
        reaction.rounds.extend(more.rounds)
        reaction.release.extend(more.release)
        reaction.messages.extend(more.messages)
      self._maybe_regroup(time, reaction)
    return reaction

  def _after_drop(self, worker, time, was_blocked):
    g = int(self.route[worker])
    rnd = self.new_round(time, ())
    reaction = Reaction()
    if self.next_route is not None:     # the barrier may now be complete
      self._maybe_regroup(time, reaction)
    elif not self._busy(g):             # a busy group server releases at the adopt
      self._release_group(g, rnd, reaction)
    if any_of(rnd.pulls):
      reaction.rounds.insert(0, rnd)
    return reaction

  def _rejoin_peers(self, worker):
    return super()._rejoin_peers(worker) & (self.route == self.route[worker])

  def _rejoin_clock(self, worker, peers):
    clock = self.clock - self.baseline   # clocks count since the last regrouping
    return int(self.baseline[worker] + clock[peers].min())

  def _after_rejoin(self, worker, time):
    for queue in self.held:
      while worker in queue:
        queue.remove(worker)
