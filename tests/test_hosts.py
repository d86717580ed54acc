"""One simulation across processes (``sim/hosts.py``): two ``jax.distributed`` processes of two
CPU devices each, on loopback, run the one-device simulation bit for bit, stop and resume.

The processes are started with ``--xla_force_host_platform_device_count=2`` (read when JAX
starts); every one is killed when the test ends, whatever happened.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gssp_jax.runtime import launch
from gssp_jax.sim import devices
from gssp_jax.sim import hosts

import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROCESS = textwrap.dedent(r"""
    import json, sys
    rank, port, data_dir, out, stop = (int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                       int(sys.argv[5]))
    from gssp_jax.sim import hosts
    hosts.initialize(f"127.0.0.1:{port}", 2, rank, timeout=120)
    import jax
    from gssp_jax.train import loop
    import helpers
    assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    config = helpers.cluster_config("gssp", data_dir, executor="levels", model="helpers:TinyCNN",
                                    **{"compress.name": "gdtopk", "devices": 0,
                                       "train.stop_after_updates": stop})
    summary = loop.train_and_evaluate(config, out, progress=False)
    env = summary["environment"]
    print("SUMMARY", json.dumps({"status": summary["status"],
                                 "pushes": summary["totals"]["pushes"],
                                 "processes": [env["num_processes"], env["process_index"],
                                               env["num_devices"]]}))
    jax.distributed.shutdown()
    """)


def _run_two(tmp_path, data_dir, stop: int) -> list[dict]:
  """Both processes of one run (``train.stop_after_updates=stop``); their summaries' status and
  pushes. Each is killed (its whole session) when this returns or fails."""
  script = tmp_path / "process.py"
  script.write_text(_PROCESS)
  port = launch.free_port()
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                     + " --xla_force_host_platform_device_count=2").strip(),
         "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests"), REPO,
                                        os.environ.get("PYTHONPATH", "")])}
  procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), data_dir,
                             str(tmp_path / "run"), str(stop)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True) for rank in (0, 1)]
  outs = []
  try:
    for proc in procs:
      try:
        outs.append(proc.communicate(timeout=300)[0])
      except subprocess.TimeoutExpired:
        outs.append("(timed out after 300 s)")
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    outs += [proc.communicate()[0] or "" for proc in procs[len(outs):]]
  tails = "\n".join(f"process {i}: ...{out[-3000:]}" for i, out in enumerate(outs))
  assert all(proc.returncode == 0 for proc in procs), tails
  return [json.loads([x for x in out.splitlines() if x.startswith("SUMMARY ")][-1][8:])
          for out in outs]


@pytest.mark.slow
def test_two_processes_stop_resume_and_end_with_one_devices_metrics_and_weights(tmp_path,
                                                                               data_dir):
  """GSSP with GDTopK on the levels executor, 4 workers, on 2 processes x 2 CPU devices (one
  job slot each): stopped at 11 pushes and resumed from process 0's checkpoint (the only one;
  process 1 gets its state from process 0), each process's metrics and the final weights equal
  the one-device run's, bit for bit (the reported training loss to its last bits, as on one
  process's four devices, ``test_devices``); process 1's copy is in ``run/process_1``."""
  from gssp_jax.train import loop, trained  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  first = _run_two(tmp_path, data_dir, stop=11)
  assert first == [{"status": "stopped", "pushes": 11, "processes": [2, i, 4]}
                   for i in (0, 1)], first
  second = _run_two(tmp_path, data_dir, stop=0)
  assert second == [{"status": "done", "pushes": 16, "processes": [2, i, 4]}
                    for i in (0, 1)], second
  assert "cpu: 4 x cpu over 2 processes (this one 1)" in (
      tmp_path / "run" / "process_1" / "log.txt").read_text()

  config = helpers.cluster_config("gssp", data_dir, executor="levels", model="helpers:TinyCNN",
                                  **{"compress.name": "gdtopk"})
  assert loop.train_and_evaluate(config, str(tmp_path / "one"), progress=False)["status"] == "done"
  want = helpers.metric_lines(tmp_path / "one")
  weights = lambda d: [np.asarray(x) for x in jax.tree.leaves(trained.load_trained(d).params)]
  assert len(want) == 2
  for where in (tmp_path / "run", tmp_path / "run" / "process_1"):
    got = helpers.metric_lines(where)
    assert len(got) == len(want), where
    for many, one in zip(got, want):
      assert many["train_loss"] == pytest.approx(one["train_loss"], rel=1e-6)
      assert ({k: v for k, v in many.items() if k != "train_loss"}
              == {k: v for k, v in one.items() if k != "train_loss"}), where
  for a, b in zip(weights(str(tmp_path / "run")), weights(str(tmp_path / "one"))):
    np.testing.assert_array_equal(a, b)
  assert sorted(os.listdir(tmp_path / "run" / "process_1")) == sorted(
      set(os.listdir(tmp_path / "run")) - {"process_1", "checkpoints"})


def test_across_processes_every_device_is_used_or_the_count_is_refused():
  assert devices.count(0, 4, processes=2) == 4 and devices.count(4, 4, processes=2) == 4
  for bad in (1, 2):
    with pytest.raises(ValueError, match=rf"config.devices={bad} is invalid across 2 processes: "
                                         r"the simulation uses every process's devices; allowed: "
                                         r"0 or 4 \(all\)"):
      devices.count(bad, 4, processes=2)


@pytest.mark.parametrize("args,error", [
    (("127.0.0.1", 2, 0), r"coordinator_address='127.0.0.1' is invalid; allowed: host:port"),
    (("127.0.0.1:x", 2, 0), r"coordinator_address='127.0.0.1:x' is invalid"),
    (("127.0.0.1:1234", 1, 0), r"num_processes=1 is invalid; allowed: an int >= 2"),
    (("127.0.0.1:1234", 2, 2), r"process_id=2 is invalid; allowed: 0..1"),
    (("127.0.0.1:1234", 2, -1), r"process_id=-1 is invalid")])
def test_bad_cluster_arguments_are_refused_before_anything_starts(args, error):
  with pytest.raises(ValueError, match=error):
    hosts.initialize(*args)


def test_the_command_refuses_a_process_id_without_processes(tmp_path):
  """``experiments.main``: a lone ``--process_id`` is an error, not ignored; no workdir is left."""
  out = subprocess.run(
      [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
       f"--workdir={tmp_path / 'w'}", "--process_id=1"], cwd=REPO, capture_output=True,
      text=True, timeout=120)
  assert out.returncode != 0
  assert "num_processes=1 is invalid; allowed: an int >= 2" in out.stderr + out.stdout
  assert not (tmp_path / "w").exists()


def _as_two_processes(monkeypatch, rows):
  """``hosts`` as process 0 of two, whose gathers return ``rows(values)`` (the other's row)."""
  monkeypatch.setattr(hosts, "processes", lambda: 2)
  monkeypatch.setattr(hosts, "_gathered",
                      lambda v: np.stack([np.asarray(v, np.int32), rows(np.asarray(v))]))


def test_what_processes_agree_on(monkeypatch):
  """Any process's stop or save is everyone's; process 0's calibrated time is everyone's, bit
  for bit."""
  assert hosts.agree_any(True) and not hosts.agree_any(False)   # one process: its own
  assert hosts.agree_value(0.1) == 0.1 and hosts.share_bytes(b"ab") == b"ab"
  _as_two_processes(monkeypatch, lambda v: np.ones_like(v, np.int32))
  assert hosts.agree_any(False)
  _as_two_processes(monkeypatch, lambda v: np.zeros_like(v, np.int32))
  assert not hosts.agree_any(False) and hosts.agree_any(True)
  # The other process measured another time: process 0's (this one's) is taken.
  _as_two_processes(monkeypatch, lambda v: np.asarray([0.5], np.float64).view(np.int32))
  assert hosts.agree_value(0.123456789) == 0.123456789


def test_a_state_travels_as_its_bytes_exactly():
  """What process 0 restores reaches the others as bytes: every dtype, -0.0 and NaN's bits."""
  state = {"w": np.asarray([[-0.0, np.nan], [1e-38, 3.0]], np.float32),
           "k": np.arange(5, dtype=np.int64) - 2, "m": np.asarray([True, False]),
           "u": np.asarray(7, np.uint32)}
  template = {k: np.zeros_like(v) for k, v in state.items()}
  back = hosts.tree_from_bytes(hosts.tree_bytes(state), template)
  for key, value in state.items():
    assert back[key].dtype == value.dtype and back[key].shape == value.shape
    assert back[key].tobytes() == value.tobytes(), key
  with pytest.raises(ValueError, match="63 bytes sent for a state of 62"):
    hosts.tree_from_bytes(hosts.tree_bytes(state) + b"x", template)
