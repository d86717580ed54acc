"""GSSP: SSP(s) inside each group at its group server; asynchronous exchange between groups."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import transforms
from gssp_jax.sync.protocols.base import Message
from gssp_jax.sync.protocols.base import Protocol
from gssp_jax.sync.protocols.base import Reaction
from gssp_jax.sync.protocols.base import release_where


class GSSPProtocol(Protocol):
  """Grouped SSP with asynchronous inter-group exchange.

  * A worker's push is applied at once by its group server. The worker may go
    on while it is at most ``s`` clocks ahead of the slowest worker **of its
    own group**; nothing outside the group ever blocks it.
  * Every ``forward_every`` pushes (default: the group's size) the group
    server forwards the sum of those pushes: a ``forward`` round, then a
    ``Message("deliver", g)`` the caller delivers after the link's delay.
    * ``peer``: delivery applies the sum at every other group server.
    * ``global``: delivery applies it at the global server (replica ``G``),
      which returns its weights: a ``Message("adopt", g)``; on arrival the
      group server copies them.
    A group has at most one forward in flight; pushes that complete another
    ``forward_every`` meanwhile are forwarded as soon as the previous one
    lands, so no gradient is lost or sent twice.

  Args:
    num_workers: W.
    groups: ``[W]`` group id of each worker (``grouping.py`` builds it, e.g.
      by speed), ids ``0..G-1`` each used.
    staleness: s >= 0, the in-group bound.
    inter_group: ``"peer"`` or ``"global"``.
    forward_every: K >= 1, or None for each group's size.
  """

  name = "gssp"

  def __init__(self, num_workers: int, groups, staleness: int = 3, *,
               inter_group: str = "peer", forward_every: int | None = None):
    num_workers = transforms.check_int("gssp", "num_workers", num_workers, 1)
    ids = np.asarray(groups)
    num_groups = int(ids.max()) + 1 if ids.size else 0
    route = transforms.check_assignment("gssp", "groups", groups, num_workers, max(num_groups, 1))
    if sorted(set(route.tolist())) != list(range(num_groups)):
      raise ValueError(f"gssp groups={route.tolist()!r} is invalid; allowed: every id in "
                       f"0..{num_groups - 1} used by at least one worker")
    if inter_group not in transforms.INTER_GROUP:
      raise ValueError(f"gssp inter_group={inter_group!r} is invalid; allowed: "
                       f"{', '.join(transforms.INTER_GROUP)}")
    super().__init__(num_workers, num_groups + (inter_group == "global"), num_groups, route)
    self.staleness = transforms.check_int("gssp", "staleness", staleness, 0)
    self.inter_group = inter_group
    sizes = np.bincount(route, minlength=num_groups)
    self.forward_every = (sizes.astype(np.int64) if forward_every is None else np.full(
        [num_groups], transforms.check_int("gssp", "forward_every", forward_every, 1), np.int64))
    self.since_forward = np.zeros([num_groups], np.int64)
    self.in_flight = np.zeros([num_groups], bool)
    self.next_route = None   # a regrouping waiting for its barrier
    self.regroups: list[tuple[float, list]] = []

  def request_regroup(self, groups) -> None:
    """Moves workers to new groups at the next barrier (e.g. by speed measured over an epoch).

    Every worker finishes its current iteration and waits; when all wait, the new
    groups take effect and everyone pulls from its new group server. Group ids
    stay the servers' ids, so pending sums and forwards in flight are unaffected.
    """
    route = transforms.check_assignment("gssp", "groups", groups, self.num_workers,
                                        self.num_groups)
    if sorted(set(route.tolist())) != list(range(self.num_groups)):
      raise ValueError(f"gssp groups={route.tolist()!r} is invalid; allowed: every id in "
                       f"0..{self.num_groups - 1} used by at least one worker")
    self.next_route = route

  def _maybe_forward(self, group: int, rnd, reaction) -> None:
    if self.since_forward[group] >= self.forward_every[group] and not self.in_flight[group]:
      rnd.forward[group] = True
      self.since_forward[group] = 0
      self.in_flight[group] = True
      reaction.messages.append(Message("deliver", group))

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    g = int(self.route[worker])
    self.clock[worker] += 1
    self.since_forward[g] += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    rnd.applies[g] = True
    reaction = Reaction(rounds=[rnd])
    self._maybe_forward(g, rnd, reaction)
    self.blocked[worker] = True
    if self.next_route is not None:
      if self.blocked.all():   # the barrier: regroup, everyone pulls from its new server
        self.route = self.next_route
        self.next_route = None
        self.regroups.append((float(time), self.route.tolist()))
        regroup = self.new_round(time)   # no arrivals; pulls routed by the new groups
        reaction.rounds.append(regroup)
        release_where(self, regroup, np.ones([self.num_workers], bool), reaction)
      return reaction
    mine = self.route == g
    ahead = self.clock - self.clock[mine].min()
    release_where(self, rnd, mine & (ahead <= self.staleness), reaction)
    return reaction

  def on_message(self, message, time):
    g = int(message.group)
    rnd = self.new_round(time)
    reaction = Reaction(rounds=[rnd])
    if message.kind == "deliver" and self.inter_group == "peer":
      rnd.deliver[g] = True
      rnd.applies[:self.num_groups] = np.arange(self.num_groups) != g
      self.in_flight[g] = False
      self._maybe_forward(g, rnd, reaction)
    elif message.kind == "deliver":
      rnd.deliver[g] = True
      rnd.applies[self.num_groups] = True
      reaction.messages.append(Message("adopt", g))
    elif message.kind == "adopt" and self.inter_group == "global":
      rnd.adopt[g] = self.num_groups
      self.in_flight[g] = False
      self._maybe_forward(g, rnd, reaction)
    else:
      return super().on_message(message, time)
    return reaction
