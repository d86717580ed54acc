"""Each scheme's legs: who sends what to whom, over which link, and in which class of traffic.

A scheme names its legs class (``Scheme.legs``, default :class:`ServerLegs`);
the simulator and the real runtime build one per run (``sim.traffic.Traffic``)
and ask it for the delay of every push, pull and server-to-server message and
for the bytes every round moves, counted per class (:data:`CLASSES`):

* ``worker_to_server``: pushes, worker -> its server (``pushed_per_worker``).
* ``server_to_worker``: pulls, server -> worker (``pulls_per_worker`` times
  the pull's bytes).
* ``server_to_server``: forwards, deliveries, adoptions between servers
  (``Protocol.server_payloads``; counted by ``sim.records``, not here).
* ``worker_to_node``: a worker's gradient to its node's aggregator (InHAD).
* ``node_to_server``: the node aggregates the server pulls (InHAD).
* ``member_leader``: inside a CASP community, each member's gradient to the
  leader and the leader's copy of the reply to each member.
* ``ring_allreduce``: the bytes every worker sends in a ring all-reduce.

The classes but the first three are counted in ``host["class_bytes"]``.

The built-in legs:

* :class:`ServerLegs` (every scheme but these): a push crosses the worker's
  link into its server, a pull comes back over it, a message between servers
  crosses the server link.
* :class:`PeerLegs` (DS-Sync): no server; each member's push and pull cross its own link
  alone (its replica is its own).
* :class:`GroupLegs` (GSSP, HALoS): the default's legs; the exchanges with a
  global server are routed (below).
* :class:`NodeLegs` (InHAD): a worker's gradient goes to its node's
  aggregator over the node's local link (``node_time``), then only its
  iteration number (:data:`IN_BYTES`) goes to the server over the worker's
  link. The server's pull of the N node aggregates (``Message("aggregate")``)
  is N dense payloads over the server link. Workers pull over their own link.
* :class:`CommunityLegs` (CASP): a community of one pushes and pulls over its
  own link. In a larger one each member's gradient goes to the leader over the
  member's link (the leader's own costs nothing), the leader sends one payload
  to the server (``Message("community")``) and gets one reply over its link,
  then forwards it to every member over the member's link.
* :class:`RingLegs` (``bsp_allreduce``): no server. At BSP's barrier the
  workers all-reduce their gradients over a bandwidth-optimal ring (a
  reduce-scatter, then an all-gather): ``2 (W - 1)`` steps, in each of which
  every worker sends one chunk of ``model / W`` bytes to its successor
  (``w -> w + 1 mod W``), so each sends and receives ``2 (W - 1) / W`` of the
  model. A step lasts as long as its slowest hop, ``latency[w] + chunk /
  min(bandwidth[w], bandwidth[w + 1])`` (the sender's latency, the slower of
  the two links): :func:`ring_time`. That time is the workers' "pull" (they
  start their next iteration when the ring ends, each with the same averaged
  gradient applied); their pushes cost nothing (the gradient stays on the
  worker until the barrier).

With ``cluster.shared_server_links`` a push or pull crosses the shared link
that :meth:`ServerLegs.route` names: the server's interface by default, the
node's local link for InHAD's pushes, the leader's link (in for pushes, out
for the reply's forward) for a CASP member; and a message the one that
:meth:`ServerLegs.message_route` names: a CASP community's upload, the
server's interface; a group server's exchange with a global server
(:class:`GroupLegs`: GSSP ``global``, HALoS), the global server's interface to
the other servers. GSSP ``peer`` deliveries, InHAD's pull of the aggregates and
the server's reply to a CASP leader keep their fixed delays
(:meth:`ServerLegs.message_delay`).

A scheme a researcher registers gets :class:`ServerLegs` unless its ``Scheme``
names another class; a subclass overrides the methods of the legs it changes.
Host-only (no JAX); ``cluster`` is a ``sim.cluster.Cluster`` (``link_time``,
``server_time``, ``node_time``, ``bandwidth``, ``latency``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

IN_BYTES = 8   # an iteration number (int64)

CLASSES = ("worker_to_server", "server_to_worker", "server_to_server", "worker_to_node",
           "node_to_server", "member_leader", "ring_allreduce")


def traffic_fields(by_class: dict[str, int]) -> dict:
  """The byte fields of a metrics line and of ``summary.json``'s totals, from bytes per class.

  ``bytes_pushed``: into the servers (workers' pushes, InHAD's node
  aggregates); ``bytes_pulled``: out of them to the workers;
  ``bytes_between_servers``; ``bytes_local``: inside a node or a community;
  ``bytes_total``: every class; ``bytes_by_class``: each class (every one of
  :data:`CLASSES`, 0 where the scheme has no such leg).
  """
  unknown = set(by_class) - set(CLASSES)
  if unknown:
    raise ValueError(f"traffic classes {sorted(unknown)!r} are invalid; allowed: "
                     f"{', '.join(CLASSES)}")
  full = {name: int(by_class.get(name, 0)) for name in CLASSES}
  return {"bytes_pushed": full["worker_to_server"] + full["node_to_server"],
          "bytes_pulled": full["server_to_worker"],
          "bytes_between_servers": full["server_to_server"],
          "bytes_local": full["worker_to_node"] + full["member_leader"],
          "bytes_total": sum(full.values()),
          "bytes_by_class": full}


def traffic_line(fields: dict) -> str:
  """One line of a run's traffic (``fields``: :func:`traffic_fields`' keys): the total, then
  each class that moved bytes."""
  parts = [f"{name} {_megabytes(n)}" for name, n in fields["bytes_by_class"].items() if n]
  return f"traffic {_megabytes(fields['bytes_total'])} in all" + (
      f": {', '.join(parts)}" if parts else "")


def _megabytes(num_bytes: int) -> str:
  return f"{num_bytes / 1e6:.6g} MB"


def ring_time(cluster, num_bytes: int) -> float:
  """Seconds of a ring all-reduce of ``num_bytes`` over every worker's link (:class:`RingLegs`):
  ``2 (W - 1)`` steps of one chunk of ``ceil(num_bytes / W)`` bytes per hop, each step as long
  as its slowest hop (its latency plus the chunk over the slower of its two links)."""
  W = cluster.bandwidth.size
  if W == 1:
    return 0.0
  chunk = -(-int(num_bytes) // W)
  hop_bandwidth = np.minimum(cluster.bandwidth, np.roll(cluster.bandwidth, -1))
  step = float(np.max(cluster.latency + chunk / hop_bandwidth))
  return 2 * (W - 1) * step


def add(host: dict, name: str, num_bytes: int) -> None:
  """Adds ``num_bytes`` of class ``name`` (one of :data:`CLASSES`) to ``host["class_bytes"]``."""
  if name not in CLASSES:
    raise ValueError(f"traffic class {name!r} is invalid; allowed: {', '.join(CLASSES)}")
  class_bytes = host["class_bytes"]
  class_bytes[name] = class_bytes.get(name, 0) + int(num_bytes)


class ServerLegs:
  """A push crosses the worker's link into its server; a pull comes back; servers talk directly.

  Args:
    cluster: the run's ``sim.cluster.Cluster``.
    push_payload: ``(worker, iteration) -> bytes`` of a worker's push.
    dense_payload: bytes of a dense gradient (what a sum of gradients costs: a
      sum of sparse gradients is not sparse).
    pull_bytes: bytes of the weights a worker pulls.

  Class attributes:
    counts_per_round: a round's bytes depend on the protocol's state then, so
      rounds are counted as they happen (:meth:`count_round`); else they may
      be counted later, many at once (:meth:`count_rounds`).
    counts_device_pushes: the device's per-worker push bytes reached a server
      (``worker_to_server``); else this class counts the pushes.
    has_server: pushes and pulls go through a parameter server (the real
      runtime runs only such schemes).
    supports_topology: its legs cross a network topology's regions (``cluster.topology``,
      ``sim/topology.py``): pushes, pulls and the messages between servers go from the
      sender's region to the receiver's. The legs whose transfers stay inside a node, a
      community or a ring (InHAD, CASP, DS-Sync, BSP over a ring) do not model regions.
    dense_only: the legs move dense gradients only (a compressor cannot apply).
    local_class: the class that a checkpoint's ``local_bytes`` counter (before
      the classes existed) held, or None.
  """

  counts_per_round = False
  counts_device_pushes = True
  has_server = True
  dense_only = False
  supports_topology = True
  local_class: str | None = None

  def __init__(self, cluster, push_payload: Callable[[int, int], int], dense_payload: int,
               pull_bytes: int):
    self.cluster = cluster
    self.push_payload, self.dense_payload, self.pull_bytes = push_payload, dense_payload, pull_bytes
    # Per worker, as Python floats: a routed transfer reads them at every push and pull.
    self._caps, self._latencies = cluster.bandwidth.tolist(), cluster.latency.tolist()
    self.topology = getattr(cluster, "topology", None)
    self.server_region: list[int] | None = None   # with a topology: place_servers

  def place_servers(self, regions) -> None:
    """With a topology: each server's (replica's) region, fixed for the run (``Traffic``)."""
    self.server_region = [int(r) for r in regions]

  def _regions(self, worker: int, server: int, kind: str) -> tuple[int, int]:
    """``(from, to)`` regions of a worker's push (to its server) or pull (from it)."""
    if self.server_region is None:
      raise RuntimeError("a topology's legs need their servers placed first (place_servers)")
    w, s = int(self.topology.regions[worker]), self.server_region[server]
    return (w, s) if kind == "push" else (s, w)

  # -- time -------------------------------------------------------------------------------------

  def _worker_time(self, protocol, kind: str, worker: int, num_bytes: int) -> float:
    """A push's or pull's time alone: over the worker's link, and across regions if any."""
    if self.topology is None:
      return self.cluster.link_time(worker, num_bytes)
    a, b = self._regions(worker, protocol.route.item(worker), kind)
    return self.topology.transfer_time(num_bytes, self._caps[worker], self._latencies[worker],
                                       a, b)

  def push_delay(self, protocol, worker: int, iteration: int) -> float:
    """End of compute -> the push event (arrival at the server, or where the scheme says)."""
    return self._worker_time(protocol, "push", worker, self.push_payload(worker, iteration))

  def pull_delay(self, protocol, worker: int) -> float:
    """Release -> the start of the worker's next iteration."""
    return self._worker_time(protocol, "pull", worker, self.pull_bytes)

  def message_delay(self, protocol, message, iteration: np.ndarray) -> float:
    """A server-to-server message's delay (``iteration``: pushes per worker so far)."""
    del protocol, message, iteration
    return self.cluster.server_time(self.pull_bytes)

  def route(self, protocol, kind: str, worker: int, iteration: int):
    """The shared link a push (``kind`` "push") or pull ("pull") crosses, with
    ``cluster.shared_server_links``: ``(link, bytes, cap, latency[, capacity])`` (see
    ``sync.TimelineEngine``), or None: it takes :meth:`push_delay` / :meth:`pull_delay` alone.

    Here: the worker's server's interface, ``(server, kind)`` (the server's bandwidth),
    at most the worker's bandwidth, then its latency. With a topology the link is a path:
    the interface, then the links between the two regions (``topology.hops``), the cap at
    most the region's own bandwidth inside one, the latency plus the regions'.
    """
    num_bytes = self.push_payload(worker, iteration) if kind == "push" else self.pull_bytes
    server = protocol.route.item(worker)
    if self.topology is None:
      return ((server, kind), num_bytes, self._caps[worker], self._latencies[worker])
    a, b = self._regions(worker, server, kind)
    return self._path((server, kind), a, b, num_bytes, self._caps[worker],
                      self._latencies[worker])

  def _path(self, interface, a: int, b: int, num_bytes: int, cap: float, latency: float):
    """A routed transfer across a topology: ``interface`` (its capacity the engine's), then
    the hops from region ``a`` to ``b``."""
    t = self.topology
    return (((interface, None),) + t.hops(a, b), num_bytes, min(cap, t.own_cap(a, b)),
            latency + float(t.latency[a, b]))

  def servers(self, protocol) -> int:
    """How many server interfaces the pushes cross (what ``cluster.server_capacity='split'``
    divides the server bandwidth by): here one per distinct server of ``protocol.route``."""
    return int(np.unique(protocol.route).size)

  def message_route(self, protocol, message, iteration: np.ndarray):
    """The shared link a message crosses, with ``cluster.shared_server_links`` (as
    :meth:`route`), or None: it takes :meth:`message_delay` alone. Here None: messages
    between servers keep their fixed delays."""
    del protocol, message, iteration
    return None

  # -- bytes ------------------------------------------------------------------------------------

  def count_round(self, protocol, rnd, iteration: np.ndarray, host: dict) -> None:
    """Adds ``rnd``'s bytes to ``host``'s counters (pushes: the device's, at evaluations)."""
    del protocol, iteration
    host["pulls_per_worker"][rnd.pulls.nonzero()[0]] += 1

  def count_rounds(self, stacked: dict, host: dict) -> None:
    """:meth:`count_round` of many rounds (their ``arrived`` and ``pulls``, ``[n, W]``), for
    legs without ``counts_per_round``."""
    host["pulls_per_worker"] += stacked["pulls"].sum(0)


class NodeLegs(ServerLegs):
  """InHAD: gradients to the node's aggregator, iteration numbers to the server (module doc)."""

  counts_per_round = True
  supports_topology = False
  counts_device_pushes = False
  local_class = "worker_to_node"

  def servers(self, protocol) -> int:
    del protocol
    return 1   # one server; the routes name the nodes, whose links are not its interface

  def push_delay(self, protocol, worker, iteration):
    del protocol
    c = self.cluster
    return c.node_time(self.push_payload(worker, iteration)) + c.link_time(worker, IN_BYTES)

  def message_delay(self, protocol, message, iteration):
    if message.kind == "aggregate":
      return self.cluster.server_time(protocol.num_nodes * self.dense_payload)
    return super().message_delay(protocol, message, iteration)

  def route(self, protocol, kind, worker, iteration):
    """A pull: the one server's interface (``(0, "pull")``: the protocol's routes name the
    nodes, not servers). A push: the node's local link (``("node", n)``, shared by the node's
    workers, ``node_bandwidth``), then its iteration number's link time."""
    if kind != "push":
      return ((0, kind), self.pull_bytes, self._caps[worker], self._latencies[worker])
    c = self.cluster
    return (("node", protocol.route.item(worker)), self.push_payload(worker, iteration),
            c.node_bandwidth, c.node_latency + c.link_time(worker, IN_BYTES), c.node_bandwidth)

  def count_round(self, protocol, rnd, iteration, host):
    for w in rnd.arrived.nonzero()[0]:
      host["pushed_per_worker"][w] += IN_BYTES
      add(host, "worker_to_node", self.push_payload(int(w), int(iteration[w]) - 1))
    if rnd.aggregate:
      add(host, "node_to_server", protocol.num_nodes * self.dense_payload)
    host["pulls_per_worker"][rnd.pulls.nonzero()[0]] += 1



class PeerLegs(ServerLegs):
  """DS-Sync: no parameter server. Each worker keeps its own replica, and a group averages its
  members' gradients over their own links: a member's push and pull cost its link's time alone
  (no server interface to share, so ``cluster.server_capacity`` divides nothing)."""

  supports_topology = False

  def servers(self, protocol) -> int:
    del protocol
    return 0

  def route(self, protocol, kind, worker, iteration):
    del protocol, kind, worker, iteration
    return None


class GroupLegs(ServerLegs):
  """GSSP, HALoS: a worker's legs go to its group server (the default's); with a global server,
  the group servers' exchanges with it cross its interface.

  With ``cluster.shared_server_links``, a group's delivery to the global server (replica
  ``G``) crosses ``("servers", G, "push")`` and the global server's reply (``adopt``)
  ``("servers", G, "pull")``: its interface to the other servers, ``server_bandwidth`` each
  way, shared by the groups' exchanges in progress. Peer deliveries keep their fixed delay: a
  group has one forward in flight at a time, so its own link has nothing to share with, and
  a message is one transfer (its G - 1 receivers' links are not modelled).
  """

  def servers(self, protocol) -> int:
    """The group servers, and the global one where there is one (GSSP ``global``, HALoS)."""
    return super().servers(protocol) + (protocol.num_replicas != protocol.num_groups)

  def message_route(self, protocol, message, iteration):
    kind = {"deliver": "push", "adopt": "pull"}.get(message.kind)
    G = protocol.num_groups
    if kind is None or protocol.num_replicas == G:   # peer: no global server
      return super().message_route(protocol, message, iteration)
    c = self.cluster
    # The global server's interface: a server interface like the others (the engine's
    # capacity: server_bandwidth, or its share under cluster.server_capacity='split').
    if self.topology is None:
      return (("servers", G, kind), self.pull_bytes, c.server_bandwidth, c.server_latency)
    a, b = self._server_regions(message, G)
    return self._path(("servers", G, kind), a, b, self.pull_bytes, c.server_bandwidth,
                      c.server_latency)

  def _server_regions(self, message, other: int) -> tuple[int, int]:
    """``(from, to)`` regions of a message between group ``message.group``'s server and server
    ``other``: a delivery leaves the group's, an adoption arrives there."""
    g, o = self.server_region[message.group], self.server_region[other]
    return (g, o) if message.kind == "deliver" else (o, g)

  def message_delay(self, protocol, message, iteration):
    """As the default's, across regions with a topology: to or from the global server, or a
    peer delivery to every other group's server at once (the slowest of those transfers)."""
    if self.topology is None or message.kind not in ("deliver", "adopt"):
      return super().message_delay(protocol, message, iteration)
    c, G = self.cluster, protocol.num_groups
    others = [G] if protocol.num_replicas != G else [h for h in range(G) if h != message.group]
    return max((self.topology.transfer_time(self.pull_bytes, c.server_bandwidth,
                                            c.server_latency, *self._server_regions(message, o))
                for o in others), default=0.0)


class CommunityLegs(ServerLegs):
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
      add(host, "member_leader", sum(self.push_payload(int(w), int(iteration[w]) - 1)
                                     for w in arrived[1:]))
    for w in rnd.pulls.nonzero()[0]:   # the server replies to leaders; they forward the reply
      if protocol.leader(int(w)) == w:
        host["pulls_per_worker"][w] += 1
      else:
        add(host, "member_leader", self.pull_bytes)


class RingLegs(ServerLegs):
  """BSP over a ring all-reduce: no server; the barrier's ring is every worker's pull (module doc).

  Every round in which gradients arrive (a barrier) moves ``2 (W - 1)`` times
  the dense gradient over the ring in all (``ring_allreduce``): each of its
  ``2 (W - 1)`` steps passes every one of the W chunks one hop on.
  """

  counts_device_pushes = False
  has_server = False
  dense_only = True
  supports_topology = False

  def __init__(self, cluster, push_payload, dense_payload, pull_bytes):
    super().__init__(cluster, push_payload, dense_payload, pull_bytes)
    self.allreduce_bytes = 2 * (cluster.bandwidth.size - 1) * int(dense_payload)
    self.allreduce_time = ring_time(cluster, dense_payload)

  def push_delay(self, protocol, worker, iteration):
    del protocol, worker, iteration
    return 0.0

  def pull_delay(self, protocol, worker):
    del protocol, worker
    return self.allreduce_time

  def route(self, protocol, kind, worker, iteration):
    del protocol, kind, worker, iteration
    return None   # no server; the ring's hops are each used by one transfer at a time

  def servers(self, protocol) -> int:
    del protocol
    return 0

  def count_round(self, protocol, rnd, iteration, host):
    del protocol, iteration
    if rnd.arrived.any():
      add(host, "ring_allreduce", self.allreduce_bytes)

  def count_rounds(self, stacked, host):
    add(host, "ring_allreduce", self.allreduce_bytes * int(stacked["arrived"].any(1).sum()))
