"""One simulation over several local devices (``config.devices``, ``sim/devices.py``).

The multi-device runs happen in a child process started with
``--xla_force_host_platform_device_count=4`` (the flag is read when JAX starts, and this
process has one CPU device); the refusals are checked here, before anything is compiled.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gssp_jax import config as config_lib
from gssp_jax.sim import devices
from gssp_jax import executors

import helpers

_CHILD = textwrap.dedent(r"""
    import json, re, sys
    import jax, numpy as np
    from gssp_jax.sim import chunk as chunk_lib, devices
    from gssp_jax.train import loop, trained
    import helpers
    data_dir, out = sys.argv[1], sys.argv[2]
    assert jax.local_device_count() == 4, jax.local_devices()
    result = {}
    collective = r"(?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
    # 0: all four; "resumed": stopped after 12 updates, then resumed from its checkpoint.
    for name, changes in (("one", {"devices": 1}), ("four", {"devices": 0}),
                          ("resumed", {"devices": 0, "train.stop_after_updates": 12})):
      config = helpers.cluster_config("gssp", data_dir, executor="levels", model="helpers:TinyCNN",
                                      **{"compress.name": "gdtopk"}, **changes)
      summary = loop.train_and_evaluate(config, f"{out}/{name}", progress=False)
      if name == "resumed":
        assert summary["status"] == "stopped", summary["status"]
        config.train.stop_after_updates = 0
        summary = loop.train_and_evaluate(config, f"{out}/{name}", progress=False)
      weights = trained.load_trained(f"{out}/{name}").params
      result[name] = {"status": summary["status"],
                      "metrics": helpers.metric_lines(f"{out}/{name}"),
                      "weights": [np.asarray(x).tobytes().hex() for x in jax.tree.leaves(weights)]}
      if name == "four":   # the compiled chunk: its collectives, and where they are
        sim = loop.build_run(config, f"{out}/hlo")
        runner = sim.feed
        plan = chunk_lib.pack(runner.packing, runner.planner.empty_chunk().device_tree())
        text = runner.chunk_fn.lower(sim.state, sim.arrays,
                                     devices.place(plan, runner.mesh)).compile().as_text()
        bodies = set(re.findall(r" while\(.*?body=(%[\w.-]+)", text))
        blocks = {b.split(" ", 1)[0]: b for b in re.split(r"\n(?=\S)", text)}
        rows = lambda x: {s.data.shape[0] for s in x.addressable_shards}
        result["hlo"] = {"collectives": len(re.findall(rf" {collective}(?:-start)?\(", text)),
                         "in_loops": sum(len(re.findall(collective, blocks.get(b, "")))
                                         for b in bodies),
                         "loops": len(bodies), "pieces": runner.shape.pieces,
                         # rows per device: the pulled weights and GDTopK's residuals by owner
                         "worker_rows": sorted(rows(sim.state.worker_params)),
                         "residual_rows": sorted(rows(jax.tree.leaves(sim.state.comp_state.residual)[0])),
                         "gradient_rows": sorted(rows(sim.state.grad_buf))}
    json.dump(result, open(f"{out}/result.json", "w"))
    """)


@pytest.mark.slow
def test_four_devices_give_one_devices_metrics_and_weights_bit_for_bit(tmp_path, data_dir):
  """GSSP with GDTopK on the levels executor, 4 workers: on all 4 CPU devices (devices=0), one
  job slot each, every final weight and every metric but the reported training loss equals the
  one-device run's, bit for bit: each job's gradient is the same program on the same inputs, and
  every round runs on every device. The
  compiled chunk gathers the jobs' results a fixed number of times per piece, never in a loop."""
  script = tmp_path / "child.py"
  script.write_text(_CHILD)
  here = os.path.dirname(os.path.abspath(__file__))
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                     + " --xla_force_host_platform_device_count=4").strip(),
         "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
  subprocess.run([sys.executable, str(script), data_dir, str(tmp_path)], env=env, check=True,
                 timeout=600)
  result = json.loads((tmp_path / "result.json").read_text())
  assert result["one"]["status"] == result["four"]["status"] == result["resumed"]["status"] == "done"
  assert result["four"]["weights"] == result["one"]["weights"] == result["resumed"]["weights"]
  assert len(result["four"]["metrics"]) == len(result["one"]["metrics"]) == 2
  for run in ("four", "resumed"):
    for many, one in zip(result[run]["metrics"], result["one"]["metrics"]):
      # The training loss is a report, not an input to training: each job's batch mean is a
      # reduction XLA schedules differently in the two programs (measured: the last bit or two).
      many, one = dict(many), dict(one)
      assert many.pop("train_loss") == pytest.approx(one.pop("train_loss"), rel=1e-6)
      assert many == one
  # A fixed number of collectives per piece (the jobs' results gathered, the owned rows they
  # read exchanged), none inside a loop (the rounds' scans).
  hlo = result["hlo"]
  assert hlo["collectives"] > 0 and hlo["collectives"] % hlo["pieces"] == 0, hlo
  assert hlo["loops"] > 0 and hlo["in_loops"] == 0, hlo
  # Memory by owner: each device holds one worker's row of the pulled weights and of GDTopK's
  # residuals (4 workers, 4 devices); the outstanding gradients, which rounds read, all 4.
  assert hlo["worker_rows"] == hlo["residual_rows"] == [1] and hlo["gradient_rows"] == [4], hlo


@pytest.mark.parametrize("value,executor,error", [
    (-1, "levels", r"config.devices=-1 is invalid; allowed: 0 \(all 1 local devices\) or 1..1"),
    (2, "levels", r"config.devices=2 is invalid: this process has 1 local cpu device"),
    (0, "rounds", r"config.devices=0 cannot apply: it sets the levels executor, and this run "
                  r"uses 'rounds'"),
    (3, "auto", r"config.devices=3 is invalid: this process has 1 local cpu device")])
def test_a_device_count_that_cannot_apply_is_refused_before_anything_is_built(value, executor,
                                                                              error):
  config = config_lib.override(helpers.cluster_config("ssp"), {"executor": executor})
  config.devices = value
  with pytest.raises(ValueError, match=error):
    config_lib.validate_config(config)
  config.devices = 1
  config_lib.validate_config(config)   # the default applies to every executor
  executors.validate_levels_per_call(config)


def test_job_slots_that_do_not_split_evenly_are_refused():
  """And a count that is not an int (a config's own type check refuses it first)."""
  devices.check_slots(4, 8)
  for bad in ("2", True, 1.5):
    with pytest.raises(ValueError, match=f"config.devices={bad!r} is invalid"):
      devices.count(bad, 4)
  with pytest.raises(ValueError, match=r"config.devices=4 cannot split a piece's 6 job slots "
                                       r"evenly; allowed: .*level_job_slots to a multiple of 4"):
    devices.check_slots(4, 6)
  assert devices.mesh_for(1) is None
  assert devices.count(0, 4) == 4 and devices.count(3, 4) == 3
