"""A run's traffic: its scheme's legs (``sync.legs``) wired into the timeline engine.

Each scheme describes its own legs (``Scheme.legs``: which link a push, pull
or server-to-server message crosses and which class of traffic its bytes
count in; ``sync.legs`` lists the classes and the built-in legs).
:class:`Traffic` builds the run's legs from the cluster and the payload sizes
and gives the timeline engine their delays.

Contention (``route``, with ``cluster.shared_server_links``): a push or pull
crosses the shared link its legs name (``legs.route``), shared max-min fairly
by the transfers in progress on it (``sync.links``), each transfer capped by
its sender's own bandwidth, its latency added after. By default a push into a
server (the worker's replica's: its GSSP group server, else the one server)
and a pull out of it cross the server's interface, ``(server, "push")`` in and
``(server, "pull")`` out; BSP's W simultaneous pushes of the whole model
therefore take W times one push's transfer at a server as fast as a worker.
InHAD's push crosses its node's local link, a CASP member's push and pull its
leader's link, a CASP community's upload (a message) the server's interface,
a group server's exchange with a global server (GSSP ``global``, HALoS) the
global server's interface to the other servers (``sync.legs``: ``route``,
``message_route``). Fixed delays still: GSSP ``peer`` deliveries, InHAD's pull
of the aggregates, the server's reply to a CASP leader, and every leg without
``shared``.

With a network topology (``cluster.topology``, ``sim/topology.py``) a routed transfer's link
is a path: the server's interface, then the links between the two ends' regions (a region's
uplink, the pipe between the regions, the other's downlink), every one shared over the whole
network (``sync.links.NetworkLinks``); an unrouted one takes its path's time alone.

Byte counters (``host`` keys, ``sim.records.new_counters``):
``pushed_per_worker`` (to a server, by the worker), ``pulls_per_worker``
(pulls from a server), ``server_bytes`` (between servers) and
``class_bytes`` (the other classes, by name).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gssp_jax.sync import legs as legs_lib

IN_BYTES = legs_lib.IN_BYTES


class Traffic:
  """Link delays and byte counts of one scheme on one cluster.

  Args:
    legs: the scheme's legs class (``Scheme.legs``, a ``sync.legs.ServerLegs``).
    cluster: a ``cluster.Cluster``.
    push_payload: ``(worker, iteration) -> bytes`` of a worker's push.
    dense_payload: bytes of a dense gradient (what an aggregate or a community
      sum costs: a sum of sparse gradients is not sparse).
    pull_bytes: bytes of the weights a worker pulls.
    shared: route the legs into servers over their shared interfaces.
    capacity: ``cluster.server_capacity``: ``"each"`` (every server interface has the
      cluster's server bandwidth) or ``"split"`` (the scheme's servers share it:
      :meth:`interface_bandwidth`).
    compress_time: ``compress.compute_time``, seconds a worker spends compressing one push
      (0 without a compressor); the engine adds it before every push leaves.
  """

  def __init__(self, legs: type, cluster, push_payload: Callable[[int, int], int],
               dense_payload: int, pull_bytes: int, shared: bool = False,
               capacity: str = "each", compress_time: float = 0.0):
    self.legs = legs(cluster, push_payload, dense_payload, pull_bytes)
    self.compress_time = float(compress_time)
    self.cluster, self.shared, self.capacity = cluster, bool(shared), capacity
    self.topology = getattr(cluster, "topology", None)   # sim/topology.py, or None
    self.push_payload, self.dense_payload, self.pull_bytes = push_payload, dense_payload, pull_bytes
    self.push_delay, self.pull_delay = self.legs.push_delay, self.legs.pull_delay
    self.message_delay, self.count_round = self.legs.message_delay, self.legs.count_round
    self.count_rounds = self.legs.count_rounds

  @property
  def counts_per_round(self) -> bool:
    """Whether a round's bytes depend on the protocol's state then (``legs.counts_per_round``)."""
    return self.legs.counts_per_round

  @property
  def counts_device_pushes(self) -> bool:
    """Whether the device's per-worker push bytes reached a server (else the legs count them)."""
    return self.legs.counts_device_pushes

  def engine(self, protocol, compute_time, *, record: bool = False):
    """A ``sync.TimelineEngine`` of ``protocol`` whose delays (and shared links) are these, with
    the cluster's ``server_update_time`` and this run's ``compress_time``."""
    from gssp_jax import sync  # pylint: disable=g-import-not-at-top  (looked up per call)
    if self.topology is not None:   # servers placed by the fresh protocol's routes
      self.legs.place_servers(self.topology.server_regions(protocol.route,
                                                           protocol.num_replicas))
    engine = sync.TimelineEngine(
        protocol, compute_time,
        push_delay=lambda w, k: self.push_delay(engine.protocol, w, k),
        pull_delay=lambda w: self.pull_delay(engine.protocol, w),
        message_delay=lambda m: self.message_delay(engine.protocol, m, engine.iteration),
        record=record, link_bandwidth=self.interface_bandwidth(protocol),
        route=((lambda kind, w, k: self.route(engine.protocol, kind, w, k))
               if self.shared else None),
        message_route=((lambda m: self.legs.message_route(engine.protocol, m, engine.iteration))
                       if self.shared else None),
        equal_caps=bool(np.all(self.cluster.bandwidth == self.cluster.bandwidth[0])),
        network=self.topology is not None,
        update_time=self.cluster.server_update_time,
        compress_time=self.compress_time)
    return engine

  def interface_bandwidth(self, protocol) -> float:
    """Bytes/s of each server's shared interface: ``cluster.server_bandwidth``, or with
    ``cluster.server_capacity='split'`` that divided among the scheme's servers
    (``legs.servers``), so every scheme has the same server capacity in all."""
    servers = self.legs.servers(protocol)
    if self.capacity == "split" and servers > 1:
      return self.cluster.server_bandwidth / servers
    return self.cluster.server_bandwidth

  def route(self, protocol, kind: str, worker: int, iteration: int):
    """The shared link a push or pull crosses (``legs.route``), or None: the transfer takes
    ``push_delay`` / ``pull_delay`` alone (without ``shared``, or a leg the legs leave
    unrouted)."""
    return self.legs.route(protocol, kind, worker, iteration) if self.shared else None
