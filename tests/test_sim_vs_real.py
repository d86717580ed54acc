"""The simulator against a real run (``benchmarks/sim_vs_real.py``): the comparison's figures, and
one small case for real (two meshes in network namespaces, their links shaped by ``tc``)."""

import numpy as np
import pytest

import netns
from benchmarks import sim_vs_real


def test_the_comparison_of_two_push_logs():
  """Two logs of the same pushes, the simulated one 10 % slower and one push moved from mesh 1
  to mesh 0: the span's error, the pushes' error and the order's correlation follow."""
  real_log = [[0.1 * i, i % 2] for i in range(20)]
  sim_log = [[0.11 * i, i % 2] for i in range(20)]
  sim_log[-1][1] = 0
  real = {"push_log": real_log, "totals": {"staleness": {"hist": [10, 10], "mean": 0.5},
                                           "blocked_time_per_worker": [0.0, 1.0]}}
  sim = {"push_log": sim_log, "staleness": {"hist": [5, 15], "mean": 0.75}, "blocked": [0, 1]}
  f = sim_vs_real.compare(real, sim, 2)
  assert f["span_error"] == pytest.approx(0.1)
  assert f["staleness_tv"] == pytest.approx(0.25)
  assert f["pushes_real"] == [10, 10] and f["pushes_sim"] == [11, 9]
  assert f["pushes_error"] == pytest.approx(0.1)
  assert f["order_correlation"] > 0.9   # the pushes both logs have, in the same order
  assert f["met"] == {"span": False, "staleness_tv": False, "pushes": False}
  assert sim_vs_real.tv_distance([1, 0], [0, 0, 1]) == 1.0


@pytest.mark.parametrize("meshes", [2, 4])
def test_a_case_config_is_valid_for_every_scheme_and_cluster(data_dir, meshes):
  from gssp_jax import config as config_lib
  for scheme in sim_vs_real.SCHEMES:
    for cluster in sim_vs_real.CLUSTERS:
      config = sim_vs_real.make_config(sim_vs_real.Case(scheme, cluster, meshes=meshes))
      config.data_dir = data_dir
      config.executor = "dist"
      config_lib.validate_config(config)
      assert not config.dist.emulate_network and config.dist.record_pushes


@pytest.mark.slow
def test_one_small_case_for_real(tmp_path, data_dir):
  """BSP on 2 meshes at speeds 1 and 2 (0.2 s a step), links of 2.5 MB/s imposed by ``tc``:
  the simulated span within 10 % of the real one, every push's mesh and order as simulated."""
  if reason := netns.skip_reason():
    pytest.skip(reason)
  del data_dir   # the runs read it from $GSSP_DATA_DIR, as the fixture checked
  latency = sim_vs_real.calibrate(str(tmp_path), meshes=2, pushes=24, base_time=0.2,
                                  bandwidth=2.5e6, timeout=240)
  assert 0 <= latency < 0.05   # a few milliseconds a transfer on loopback-like links
  case = sim_vs_real.Case("bsp", "tiers", meshes=2, pushes=32)
  f = sim_vs_real.run_case(case, str(tmp_path), latency, timeout=240)
  assert f["pushes"] == 32 and f["pushes_real"] == f["pushes_sim"] == [16, 16]
  assert abs(f["span_error"]) < 0.1, f
  assert f["staleness_tv"] == 0.0   # BSP: every push is fresh
  assert f["order_correlation"] > 0.95, f
  assert np.all(np.asarray(f["blocked_real"]) >= 0)
