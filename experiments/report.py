"""Turns a sweep's workdir into tables (Markdown, CSV) and plots (PNG).

  python -m experiments.report DIR [--out=DIR]
"""

from absl import app
from absl import flags

from gssp_jax import report

_OUT = flags.DEFINE_string("out", None, "where to write the report (default: DIR itself)")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: python -m experiments.report DIR [--out=DIR]")
  paths = report.write_report(argv[1], _OUT.value)
  for kind, path in paths.items():
    print(f"{kind}: {path}")


if __name__ == "__main__":
  app.run(main)
