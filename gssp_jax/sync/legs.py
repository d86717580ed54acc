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

The legs:

* :class:`ServerLegs` (here; every scheme that names no other): a push crosses the worker's
  link into its server, a pull comes back over it, a message between servers crosses the
  server link.
* Each other scheme's, in its package (``sync/schemes/<name>/legs.py``, each saying what
  goes where): ``PeerLegs`` (DS-Sync), ``GroupLegs`` (GSSP, and HALoS), ``NodeLegs``
  (InHAD), ``CommunityLegs`` (CASP), ``RingLegs`` (``bsp_allreduce``, with
  ``ring_time``).

With ``cluster.shared_server_links`` a push or pull crosses the shared link
that :meth:`ServerLegs.route` names: the server's interface by default, the
node's local link for InHAD's pushes, the leader's link (in for pushes, out
for the reply's forward) for a CASP member; and a message the one that
:meth:`ServerLegs.message_route` names: a CASP community's upload, the
server's interface; a group server's exchange with a global server
(GSSP's ``GroupLegs``: GSSP ``global``, HALoS), the global server's interface to
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
