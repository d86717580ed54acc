"""The real runtime's settings, ``config.dist.*``, and what of a config it can run.

``config.validate_config`` calls :func:`validate`; ``experiments.launch`` and
the server and meshes read the keys it checks.
"""

from __future__ import annotations

import ml_collections

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.runtime import auth
from gssp_jax.runtime import flight
from gssp_jax.runtime import wire
from gssp_jax.sync import registry

# What the real runtime cannot run yet, and why (checked before anything starts).
_UNSUPPORTED_SYNC = {
    "regroup_every_epoch": "regrouping by measured speed needs a barrier of every mesh at each "
                           "epoch end; the real runtime keeps the groups of the start",
}


def validate(config: ml_collections.ConfigDict) -> None:
  """``config.dist.*``: positive timeouts, a host:port address, TLS files together, a data plane
  this host has; under ``executor='dist'`` also :func:`check_real_run`.

  Raises:
    ValueError: one line naming the key, its value and what is allowed.
  """
  if "dist" not in config:
    return
  for key in ("dist.heartbeat_timeout", "dist.join_timeout", "dist.retry_seconds",
              "dist.hang_timeout", "dist.save_timeout", "dist.all_lost_timeout"):
    checks.positive(config, key)
  checks.positive(config, "dist.num_servers", int)
  for key in ("emulate_cluster", "tls_client_auth", "emulate_network", "record_pushes"):
    checks.check_bool(f"dist.{key}", config.dist[key])
  _check_tls(config.dist)
  plane = config.dist.get("data_plane", "grpc")
  if plane not in defaults.DATA_PLANES:
    checks.fail("dist.data_plane", plane, " or ".join(map(repr, defaults.DATA_PLANES)))
  if plane == "flight" and not flight.available():
    checks.fail("dist.data_plane", "flight", "'grpc' where pyarrow (with Flight) is not "
                "installed (pip install pyarrow)")
  if config.dist.server_address:
    wire.check_address("config.dist.server_address", config.dist.server_address)
  if config.get("executor", "auto") == "dist":
    check_real_run(config)


def _check_tls(dist: ml_collections.ConfigDict) -> None:
  mode = dist.get("tls_mode", "run")
  if mode not in auth.TLS_MODES:
    checks.fail("dist.tls_mode", mode, " or ".join(map(repr, auth.TLS_MODES)))
  files = ("tls_cert", "tls_key", "tls_ca", "tls_client_auth", "tls_server_name")
  if mode != "files":
    for key in files:
      if dist[key]:
        checks.fail(f"dist.{key}", dist[key], f"its default, with dist.tls_mode={mode!r} (it is "
                    "read only with dist.tls_mode='files')")
    return
  tls = {k: dist[k] for k in files[:3]}
  if not all(tls.values()):
    missing = [k for k, v in tls.items() if not v]
    checks.fail(f"dist.{missing[0]}", "", "a PEM file: dist.tls_mode='files' needs dist.tls_cert,"
                " dist.tls_key and dist.tls_ca together")


def check_real_run(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming what of ``config`` the real runtime cannot run, and why."""
  scheme = registry.scheme_from_config(config, worker_times=None)
  protocol = scheme.make_protocol()
  if not scheme.legs.has_server:
    raise ValueError(
        f"config.sync.scheme={config.sync.scheme!r} cannot run on the real runtime: its workers "
        "exchange gradients without a server (its legs: sync.legs), and the real runtime moves "
        "every gradient through parameter servers. Simulate it with python -m experiments.main "
        "instead")
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
  if config.cluster.get("topology", ""):
    raise ValueError(f"config.cluster.topology={config.cluster.topology!r} cannot apply to the "
                     "real runtime: its transfers cross the real network (impose a topology on "
                     "it with the kernel, as benchmarks do), and emulating one by sleeping would "
                     "not contend; leave it unset")
