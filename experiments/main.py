r"""Trains one configuration.

  python -m experiments.main --config=configs/mnist_lenet5.py --workdir=/tmp/mnist_lenet5
  python -m experiments.main --config=configs/mnist_lenet5.py:smoke --workdir=/tmp/smoke \
      --config.num_workers=8 --config.data_dir=/path/to/data   # local files, no download

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

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, summary and checkpoints.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.setup_logging()
  # Checked before log.txt is created: a mistake leaves no empty workdir behind.
  cli.check_workdir(_WORKDIR.value)
  config_lib.validate_config(_CONFIG.value)
  xla_env.use_compilation_cache()   # a rerun or a resumed run skips compilation
  with (cli.removed_if_nothing_ran(_WORKDIR.value),   # e.g. no data where it was pointed
        cli.log_to_file(os.path.join(_WORKDIR.value, "log.txt")),   # appended on resume
        cli.sigterm_as_interrupt()):   # `kill` records an interrupted run like Ctrl-C
    summary = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print(cli.final_line(summary, _WORKDIR.value))


if __name__ == "__main__":
  cli.run_main(main)   # user errors: one line (--verbose: the traceback)
