"""InHAD's legs: a worker's gradient goes to its node's aggregator over the node's local link
(``node_time``), then only its iteration number (``legs.IN_BYTES``) goes to the server over the
worker's link. The server's pull of the N node aggregates (``Message("aggregate")``) is N dense
payloads over the server link (a fixed delay). Workers pull over their own link. With
``cluster.shared_server_links`` a push crosses the node's local link."""

from __future__ import annotations

from gssp_jax.sync import legs


class NodeLegs(legs.ServerLegs):
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
    return c.node_time(self.push_payload(worker, iteration)) + c.link_time(worker, legs.IN_BYTES)

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
            c.node_bandwidth, c.node_latency + c.link_time(worker, legs.IN_BYTES), c.node_bandwidth)

  def count_round(self, protocol, rnd, iteration, host):
    for w in rnd.arrived.nonzero()[0]:
      host["pushed_per_worker"][w] += legs.IN_BYTES
      legs.add(host, "worker_to_node", self.push_payload(int(w), int(iteration[w]) - 1))
    if rnd.aggregate:
      legs.add(host, "node_to_server", protocol.num_nodes * self.dense_payload)
    host["pulls_per_worker"][rnd.pulls.nonzero()[0]] += 1
