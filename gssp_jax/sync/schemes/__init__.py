"""The built-in schemes, one package each: its protocol (the host half, no JAX), its transform
and state types (the device half), its builder, the ``config.sync.*`` keys it reads and the legs
its bytes take, registered with ``sync.registry`` exactly as a researcher's scheme is.

Registered in the order the papers' table lists them; then their names are fixed.
"""

from gssp_jax.sync import registry
from gssp_jax.sync.schemes import casp
from gssp_jax.sync.schemes import dssync
from gssp_jax.sync.schemes import gssp
from gssp_jax.sync.schemes import halos
from gssp_jax.sync.schemes import inhad
from gssp_jax.sync.schemes import local
from gssp_jax.sync.schemes import ssp


def _register_all() -> None:
  ssp.register()          # bsp, asp, ssp, dssp
  gssp.register()
  inhad.register()
  dssync.register()
  casp.register()
  local.register()        # local_sgd, diloco, async_local_sgd
  halos.register()
  ssp.register_allreduce()
  registry.fix_built_ins()


_register_all()
