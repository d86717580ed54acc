"""What the command-line entry points share: logging that keeps Orbax's per-save chatter out,
and ``kill`` treated like Ctrl-C."""

import contextlib
import logging as std_logging
import os
import signal
import threading

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


def _raise_interrupt(signum, frame):
  del frame
  raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt():
  """While inside, SIGTERM (``kill PID``, a job scheduler's stop) raises KeyboardInterrupt.

  Without it Python dies on SIGTERM at once: a run would not write its
  ``interrupted`` summary and a parallel sweep would leave its child trials
  running. Outside the main thread (where handlers cannot be set) it does nothing.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
