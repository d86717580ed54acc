"""InHAD: workers aggregate on their node; the server pulls the nodes' aggregates.

``protocol.py``: when the server pulls (the host half, no JAX); ``transform.py``: the node
aggregates and the server's update (the device half); its bytes go through ``legs.NodeLegs``.
"""

from gssp_jax.sync import grouping
from gssp_jax.sync import registry
from gssp_jax.sync.schemes.inhad import legs
from gssp_jax.sync.schemes.inhad import transform
from gssp_jax.sync.schemes.inhad.protocol import InHADProtocol


def build(W, *, grouping_method, num_nodes, worker_times, inhad_threshold, scale, **_):
  nodes = grouping.make_groups(grouping_method, W, num_nodes, worker_times)
  tx = transform.inhad(W, num_nodes, assignment=nodes, scale=scale)
  InHADProtocol(W, nodes, inhad_threshold)   # validates
  return registry.Scheme("inhad", tx, lambda: InHADProtocol(W, nodes, inhad_threshold), W, 1,
                         nodes, legs=legs.NodeLegs)


def register() -> None:
  registry.register_built_in("inhad", build, ("num_nodes", "inhad_threshold", "grouping"))
