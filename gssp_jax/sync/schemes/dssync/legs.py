"""DS-Sync's legs: no server; each member's push and pull cross its own link alone (its
replica is its own)."""

from __future__ import annotations

from gssp_jax.sync import legs


class PeerLegs(legs.ServerLegs):
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
