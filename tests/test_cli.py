"""Errors a person reads: user errors end an entry point with one line and exit code 1."""

import os
import pathlib
import signal
import subprocess
import sys
import time

from absl import flags
import pytest

from gssp_jax import cli

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(*args, env=None):
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=300)


def _one_line(proc) -> str:
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1 and len(lines) == 1 and proc.stdout == "", proc.stderr
  assert lines[0].startswith("error: ")
  return lines[0]


def test_user_errors_one_line_and_others_keep_their_traceback(monkeypatch):
  monkeypatch.delenv(cli.VERBOSE_ENV, raising=False)
  with pytest.raises(SystemExit) as e, cli.user_errors(["prog"]):
    raise KeyError("config has no key 'sync.x'")
  assert e.value.code == "error: config has no key 'sync.x'"   # not its repr
  with pytest.raises(SystemExit) as e, cli.user_errors(["prog"]):
    raise FileNotFoundError(2, "No such file or directory", "/x/y")
  assert e.value.code == "error: No such file or directory: /x/y"
  with pytest.raises(RuntimeError), cli.user_errors(["prog"]):   # a programming error
    raise RuntimeError("bug")
  for argv in (["prog", "--verbose"], ["prog", "--verbose=true"]):
    with pytest.raises(ValueError), cli.user_errors(argv):
      raise ValueError("kept with its traceback")
  with pytest.raises(SystemExit), cli.user_errors(["prog", "--verbose", "--noverbose"]):
    raise ValueError("one line")
  monkeypatch.setenv(cli.VERBOSE_ENV, "1")
  with pytest.raises(ValueError), cli.user_errors(["prog"]):
    raise ValueError("kept")


def test_user_message_of_ml_collections_and_multi_line_errors():
  trace = ("flag --config=c.py:bogus: Error whilst parsing config file:\n\nTraceback (most "
           "recent call last):\n  File \"c.py\", line 3\n    raise ValueError(...)\n"
           "ValueError: unknown config arg 'bogus'; allowed: smoke\n")
  assert cli.user_message(flags.IllegalFlagValueError(trace)) == (
      "flag --config=c.py:bogus: ValueError: unknown config arg 'bogus'; allowed: smoke")
  assert cli.user_message(ValueError("first\nsecond\nthird")) == (
      "first (and 2 more lines: --verbose shows them with the traceback)")


def test_check_workdir_refuses_a_file_and_a_path_under_one(tmp_path):
  afile = tmp_path / "f"
  afile.write_text("")
  with pytest.raises(NotADirectoryError, match=rf"--workdir={afile} is a file; allowed"):
    cli.check_workdir(str(afile))
  with pytest.raises(NotADirectoryError, match=rf"lies under the file {afile}"):
    cli.check_workdir(str(afile / "run"))
  assert cli.check_workdir(str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")
  assert not (tmp_path / "new").exists()


def test_main_examples_of_the_issue_one_line_nothing_created(tmp_path):
  workdir = tmp_path / "run"
  # A config file that does not exist: one line, and no workdir, no empty log.txt.
  line = _one_line(_run("experiments.main", "--config=configs/nope.py", f"--workdir={workdir}"))
  assert line == ("error: --config=configs/nope.py: config file 'configs/nope.py' does not "
                  "exist; allowed: a Python file defining get_config()")
  assert not workdir.exists()
  # A workdir that is a file (was a raw FileExistsError), with a config key that does not
  # exist in another run; --verbose keeps the traceback.
  afile = tmp_path / "file"
  afile.write_text("")
  proc = _run("experiments.main", "--config=configs/mnist_lenet5.py:smoke", f"--workdir={afile}",
              "--verbose")
  assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f"NotADirectoryError: --workdir={afile} is a file; allowed: a directory (created if "
      "missing) or a new path")
  assert afile.read_text() == ""


def test_sweep_and_report_errors_one_line(tmp_path):
  workdir = tmp_path / "sweep"
  line = _one_line(_run("experiments.sweep", "--sweep=configs/sweeps/tiny.py",
                        f"--workdir={workdir}", "--config.sync.stalenes=2"))
  assert line.startswith("error: flag --config.sync.stalenes=2: config has no key "
                         "'sync.stalenes' (did you mean 'sync.staleness'?); allowed: the keys "
                         "under 'sync': ")
  line = _one_line(_run("experiments.sweep", "--sweep=configs/sweeps/nope.py",
                        f"--workdir={workdir}", "--config.seed=1"))
  assert line.startswith("error: sweep file 'configs/sweeps/nope.py' does not exist") and (
      "; allowed: configs/sweeps/cifar10_resnet18_lr.py, " in line
      and "configs/sweeps/tiny.py" in line)
  line = _one_line(_run("experiments.sweep", "--sweep=configs/sweeps/tinyy.py",
                        f"--workdir={workdir}"))
  assert line.startswith("error: sweep file 'configs/sweeps/tinyy.py' does not exist (did you "
                         "mean 'configs/sweeps/tiny.py'?); allowed: ")
  line = _one_line(_run("experiments.sweep", "--sweep=configs/sweeps/tiny.py",
                        f"--workdir={workdir}", "--config.num_workers=four"))
  assert line == "error: --config.num_workers=four is invalid; allowed: an integer"
  for flag, allowed in (("--config.optimizer.learning_rate=fast", "a number"),
                        ("--config.data_download=maybe", "True or False")):
    line = _one_line(_run("experiments.main", "--config=configs/mnist_lenet5.py",
                          f"--workdir={workdir}", flag))
    assert line == f"error: {flag} is invalid; allowed: {allowed}"
  assert not workdir.exists()
  line = _one_line(_run("experiments.report", str(tmp_path / "nope")))
  assert "does not exist" in line


@pytest.mark.parametrize("flag, meant, where", [
    ("--config.num_epochs=1", "'train.num_epochs'", "the top-level keys: "),
    ("--config.sync.schem=bsp", "'sync.scheme'", "the keys under 'sync': "),
    ("--noconfig.train.nesterov", "'optimizer.nesterov'", "the keys under 'train': "),
    ("--config.foo.bar=1", None, "the top-level keys: "),
])
def test_an_unknown_key_is_suggested_across_sections_and_allowed_is_never_empty(
    flag, meant, where, tmp_path):
  line = _one_line(_run("experiments.main", "--config=configs/mnist_lenet5.py",
                        f"--workdir={tmp_path / 'run'}", flag))
  key = flag.split("config.", 1)[1].split("=", 1)[0]
  said = f" (did you mean {meant}" if meant else ";"
  assert line.startswith(f"error: flag {flag}: config has no key {key!r}{said}"), line
  listed = line.split(f"; allowed: {where}", 1)[1]
  assert "batch_size" in listed or "scheme" in listed or "num_epochs" in listed, line
  assert not (tmp_path / "run").exists()


def test_a_data_directory_without_the_data_names_remedies_that_apply_and_leaves_nothing(
    tmp_path):
  """The download on (the default) and failing (a mirror that refuses): the remedies are a data
  directory or a reachable mirror, never "enable the download"; the new workdir is removed."""
  empty, workdir = tmp_path / "empty", tmp_path / "run"
  empty.mkdir()
  proc = _run("experiments.main", "--config=configs/mnist_lenet5.py:smoke", f"--workdir={workdir}",
              f"--config.data_dir={empty}", "--config.data_url=http://127.0.0.1:9/",
              env={"GSSP_CACHE_DIR": str(tmp_path / "cache")})
  assert proc.returncode == 1, proc.stderr[-2000:]
  message = proc.stderr[proc.stderr.index("error: No data found"):]
  assert f"data directory {empty}: none of the mnist files" in message
  assert "download: failed: download of http://127.0.0.1:9/" in message
  assert "data_download=True" not in message
  assert "2. or, with a network, download from a reachable mirror" in message
  assert not workdir.exists()
  # With the download off, enabling it is the second remedy.
  proc = _run("experiments.main", "--config=configs/mnist_lenet5.py:smoke", f"--workdir={workdir}",
              f"--config.data_dir={empty}", "--config.data_download=False")
  assert "2. enable the checksummed download with --config.data_download=True" in proc.stderr
  assert not workdir.exists()


def test_a_workdir_is_kept_once_its_run_wrote_anything_but_its_log(tmp_path):
  for made, kept in ((["log.txt"], False), (["log.txt", "config.json"], True)):
    workdir = tmp_path / f"w{len(made)}"
    with pytest.raises(ValueError), cli.removed_if_nothing_ran(str(workdir)):
      workdir.mkdir()
      for name in made:
        (workdir / name).write_text("")
      raise ValueError("no data")
    assert workdir.exists() == kept
  existing = tmp_path / "w2"   # existed before the command: never removed
  (existing / "config.json").unlink()
  with pytest.raises(ValueError), cli.removed_if_nothing_ran(str(existing)):
    raise ValueError("no data")
  assert existing.exists()


def test_missing_data_is_a_user_error_printed_whole():
  from gssp_jax.data.types import DataError  # pylint: disable=g-import-not-at-top
  error = DataError("No data found for dataset 'mnist'. Looked at:\n  - data directory: not set\n"
                    "Provide the files in one of these ways:\n  1. pass --config.data_dir=DIR")
  with pytest.raises(SystemExit) as exit_info:
    with cli.user_errors(["prog"]):
      raise error
  assert str(exit_info.value) == f"error: {error}"   # every line: where it looked, what to do


_CHILD = """
import pathlib, signal, sys, time
from gssp_jax import cli
cli.stop_with_parent()   # as cli.run_main does first
out = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (out.with_name("sigterm").touch(), sys.exit(0)))
out.with_name("ready").touch()
time.sleep(60)
"""


def test_a_child_whose_parent_died_before_it_asked_stops_at_once():
  """The parent's death between the child's start and its request: the child is reparented,
  no death signal would come, so it signals itself."""
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  env = {**os.environ, cli.PARENT_ENV: f"{dead.pid}:{int(signal.SIGTERM)}"}
  out = subprocess.run([sys.executable, "-c", "from gssp_jax import cli; cli.stop_with_parent();"
                        " print('still running')"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == -signal.SIGTERM and "still running" not in out.stdout
  env.pop(cli.PARENT_ENV)   # not started by child_process: nothing to do
  out = subprocess.run([sys.executable, "-c", "from gssp_jax import cli; cli.stop_with_parent();"
                        " print('still running')"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0 and "still running" in out.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stoppable_child_is_out_of_the_terminals_group_and_stops_with_its_parent(tmp_path):
  """A sweep's trial: a terminal's Ctrl-C must reach only the sweep (which then sends one
  SIGTERM), and the trial still gets SIGTERM, its first signal, when the sweep dies."""
  parent = subprocess.Popen(
      [sys.executable, "-c", "import os, subprocess, sys, time; from gssp_jax import cli;"
       f" c = subprocess.Popen([sys.executable, '-c', {_CHILD!r}, {str(tmp_path / 'x')!r}],"
       " **cli.child_process(dict(os.environ))); print(c.pid, flush=True); time.sleep(60)"],
      cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
  child = None
  try:
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
      assert time.monotonic() < deadline, "the child never started"
      time.sleep(0.1)
    assert os.getsid(child) not in (os.getsid(parent.pid), os.getsid(0))
    parent.kill()   # however the parent dies
    parent.wait()
    deadline = time.monotonic() + 30
    while not (tmp_path / "sigterm").exists() and time.monotonic() < deadline:
      time.sleep(0.1)
    assert (tmp_path / "sigterm").exists(), "the child got no SIGTERM when its parent died"
  finally:
    if parent.poll() is None:
      parent.kill()
      parent.wait()
    if child is not None:
      try:
        os.kill(child, signal.SIGKILL)
      except ProcessLookupError:
        pass


_IGNORING = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)            # as a background job of a script starts
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""
_WAITING = """
import pathlib, sys, time
from gssp_jax import cli
with cli.sigterm_as_interrupt():
  try:   # the ready file inside the try: a signal that lands while it is written is heard too
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(60)
  except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_command_hears_ctrl_c_and_kill_even_if_it_inherited_them_ignored_or_blocked(
    tmp_path, signum):
  """A sweep that inherited SIGINT ignored (or blocked) never stopped its trials: they trained
  to the end and were recorded ``done``. Inside ``sigterm_as_interrupt`` both signals raise."""
  ready = tmp_path / "ready"
  proc = subprocess.Popen([sys.executable, "-c", _IGNORING, _WAITING, str(ready)], cwd=REPO,
                          stdout=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not ready.exists():
      assert proc.poll() is None and time.monotonic() < deadline, "the child did not start"
      time.sleep(0.1)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert out.strip() == "interrupted" and proc.returncode == 0


def test_every_launch_flag_in_the_cluster_recipes_exists():
  """docs/REAL_RUNS.md's one-command-per-process, SLURM and Ray recipes use only flags that
  ``experiments.launch`` and ``experiments.sweep`` define (their ``--helpfull``)."""
  import re  # pylint: disable=g-import-not-at-top
  text = (REPO / "docs" / "REAL_RUNS.md").read_text()
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  used = {"launch": set(), "sweep": set()}
  for block in blocks:
    for command in re.split(r"(?<!\\)\n", block):
      for kind in used:
        if f"experiments.{kind}" in command:   # its flags: what follows the module's name
          after = command.split(f"experiments.{kind}", 1)[1]
          used[kind] |= set(re.findall(r"--([a-z_]+)", after))
  assert "launcher" in used["launch"] and "role" in used["launch"] and "launcher" in used["sweep"]
  for kind, names in used.items():
    helpfull = _run(f"experiments.{kind}", "--helpfull").stdout
    defined = set(re.findall(r"--(?:\[no\])?([a-z_]+)", helpfull))
    assert names - {"config"} <= defined, (kind, sorted(names - defined))


def test_ray_flags_where_they_do_not_apply_are_refused_not_ignored(tmp_path):
  hetero = "--config=configs/mnist_lenet5_hetero.py:smoke"
  for module, args, where in (
      ("experiments.launch", [hetero, "--ray_cpus_per_process=2"], "with --launcher=local"),
      ("experiments.launch", [hetero, "--ray_address=head:6379"], "with --launcher=local"),
      ("experiments.launch", [hetero, "--role=worker", "--mesh=0",
                              "--config.dist.server_address=127.0.0.1:1", "--launcher=ray"],
       "with --role=worker"),
      ("experiments.sweep", ["--sweep=configs/sweeps/tiny.py", "--ray_gpus_per_trial=1"],
       "with --launcher=local")):
    line = _one_line(_run(module, *args, f"--workdir={tmp_path / 'w'}"))
    assert f"is invalid {where}; allowed: only with --launcher=ray" in line, line
  assert not (tmp_path / "w").exists()   # refused before anything was made


def _summary(virtual, wall, **more):
  return {"status": "done", "metric": "test_accuracy", "warnings": [],
          "final": {"test_accuracy": 0.83871, "epoch": 1.0},
          "totals": {"virtual_time": virtual, "wall_time": wall}, **more}


def test_the_final_line_names_virtual_and_wall_time_where_a_cluster_is_simulated():
  assert cli.final_line(_summary(2.0912, 55.3), "/tmp/w") == (
      "final test_accuracy: 0.8387 after 1.00 epochs, virtual 2.1 s, wall 55 s (done); "
      "workdir /tmp/w")
  assert cli.final_line(_summary(0.334, 8.44), "/tmp/w").endswith(
      "epochs, virtual 0.33 s, wall 8.4 s (done); workdir /tmp/w")
  # BSP in the fused loop has no cluster; a real run's events follow wall time.
  for summary in (_summary(None, 70.2), _summary(10.1, 10.1, runtime="dist")):
    assert cli.final_line(summary, "/tmp/w") == (
        "final test_accuracy: 0.8387 after 1.00 epochs, wall 70 s (done); workdir /tmp/w"
        if summary["totals"]["virtual_time"] is None else
        "final test_accuracy: 0.8387 after 1.00 epochs, wall 10 s (done); workdir /tmp/w")
  assert cli.final_line({**_summary(1.5, 3.0), "final": None}, "/tmp/w") == (
      "no evaluation, virtual 1.5 s, wall 3.0 s (done); workdir /tmp/w")
