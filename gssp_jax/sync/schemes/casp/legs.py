"""CASP's legs: a community of one pushes and pulls over its own link. In a larger one each
member's gradient goes to the leader over the member's link (the leader's own costs nothing), the
leader sends one payload to the server (``Message("community")``, over the server's interface)
and gets one reply over its link (a fixed delay), then forwards it to every member over the
member's link; the members' legs are ``member_leader`` traffic. With
``cluster.shared_server_links`` a member's push crosses the leader's link in, the reply's
forward the leader's link out."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import legs


class CommunityLegs(legs.ServerLegs):
  """CASP: a community's members talk to its leader, the leader to the server (module doc)."""

  counts_per_round = True
  supports_topology = False
  counts_device_pushes = False
  local_class = "member_leader"

  def push_delay(self, protocol, worker, iteration):
    if protocol.members(worker).size > 1 and protocol.leader(worker) == worker:
      return 0.0   # the leader's own gradient is already there
    return super().push_delay(protocol, worker, iteration)

  def pull_delay(self, protocol, worker):
    if protocol.members(worker).size == 1:
      return super().pull_delay(protocol, worker)
    c, leader = self.cluster, protocol.leader(worker)
    local = 0.0 if leader == worker else c.link_time(worker, self.pull_bytes)
    return c.link_time(leader, self.pull_bytes) + local

  def message_delay(self, protocol, message, iteration):
    if message.kind != "community":
      return super().message_delay(protocol, message, iteration)
    members = np.flatnonzero(protocol.communities == message.group)
    return self.cluster.link_time(int(members[0]), self.community_bytes(members, iteration))

  def route(self, protocol, kind, worker, iteration):
    """A community of one: the server's interface. In a larger one a member's push crosses its
    leader's incoming link (``("leader", l, "push")``, the leader's bandwidth) and its pull the
    leader's outgoing one (``("leader", l, "pull")``), after the reply's fixed trip from the
    server to the leader (added to its latency: every member of a community is released at
    the same instant, so the forwards' shares are the same either way). The leader's own push
    and pull are not routed (:meth:`push_delay`, :meth:`pull_delay`)."""
    if protocol.members(worker).size == 1:
      return super().route(protocol, kind, worker, iteration)
    leader = protocol.leader(worker)
    if leader == worker:
      return None
    latency = self._latencies[worker]
    if kind == "push":
      num_bytes = self.push_payload(worker, iteration)
    else:
      num_bytes, latency = self.pull_bytes, latency + self.cluster.link_time(leader,
                                                                            self.pull_bytes)
    return (("leader", leader, kind), num_bytes, self._caps[worker], latency,
            self._caps[leader])

  def message_route(self, protocol, message, iteration):
    """A community's upload crosses the server's interface, ``(0, "push")``, as a community of
    one's push does: at most the leader's bandwidth, then its latency."""
    if message.kind != "community":
      return super().message_route(protocol, message, iteration)
    members = np.flatnonzero(protocol.communities == message.group)
    leader = int(members[0])
    return ((0, "push"), self.community_bytes(members, iteration), self._caps[leader],
            self._latencies[leader])

  def community_bytes(self, members: np.ndarray, iteration: np.ndarray) -> int:
    """One community push: the sum of its members' last pushes, at most dense."""
    return int(min(self.dense_payload,
                   sum(self.push_payload(int(w), int(iteration[w]) - 1) for w in members)))

  def count_round(self, protocol, rnd, iteration, host):
    arrived = rnd.arrived.nonzero()[0]
    if arrived.size == 1:
      w = int(arrived[0])
      host["pushed_per_worker"][w] += self.push_payload(w, int(iteration[w]) - 1)
    elif arrived.size:
      leader = int(arrived[0])
      host["pushed_per_worker"][leader] += self.community_bytes(arrived, iteration)
      legs.add(host, "member_leader", sum(self.push_payload(int(w), int(iteration[w]) - 1)
                                     for w in arrived[1:]))
    for w in rnd.pulls.nonzero()[0]:   # the server replies to leaders; they forward the reply
      if protocol.leader(int(w)) == w:
        host["pulls_per_worker"][w] += 1
      else:
        legs.add(host, "member_leader", self.pull_bytes)
