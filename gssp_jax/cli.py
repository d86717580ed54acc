"""What the command-line entry points share: logging that keeps Orbax's per-save chatter out,
``kill`` treated like Ctrl-C, and user errors in one line (:func:`run_main`)."""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import re
import shutil
import signal
import sys
import threading
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections.config_flags import config_flags   # is_config_flag: not re-exported

from gssp_jax import defaults
from gssp_jax.data.types import DataError


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
  raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def sigterm_as_interrupt():
  """While inside, SIGTERM (``kill PID``, a job scheduler's stop) raises KeyboardInterrupt.

  Without it Python dies on SIGTERM at once: a run would not write its
  ``interrupted`` summary and a parallel sweep would leave its child trials
  running. Outside the main thread (where handlers cannot be set) it does nothing.

  Ctrl-C (SIGINT) raises KeyboardInterrupt inside too, even where the process inherited it
  ignored or blocked (a background job of a non-interactive shell starts with SIGINT ignored;
  dispositions set to "ignore" and blocked signals survive ``exec``): a sweep whose trials run
  in other sessions must hear it, or they train on to the end and are recorded ``done``.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, _raise_interrupt)
  previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
  unblocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    signal.signal(signal.SIGINT, signal.SIG_DFL if previous_int is None else previous_int)
    signal.signal(signal.SIGTERM, previous)


PARENT_ENV = "GSSP_STOP_WITH_PARENT"   # "<parent pid>:<signal>", set by child_process()


def child_process(env: dict[str, str], signum: int = signal.SIGTERM) -> dict[str, Any]:
  """``subprocess.Popen`` arguments for a child run that its parent stops with one signal.

  The child runs in its own session: a terminal's Ctrl-C (SIGINT to the whole
  foreground process group) reaches only the parent, which then sends each child
  a single SIGTERM. Were the child in the group, it would take that SIGTERM as a
  second signal and stop at once, without the checkpoint its first one asked
  for (``base/interrupt.py``). Out of the group it no longer gets the
  terminal's hang-up, so it asks for ``signum`` when the parent dies instead
  (:func:`stop_with_parent`, called by :func:`run_main`, so the child must be a
  gssp_jax command). That is done in the child, not in a ``preexec_fn``: code run
  between fork and exec in a multithreaded parent (JAX's) can deadlock.
  """
  return {"env": {**env, PARENT_ENV: f"{os.getpid()}:{int(signum)}"},
          "start_new_session": True}


def stop_with_parent() -> None:
  """In a child started with :func:`child_process`: its signal when the parent dies, however
  it dies (``PR_SET_PDEATHSIG`` on Linux), or at once if the parent is already gone."""
  value = os.environ.pop(PARENT_ENV, "")   # not inherited by this process's own children
  if not value:
    return
  parent, signum = (int(part) for part in value.split(":"))
  if sys.platform.startswith("linux"):
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL(None, use_errno=True).prctl(1, signum)   # PR_SET_PDEATHSIG
  if os.getppid() != parent:   # it died before the request: nobody would signal this process
    os.kill(os.getpid(), signum)


# --- Errors a person reads -------------------------------------------------------------------
#
# A user error (a bad flag or config value, a config key that does not exist, a path that is
# missing or of the wrong kind) ends the command with one line on stderr and exit code 1: the
# framework's messages already name the key, the value and what is allowed, and a traceback
# only hides them. Anything else is a programming error and keeps its traceback, as does
# every error under --verbose or GSSP_VERBOSE=1.

VERBOSE_ENV = "GSSP_VERBOSE"
USER_ERRORS = (ValueError, KeyError, OSError, flags.Error, DataError)
_ML_COLLECTIONS_TRACE = "Error whilst parsing config file:"


def _verbose_requested(argv: Sequence[str]) -> bool:
  """--verbose (any spelling absl accepts) or GSSP_VERBOSE=1; read from argv, as an error may
  come before the flags are parsed."""
  if os.environ.get(VERBOSE_ENV, "").lower() in ("1", "true", "yes"):
    return True
  verbose = False
  for arg in argv[1:]:
    if arg == "--":
      break
    name, _, value = arg.lstrip("-").partition("=")
    if name == "verbose":
      verbose = value.lower() not in ("0", "false", "no") if value else True
    elif name == "noverbose":
      verbose = False
  return verbose


def user_message(error: BaseException) -> str:
  """The one line printed for a user error: its message, without the Python wrapping."""
  if isinstance(error, KeyError) and len(error.args) == 1 and isinstance(error.args[0], str):
    message = error.args[0]   # str(KeyError) is the repr of its argument
  elif isinstance(error, OSError) and error.filename is not None and error.strerror:
    message = f"{error.strerror}: {error.filename}"
  else:
    message = str(error) or type(error).__name__
  if _ML_COLLECTIONS_TRACE in message:
    # ml_collections puts the traceback of a failing get_config() into the flag's error;
    # its last line is the exception itself.
    head, _, trace = message.partition(_ML_COLLECTIONS_TRACE)
    last = [line.strip() for line in trace.splitlines() if line.strip()][-1:]
    message = head + (last[0] if last else "")
  lines = [line for line in message.splitlines() if line.strip()]
  if isinstance(error, DataError):
    return message   # missing data: its lines list where it looked and how to provide the files
  if len(lines) > 1:
    message = (f"{lines[0].rstrip()} (and {len(lines) - 1} more lines: --verbose shows them "
               "with the traceback)")
  return message


@contextlib.contextmanager
def user_errors(argv: Sequence[str], kinds=USER_ERRORS):
  """Inside, an exception of ``kinds`` exits with ``error: <one line>`` on stderr and code 1.

  Under --verbose (in ``argv``) or GSSP_VERBOSE=1 it propagates with its traceback.
  """
  try:
    yield
  except kinds as e:
    if _verbose_requested(argv):
      raise
    raise SystemExit(f"error: {user_message(e)}") from None


def _config_file_flags() -> list[str]:
  return [name for name in flags.FLAGS if config_flags.is_config_flag(flags.FLAGS[name])]


def _flag_value(argv: Sequence[str], i: int, name: str) -> str | None:
  """The value ``argv[i]`` gives the flag ``--name`` (``--name=V`` or ``--name V``), or None."""
  arg = argv[i]
  if arg.startswith((f"--{name}=", f"-{name}=")):
    return arg.partition("=")[2]
  if arg in (f"--{name}", f"-{name}") and i + 1 < len(argv):
    return argv[i + 1]
  return None


def _config_spec(argv: Sequence[str], name: str) -> str | None:
  """The last ``FILE[:arg]`` given to the config-file flag ``name`` in ``argv``, or None."""
  spec = None
  for i in range(1, len(argv)):
    if argv[i] == "--":
      break
    spec = _flag_value(argv, i, name) or spec
  return spec


def check_config_files(argv: Sequence[str]) -> None:
  """Refuses a ``--config=FILE[:arg]`` whose file does not exist, before anything loads it.

  ml_collections would defer the failure to the first use of the config, with a
  44-line chained OSError, after the entry point may have created its workdir.
  """
  names = _config_file_flags()
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    for name in names:
      spec = _flag_value(argv, i, name)
      if spec is not None:
        path = spec.split(":", 1)[0]
        if not os.path.isfile(path):
          what = "is a directory" if os.path.isdir(path) else "does not exist"
          raise FileNotFoundError(f"--{name}={spec}: config file {path!r} {what}; allowed: a "
                                  "Python file defining get_config()")


def _unknown_override(argv: Sequence[str], error: BaseException) -> str | None:
  """``--config.sync.nokey=1``: ml_collections says only ``"'nokey'"``; name the flag, the keys
  it probably meant in any section, and the keys allowed where it points."""
  found = re.search(r"'([A-Za-z0-9_]+)", str(error))
  if found is None:
    return None
  missing = found.group(1)
  for arg in argv[1:]:
    for name in _config_file_flags():
      match = re.match(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)", arg)
      if match and missing in match.group(1).split("."):
        config = _loaded_config(argv, name)
        if config is None:
          return (f"flag {arg}: the config has no key {match.group(1)!r}; allowed: keys of the "
                  "config file's get_config()")
        return f"flag {arg}: {defaults.unknown_key_message(config, match.group(1))}"
  return None


def _loaded_config(argv: Sequence[str], name: str) -> ml_collections.ConfigDict | None:
  """The config that ``--name=FILE[:arg]`` in ``argv`` loads, loaded again (absl has dropped it
  once an override of it failed); None if it cannot be."""
  spec = _config_spec(argv, name)
  if spec is None:
    return None
  try:
    value = flags.FLAGS[name].parser.parse(spec)
  except Exception:  # pylint: disable=broad-except   # a config file that fails: said elsewhere
    return None
  return value if isinstance(value, ml_collections.ConfigDict) else None


# absl's messages for a --config.<key>=<value> of the wrong type -> what the key allows.
_TYPE_ERRORS = (("invalid literal for int()", "an integer"),
                ("could not convert string to float", "a number"),
                ("Non-boolean argument to boolean flag", "True or False"))


def _bad_override_value(error: BaseException) -> str | None:
  """``--config.num_workers=four``: absl says ``invalid literal for int() ...``; say what is
  allowed, in the one-line form every other invalid value takes."""
  text = str(error)
  found = re.match(r"flag (--?[A-Za-z0-9_.]+)=(.*?): ", text)
  if found is None:
    return None
  for said, allowed in _TYPE_ERRORS:
    if said in text:
      flag, value = found.groups()
      return f"{flag}={value} is invalid; allowed: {allowed}"
  return None


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing with user errors in one line; config files must exist and load."""
  with user_errors(argv):
    check_config_files(argv)
    try:
      rest = flags.FLAGS(list(argv))
    except (AttributeError, KeyError) as e:   # ml_collections: --config.<key it does not have>
      message = _unknown_override(argv, e)
      if message is None:
        raise
      raise ValueError(message) from e
    except flags.IllegalFlagValueError as e:   # a value of the wrong type
      message = _bad_override_value(e)
      if message is None:
        raise
      raise ValueError(message) from e
    for name in _config_file_flags():
      value = flags.FLAGS[name].value
      if value is not None and not isinstance(value, ml_collections.ConfigDict):
        # ml_collections' stand-in for a config that failed to load raises its error here.
        getattr(value, "keys", None)
    return rest


def check_workdir(path: str) -> str:
  """Refuses a ``--workdir`` that is a file or lies under one, before anything is created."""
  if not path:
    raise ValueError(f"--workdir={path!r} is invalid; allowed: a directory path")
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    where = "is a file" if probe == os.path.abspath(path) else f"lies under the file {probe}"
    raise NotADirectoryError(f"--workdir={path} {where}; allowed: a directory (created if "
                             "missing) or a new path")
  return path


@contextlib.contextmanager
def removed_if_nothing_ran(workdir: str):
  """Removes ``workdir`` again if this command created it and fails before its run wrote
  anything but ``log.txt`` (a data directory without the data, a user model that does not
  import): a bad command leaves nothing behind. A workdir that existed, or holds anything
  else (a config, metrics, a checkpoint), is never touched."""
  created = not os.path.exists(workdir)
  try:
    yield
  except BaseException:
    if created and os.path.isdir(workdir) and set(os.listdir(workdir)) <= {"log.txt"}:
      shutil.rmtree(workdir, ignore_errors=True)
    raise


def seconds(value: float) -> str:
  """``0.33 s``, ``2.1 s``, ``55 s``: two significant digits below 10 s, whole seconds above."""
  if value < 1:
    return f"{value:.2f} s"
  return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def final_line(summary: dict[str, Any], workdir: str) -> str:
  """A finished run's last line (``experiments.main`` and ``experiments.launch`` print it).

  ``final test_accuracy: 0.8387 after 1.00 epochs, virtual 2.1 s, wall 55 s (done); workdir
  DIR``: a simulated run names the seconds its modelled cluster took (virtual) beside the
  seconds this machine took (wall); a run without a simulated cluster (BSP in the fused loop)
  and a real run, whose events follow wall time, name wall time alone. A run that cannot have
  learned says why after its status (``summary["warnings"]``, ``base/health.py``), and a
  collapsed one its reason.
  """
  final, metric = summary.get("final") or {}, summary.get("metric")
  status = summary["status"]
  notes = list(summary.get("warnings") or [])
  if summary.get("collapse_reason"):
    notes.insert(0, summary["collapse_reason"])
  if notes:
    status += "; did not learn: " + "; ".join(notes)
  totals = summary.get("totals") or {}
  took = []
  if totals.get("virtual_time") is not None and summary.get("runtime") != "dist":
    took.append(f"virtual {seconds(totals['virtual_time'])}")
  if totals.get("wall_time") is not None:
    took.append(f"wall {seconds(totals['wall_time'])}")
  took_text = "".join(f", {t}" for t in took)
  if metric in final:
    held_out = defaults.validation_metric(metric)   # data.validation_size's, where scored
    beside = f" ({held_out} {final[held_out]:.4f})" if held_out in final else ""
    return (f"final {metric}: {final[metric]:.4f}{beside} after {final['epoch']:.2f} epochs"
            f"{took_text} ({status}); workdir {workdir}")
  return f"no evaluation{took_text} ({status}); workdir {workdir}"


def run_main(main: Callable[[list[str]], Any],
             prepare_argv: Callable[[list[str]], list[str]] | None = None) -> None:
  """``app.run(main)`` where user errors print one line (:func:`user_errors`) and exit with 1.

  Defines ``--verbose`` (keep the traceback). A child started with
  :func:`child_process` first asks to stop with its parent. ``prepare_argv`` may rewrite the
  command line before the flags are parsed (``sys.argv`` too, as
  ml_collections' config flags read it).
  """
  stop_with_parent()
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "Show the traceback of a user error (also: "
                      f"{VERBOSE_ENV}=1); by default it is one line.")

  def parser(argv):
    if prepare_argv is not None:
      with user_errors(argv):
        argv = sys.argv = prepare_argv(list(argv))
    return parse_flags(argv)

  def guarded(argv):
    with user_errors(sys.argv), interrupted_in_one_line(sys.argv):
      return main(argv)

  app.run(guarded, flags_parser=parser)


INTERRUPTED_EXIT = 130   # a shell's code for a process stopped by SIGINT


def resume_command(argv: Sequence[str]) -> str:
  """The command line that ran this process (``python -m <module> ...``): it resumes a run."""
  import shlex  # pylint: disable=g-import-not-at-top
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  program = f"python -m {spec.name}" if spec is not None and spec.name else shlex.quote(argv[0])
  return " ".join([program] + [shlex.quote(a) for a in argv[1:]])


@contextlib.contextmanager
def interrupted_in_one_line(argv: Sequence[str]):
  """Inside, Ctrl-C or SIGTERM ends the process with one line on stderr and code 130.

  The line says where the checkpoint is (a run that saved one raises
  ``interrupt.Interrupted``) and the command that resumes: the same command
  again. Under --verbose (or GSSP_VERBOSE=1) the traceback stays.
  """
  try:
    yield
  except KeyboardInterrupt as e:
    if _verbose_requested(argv):
      raise
    from gssp_jax.base import interrupt  # pylint: disable=g-import-not-at-top
    if isinstance(e, interrupt.Interrupted):
      what = str(e)
    else:   # a second signal stopped it at once, or it came before any run started
      what = (f"interrupted ({e})" if str(e) else "interrupted") + (
          "; what its last checkpoint holds is kept")
    sys.stdout.flush()
    print(f"{what}. To resume, run the same command: {resume_command(argv)}", file=sys.stderr,
          flush=True)
    raise SystemExit(INTERRUPTED_EXIT) from None
