"""GSSP's legs (and HALoS's): ``legs.ServerLegs``' for pushes and pulls; a group server's
exchange with a global server (GSSP ``global``, HALoS) is routed through the global server's
interface to the other servers; GSSP ``peer`` deliveries keep their fixed delays."""

from __future__ import annotations

from gssp_jax.sync import legs


class GroupLegs(legs.ServerLegs):
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
