"""Local SGD, DiLoCo and asynchronous Local SGD: local-update schemes on a server scheme's
transform and protocol (BSP's, ASP's), each declaring how it uses ``config.local``
(``sync.local.LocalUpdate``). HALoS, with servers of its own, is ``schemes/halos``.
"""

from gssp_jax.sync import local
from gssp_jax.sync import registry
from gssp_jax.sync.schemes import ssp


def register() -> None:
  registry.register_built_in("local_sgd", ssp.bsp_scheme("local_sgd"), (),
                             local=local.LocalUpdate(workers="optimizer"))
  registry.register_built_in("diloco", ssp.bsp_scheme("diloco"), (), local=local.LocalUpdate())
  registry.register_built_in("async_local_sgd", ssp.asp_scheme("async_local_sgd"), (),
                             local=local.LocalUpdate(reads=("dylu", "delayed_nesterov")))
