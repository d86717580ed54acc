"""What a run shows while it trains: console progress, ``log.txt`` and TensorBoard event files.

``train_and_evaluate`` opens :func:`run_output` around a run, so a notebook or a
plain script sees the same progress lines as the command line and the workdir
gets the same ``log.txt``; and it feeds every metrics line to a
:class:`MetricWriter`, which writes TensorBoard scalars under
``workdir/tensorboard`` with ``tensorboardX`` (no TensorFlow needed).
"""

from __future__ import annotations

import contextlib
import glob
import logging as std_logging
import os
import struct
import sys
from typing import Any, Iterator

from absl import logging

from gssp_jax import cli

TENSORBOARD_DIR = "tensorboard"
# The second tag family: the same scalars against virtual time, in virtual milliseconds
# (TensorBoard steps are integers).
BY_VIRTUAL_TIME = "by_virtual_ms"


def _logs_to(path: str) -> bool:
  """True if the absl logger already appends to ``path`` (``experiments.main``, a sweep trial)."""
  path = os.path.abspath(path)
  return any(isinstance(h, std_logging.FileHandler) and os.path.abspath(h.baseFilename) == path
             for h in logging.get_absl_logger().handlers)


def _info_reaches_a_console() -> bool:
  """True if absl INFO lines are already shown (``app.run`` with ``cli.setup_logging``)."""
  logger = logging.get_absl_logger()
  if not logger.isEnabledFor(std_logging.INFO):
    return False
  handlers, node = [], logger
  while node is not None:
    handlers += [h for h in node.handlers if not isinstance(h, std_logging.FileHandler)]
    node = node.parent if node.propagate else None
  return bool(handlers)


@contextlib.contextmanager
def run_output(workdir: str, progress: bool = True) -> Iterator[None]:
  """While inside, absl INFO lines go to ``workdir/log.txt`` and, if ``progress``, to stdout.

  Each is added only where it is missing: under ``experiments.main`` or a sweep
  the file handler and the console already exist, so nothing is logged twice.
  In a notebook or a script that never called ``app.run``, absl drops INFO
  lines; here they go to ``sys.stdout`` as it is when the run starts (in
  Jupyter, the cell's output), Orbax's per-save chatter left out.
  ``progress=False`` keeps the console to warnings; ``log.txt`` is written
  either way.
  """
  shown = _info_reaches_a_console()   # before the file handler lowers the logger's level
  with contextlib.ExitStack() as stack:
    path = os.path.join(workdir, "log.txt")
    if not _logs_to(path):
      stack.enter_context(cli.log_to_file(path))   # appended on resume
    if not shown:
      stack.enter_context(_console(progress))
    yield


@contextlib.contextmanager
def _console(progress: bool) -> Iterator[None]:
  """absl INFO lines (``progress``) or warnings only to the console, and nowhere else."""
  handler = std_logging.StreamHandler(sys.stdout if progress else sys.stderr)
  handler.setLevel(std_logging.INFO if progress else std_logging.WARNING)
  handler.setFormatter(std_logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
  handler.addFilter(cli.quiet_orbax)
  logger = logging.get_absl_logger()
  old_level, old_propagate = logger.level, logger.propagate
  logger.addHandler(handler)
  logger.setLevel(std_logging.INFO)
  # Not also to a root handler (some imports call logging.basicConfig), which would print
  # every INFO line, Orbax's included, or the warnings a second time.
  logger.propagate = False
  try:
    yield
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    logger.propagate = old_propagate
    handler.flush()


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
  """The numeric scalars of a metrics line, nested keys joined by ``/`` (lists and None left out).

  ``{"staleness": {"mean": 1.5}, "blocked_time": None}`` -> ``{"staleness/mean": 1.5}``.
  """
  out = {}
  for key, value in record.items():
    if isinstance(value, dict):
      out.update(scalars(value, f"{prefix}{key}/"))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out[prefix + key] = float(value)
  return out


class MetricWriter:
  """TensorBoard scalars of a run's metrics lines, one event file per session.

  Every numeric metric is a tag stepped by the line's position (``updates`` or
  ``pushes``, the executor's ``position_key``); lines with a virtual time are
  also written under ``by_virtual_ms/<metric>`` stepped by virtual milliseconds.
  A resumed session deletes the earlier sessions' event files and writes the
  kept lines again (the ones ``metrics.jsonl`` keeps) into its own file, which
  starts with TensorBoard's restart marker at step 0 (``purge_step=0``): the
  files on disk never hold a step twice, and a TensorBoard that already read the
  old files drops them too.
  """

  def __init__(self, workdir: str, position_key: str, history: list[dict]):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top (optional-heavy)
    self.logdir = os.path.join(workdir, TENSORBOARD_DIR)
    self.position_key = position_key
    old = glob.glob(os.path.join(self.logdir, "events.out.tfevents.*"))
    for path in old:
      os.remove(path)
    self._writer = SummaryWriter(self.logdir, purge_step=0 if old else None, flush_secs=30)
    for record in history:
      self.write(record, flush=False)
    self._writer.flush()

  def write(self, record: dict[str, Any], flush: bool = True) -> None:
    step = int(record[self.position_key])
    values = scalars(record)
    for tag, value in values.items():
      self._writer.add_scalar(tag, value, step)
    vtime = record.get("virtual_time")
    if vtime is not None:
      vstep = int(round(vtime * 1000))
      for tag, value in values.items():
        self._writer.add_scalar(f"{BY_VIRTUAL_TIME}/{tag}", value, vstep)
    if flush:   # a TensorBoard watching the workdir shows each evaluation at once
      self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """``{tag: [(step, value), ...]}`` from the event files in ``logdir``, in file order.

  Reads the TFRecord framing (length, masked CRC-32C, event, masked CRC-32C),
  checks both checksums with ``tensorboardX``'s own ``masked_crc32c`` and parses
  each record with its ``event_pb2``, so no TensorBoard or TensorFlow is needed.
  A restart marker (``SessionLog.START`` at step ``s``) drops the values with
  step >= ``s`` read before it, as TensorBoard does.
  """
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top
  out: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      header = data[pos:pos + 8]
      (length,) = struct.unpack("Q", header)
      (crc,) = struct.unpack("I", data[pos + 8:pos + 12])
      body = data[pos + 12:pos + 12 + length]
      (body_crc,) = struct.unpack("I", data[pos + 12 + length:pos + 16 + length])
      if crc != masked_crc32c(header) or body_crc != masked_crc32c(body):
        raise ValueError(f"{path}: corrupt record at byte {pos}")
      pos += 16 + length
      event = event_pb2.Event.FromString(body)
      if event.HasField("session_log") and event.session_log.status == event.session_log.START:
        for tag in out:
          out[tag] = [(s, v) for s, v in out[tag] if s < event.step]
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
  return out
