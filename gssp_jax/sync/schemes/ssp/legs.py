"""BSP over a ring all-reduce (``bsp_allreduce``): no server. At BSP's barrier the workers
all-reduce their gradients over a bandwidth-optimal ring (a reduce-scatter, then an
all-gather): ``2 (W - 1)`` steps, in each of which every worker sends one chunk of
``model / W`` bytes to its successor (``w -> w + 1 mod W``), so each sends and receives
``2 (W - 1) / W`` of the model. A step lasts as long as its slowest hop, ``latency[w] + chunk /
min(bandwidth[w], bandwidth[w + 1])`` (the sender's latency, the slower of the two links):
:func:`ring_time`. That time is the workers' "pull" (they start their next iteration when the
ring ends, each with the same averaged gradient applied); their pushes cost nothing (the
gradient stays on the worker until the barrier)."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import legs


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


class RingLegs(legs.ServerLegs):
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
      legs.add(host, "ring_allreduce", self.allreduce_bytes)

  def count_rounds(self, stacked, host):
    legs.add(host, "ring_allreduce", self.allreduce_bytes * int(stacked["arrived"].any(1).sum()))
