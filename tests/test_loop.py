"""The one training loop: the executor the config picks, BSP on a cluster, no key ignored."""

import subprocess
import sys

import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax.studies import sweep
from gssp_jax.sim import executor as sim_executor
from gssp_jax.sim import simulate
from gssp_jax import executors
from gssp_jax.train import loop
from gssp_jax.base import workdir as workdir_lib


def _small(data_dir, **changes):
  return helpers.mnist_smoke(data_dir, **changes)


_metrics = helpers.metric_lines


def test_bsp_with_cluster_speeds_runs_simulated_and_reports_virtual_time(tmp_path, data_dir):
  # Worker 3 is 4x slower: BSP waits for it every round, so a round takes 4 base iterations.
  config = _small(data_dir, **{"cluster.speeds": (1.0, 1.0, 1.0, 4.0), "cluster.base_time": 0.1,
                               "train.target_accuracy": 0.1})
  # The simulator: BSP (a barrier) with rounds on a CPU, levels on an accelerator.
  assert executors.executor_name(config, backend="cpu") == "rounds"
  assert executors.executor_name(config, backend="gpu") == "levels"
  summary = loop.train_and_evaluate(config, str(tmp_path))
  lines = _metrics(tmp_path)
  assert len(lines) == 2 and all(line["virtual_time"] > 0 for line in lines)
  rounds = summary["totals"]["updates"]
  assert rounds == 512 // 4 // 32 and summary["totals"]["pushes"] == 4 * rounds
  # Every round waits for the slow worker: at least 0.4 s of compute each.
  assert summary["totals"]["virtual_time"] >= 0.4 * rounds
  assert summary["totals"]["virtual_time"] == lines[-1]["virtual_time"]
  assert summary["cluster"]["speeds"] == [1.0, 1.0, 1.0, 4.0]
  assert summary["time_to_target"] is not None and summary["time_to_target"] > 0
  assert max(lines[-1]["blocked_time_per_worker"]) > 0   # the fast workers wait


def test_the_executor_key_picks_what_it_says(tmp_path, data_dir):
  config = config_lib.default_config()
  assert executors.executor_name(config) == "fused"                 # auto: BSP, no cluster
  for changes in ({"sync.scheme": "ssp"}, {"cluster.profile": "homogeneous"},
                  {"cluster.jitter": 0.1}, {"cluster.bandwidth": 1e6}, {"executor": "rounds"}):
    changed = config_lib.override(config_lib.default_config(), changes)
    barrier = "sync.scheme" not in changes   # BSP on a cluster: rounds on a CPU
    assert executors.executor_name(changed, backend="cpu") == (
        "rounds" if "executor" in changes or barrier else "levels"), changes
    assert executors.executor_name(changed, backend="gpu") == (
        "rounds" if "executor" in changes else "levels"), changes
  # executor='rounds' on the default BSP config: the simulator on a homogeneous cluster, with
  # virtual time (one base iteration plus a push and a pull per round) and the simulator's keys.
  fused = loop.train_and_evaluate(_small(data_dir), str(tmp_path / "fused"))
  rounds = loop.train_and_evaluate(_small(data_dir, executor="rounds"), str(tmp_path / "rounds"))
  assert fused["final"]["virtual_time"] is None and "pushes" not in fused["final"]
  assert rounds["final"]["virtual_time"] > 0.05 * rounds["totals"]["updates"]
  assert rounds["final"]["pushes"] == 4 * fused["final"]["updates"]
  assert rounds["totals"]["updates"] == fused["totals"]["updates"]
  assert rounds["scheme"]["name"] == "bsp" and rounds["cluster"]["speeds"] == [1.0] * 4
  assert "scheme" not in fused and "cluster" not in fused


@pytest.mark.parametrize("changes,match", [
    ({"executor": "levels2"}, r"config.executor='levels2' is invalid; allowed: auto, fused"),
    ({"executor": "fused", "sync.scheme": "gssp"},
     r"config.executor='fused' cannot apply: sync.scheme='gssp'"),
    ({"executor": "fused", "cluster.speeds": (1.0, 2.0, 1.0, 1.0)},
     r"config.executor='fused' cannot apply: config.cluster describes a cluster"),
])
def test_an_executor_that_cannot_run_the_config_is_rejected(changes, match):
  config = config_lib.override(config_lib.default_config(), changes, check_types=False)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


@pytest.mark.parametrize("changes,match", [
    # Range checks run under every scheme, even one that does not read the key.
    ({"sync.staleness": -1}, r"^config.sync.staleness=-1 is invalid; allowed: an integer >= 0$"),
    ({"sync.scheme": "asp", "sync.staleness_range": (5, 2)},
     r"config.sync.staleness_range=\(5, 2\) is invalid"),
    ({"sync.scheme": "casp", "sync.inter_group": "ring"}, r"config.sync.inter_group='ring'"),
    ({"sync.scheme": "ssp", "sync.casp.traffic_penalty": -1.0},
     r"config.sync.casp.traffic_penalty=-1.0 is invalid"),
    # A valid value that the scheme does not read.
    ({"sync.staleness": 5}, r"^config.sync.staleness=5 cannot apply: sync.scheme='bsp' does not "
     r"read it \(read only by ssp, gssp\); leave it at its default 3$"),
    ({"sync.scheme": "asp", "sync.staleness": 0}, r"config.sync.staleness=0 cannot apply"),
    ({"sync.scheme": "ssp", "sync.num_groups": 2}, r"config.sync.num_groups=2 cannot apply: "
     r"sync.scheme='ssp'"),
    ({"sync.scheme": "ssp", "sync.staleness_range": (1, 4)},
     r"config.sync.staleness_range=\(1, 4\) cannot apply: .*read only by dssp"),
    ({"sync.scheme": "gssp", "sync.casp.max_communities": 2},
     r"config.sync.casp.max_communities=2 cannot apply: sync.scheme='gssp'"),
    ({"sync.scheme": "gssp", "sync.group_size": 4}, r"config.sync.group_size=4 cannot apply"),
    ({"sync.scheme": "dssync", "sync.grouping": "kmeans"},
     r"config.sync.grouping='kmeans' cannot apply: .*read only by gssp, inhad"),
    # Cluster keys another profile reads.
    ({"cluster.profile": "homogeneous", "cluster.tiers": (1.0, 2.0)},
     r"config.cluster.tiers=\(1.0, 2.0\) cannot apply with cluster.profile='homogeneous'"),
    ({"cluster.profile": "tiers", "cluster.sigma": 1.0},
     r"config.cluster.sigma=1.0 cannot apply with cluster.profile='tiers'"),
    ({"cluster.trace_file": "/tmp/times.csv"},
     r"config.cluster.trace_file='/tmp/times.csv' cannot apply with cluster.profile='none'.*"
     r"set cluster.profile='trace'"),
    ({"cluster.profile": "tiers", "cluster.tiers": (1.0, 2.0),
      "cluster.speeds": (1.0, 1.0, 2.0, 2.0)},
     r"config.cluster.tiers=\(1.0, 2.0\) cannot apply beside cluster.speeds"),
])
def test_a_key_that_cannot_apply_is_rejected_naming_it(changes, match):
  config = config_lib.override(config_lib.default_config(), changes, check_types=False)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_keys_the_scheme_reads_and_default_values_are_accepted():
  for scheme, changes in [
      ("ssp", {"sync.staleness": 0}), ("dssp", {"sync.staleness_range": (1, 4)}),
      ("gssp", {"sync.num_groups": 2, "sync.grouping": "kmeans", "sync.forward_every": 2}),
      ("inhad", {"sync.num_nodes": 2, "sync.grouping": "round_robin"}),
      ("dssync", {"sync.group_size": 4}), ("casp", {"sync.casp.max_communities": 2}),
      ("bsp", {"sync.staleness": 3, "cluster.profile": "lognormal", "cluster.sigma": 0.2}),
      ("asp", {"cluster.profile": "tiers", "cluster.tiers": (1.0, 2.0)})]:
    config = config_lib.override(config_lib.default_config(), {"sync.scheme": scheme, **changes})
    config_lib.validate_config(config)


def test_a_sweep_base_config_may_set_keys_for_its_other_trials(tmp_path):
  # tiny.py's base sets sync.num_groups=2 for its GSSP trials; its BSP trials leave it unread.
  trials = sweep.expand("configs/sweeps/tiny.py")
  bsp = next(t for t in trials if t.config.sync.scheme == "bsp")
  assert bsp.allow_unread == ("sync.num_groups",)
  with pytest.raises(ValueError, match=r"sync.num_groups=2 cannot apply"):
    config_lib.validate_config(bsp.config)      # alone, it would be rejected
  path = tmp_path / "never_read.py"
  path.write_text(
      "from configs import mnist_lenet5\nfrom gssp_jax.studies.sweep import sweep\n"
      "def get_config():\n  c = mnist_lenet5.get_config('smoke')\n  c.sync.group_size = 4\n"
      "  return c\n"
      "def get_sweep():\n  return sweep('sync.scheme', ['bsp', 'ssp'])\n")
  with pytest.raises(ValueError, match=r"sync.group_size=4 cannot apply"):
    sweep.expand(str(path))                   # a base key no trial reads stays an error


def test_a_run_recorded_before_the_executor_key_still_resumes(tmp_path):
  config = config_lib.default_config()
  recorded, _ = helpers.recorded_without(config, tmp_path, "executor")
  config.executor = "rounds"
  assert workdir_lib.config_changes(recorded, config) == [("executor", "auto", "rounds")]


def test_the_simulator_does_not_import_the_loop():
  code = ("import sys\n"
          "import gssp_jax.sim.simulate, gssp_jax.sim.executor, gssp_jax.sim.traffic\n"
          "bad = [m for m in ('gssp_jax.train.loop', 'gssp_jax.executors') "
          "if m in sys.modules]\n"
          "assert not bad, bad\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_buffered_device_steps_equal_one_call_per_round(tmp_path, data_dir, monkeypatch):
  """The simulator runs its steps in batches (flushed before DGC's byte reads, evaluations and
  checkpoints, and at MAX_BUFFERED_ROUNDS); the result is bit-identical to one call per round."""
  calls, make_round_runner = [], sim_executor.make_round_runner

  def recording_runner(job_fn, round_fn, *args):
    run = make_round_runner(job_fn, round_fn, *args)
    def recorded(state, arrays, steps):
      calls.append(len(steps))
      return run(state, arrays, steps)
    return recorded

  monkeypatch.setattr(sim_executor, "make_round_runner", recording_runner)
  runs = {}
  for buffered in (1, 4):
    calls.clear()
    monkeypatch.setattr(simulate, "MAX_BUFFERED_ROUNDS", buffered)
    config = _small(data_dir, **{"sync.scheme": "ssp", "sync.staleness": 1,
                                 "cluster.speeds": (1.0, 1.0, 2.0, 3.0), "compress.name": "topk",
                                 "compress.ratio": 0.1, "model": "helpers:TinyCNN",
                                 "executor": "rounds"})
    summary = loop.train_and_evaluate(config, str(tmp_path / str(buffered)))
    runs[buffered] = (_metrics(tmp_path / str(buffered)), summary["totals"]["rounds"],
                      list(calls))
  (one, rounds_one, calls_one), (four, rounds_four, calls_four) = runs[1], runs[4]
  assert one == four and rounds_one == rounds_four
  assert sum(calls_one) == sum(calls_four) == rounds_one + 1   # + the first jobs
  # One round per call (the first also carries the first jobs) against up to four.
  assert max(calls_one) <= 2 and max(calls_four) <= 5 and len(calls_four) < len(calls_one)
