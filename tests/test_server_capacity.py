"""Equal server capacity (``cluster.server_capacity='split'``): a scheme's G servers share the
cluster's server bandwidth, 1/G each, so GSSP's four group servers no longer get four times
BSP's one."""

import numpy as np
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import traffic
from gssp_jax.train import loop

SPEEDS = np.array([1.0] * 4 + [1.5] * 4 + [2.0] * 4 + [3.0] * 4)


@pytest.mark.parametrize("name, servers", [("bsp", 1), ("gssp", 4), ("dssync", 0),
                                           ("inhad", 1), ("halos", 5), ("bsp_allreduce", 0)])
def test_each_server_interface_gets_its_share_of_the_capacity(name, servers):
  scheme = sync.build_scheme(name, 16, worker_times=SPEEDS, num_groups=4, num_nodes=4,
                             group_size=4)
  cluster = cluster_lib.Cluster(speeds=SPEEDS, server_bandwidth=1e9)
  protocol = scheme.make_protocol()
  for capacity, each in (("each", 1e9), ("split", 1e9 / max(servers, 1))):
    links = traffic.Traffic(scheme.legs, cluster, lambda w, k: 100, 100, 100, shared=True,
                            capacity=capacity)
    assert links.legs.servers(protocol) == servers
    assert links.interface_bandwidth(protocol) == each


def test_a_push_into_a_split_server_takes_its_share_of_the_time():
  """GSSP with two groups of one worker each (speeds 1 and 1): each push of 1,000 bytes crosses
  its group server's interface alone; at a total of 1e6 bytes/s split two ways it takes 2 ms,
  against 1 ms when each server has the whole (the worker links are far faster)."""
  scheme = sync.build_scheme("gssp", 2, worker_times=np.ones(2), num_groups=2, staleness=1)
  cluster = cluster_lib.Cluster(speeds=np.ones(2), base_time=1.0, bandwidth=1e12, latency=0.0,
                                server_bandwidth=1e6, server_latency=0.0)
  arrivals = {}
  for capacity in ("each", "split"):
    links = traffic.Traffic(scheme.legs, cluster, lambda w, k: 1000, 1000, 1000, shared=True,
                            capacity=capacity)
    engine = links.engine(scheme.make_protocol(), cluster.compute_time, record=True)
    while engine.num_pushes < 2:
      engine.step()
    arrivals[capacity] = sorted(t for t, _, _ in engine.pushes)
  assert arrivals["each"] == pytest.approx([1.001, 1.001], abs=1e-9)
  assert arrivals["split"] == pytest.approx([1.002, 1.002], abs=1e-9)


@pytest.mark.parametrize("changes, match", [
    ({"cluster.server_capacity": "half"},
     r"config.cluster.server_capacity='half' is invalid; allowed: 'each', 'split'"),
    ({"cluster.server_capacity": "split", "cluster.shared_server_links": False},
     r"config.cluster.server_capacity='split' is invalid; allowed: 'each' with "
     r"shared_server_links=False"),
])
def test_a_bad_server_capacity_is_refused(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(helpers.cluster_config("gssp", **changes))


def test_the_summary_states_the_servers_and_their_bandwidth(tmp_path, data_dir):
  config = helpers.cluster_config("gssp", data_dir, num_epochs=1.0,
                                  **{"cluster.server_capacity": "split",
                                     "cluster.server_bandwidth": 1e8})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  cluster = summary["cluster"]
  assert (cluster["servers"], cluster["server_interface_bandwidth"]) == (2, 5e7)
  assert cluster["shared_server_links"] is True


def test_inhads_pulls_cross_its_one_server_not_one_interface_per_node():
  """InHAD's routes name its nodes; its pulls still leave its one server through one interface
  (they used to cross one per node: the server's capacity times the nodes)."""
  scheme = sync.build_scheme("inhad", 16, worker_times=SPEEDS, num_nodes=4)
  cluster = cluster_lib.Cluster(speeds=SPEEDS)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: 100, 100, 100, shared=True)
  protocol = scheme.make_protocol()
  assert len(set(protocol.route.tolist())) == 4
  assert {links.route(protocol, "pull", w, 0)[0] for w in range(16)} == {(0, "pull")}
  assert len({links.route(protocol, "push", w, 0)[0] for w in range(16)}) == 4   # node links
