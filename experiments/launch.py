r"""Trains one configuration for real: a parameter server and meshes of worker processes.

One host (the server and M x P worker processes on loopback, free ports):

  python -m experiments.launch --config=configs/mnist_lenet5_hetero.py:smoke \
      --workdir=/tmp/real --config.num_workers=4 --processes_per_mesh=1

A cluster, one command per process (roles from flags or GSSP_* variables):

  python -m experiments.launch --role=server --config=... --workdir=DIR \
      --config.dist.server_address=node0:5000
  python -m experiments.launch --role=worker --mesh=3 --config=... --workdir=DIR \
      --config.dist.server_address=node0:5000 [--processes_per_mesh=2 --rank=0 \
      --coordinator_address=node3:6000]

The run's shape is the config's, as in a simulation: ``num_workers`` meshes,
``dist.num_servers`` parameter shards, the server at ``dist.server_address``
(it binds that address, and every process reaches it there). The flags say only
where a process belongs in it.

With several processes per mesh and no --rank/--coordinator_address,
jax.distributed detects them (SLURM, Open MPI, Kubernetes).

A Ray cluster, from its head node (or a local Ray instance without --ray_address):

  python -m experiments.launch --launcher=ray [--ray_address=ADDR] --config=... \
      --workdir=DIR --config.num_workers=4 --config.dist.num_servers=2 \
      [--ray_gpus_per_process=1]
"""

import json
import os
import sys

# gRPC logs each failed TLS handshake at INFO, so strangers knocking on a port would fill the run's
# logs; read once, when gRPC loads (below), so set before. Errors are still logged; a value of
# your own wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging
from ml_collections import config_flags

from gssp_jax import cli
from gssp_jax import xla_env
from gssp_jax.runtime import launch
from gssp_jax.runtime import private_net
from gssp_jax.runtime import ray_launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, summary and checkpoints.")
_ROLE = flags.DEFINE_enum("role", None, launch.ROLES,
                          "local (default): start everything here; server; worker.")
_PPM = flags.DEFINE_integer("processes_per_mesh", 1, "Processes per mesh (split the batch).")
_MESH = flags.DEFINE_integer("mesh", None, "worker: the mesh (protocol worker) of this process.")
_RANK = flags.DEFINE_integer("rank", None, "worker: this process's rank in its mesh.")
_COORD = flags.DEFINE_string("coordinator_address", None,
                             "worker, P > 1: the mesh's jax.distributed coordinator host:port.")
_SHARD = flags.DEFINE_integer("shard", None, "shard: this process's shard, 1..S-1.")
_SHARD_ADDRESS = flags.DEFINE_string("shard_address", None,
                                     "shard: the host:port it binds (default 127.0.0.1:0).")
_PRIVATE = flags.DEFINE_bool(
    "private_network", False, "local: run every process in a network namespace of its own "
    "(Linux, unshare), so no other user of the host reaches any of the run's ports, the meshes' "
    "jax coordinators and gloo included; addresses must then be loopback")
_RAY_FLAGS = ray_launch.define_flags("process", "every process on this host")
_LAUNCHER, _RAY_ADDRESS, _RAY_CPUS, _RAY_GPUS = _RAY_FLAGS
flags.mark_flags_as_required(["config", "workdir"])


def _config_flags(argv) -> list[str]:
  """The --config and --config.* flags of this command, passed on to the children."""
  return [a for a in argv[1:] if a.startswith("--config")]


def _exit_now(code: int) -> None:
  """Exits at once once a role's work is done and written (summary, checkpoint, logs).

  The interpreter's teardown can abort (``terminate called … exception not
  rethrown``) while gRPC's and other native background threads still run;
  nothing is left to write, so the process leaves without it.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  logging.flush()
  os._exit(code)  # pylint: disable=protected-access


def _enter_private_network(topo) -> None:
  """Starts this launcher again in a network namespace of its own (``runtime/private_net.py``),
  or, once in it, brings its loopback up; raises UsageError where it cannot."""
  if topo.role != "local" or _LAUNCHER.value != "local":
    raise app.UsageError("--private_network is for the one-host launcher (no --role, "
                         "--launcher=local): a cluster's processes reach each other over the "
                         "network; keep it private with a firewall (docs/REAL_RUNS.md)")
  try:
    private_net.check_addresses({launch.SERVER_KEY: topo.server_address,
                                 "--coordinator_address": _COORD.value})
    if not private_net.inside():
      private_net.check_available()
      private_net.reexec(["-m", "experiments.launch", *sys.argv[1:]])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  private_net.loopback_up()
  logging.info("in a network namespace of its own: no process outside it reaches the run")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.setup_logging()
  xla_env.use_compilation_cache()   # restarted meshes and resumed runs skip compilation
  config = _CONFIG.value
  topo = launch.Topology.from_env(role=_ROLE.value, mesh=_MESH.value, rank=_RANK.value,
                                  coordinator_address=_COORD.value,
                                  processes_per_mesh=_PPM.value, shard=_SHARD.value,
                                  shard_address=_SHARD_ADDRESS.value)
  launch.check_topology(topo, config)
  if _PRIVATE.value:
    _enter_private_network(topo)
  if topo.role != "local":
    ray_launch.refuse_unused(_RAY_FLAGS, f"with --role={topo.role}")
  elif _LAUNCHER.value == "local":
    ray_launch.refuse_unused(_RAY_FLAGS[1:], "with --launcher=local")
  workdir = _WORKDIR.value
  if topo.role == "server":
    from gssp_jax.runtime import server  # pylint: disable=g-import-not-at-top
    from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
    with (cli.log_to_file(os.path.join(workdir, "log.txt")), cli.sigterm_as_interrupt()):
      try:
        summary = loop.train_and_evaluate(launch.server_config(config, topo), workdir)
      except server.RunFailed:   # logged once where it happened; summary.json says why
        print(f"status failed; workdir {workdir}")
        _exit_now(1)
    print(f"status {summary['status']}; workdir {workdir}")
    _exit_now(1 if summary["status"] in ("failed", "diverged") else 0)
  if topo.role == "shard":
    with cli.sigterm_as_interrupt():
      launch.run_shard(config, workdir, topo)
    _exit_now(0)
  if topo.role == "worker":
    with cli.sigterm_as_interrupt():
      launch.run_worker(config, topo)
    _exit_now(0)
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  check = config.copy_and_resolve_references()
  with check.unlocked():
    check.executor = "dist"
  config_lib.validate_config(check)   # before any process starts
  if _LAUNCHER.value == "ray":
    launcher = ray_launch.RayLauncher(_config_flags(sys.argv), workdir, topo, config,
                                      address=_RAY_ADDRESS.value, cpus=_RAY_CPUS.value,
                                      gpus=_RAY_GPUS.value)
  else:
    launcher = launch.LocalLauncher(_config_flags(sys.argv), workdir, topo, config)
  with cli.sigterm_as_interrupt():
    try:
      code = launcher.run()   # on a signal it waits for the server's checkpoint, then raises
    except KeyboardInterrupt as e:
      raise launch.interrupted(e, workdir) from None
  logging.info("the server exited with code %d; every process ended", code)
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path):   # the server writes it as it ends (failed runs too)
    with open(summary_path) as f:
      print(cli.final_line(json.load(f), workdir))
  if code:
    sys.exit(code)


if __name__ == "__main__":
  cli.run_main(main)
