"""CASP: communities of workers, each pushing one aggregated gradient; an actor-critic chooses
the communities.

``protocol.py``: the communities and who waits (the host half, no JAX); ``transform.py``: the
server's update (the device half); its bytes go through ``legs.CommunityLegs``.
"""

from gssp_jax.sync import registry
from gssp_jax.sync.schemes.casp import legs
from gssp_jax.sync.schemes.casp import transform
from gssp_jax.sync.schemes.casp.protocol import CASPProtocol


def build(W, *, casp, scale, **_):
  CASPProtocol(W, **casp)                  # validates
  return registry.Scheme("casp", transform.casp(W, scale=scale), lambda: CASPProtocol(W, **casp),
                         W, 1, registry.zeros(W), legs=legs.CommunityLegs)


def register() -> None:
  registry.register_built_in(
      "casp", build, ("casp.max_communities", "casp.reconfigure_every", "casp.traffic_penalty"))
