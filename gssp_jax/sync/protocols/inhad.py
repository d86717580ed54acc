"""InHAD: node-local aggregation; the server counts iteration numbers and pulls past a threshold."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import transforms
from gssp_jax.sync.protocols.base import Protocol
from gssp_jax.sync.protocols.base import Reaction


class InHADProtocol(Protocol):
  """Workers never wait; the server updates once every ``threshold`` iterations.

  A worker's gradient joins its node's aggregate and the node reports only its
  iteration number (IN) to the server. When the INs counted since the last
  update reach ``threshold`` (default W: on average one iteration per worker)
  the server pulls every node's aggregate and applies their sum in one update.
  A worker pulls after each push, so it starts from the newest global model.

  Args:
    num_workers: W.
    nodes: ``[W]`` node id of each worker.
    threshold: INs per server update, >= 1 (None: W).
  """

  name = "inhad"

  def __init__(self, num_workers: int, nodes, threshold: int | None = None):
    num_workers = transforms.check_int("inhad", "num_workers", num_workers, 1)
    ids = np.asarray(nodes)
    num_nodes = int(ids.max()) + 1 if ids.size else 1
    route = transforms.check_assignment("inhad", "nodes", nodes, num_workers, num_nodes)
    super().__init__(num_workers, 1, 1, route)
    self.num_nodes = num_nodes
    self.threshold = (num_workers if threshold is None
                      else transforms.check_int("inhad", "threshold", threshold, 1))
    self.count = 0

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.clock[worker] += 1
    self.count += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    if self.count >= self.threshold:
      rnd.aggregate[...] = True
      rnd.applies[0] = True
      self.count = 0
    rnd.pulls[worker] = True
    return Reaction(rounds=[rnd], release=[worker])
