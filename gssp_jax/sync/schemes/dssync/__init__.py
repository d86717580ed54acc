"""DS-Sync: no server; each round averages the weights inside groups of workers.

``protocol.py``: the groups of each round (the host half, no JAX); ``transform.py``: each
worker's own replica (the device half); its bytes go through ``legs.PeerLegs``.
"""

from gssp_jax.sync import registry
from gssp_jax.sync.schemes.dssync import legs
from gssp_jax.sync.schemes.dssync import transform
from gssp_jax.sync.schemes.dssync.protocol import DSSyncProtocol


def build(W, *, group_size, seed, **_):
  DSSyncProtocol(W, group_size, seed)      # validates
  return registry.Scheme("dssync", transform.dssync(W),
                         lambda: DSSyncProtocol(W, group_size, seed), W, W, registry.zeros(W),
                         legs=legs.PeerLegs)


def register() -> None:
  registry.register_built_in("dssync", build, ("group_size",))
