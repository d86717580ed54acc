"""A network topology (``sim/topology.py``): workers and servers in regions, every link a transfer
crosses shared max-min fairly over the whole network (``sync.links.NetworkLinks``), presets, and
bad topologies refused with one line."""

import numpy as np
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import topology as topology_lib
from gssp_jax.sim import traffic
from gssp_jax.sync import links as links_lib
from gssp_jax.train import loop


def test_progressive_filling_by_hand_and_on_one_link():
  # Link A (10) carries transfers 0 and 1, link B (4) transfers 0 and 2: B fills first at 2
  # each; transfer 1 takes what A has left (8).
  assert links_lib.network_rates([("A", "B"), ("A",), ("B",)], [100, 100, 100],
                                 {"A": 10.0, "B": 4.0}) == pytest.approx([2, 8, 2])
  # A cap below the share: transfer 1 stops at 1, and the others share the rest of A.
  assert links_lib.network_rates([("A",), ("A",), ("A",)], [100, 1, 100],
                                 {"A": 10.0}) == pytest.approx([4.5, 1, 4.5])
  rng = np.random.default_rng(0)
  for _ in range(50):   # one link per path: the single-link water-filling
    caps = rng.uniform(0.1, 5, size=rng.integers(1, 8)).tolist()
    got = links_lib.network_rates([("L",)] * len(caps), caps, {"L": 6.0})
    assert got == pytest.approx(links_lib.max_min_rates(caps, 6.0))


def _schedule(links, starts):
  """``{i: end time}`` of transfers ``starts[i] = (time, key, bytes, cap)``, in time order."""
  keys = {links.event_key(s[1]) for s in starts}
  ends, i = {}, 0
  while True:
    live = [(links.next_end(k), k) for k in keys if links.next_end(k) is not None]
    t_end, key = min(live) if live else (np.inf, None)
    t_start = starts[i][0] if i < len(starts) else np.inf
    if t_start == t_end == np.inf:
      return ends
    if t_start <= t_end:
      time, path, num_bytes, cap = starts[i]
      links.start(path, time, i, num_bytes, cap)
      i += 1
    else:
      for tag in links.finish(key, t_end):
        ends[tag] = t_end


def test_one_link_paths_give_the_shared_links_schedule():
  rng = np.random.default_rng(1)
  starts = sorted((float(rng.uniform(0, 2)), int(rng.integers(2)), float(rng.uniform(1, 5)),
                   float(rng.uniform(0.5, 3))) for _ in range(12))
  shared = _schedule(links_lib.SharedLinks(4.0), [(t, ("s", k), b, c) for t, k, b, c in starts])
  network = _schedule(links_lib.NetworkLinks(4.0),
                      [(t, ((("s", k), None),), b, c) for t, k, b, c in starts])
  assert len(shared) == len(network) == 12
  assert [shared[i] for i in range(12)] == pytest.approx([network[i] for i in range(12)],
                                                         rel=1e-9)


def _engine(name, cluster, workers, pull=1000, push=1000, **kw):
  scheme = sync.build_scheme(name, workers, worker_times=np.ones(workers), **kw)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: push, push, pull, shared=True)
  return links.engine(scheme.make_protocol(), cluster.compute_time, record=True)


def _regions(regions, bandwidth, uplink=(), latency=(), server_region=0):
  cfg = helpers.mnist_smoke(**{
      "num_workers": len(regions), "cluster.topology": "regions", "cluster.regions": regions,
      "cluster.region_bandwidth": bandwidth, "cluster.uplink_bandwidth": uplink,
      "cluster.region_latency": latency, "cluster.server_region": server_region}).cluster
  return topology_lib.from_config(cfg, len(regions), np.full([len(regions)], 1e12))


def test_pushes_from_another_region_share_the_pipe_between_them():
  """BSP, 4 workers: 0 and 1 beside the server (region 0), 2 and 3 in region 1 behind a pipe of
  1e6 bytes/s each way; links and the server's interface far faster. Each push of 1,000 bytes
  from region 1 gets half the pipe: 2 ms, so the round's pushes arrive at 1.000 s (local) and
  1.002 s (remote); the pulls to region 1 share the other direction: 2 ms again."""
  topology = _regions((0, 0, 1, 1), ((1e12, 1e6), (1e6, 1e12)))
  cluster = cluster_lib.Cluster(speeds=np.ones(4), base_time=1.0, bandwidth=1e12, latency=0.0,
                                server_bandwidth=1e12, server_latency=0.0, topology=topology)
  engine = _engine("bsp", cluster, 4)
  while engine.num_pushes < 8:
    engine.step()
  first = sorted((w, t) for t, w, k in engine.pushes if k == 0)
  assert [t for _, t in first] == pytest.approx([1.0, 1.0, 1.002, 1.002], abs=1e-8)
  starts = {w: t for t, w, k in engine.starts if k == 1}
  assert starts[0] == pytest.approx(1.002, abs=1e-8) and starts[1] == pytest.approx(1.002)
  assert starts[2] == pytest.approx(1.004, abs=1e-8) and starts[3] == pytest.approx(1.004)


def test_an_oversubscribed_uplink_is_shared_by_the_racks_transfers():
  """4 racks of 2 workers, each rack's uplink (and downlink) a quarter of its workers' links
  (2 x 1e6 / 4 = 5e5 bytes/s); the server in rack 0. The six remote pushes of 1,000 bytes share
  their racks' uplinks two by two (2.5e5 each) and rack 0's downlink six ways (8.3e4 each, the
  bottleneck): 12 ms, where alone on its own link a push takes 1 ms, as rack 0's own do."""
  cfg = helpers.mnist_smoke(**{"num_workers": 8, "cluster.topology": "oversubscribed"}).cluster
  topology = topology_lib.from_config(cfg, 8, np.full([8], 1e6))
  np.testing.assert_allclose(topology.uplink, [5e5] * 4)
  cluster = cluster_lib.Cluster(speeds=np.ones(8), base_time=1.0, bandwidth=1e6, latency=0.0,
                                server_bandwidth=1e12, server_latency=0.0, topology=topology)
  engine = _engine("asp", cluster, 8)
  while engine.num_pushes < 8:
    engine.step()
  arrivals = {w: t for t, w, k in engine.pushes if k == 0}
  assert [arrivals[w] for w in (0, 1)] == pytest.approx([1.001, 1.001], abs=1e-8)
  assert [arrivals[w] for w in range(2, 8)] == pytest.approx([1.012] * 6, abs=1e-8)


def test_group_servers_sit_in_their_groups_regions_and_exchange_across():
  """HALoS-like: GSSP with a global server over 2 regions; group g's server is in region g and
  the global server in cluster.server_region (1). A group's delivery to the global server
  crosses the pipe from its region (region 0's: 1e6 bytes/s, so 1 ms for 1,000 bytes; region
  1's stays inside: nothing but the interface)."""
  topology = _regions((0, 0, 1, 1), ((1e12, 1e6), (1e6, 1e12)), server_region=1)
  cluster = cluster_lib.Cluster(speeds=np.ones(4), base_time=1.0, bandwidth=1e12, latency=0.0,
                                server_bandwidth=1e12, server_latency=0.0, topology=topology)
  scheme = sync.build_scheme("gssp", 4, worker_times=np.ones(4), num_groups=2, staleness=1,
                             inter_group="global", grouping_method="contiguous")
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: 1000, 1000, 1000, shared=True)
  links.engine(scheme.make_protocol(), cluster.compute_time)
  assert links.legs.server_region[:3] == [0, 1, 1]   # the group servers, the global one
  protocol = scheme.make_protocol()
  deliver0 = links.legs.message_route(protocol, sync.Message("deliver", 0), np.zeros(4))
  assert [hop for hop, _ in deliver0[0]] == [("servers", 2, "push"), ("wan", 0, 1)]
  deliver1 = links.legs.message_route(protocol, sync.Message("deliver", 1), np.zeros(4))
  assert [hop for hop, _ in deliver1[0]] == [("servers", 2, "push")]
  assert links.legs.message_delay(protocol, sync.Message("adopt", 0), np.zeros(4)) == (
      pytest.approx(1000 / 1e6))


def test_the_halos_preset():
  cfg = helpers.mnist_smoke(**{"num_workers": 16, "cluster.topology": "halos"}).cluster
  t = topology_lib.from_config(cfg, 16, np.full([16], 1.25e9))
  assert t.regions.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  assert t.bandwidth[1, 3] == pytest.approx(0.117 * 1.25e8)
  assert t.bandwidth[0, 2] == pytest.approx(0.935 * 1.25e8)
  assert np.all(np.diag(t.bandwidth) == 100 * 1.25e8)
  np.testing.assert_array_equal(t.bandwidth, t.bandwidth.T)
  # An uncontended pull of 1 MB from the server (region 0) to region 3: over 0.202 Gb/s.
  assert t.transfer_time(1e6, 1.25e9, 0.0, 0, 3) == pytest.approx(1e6 / (0.202 * 1.25e8))


@pytest.mark.parametrize("changes, match", [
    ({"cluster.topology": "mesh"}, r"config.cluster.topology='mesh' is invalid; allowed: '', "
                                   r"'regions', 'halos', 'oversubscribed'"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 1, 1),
      "cluster.region_bandwidth": ((1e9, 1e8), (1e8, 1e9))},
     r"config.cluster.regions=\(0, 1, 1\) is invalid; allowed: 4 region ids"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 2, 2, 0),
      "cluster.region_bandwidth": ((1e9, 1e8), (1e8, 1e9))},
     r"regions numbered 0..R-1 with a worker in each \(region 1 has none\)"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 0, 1, 1),
      "cluster.region_bandwidth": ((1e9, 1e8, 1e8), (1e8, 1e9, 1e8))},
     r"config.cluster.region_bandwidth=.* is invalid; allowed: a 2 x 2 matrix"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 0, 1, 1),
      "cluster.region_bandwidth": ((1e9, -1e8), (1e8, 1e9))},
     r"positive finite bytes/s \(entry \[0\]\[1\] is -100000000.0\)"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 0, 1, 1),
      "cluster.region_bandwidth": ((1e9, 1e8), (1e8, 1e9)),
      "cluster.region_latency": ((0.0, -1.0), (0.0, 0.0))},
     r"config.cluster.region_latency=.* is invalid; allowed: finite seconds >= 0 \(entry \[0\]"
     r"\[1\] is -1.0\)"),
    ({"cluster.topology": "regions", "cluster.regions": (0, 0, 1, 1),
      "cluster.region_bandwidth": ((1e9, 1e8), (1e8, 1e9)), "cluster.uplink_bandwidth": (1.0,)},
     r"config.cluster.uplink_bandwidth=\(1.0,\) is invalid; allowed: 2 numbers"),
    ({"cluster.topology": "halos", "cluster.regions": (0, 0, 1, 1)},
     r"config.cluster.regions=\(0, 0, 1, 1\) cannot apply with cluster.topology='halos'"),
    ({"cluster.topology": "halos", "num_workers": 6},
     r"config.cluster.topology='halos' is invalid; allowed: a topology whose 4 regions divide "
     r"num_workers=6"),
    ({"cluster.topology": "halos", "cluster.server_region": 4},
     r"config.cluster.server_region=4 is invalid; allowed: a region id in 0..3"),
    ({"cluster.server_region": 1}, r"config.cluster.server_region=1 cannot apply without "
                                   r"cluster.topology"),
    ({"cluster.topology": "halos", "sync.scheme": "dssync"},
     r"config.cluster.topology='halos' is invalid; allowed: '' \(none\) with "
     r"sync.scheme='dssync'"),
])
def test_a_bad_topology_is_one_line(changes, match):
  config = helpers.cluster_config("ssp", **changes)
  with pytest.raises(ValueError, match=match) as e:
    config_lib.validate_config(config)
  assert "\n" not in str(e.value)


def test_the_real_runtime_refuses_a_topology():
  from gssp_jax.runtime import settings
  config = helpers.cluster_config("ssp", **{"cluster.topology": "halos"})
  with pytest.raises(ValueError, match=r"config.cluster.topology='halos' cannot apply to the "
                                       r"real runtime"):
    settings.check_real_run(config)


def test_a_run_on_the_halos_preset_and_its_resume(tmp_path, data_dir):
  """GSSP (a global server) on 4 workers in the HALoS regions (one each): the run reports its
  topology, its transfers across regions make it slower than the same run without, and a run
  stopped mid-way (transfers in flight on the network) resumes to the uninterrupted result."""
  changes = {"cluster.jitter": 0.0, "sync.inter_group": "global"}
  runs = {}
  for name, extra in (("flat", {}), ("halos", {"cluster.topology": "halos"}),
                      ("resumed", {"cluster.topology": "halos", "train.stop_after_updates": 5})):
    config = helpers.cluster_config("gssp", data_dir, num_epochs=1.0, eval_every=0.5,
                                    **changes, **extra)
    runs[name] = loop.train_and_evaluate(config, str(tmp_path / name), progress=False)
  assert runs["resumed"]["status"] != "done"
  config.train.stop_after_updates = 0
  runs["resumed"] = loop.train_and_evaluate(config, str(tmp_path / "resumed"), progress=False)
  assert runs["halos"]["cluster"]["topology"]["name"] == "halos"
  assert "topology" not in runs["flat"]["cluster"]
  assert runs["halos"]["totals"]["virtual_time"] > runs["flat"]["totals"]["virtual_time"]
  assert helpers.metric_lines(str(tmp_path / "resumed")) == helpers.metric_lines(
      str(tmp_path / "halos"))
