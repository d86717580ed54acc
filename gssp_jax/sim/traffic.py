"""Who sends what to whom, over which link: the delays a timeline uses and the bytes it moves.

Most schemes send every push and pull over the worker's own link
(``Cluster.link_time``) and server-to-server messages over the server link.
Two schemes move data differently:

* InHAD: a worker's gradient goes to its node's aggregator over the node's
  local link (``Cluster.node_time``), then only its iteration number
  (``IN_BYTES``) goes to the server over the worker's link. The server's pull
  of the N node aggregates (``Message("aggregate")``) is N dense payloads over
  the server link. Workers pull the global model over their own link.
* CASP: a community of one pushes and pulls over its own link. In a larger
  community each member's gradient goes to the leader over the member's link
  (the leader's own costs nothing), the leader sends one payload to the server
  (``Message("community")``) and gets one reply over its link, then forwards it
  to every member over the member's link.

Contention (``route``, with ``cluster.shared_server_links``): a push into a
server (the worker's replica's: its GSSP group server, else the one server)
and a pull out of it cross the server's interface, ``(server, "push")`` in and
``(server, "pull")`` out, each shared max-min fairly by the transfers in
progress on it (``sync.links``), each transfer capped by its worker's own
bandwidth, its latency added after. BSP's W simultaneous pushes of the whole
model therefore take W times one push's transfer at a server as fast as a
worker. Not routed (fixed delays, as before): InHAD's push to its node's
aggregator, a CASP community's member <-> leader legs and upload, and messages
between servers.

Byte counters (``host`` keys): ``pushed_per_worker`` (to a server, by the
worker), ``node_push_bytes`` (InHAD's aggregates, node -> server),
``pulls_per_worker`` (pulls from a server), ``local_bytes`` (inside a node or
a community: InHAD's worker -> aggregator, CASP's member <-> leader).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

IN_BYTES = 8   # an iteration number (int64)


class Traffic:
  """Link delays and byte counts of one scheme on one cluster.

  Args:
    scheme: the scheme's name.
    cluster: a ``cluster.Cluster``.
    push_payload: ``(worker, iteration) -> bytes`` of a worker's push.
    dense_payload: bytes of a dense gradient (what an aggregate or a community
      sum costs: a sum of sparse gradients is not sparse).
    pull_bytes: bytes of the weights a worker pulls.
  """

  def __init__(self, scheme: str, cluster, push_payload: Callable[[int, int], int],
               dense_payload: int, pull_bytes: int, shared: bool = False):
    self.scheme, self.cluster, self.shared = scheme, cluster, bool(shared)
    self.push_payload, self.dense_payload, self.pull_bytes = push_payload, dense_payload, pull_bytes
    # Per worker, as Python floats: a routed transfer reads them at every push and pull.
    self._caps, self._latencies = cluster.bandwidth.tolist(), cluster.latency.tolist()

  # ------------------------------------------------------------ time

  def push_delay(self, protocol, worker: int, iteration: int) -> float:
    """End of compute -> the push event (arrival at the server, or at the leader)."""
    c = self.cluster
    if self.scheme == "inhad":
      return c.node_time(self.push_payload(worker, iteration)) + c.link_time(worker, IN_BYTES)
    if self.scheme == "casp" and protocol.members(worker).size > 1:
      if protocol.leader(worker) == worker:
        return 0.0
    return c.link_time(worker, self.push_payload(worker, iteration))

  def pull_delay(self, protocol, worker: int) -> float:
    c = self.cluster
    if self.scheme == "casp" and protocol.members(worker).size > 1:
      leader = protocol.leader(worker)
      local = 0.0 if leader == worker else c.link_time(worker, self.pull_bytes)
      return c.link_time(leader, self.pull_bytes) + local
    return c.link_time(worker, self.pull_bytes)

  def engine(self, protocol, compute_time, *, record: bool = False):
    """A ``sync.TimelineEngine`` of ``protocol`` whose delays (and shared links) are these."""
    from gssp_jax import sync  # pylint: disable=g-import-not-at-top  (looked up per call)
    engine = sync.TimelineEngine(
        protocol, compute_time,
        push_delay=lambda w, k: self.push_delay(engine.protocol, w, k),
        pull_delay=lambda w: self.pull_delay(engine.protocol, w),
        message_delay=lambda m: self.message_delay(engine.protocol, m, engine.iteration),
        record=record, link_bandwidth=self.cluster.server_bandwidth,
        route=((lambda kind, w, k: self.route(engine.protocol, kind, w, k))
               if self.shared else None),
        equal_caps=bool(np.all(self.cluster.bandwidth == self.cluster.bandwidth[0])))
    return engine

  def route(self, protocol, kind: str, worker: int, iteration: int):
    """The shared link a push or pull crosses: ``(link, bytes, cap, latency)``, or None.

    None: the transfer takes :meth:`push_delay` / :meth:`pull_delay` alone
    (without ``shared``, or a path that does not end at a server's interface).
    """
    if not self.shared:
      return None
    scheme = self.scheme
    if scheme == "inhad" and kind == "push":
      return None   # to the node's aggregator
    if scheme == "casp" and protocol.members(worker).size > 1:
      return None   # through the community's leader
    num_bytes = self.push_payload(worker, iteration) if kind == "push" else self.pull_bytes
    return ((protocol.route.item(worker), kind), num_bytes, self._caps[worker],
            self._latencies[worker])

  def message_delay(self, protocol, message, iteration: np.ndarray) -> float:
    """``iteration``: pushes per worker so far (the engine's), to size a community's push."""
    c = self.cluster
    if self.scheme == "inhad" and message.kind == "aggregate":
      return c.server_time(protocol.num_nodes * self.dense_payload)
    if self.scheme == "casp" and message.kind == "community":
      members = np.flatnonzero(protocol.communities == message.group)
      return c.link_time(int(members[0]), self.community_bytes(members, iteration))
    return c.server_time(self.pull_bytes)

  def community_bytes(self, members: np.ndarray, iteration: np.ndarray) -> int:
    """One community push: the sum of its members' last pushes, at most dense."""
    return int(min(self.dense_payload,
                   sum(self.push_payload(int(w), int(iteration[w]) - 1) for w in members)))

  # ------------------------------------------------------------ bytes

  @property
  def counts_per_round(self) -> bool:
    """Whether a round's bytes depend on the protocol's state then (InHAD's, CASP's): such
    rounds are counted as they happen (:meth:`count_round`), others may be counted later."""
    return self.scheme in ("inhad", "casp")

  def count_pulls(self, pulls: np.ndarray, host: dict) -> None:
    """Adds the pulls of rounds (``[n, W]`` bool) of a scheme without ``counts_per_round``."""
    host["pulls_per_worker"] += pulls.sum(0)

  @property
  def counts_device_pushes(self) -> bool:
    """Whether the device's per-worker push bytes reached a server (else counted here)."""
    return self.scheme not in ("inhad", "casp")

  def count_round(self, protocol, rnd, iteration: np.ndarray, host: dict) -> None:
    """Adds ``rnd``'s bytes to ``host``'s counters (see the module docstring)."""
    pulled = rnd.pulls.nonzero()[0]
    if self.scheme == "inhad":
      for w in rnd.arrived.nonzero()[0]:
        host["pushed_per_worker"][w] += IN_BYTES
        host["local_bytes"] += self.push_payload(int(w), int(iteration[w]) - 1)
      if rnd.aggregate:
        host["node_push_bytes"] += protocol.num_nodes * self.dense_payload
    if self.scheme != "casp":
      host["pulls_per_worker"][pulled] += 1
      return
    arrived = rnd.arrived.nonzero()[0]
    if arrived.size == 1:
      w = int(arrived[0])
      host["pushed_per_worker"][w] += self.push_payload(w, int(iteration[w]) - 1)
    elif arrived.size:
      leader = int(arrived[0])
      host["pushed_per_worker"][leader] += self.community_bytes(arrived, iteration)
      host["local_bytes"] += sum(self.push_payload(int(w), int(iteration[w]) - 1)
                                 for w in arrived[1:])
    for w in pulled:   # the server replies to leaders; leaders forward inside the community
      if protocol.leader(int(w)) == w:
        host["pulls_per_worker"][w] += 1
      else:
        host["local_bytes"] += self.pull_bytes
