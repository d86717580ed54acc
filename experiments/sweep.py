"""Runs a config-file ablation sweep: one workdir per trial, resumable.

  python -m experiments.sweep --sweep=configs/sweeps/<name>.py --workdir=DIR [--parallel=N]

A rerun with the same workdir skips finished trials (done, collapsed, diverged),
retries failed or interrupted ones and resumes each from its checkpoint. If the
sweep file changed a trial's config since it ran, the rerun refuses, naming the
trials and keys; --rerun_changed moves those trials to DIR/_stale/<time>/ and
runs them again. Ctrl-C or
``kill`` of this process stops every trial it started (each records
``interrupted``). Everything is
library code (``gssp_jax.sweep``).
"""

from absl import app
from absl import flags

from gssp_jax import cli
from gssp_jax import sweep

_SWEEP = flags.DEFINE_string("sweep", None, "sweep file (configs/sweeps/<name>.py)", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the sweep's directory", required=True)
_PARALLEL = flags.DEFINE_integer("parallel", 1, "trials at once (separate processes when > 1)")
_MAX_TRIALS = flags.DEFINE_integer("max_trials", 0, "start at most this many trials (0 = all)")
_RERUN_CHANGED = flags.DEFINE_bool(
    "rerun_changed", False, "move trials whose config the sweep file changed to DIR/_stale/<time>/ "
    "and run them again (default: refuse, naming them)")
_ONLY = flags.DEFINE_string("only", None, "run just this trial (used by --parallel)")


def main(argv):
  del argv
  cli.setup_logging()
  with cli.sigterm_as_interrupt():   # `kill` stops the trials like Ctrl-C; a rerun resumes
    _main()


def _main():
  if _ONLY.value:
    trials = {t.name: t for t in sweep.expand(_SWEEP.value)}
    if _ONLY.value not in trials:
      raise app.UsageError(f"--only={_ONLY.value!r} is not a trial of {_SWEEP.value}; trials: "
                           f"{', '.join(trials)}")
    sweep.run_trial(trials[_ONLY.value], _WORKDIR.value)
    return
  try:
    statuses = sweep.run_sweep(_SWEEP.value, _WORKDIR.value, parallel=_PARALLEL.value,
                               max_trials=_MAX_TRIALS.value, rerun_changed=_RERUN_CHANGED.value)
  except sweep.ChangedTrialsError as e:
    raise SystemExit(f"error: {e}") from None   # one line, no traceback
  for name, status in statuses.items():
    print(f"{status or 'not run':>12}  {name}")


if __name__ == "__main__":
  app.run(main)
