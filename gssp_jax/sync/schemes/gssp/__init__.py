"""GSSP: SSP inside groups of workers at group servers, asynchronous between the groups.

``protocol.py``: who waits and when a group forwards or takes another's sum (the host half, no
JAX); ``transform.py``: the group servers' updates and the exchange buffers (the device half);
its bytes go through ``legs.GroupLegs``. Registered here with the ``config.sync.*`` keys it
reads, as a researcher's scheme is; GDTopK's ratios are per GSSP group.
"""

from gssp_jax.sync import arguments
from gssp_jax.sync import grouping
from gssp_jax.sync import registry
from gssp_jax.sync.schemes.gssp import legs
from gssp_jax.sync.schemes.gssp import transform
from gssp_jax.sync.schemes.gssp.protocol import GSSPProtocol

SYNC_KEYS = ("staleness", "num_groups", "grouping", "regroup_every_epoch", "inter_group",
             "forward_every")


def build(W, *, grouping_method, num_groups, worker_times, staleness, inter_group,
          forward_every, scale, **_):
  groups = grouping.make_groups(grouping_method, W, num_groups, worker_times)
  s = arguments.check_int("gssp", "staleness", staleness, 0)
  tx = transform.gssp(W, num_groups, inter_group=inter_group, assignment=groups, scale=scale)
  make = lambda: GSSPProtocol(W, groups, s, inter_group=inter_group, forward_every=forward_every)
  return registry.Scheme("gssp", tx, make, W, make().num_replicas, groups, legs=legs.GroupLegs)


def register() -> None:
  registry.register_built_in(
      "gssp", build, SYNC_KEYS, group_ratios=True,
      settings_line=lambda s: f", staleness bound {s.staleness} clocks ahead (in its group), "
                              f"inter-group {s.inter_group}")
