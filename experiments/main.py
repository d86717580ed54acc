r"""Trains one configuration.

  python -m experiments.main --config=configs/mnist_lenet5.py --workdir=/tmp/mnist_lenet5
  python -m experiments.main --config=configs/mnist_lenet5.py:smoke --workdir=/tmp/smoke \
      --config.num_workers=8 --config.data_dir=/path/to/data   # local files, no download

One simulation across several processes or hosts (``levels`` executor, every process's devices;
``gssp_jax/sim/hosts.py``): the same command in each, with its own ``--process_id``:

  python -m experiments.main --config=configs/mnist_lenet5.py:smoke --workdir=/tmp/smoke \
      --config.executor=levels --config.devices=0 \
      --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0

Everything but flag parsing lives in the library (``gssp_jax.train``), which a
notebook imports the same way.
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from gssp_jax import cli
from gssp_jax import config as config_lib
from gssp_jax import train
from gssp_jax import xla_env
from gssp_jax.sim import hosts

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, summary and checkpoints.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "One simulation across processes: process 0's host:port, which "
    "it binds (jax.distributed; keep it on a private network: it has no authentication).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes the simulation spans.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index, 0..num_processes-1; "
                                   "process i > 0 writes to WORKDIR/process_<i>.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.setup_logging()
  # Checked before log.txt is created: a mistake leaves no empty workdir behind.
  cli.check_workdir(_WORKDIR.value)
  if _NUM_PROCESSES.value != 1 or _COORDINATOR.value or _PROCESS_ID.value:
    hosts.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  config_lib.validate_config(_CONFIG.value)
  xla_env.use_compilation_cache()   # a rerun or a resumed run skips compilation
  here = hosts.process_workdir(_WORKDIR.value)   # this process's outputs
  with (cli.removed_if_nothing_ran(here),   # e.g. no data where it was pointed
        cli.log_to_file(os.path.join(here, "log.txt")),   # appended on resume
        cli.sigterm_as_interrupt()):   # `kill` records an interrupted run like Ctrl-C
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print(cli.final_line(summary, here))


if __name__ == "__main__":
  cli.run_main(main)   # user errors: one line (--verbose: the traceback)
