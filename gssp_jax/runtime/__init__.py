"""The real multi-process runtime: a parameter server process and meshes of worker processes.

``experiments.launch`` starts it; ``server.DistServer`` is the executor of the
one training loop on the server; ``worker.run_mesh`` is a mesh's process;
``wire`` is the gRPC transport; ``launch`` the roles and the local launcher.
"""

from __future__ import annotations

import ml_collections

# What the real runtime cannot run yet, and why (checked before anything starts).
_UNSUPPORTED_SYNC = {
    "regroup_every_epoch": "regrouping by measured speed needs a barrier of every mesh at each "
                           "epoch end; the real runtime keeps the groups of the start",
}


def check_real_run(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming what of ``config`` the real runtime cannot run, and why."""
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  scheme = sync.scheme_from_config(config, worker_times=None)
  protocol = scheme.make_protocol()
  if not getattr(protocol, "supports_membership", False):
    raise ValueError(
        f"config.sync.scheme={config.sync.scheme!r} cannot run on the real runtime: its protocol"
        " cannot drop a lost mesh or take a restarted one back (supports_membership is False),"
        " so one crash would stall every mesh; the real runtime runs bsp, asp, ssp, dssp, gssp,"
        " inhad, local_sgd, diloco, async_local_sgd and halos. Simulate it with python -m"
        " experiments.main instead")
  if config.sync.get("regroup_every_epoch", False):
    raise ValueError("config.sync.regroup_every_epoch=True cannot run on the real runtime: "
                     + _UNSUPPORTED_SYNC["regroup_every_epoch"] + "; set it False")
  if config.cluster.calibrate:
    raise ValueError("config.cluster.calibrate=True cannot apply to the real runtime: its "
                     "meshes compute for real (cluster timing keys only slow them down); set it"
                     " False and give cluster.base_time in seconds")
