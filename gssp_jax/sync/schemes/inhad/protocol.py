"""InHAD: node-local aggregation; the server counts iteration numbers and pulls past a threshold."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction


class InHADProtocol(Protocol):
  """Workers never wait; the server pulls the node aggregates once every ``threshold`` iterations.

  A worker's gradient joins its node's aggregate (over the node's local link)
  and the node reports only its iteration number (IN) to the server: that
  report is the push event. When the INs counted since the last update reach
  ``threshold`` (default W: on average one iteration per worker) the server
  pulls every node's aggregate: a ``Message("aggregate", 0)`` whose delay is
  the transfer of the N aggregates; on its arrival the server applies their
  sum in one update (an ``aggregate`` round). One pull is in flight at a time.
  Gradients that reach a node while the aggregates travel join this update
  (the device applies the aggregates as they are on arrival; a simplification:
  a real node would hold them for the next one). A worker pulls the global
  model after each push, so it starts from the newest model the server has.

  Membership: nobody ever waits, so a drop frees nobody; the threshold stays
  a count of INs (a dead worker's node simply reports fewer). A rejoining
  worker pulls the global model like after any push.

  Args:
    num_workers: W.
    nodes: ``[W]`` node id of each worker.
    threshold: INs per server update, >= 1 (None: W).
  """

  name = "inhad"
  round_fields = ("aggregate",)
  aggregating = True
  supports_membership = True

  def __init__(self, num_workers: int, nodes, threshold: int | None = None):
    num_workers = arguments.check_int("inhad", "num_workers", num_workers, 1)
    ids = np.asarray(nodes)
    num_nodes = int(ids.max()) + 1 if ids.size else 1
    route = arguments.check_assignment("inhad", "nodes", nodes, num_workers, num_nodes)
    super().__init__(num_workers, 1, 1, route)
    self.num_nodes = num_nodes
    self.threshold = (num_workers if threshold is None
                      else arguments.check_int("inhad", "threshold", threshold, 1))
    self.count = 0
    self.in_flight = False

  def round_bounds(self):
    return 1, 1   # a push joins its node's aggregate; an aggregation applies at the server

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.clock[worker] += 1
    self.count += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    rnd.pulls[worker] = True
    reaction = Reaction(rounds=[rnd], release=[worker])
    if self.count >= self.threshold and not self.in_flight:
      self.in_flight = True
      reaction.messages.append(Message("aggregate", 0))
    return reaction

  def _after_drop(self, worker, time, was_blocked):
    return Reaction()

  def on_message(self, message, time):
    if message.kind != "aggregate" or not self.in_flight:
      return super().on_message(message, time)
    rnd = self.new_round(time)
    rnd.aggregate[...] = True
    rnd.applies[0] = True
    self.count = 0       # every gradient in the aggregates is applied now
    self.in_flight = False
    return Reaction(rounds=[rnd])
