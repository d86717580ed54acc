"""What the command-line entry points share: logging that keeps Orbax's per-save chatter out."""

import logging as std_logging

from absl import logging


def quiet_orbax(record) -> bool:
  """Orbax logs every checkpoint step at INFO; keep its warnings and errors only."""
  return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def setup_logging() -> None:
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(quiet_orbax)
