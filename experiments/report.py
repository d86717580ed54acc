"""Turns a sweep's workdir into tables (Markdown, CSV) and plots (PNG).

  python -m experiments.report DIR [--out=DIR] [--target=0.98]

--target recomputes every trial's time to target from its recorded evaluations
(e.g. a lower accuracy for a reduced run); without it the runs' own target is used.
A sweep's report covers its current grid (DIR/sweep.json); trial directories
left from an older grid are listed as orphans and left out.
Times to target are interpolated between evaluations; collapsed or diverged
trials never count as reaching it; a sweep with tune(...) axes is reported at
each configuration's best tuned value, with the tuning disclosed in report.md.
"""

from absl import app
from absl import flags

from gssp_jax import cli
from gssp_jax.studies import report

_OUT = flags.DEFINE_string("out", None, "where to write the report (default: DIR itself)")
_TARGET = flags.DEFINE_float("target", None, "recompute time to this metric value (default: "
                             "each run's train.target_accuracy / target_bleu)")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m experiments.report DIR [--out=DIR] [--target=X]")
  paths = report.write_report(argv[1], _OUT.value, _TARGET.value)
  for kind, path in paths.items():
    print(f"{kind}: {path}")
  left_out = report.orphans(argv[1])
  if left_out:
    print(f"orphans (not in the sweep's current grid, left out): {', '.join(left_out)}")


if __name__ == "__main__":
  cli.run_main(main)
