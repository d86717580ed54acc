"""Traffic per class (``sync.legs``): each scheme's legs, on hand-computed two-worker cases.

The cluster of these tests: two workers, worker 0 computes 1 s per iteration,
worker 1 2 s; links so fast that transfers take microseconds, so the event
order is that of the compute. A push is ``P`` bytes, a dense gradient ``D``,
a pull ``Q``. Each run stops once 6 pushes have reached their destination.
"""

import jax
import numpy as np
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax.runtime import settings
from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import records
from gssp_jax.sim import traffic
from gssp_jax.sync import legs as legs_lib
from gssp_jax.sync.schemes.casp import legs as casp_legs
from gssp_jax.sync.schemes.inhad import legs as inhad_legs
from gssp_jax.sync.schemes.ssp import legs as ring
from gssp_jax.train import loop
from gssp_jax.train import trained

P, D, Q = 1000, 1000, 3000


def _cluster():
  return cluster_lib.Cluster(speeds=np.array([1.0, 2.0]), base_time=1.0, bandwidth=1e9,
                             latency=0.0, server_latency=0.0, node_latency=0.0)


def _count(scheme, pushes=6):
  """Runs ``scheme`` until ``pushes`` pushes; returns its traffic fields, counted as the real
  runtime counts (every round as it happens), after checking that the simulator's deferred
  counting (``records.account_rounds``) gives the same counters."""
  cluster = _cluster()
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: P, D, Q)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time)
  now, deferred = records.new_counters(2), records.new_counters(2)
  accts = [sync.accounting.Accounting(2, scheme.num_replicas,
                                      aggregating=engine.protocol.aggregating) for _ in range(2)]
  rounds = []
  while engine.num_pushes < pushes:
    for rnd in engine.step():
      records.account_round(rnd, host=now, acct=accts[0], protocol=engine.protocol,
                            links=links, iteration=engine.iteration, learning_rate=0.1,
                            pull_bytes=Q)
      if links.counts_per_round:
        links.count_round(engine.protocol, rnd, engine.iteration, deferred)
      rounds.append(rnd)
  records.account_rounds(rounds, host=deferred, acct=accts[1], protocol=engine.protocol,
                         links=links, pull_bytes=Q)
  for host in (now, deferred):
    if links.counts_device_pushes:   # the device counts every push it applies (P bytes here)
      host["pushed_per_worker"] += P * sum(r.arrived.astype(np.int64) for r in rounds)
  assert records.traffic(now, Q) == records.traffic(deferred, Q)
  return records.traffic(now, Q)


def _classes(fields):
  return {name: n for name, n in fields["bytes_by_class"].items() if n}


# Per scheme: its settings, and the bytes of each class after 6 pushes (the others are 0).
EXPECTED = {
    # 3 barriers, 2 pushes and 2 pulls each.
    "bsp": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    "local_sgd": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    "diloco": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    # DS-Sync's groups of 2 (everyone): 3 averagings; each member's push to its own replica
    # and pull back are charged over its link, as its delays are.
    "dssync": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    # Each push pulled at once.
    "asp": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    "async_local_sgd": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    "dssp": ({}, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    # Staleness 0: worker 0 waits for worker 1 after each push; both pull at 2, 4, 6 s.
    "ssp": (dict(staleness=0), dict(worker_to_server=6 * P, server_to_worker=6 * Q)),
    # Two groups of one: every push is forwarded to the other group server; the 6th push's
    # forward is still in flight, so 5 deliveries of Q bytes each.
    "gssp": (dict(num_groups=2), dict(worker_to_server=6 * P, server_to_worker=6 * Q,
                                      server_to_server=5 * Q)),
    # HALoS, two groups of one: 5 progress sums to the global server and its 5 replies.
    "halos": (dict(num_groups=2), dict(worker_to_server=6 * P, server_to_worker=6 * Q,
                                       server_to_server=10 * Q)),
    # One node: 6 gradients to the node, 6 iteration numbers to the server, 2 pulls of the one
    # node aggregate (threshold W = 2 INs, one pull in flight at a time), 6 pulls.
    "inhad": (dict(num_nodes=1), dict(worker_to_server=6 * legs_lib.IN_BYTES,
                                      worker_to_node=6 * P, node_to_server=2 * D,
                                      server_to_worker=6 * Q)),
    # One community of both: 2 community pushes applied (the 3rd in flight), each the leader's
    # one payload (min(D, 2 P)) to the server, member 1's gradient to the leader and the
    # leader's copy of the server's reply to member 1.
    "casp": (dict(casp_max_communities=1), dict(worker_to_server=2 * D, server_to_worker=2 * Q,
                                                member_leader=2 * (P + Q))),
    # No server: 3 barriers, each a ring all-reduce of 2 (W - 1) = 2 steps in which each of the
    # 2 workers sends a D / 2 chunk: 2 D bytes each.
    "bsp_allreduce": ({}, dict(ring_allreduce=3 * 2 * D)),
}


def test_every_built_in_scheme_has_its_hand_computed_case():
  assert set(EXPECTED) == set(sync.SCHEMES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_of_traffic_of_every_built_in_scheme(name):
  settings, want = EXPECTED[name]
  fields = _count(sync.build_scheme(name, 2, worker_times=[1.0, 2.0], **settings))
  assert _classes(fields) == want
  assert fields["bytes_total"] == sum(want.values())
  get = lambda name: want.get(name, 0)
  assert fields["bytes_pushed"] == get("worker_to_server") + get("node_to_server")
  assert fields["bytes_pulled"] == get("server_to_worker")
  assert fields["bytes_between_servers"] == get("server_to_server")
  assert fields["bytes_local"] == get("worker_to_node") + get("member_leader")


class _RelayLegs(legs_lib.ServerLegs):
  """A researcher's legs: each push also goes to a peer (counted as member <-> leader)."""

  def count_round(self, protocol, rnd, iteration, host):
    super().count_round(protocol, rnd, iteration, host)
    legs_lib.add(host, "member_leader", P * int(rnd.arrived.sum()))

  def count_rounds(self, stacked, host):
    super().count_rounds(stacked, host)
    legs_lib.add(host, "member_leader", P * int(stacked["arrived"].sum()))


def _registered(name, legs):
  def build(config, worker_times):
    del worker_times
    W = config.num_workers
    scheme = sync.build_scheme("asp", W)
    kw = {} if legs is None else {"legs": legs}
    return sync.Scheme(name, scheme.transform, scheme.make_protocol, W, 1, scheme.groups, **kw)
  sync.register_scheme(name, build, sync_keys=())
  config = config_lib.default_config()
  config.sync.scheme, config.num_workers = name, 2
  return sync.scheme_from_config(config)


@pytest.mark.parametrize("legs,want", [
    (None, dict(worker_to_server=6 * P, server_to_worker=6 * Q)),   # the default: push + pull
    (_RelayLegs, dict(worker_to_server=6 * P, server_to_worker=6 * Q, member_leader=6 * P)),
])
def test_a_registered_scheme_gets_its_traffic_counted(legs, want):
  try:
    scheme = _registered("mine", legs)
    assert scheme.legs is (legs or legs_lib.ServerLegs)
    assert _classes(_count(scheme)) == want
  finally:
    sync.unregister_scheme("mine")


def test_an_unknown_traffic_class_is_refused_naming_it():
  with pytest.raises(ValueError, match=r"traffic classes \['sideways'\] are invalid; allowed: "
                                       r"worker_to_server, server_to_worker"):
    legs_lib.traffic_fields({"sideways": 1})
  with pytest.raises(ValueError, match=r"traffic class 'sideways' is invalid; allowed: "
                                       r"worker_to_server"):
    legs_lib.add(records.new_counters(2), "sideways", 1)


def test_a_checkpoints_counters_from_before_the_classes_are_upgraded():
  cluster = _cluster()
  for legs, local in ((inhad_legs.NodeLegs, "worker_to_node"),
                      (casp_legs.CommunityLegs, "member_leader")):
    links = traffic.Traffic(legs, cluster, lambda w, k: P, D, Q)
    old = {**records.new_counters(2), "local_bytes": 5, "node_push_bytes": 7}
    del old["class_bytes"]
    host = records.upgrade_counters(old, links)
    assert host["class_bytes"] == {"node_to_server": 7, local: 5}
    assert "local_bytes" not in host and "node_push_bytes" not in host


@pytest.mark.parametrize("scheme", ["bsp", "casp"])
def test_summary_and_metrics_show_total_bytes_and_bytes_per_class(tmp_path, data_dir, scheme):
  config = helpers.cluster_config(scheme, train_size=512, num_epochs=1.0,
                                  **{"model": "helpers:TinyCNN"})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path))
  for fields in (summary["totals"], summary["final"]):
    by_class = fields["bytes_by_class"]
    assert list(by_class) == list(legs_lib.CLASSES)
    assert fields["bytes_total"] == sum(by_class.values()) > 0
    assert fields["bytes_pushed"] == by_class["worker_to_server"] + by_class["node_to_server"]
    assert fields["bytes_pulled"] == by_class["server_to_worker"]
    assert fields["bytes_local"] == by_class["member_leader"] + by_class["worker_to_node"]
  assert (summary["totals"]["bytes_by_class"]["member_leader"] > 0) == (scheme == "casp")
  log = (tmp_path / "log.txt").read_text()
  assert f"traffic {summary['totals']['bytes_total'] / 1e6:.6g} MB in all" in log


# -- BSP over a ring all-reduce (bsp_allreduce) ------------------------------------------------


def test_ring_allreduce_bytes_and_time_on_a_hand_computed_case():
  # W = 4, a 4 MB model (1 MB chunks), links of 100, 100, 50, 100 MB/s, 1 ms latency, 1 s of
  # compute. The hops 1 -> 2 and 2 -> 3 run at 50 MB/s: a step takes 1e6 / 50e6 + 1e-3 =
  # 0.021 s, the ring 2 (W - 1) = 6 steps: 0.126 s. Each worker sends 6 chunks (6 MB =
  # 2 (W - 1) / W of the model), 24 MB in all per all-reduce; nothing reaches a server.
  model = 4_000_000
  cluster = cluster_lib.Cluster(speeds=np.ones([4]), base_time=1.0, latency=1e-3,
                                bandwidth=np.array([100e6, 100e6, 50e6, 100e6]))
  assert ring.ring_time(cluster, model) == pytest.approx(0.126, abs=1e-12)
  scheme = sync.build_scheme("bsp_allreduce", 4)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: model, model, model, shared=True)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time)
  host, acct, times = records.new_counters(4), sync.accounting.Accounting(4, 1), []
  while engine.num_pushes < 12:
    for rnd in engine.step():
      assert rnd.arrived.all() and rnd.pulls.all() and rnd.applies.all()
      times.append(rnd.time)
      records.account_round(rnd, host=host, acct=acct, protocol=engine.protocol, links=links,
                            iteration=engine.iteration, learning_rate=0.1, pull_bytes=model)
  # The barrier when the last worker's compute ends (its push costs nothing), then the ring.
  assert times == pytest.approx([1.0, 2.126, 3.252], abs=1e-9)
  fields = records.traffic(host, model)
  assert _classes(fields) == {"ring_allreduce": 3 * 4 * 6 * 1_000_000}
  assert fields["bytes_pushed"] == fields["bytes_pulled"] == 0
  one = cluster_lib.Cluster(speeds=np.ones([1]), base_time=1.0)
  assert ring.ring_time(one, model) == 0.0   # one worker: nothing to reduce


def _ring_config(scheme, data_dir, **changes):
  config = helpers.cluster_config(scheme, train_size=512, num_epochs=1.0,
                                  **{"model": "helpers:TinyCNN", **changes})
  config.data_dir = data_dir
  return config


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
@pytest.mark.parametrize("executor", ["rounds", "levels"])
def test_bsp_allreduce_trains_the_same_parameters_as_bsp_bit_for_bit(tmp_path, data_dir,
                                                                     executor):
  summaries, params = {}, {}
  for scheme in ("bsp", "bsp_allreduce"):
    summaries[scheme] = loop.train_and_evaluate(
        _ring_config(scheme, data_dir, executor=executor), str(tmp_path / scheme))
    params[scheme] = trained.load_trained(str(tmp_path / scheme)).params
  for a, b in zip(*(jax.tree.leaves(params[s]) for s in ("bsp", "bsp_allreduce"))):
    np.testing.assert_array_equal(a, b)
  bsp, ring = summaries["bsp"]["totals"], summaries["bsp_allreduce"]["totals"]
  assert ring["updates"] == bsp["updates"] and ring["pushes"] == bsp["pushes"]
  assert ring["bytes_pushed"] == ring["bytes_pulled"] == 0
  # Each update: 2 (W - 1) = 6 dense gradients over the ring in all; BSP: W pushes and W pulls.
  dense = bsp["bytes_pushed"] // bsp["pushes"]
  assert ring["bytes_by_class"]["ring_allreduce"] == ring["updates"] * 6 * dense
  assert ring["bytes_total"] == ring["bytes_by_class"]["ring_allreduce"]


def test_bsp_allreduce_refuses_a_compressor_and_the_real_runtime():
  config = config_lib.default_config()
  config.sync.scheme, config.num_workers = "bsp_allreduce", 4
  config_lib.validate_config(config)
  config.compress.name = "topk"
  with pytest.raises(ValueError, match=r"config.compress.name='topk' is invalid; allowed: 'none' "
                                       r"with sync.scheme='bsp_allreduce'"):
    config_lib.validate_config(config)
  config.compress.name = "none"
  with pytest.raises(ValueError, match=r"'bsp_allreduce' cannot run on the real runtime: its "
                                       r"workers exchange gradients without a server"):
    settings.check_real_run(config)
