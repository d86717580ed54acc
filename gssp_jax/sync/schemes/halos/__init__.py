"""HALoS: local servers per group with Delayed Nesterov, an asynchronous global server.

``protocol.py``: when a group sends its progress and takes the global weights (the host half,
no JAX); ``transform.py``: the servers' optimizers (the device half, its own); its workers' jobs
are local updates (``sync/local.py``); its bytes go through GSSP's ``legs.GroupLegs``.
"""

from gssp_jax.sync import grouping
from gssp_jax.sync import local
from gssp_jax.sync import registry
from gssp_jax.sync.schemes.gssp import legs as gssp_legs
from gssp_jax.sync.schemes.halos import transform
from gssp_jax.sync.schemes.halos.protocol import HALoSProtocol


def build(W, *, grouping_method, num_groups, worker_times, forward_every, halos=None, **_):
  groups = grouping.make_groups(grouping_method, W, num_groups, worker_times)
  settings = dict(halos or {})
  merge = settings.pop("merge_weight", 0.25)
  make = lambda: HALoSProtocol(W, groups, forward_every=forward_every, merge_weight=merge)
  probe = make()   # validates
  tx = transform.halos(W, num_groups, assignment=groups, **{**transform.DEFAULTS, **settings})
  return registry.Scheme("halos", tx, make, W, probe.num_replicas, groups, own_optimizer=True,
                         legs=gssp_legs.GroupLegs)


def register() -> None:
  registry.register_built_in(
      "halos", build, ("num_groups", "grouping", "forward_every"),
      local=local.LocalUpdate(reads=("dylu", "halos"), delayed_nesterov_server=True),
      more_settings=lambda config: {"halos": transform.settings_from_config(config)})
