"""Ctrl-C / SIGTERM: a checkpoint where the run stopped, a resume that redoes nothing; host state
saved as versioned JSON with the Orbax checkpoint, never as a pickle."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import helpers
from gssp_jax import sync
from gssp_jax.sim import executor
from gssp_jax.sim import simulate
from gssp_jax.base import checkpoint as ckpt_lib
from gssp_jax import executors
from gssp_jax import host_state
from gssp_jax.base import interrupt
from gssp_jax.train import loop

REPO = pathlib.Path(__file__).resolve().parent.parent


def _interrupt_at(monkeypatch, cls, method, position):
  """Makes ``cls.method`` request an interrupt once the executor reaches ``position``."""
  original = getattr(cls, method)

  def patched(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    if self.position >= position:
      interrupt.request("SIGTERM")
    return out
  monkeypatch.setattr(cls, method, patched)


def _checkpoint_steps(workdir):
  return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir()
                if p.name.isdigit())


@pytest.mark.parametrize("kind", ["simulator", "fused"])
@pytest.mark.slow
def test_an_interrupt_checkpoints_where_it_stopped_and_the_resume_redoes_nothing(
    tmp_path, data_dir, monkeypatch, kind):
  if kind == "simulator":   # 16 pushes, evaluations every 8: stop at push 5
    config = helpers.cluster_config("ssp", data_dir)
    cls, method, position, key = simulate.Simulation, "_apply_round", 5, "pushes"
  else:                     # 8 updates, evaluations every 4, a chunk per update: stop at 2
    config = helpers.mnist_smoke(data_dir, num_epochs=2.0, eval_every=1.0,
                                 **{"train.log_every": 1})
    cls, method, position, key = executors.FusedBSP, "_run_chunk", 2, "updates"
  loop.train_and_evaluate(config, str(tmp_path / "whole"), progress=False)

  with monkeypatch.context() as patch:
    _interrupt_at(patch, cls, method, position)
    with pytest.raises(KeyboardInterrupt):
      loop.train_and_evaluate(config, str(tmp_path / "split"), progress=False)
  split = tmp_path / "split"
  assert json.loads((split / "summary.json").read_text())["status"] == "interrupted"
  stopped = max(_checkpoint_steps(split))
  assert position <= stopped < position + 2 and stopped % 4   # not an evaluation point
  log = (split / "log.txt").read_text()
  assert f"interrupted by SIGTERM at {key} {stopped}" in log
  assert f"run the same command again with --workdir={split}" in log
  assert interrupt.requested() is None   # cleared on the way out

  # The resume starts at the interrupted position (nothing redone) and ends as the whole run.
  resumed = {}
  original = cls.restore

  def spy(self):
    resumed["at"] = original(self)
    return resumed["at"]
  monkeypatch.setattr(cls, "restore", spy)
  summary = loop.train_and_evaluate(config, str(split), progress=False)
  assert resumed["at"] == stopped and summary["status"] == "done"
  assert helpers.metric_lines(split) == helpers.metric_lines(tmp_path / "whole")


def test_a_signal_during_the_last_evaluation_lets_the_finished_run_end_as_done(
    tmp_path, data_dir, monkeypatch):
  """The run was over when the loop noticed the signal: it is ``done`` (exit 0, a sweep does not
  retry it), not ``interrupted``."""
  config = helpers.cluster_config("ssp", data_dir)   # 16 pushes, evaluations every 8
  _interrupt_at(monkeypatch, simulate.Simulation, "evaluate", 16)
  summary = loop.train_and_evaluate(config, str(tmp_path), progress=False)
  assert summary["status"] == "done" and summary["totals"]["pushes"] == 16
  assert json.loads((tmp_path / "summary.json").read_text())["status"] == "done"
  assert max(_checkpoint_steps(tmp_path)) == 16
  assert interrupt.requested() is None


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  with interrupt.deferred():
    os.kill(os.getpid(), signal.SIGTERM)
    assert interrupt.requested() == "SIGTERM"
    with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(1)   # the handler runs between bytecodes
  assert interrupt.requested() is None
  assert {s: signal.getsignal(s) for s in before} == before


def test_sigterm_to_the_cli_saves_a_checkpoint_and_says_how_to_resume(tmp_path, data_dir):
  workdir = tmp_path / "run"
  overrides = ["--config.data.train_size=2048", "--config.data.test_size=200",
               "--config.train.num_epochs=100", "--config.train.eval_every=1.0",
               "--config.train.log_every=2", f"--config.data_dir={data_dir}"]
  proc = subprocess.Popen(
      [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
       f"--workdir={workdir}", *overrides], cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 240
    while time.time() < deadline and not (workdir / "metrics.jsonl").exists():
      time.sleep(0.2)
    assert (workdir / "metrics.jsonl").exists(), "the run never evaluated"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  # One line at the end, no traceback: where the checkpoint is and the command that resumes.
  assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("interrupted by SIGTERM at updates ") and (
      f"; its checkpoint is in {workdir}/checkpoints. To resume, run the same command: "
      "python -m experiments.main --config=configs/mnist_lenet5.py:smoke") in last, last
  log = (workdir / "log.txt").read_text()
  assert "interrupted by SIGTERM at updates" in log, out
  stopped = int(log.split("interrupted by SIGTERM at updates ")[1].split(";")[0])
  assert stopped in _checkpoint_steps(workdir)
  assert "To resume, run the same command again" in out
  assert json.loads((workdir / "summary.json").read_text())["status"] == "interrupted"


# -- host state --------------------------------------------------------------------------------


class _Custom(sync.Protocol):
  """A user's protocol: allowed because it subclasses sync.Protocol in this process."""


def _same(a, b):
  if type(a) is not type(b):
    return False
  if isinstance(a, np.ndarray):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
  if isinstance(a, np.random.Generator):
    return a.bit_generator.state == b.bit_generator.state
  if isinstance(a, dict):
    return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, float):
    return a == b or (a != a and b != b)
  if hasattr(a, "__dict__") and not isinstance(a, type):
    return _same(vars(a), vars(b))
  return a == b


def test_host_state_round_trips_exactly_through_json():
  protocol = _Custom(3)
  protocol.rng = np.random.default_rng(7)
  protocol.rng.random(5)
  jobs = executor.Jobs(workers=np.arange(2, dtype=np.int32), idx=np.ones([2, 4], np.int32),
                       iters=np.zeros([2], np.int32), ratios=np.full([2], 0.1, np.float32),
                       flushes=np.zeros([2], bool))
  tree = {"protocol": protocol, "steps": [executor.Step({"arrived": np.ones([3], bool)}, jobs)],
          "nums": (1, 2.5, float("inf"), float("nan"), np.float32(0.1), np.int64(2**40)),
          7: {"nested": [None, True, "s", 0.1 + 0.2]}, ("a", 1): {3, 1, 2}}
  document = json.loads(json.dumps(host_state.encode(tree)))
  back = host_state.decode(document)
  assert _same(back, tree) and back["protocol"].rng.random() == protocol.rng.random()


def test_host_state_refuses_unknown_classes_versions_and_object_arrays():
  class Stranger:
    pass
  with pytest.raises(host_state.HostStateError, match="Stranger is not allowed"):
    host_state.encode({"x": Stranger()})
  with pytest.raises(host_state.HostStateError, match="object array"):
    host_state.encode(np.array([object()]))
  forged = {"format": host_state.FORMAT, "version": 1,
            "state": {"__obj__": ["os:_wrap_close", {"__dict__": []}]}}
  with pytest.raises(host_state.HostStateError, match="names class os:_wrap_close, which is not"):
    host_state.decode(forged)
  with pytest.raises(host_state.HostStateError, match="format version 99"):
    host_state.decode({**host_state.encode(1), "version": 99}, "x")


def test_host_state_written_before_the_protocols_moved_reads_them_where_they_are_now():
  """A checkpoint from before each scheme had a package names its protocol (and CASP's
  actor-critic, the protocols' messages) in ``sync.protocols.*``: it reads them from their
  packages, by name; an old name of a class that is not there is still refused."""
  protocol = sync.GSSPProtocol(4, np.array([0, 0, 1, 1]), 2)
  tree = {"protocol": protocol, "message": sync.Message("forward", 1),
          "casp": sync.CASPProtocol(4, max_communities=2)}
  document = json.loads(json.dumps(host_state.encode(tree)).replace(
      "gssp_jax.sync.schemes.gssp.protocol:", "gssp_jax.sync.protocols.gssp:").replace(
          "gssp_jax.sync.schemes.casp.protocol:", "gssp_jax.sync.protocols.casp:").replace(
              "gssp_jax.sync.protocol:", "gssp_jax.sync.protocols.base:"))
  assert "gssp_jax.sync.protocols.gssp:GSSPProtocol" in json.dumps(document)
  back = host_state.decode(document)
  assert type(back["protocol"]) is sync.GSSPProtocol and _same(back, tree)
  assert type(back["casp"].agent) is sync.ActorCritic
  forged = {**document, "state": {"__obj__": ["gssp_jax.sync.protocols.gssp:Popen",
                                              {"__dict__": []}]}}
  with pytest.raises(host_state.HostStateError,
                     match="names class gssp_jax.sync.protocols.gssp:Popen"):
    host_state.decode(forged)


def test_a_simulator_checkpoint_holds_no_pickle_and_an_old_one_is_refused(tmp_path, data_dir):
  config = helpers.cluster_config("gssp", data_dir, **{"train.stop_after_updates": 5})
  loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  checkpoints = tmp_path / "run" / "checkpoints"
  assert not list(checkpoints.rglob("*.pkl"))
  (step,) = [s for s in _checkpoint_steps(tmp_path / "run") if s == 5]
  saved = ckpt_lib.Checkpointer(str(checkpoints)).restore_host(step)
  assert isinstance(saved["engine"]["protocol"], sync.Protocol)
  # A workdir of an older gssp_jax: the host state was a pickle beside the Orbax step.
  for path in checkpoints.glob("*/host"):
    for f in path.iterdir():
      f.unlink()
    path.rmdir()
  (checkpoints / "host_5.pkl").write_bytes(b"not loaded")
  with pytest.raises(host_state.HostStateError,
                     match=r"has no host state: it was written by an older gssp_jax.*host_5.pkl"):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)


# Every built-in scheme's protocol (GSSP in both inter-group variants), on a 6-worker cluster.
_SCHEMES = [(name, {}) for name in sync.registry.SCHEMES] + [("gssp", {"inter_group": "global"})]


@pytest.mark.parametrize("name, kwargs", _SCHEMES,
                         ids=[n + "".join(f"-{v}" for v in k.values()) for n, k in _SCHEMES])
def test_every_schemes_timeline_resumes_exactly_from_its_host_state(name, kwargs):
  speeds = [1.0, 1.13, 1.37, 1.91, 2.53, 3.1]
  scheme = sync.registry.build_scheme(name, len(speeds), num_groups=2, num_nodes=2,
                                      worker_times=speeds, casp_reconfigure_every=4, seed=3,
                                      **kwargs)

  def engine():
    return sync.TimelineEngine(scheme.make_protocol(), lambda w, k: speeds[w],
                               message_delay=lambda m: 0.3)

  whole, half = engine(), engine()
  while whole.num_pushes < 80:
    whole.step()
  while half.num_pushes < 37:
    half.step()
  saved = half.state_dict()
  document = json.loads(json.dumps(host_state.encode(saved)))
  back = host_state.decode(document)
  assert json.dumps(host_state.to_tree(back)) == json.dumps(host_state.to_tree(saved))
  assert type(back["protocol"]) is type(saved["protocol"])
  resumed = engine()
  resumed.load_state_dict(back)
  while resumed.num_pushes < 80:
    resumed.step()
  assert resumed.events == whole.events[len(half.events):]
  assert (json.dumps(host_state.to_tree(resumed.state_dict()))
          == json.dumps(host_state.to_tree(whole.state_dict())))
