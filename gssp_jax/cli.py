"""What the command-line entry points share: logging that keeps Orbax's per-save chatter out."""

import contextlib
import logging as std_logging
import os

from absl import logging


def quiet_orbax(record) -> bool:
  """Orbax logs every checkpoint step at INFO; keep its warnings and errors only."""
  return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def setup_logging() -> None:
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(quiet_orbax)


@contextlib.contextmanager
def log_to_file(path: str):
  """While inside, absl log lines (INFO and up, Orbax chatter filtered) are appended to ``path``."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  handler = std_logging.FileHandler(path)
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
  handler.addFilter(quiet_orbax)
  logger = logging.get_absl_logger()
  old_level = logger.level
  logger.addHandler(handler)
  logger.setLevel(min(old_level or std_logging.INFO, std_logging.INFO))
  try:
    yield path
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    handler.close()
