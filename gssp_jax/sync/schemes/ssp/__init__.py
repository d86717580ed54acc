"""BSP, ASP, SSP, DSSP and BSP over a ring all-reduce: the server schemes.

``protocol.py``: who waits (the host half, no JAX); ``transform.py``: the server's update (the
device half). Registered here with the ``config.sync.*`` keys each reads, as a researcher's
scheme is (``sync.register_scheme``).
"""

from gssp_jax.sync import arguments
from gssp_jax.sync import registry
from gssp_jax.sync.schemes.ssp import legs
from gssp_jax.sync.schemes.ssp import transform
from gssp_jax.sync.schemes.ssp.protocol import ASPProtocol
from gssp_jax.sync.schemes.ssp.protocol import BSPProtocol
from gssp_jax.sync.schemes.ssp.protocol import DSSPProtocol
from gssp_jax.sync.schemes.ssp.protocol import SSPProtocol


def bsp_scheme(name: str):
  """BSP's builder under ``name``: BSP, and Local SGD's and DiLoCo's (they push pseudo-gradients
  through BSP's server)."""
  def build(W, *, scale, **_):
    return registry.Scheme(name, transform.bsp(W, scale=scale), lambda: BSPProtocol(W), W, 1,
                           registry.zeros(W))
  return build


def asp_scheme(name: str):
  """ASP's builder under ``name``: ASP, and asynchronous Local SGD's."""
  def build(W, *, scale, **_):
    return registry.Scheme(name, transform.asp(W, scale=scale), lambda: ASPProtocol(W), W, 1,
                           registry.zeros(W))
  return build


def _bsp_allreduce(W, *, scale, **_):
  """BSP's transform and protocol (the same parameters, bit for bit) with its gradients averaged
  by a ring all-reduce instead of a server (``legs.RingLegs``). A scheme of its own rather than a
  key such as ``sync.collective``: a scheme already ties together what runs on the device, who
  waits, and which legs the bytes take; a key would apply to one scheme and be an error for all
  others, and every recorded config would need it."""
  return registry.Scheme("bsp_allreduce", transform.bsp(W, scale=scale), lambda: BSPProtocol(W),
                         W, 1, registry.zeros(W), legs=legs.RingLegs)


def _ssp(W, *, staleness, scale, **_):
  s = arguments.check_int("ssp", "staleness", staleness, 0)
  return registry.Scheme("ssp", transform.ssp(W, s, scale=scale), lambda: SSPProtocol(W, s), W,
                         1, registry.zeros(W))


def _dssp(W, *, staleness_range, scale, **_):
  rng = arguments.check_staleness_range("dssp", staleness_range)
  return registry.Scheme("dssp", transform.dssp(W, rng, scale=scale),
                         lambda: DSSPProtocol(W, rng), W, 1, registry.zeros(W))


def register() -> None:
  bound = lambda s: f"staleness bound {s.staleness} clocks ahead"
  registry.register_built_in("bsp", bsp_scheme("bsp"), (), fused_loop=True)
  registry.register_built_in("asp", asp_scheme("asp"), ())
  registry.register_built_in("ssp", _ssp, ("staleness",), settings_line=lambda s: f", {bound(s)}")
  registry.register_built_in(
      "dssp", _dssp, ("staleness_range",),
      settings_line=lambda s: f", staleness bound range {tuple(s.staleness_range)} clocks ahead")


def register_allreduce() -> None:
  registry.register_built_in(
      "bsp_allreduce", _bsp_allreduce, (),
      settings_line=lambda s: ", gradients averaged by a ring all-reduce (the replica: every "
                              "worker's copy)")
