"""Runs a config-file ablation sweep: one workdir per trial, resumable.

  python -m experiments.sweep --sweep=configs/sweeps/<name>.py --workdir=DIR [--parallel=N] \
      [--config.key=value ...]

--config.key=value overrides a key of the sweep's base config (its get_config()) for every
trial, as in experiments.main; a key the grid sets is refused (change it in the sweep
file). A rerun with other overrides is a changed sweep (below).

A rerun with the same workdir skips finished trials (done, collapsed, diverged),
retries failed or interrupted ones and resumes each from its checkpoint. If the
sweep file changed a trial's config since it ran, the rerun refuses, naming the
trials and keys; --rerun_changed moves those trials to DIR/_stale/<time>/ and
runs them again. Ctrl-C or
``kill`` of this process stops every trial it started (each records
``interrupted``). With --launcher=ray [--ray_address=ADDR] each trial is a Ray task with
--ray_cpus_per_trial and --ray_gpus_per_trial; Ray runs as many at once as they allow,
resumable as with --parallel. A tuned key declared with a ladder
(``tune(key, values, ladder=...)``) is extended where a configuration's best value is an end of
those it tried, until none is (``gssp_jax.studies.grid_edge``; the added trials are listed in
DIR/extended.json). Everything is library code (``gssp_jax.studies.sweep``).
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from gssp_jax import cli
from gssp_jax.studies import grid_edge
from gssp_jax.studies import sweep
from gssp_jax import xla_env
from gssp_jax.runtime import ray_launch

_SWEEP = flags.DEFINE_string("sweep", None, "sweep file (configs/sweeps/<name>.py)", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the sweep's directory", required=True)
_PARALLEL = flags.DEFINE_integer("parallel", 1, "trials at once (separate processes when > 1)")
_MAX_TRIALS = flags.DEFINE_integer("max_trials", 0, "start at most this many trials (0 = all)")
_RERUN_CHANGED = flags.DEFINE_bool(
    "rerun_changed", False, "move trials whose config the sweep file changed to DIR/_stale/<time>/ "
    "and run them again (default: refuse, naming them)")
_ONLY = flags.DEFINE_string("only", None, "run just this trial (used by --parallel)")
_RAY_FLAGS = ray_launch.define_flags("trial", "trials here, --parallel at once")
_LAUNCHER, _RAY_ADDRESS, _RAY_CPUS, _RAY_GPUS = _RAY_FLAGS
# The sweep file's base config, loaded by ml_collections only when --config.key=value
# overrides are given (_base_config_flag), so that they parse exactly as in experiments.main.
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "not given: the sweep file itself (get_config()), when --config.key=value "
    "overrides its keys", lock_config=True)


def _base_config_flag(argv: list[str]) -> list[str]:
  """With --config.* overrides, ``--config=<the --sweep file>`` before them (ml_collections
  defines the override flags from the config file it loads)."""
  if any(a.split("=", 1)[0] in ("--config", "-config") for a in argv[1:]):
    raise ValueError("--config is not a flag of experiments.sweep: the base config is the sweep "
                     "file's get_config(); allowed: --config.key=value overrides of it")
  if not any(a.startswith(("--config.", "--noconfig.", "-config.", "-noconfig.")) for a in argv):
    return argv
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith(("--sweep=", "-sweep="))), None)
  if spec is None:
    spec = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--sweep", "-sweep")),
                None)
  if spec is None:
    raise ValueError("--config.key=value overrides need --sweep=FILE (whose base config they "
                     "change)")
  sweep.load_sweep(spec)   # a missing or broken sweep file named as such, not as --config
  return [argv[0], f"--config={spec}", *argv[1:]]


def _overrides() -> dict:
  if _CONFIG.value is None:   # no --config.* flags
    return {}
  return config_flags.get_override_values(flags.FLAGS["config"])


def main(argv):
  del argv
  cli.check_workdir(_WORKDIR.value)
  cli.setup_logging()
  xla_env.use_compilation_cache()   # trials (and --parallel's processes) share compilations
  with cli.sigterm_as_interrupt():   # `kill` stops the trials like Ctrl-C; a rerun resumes
    _main()


def _main():
  if _ONLY.value:
    trials = {t.name: t for t in sweep.expand(_SWEEP.value, _overrides(), _WORKDIR.value)}
    if _ONLY.value not in trials:
      raise app.UsageError(f"--only={_ONLY.value!r} is not a trial of {_SWEEP.value}; trials: "
                           f"{', '.join(trials)}")
    sweep.run_trial(trials[_ONLY.value], _WORKDIR.value)
    return
  ray = None
  if _LAUNCHER.value == "ray":
    ray = ray_launch.RaySettings(_RAY_ADDRESS.value, _RAY_CPUS.value, _RAY_GPUS.value)
  else:
    ray_launch.refuse_unused(_RAY_FLAGS[1:], "with --launcher=local")
  try:
    statuses = grid_edge.run_sweep(_SWEEP.value, _WORKDIR.value, parallel=_PARALLEL.value,
                               max_trials=_MAX_TRIALS.value, rerun_changed=_RERUN_CHANGED.value,
                               overrides=_overrides(), ray=ray)
  except sweep.ChangedTrialsError as e:
    raise SystemExit(f"error: {e}") from None   # one line, no traceback
  for name, status in statuses.items():
    print(f"{status or 'not run':>12}  {name}")
  print(sweep.report_command(_WORKDIR.value, statuses))


if __name__ == "__main__":
  cli.run_main(main, prepare_argv=_base_config_flag)
