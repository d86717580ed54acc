"""A server's link shared by the transfers that overlap on it, against hand timelines."""

import pickle

import numpy as np
import pytest

from gssp_jax import sync
from gssp_jax.sync import links as links_lib

MB = 1e6


def _route(bytes_of, cap=1 * MB, server_of=lambda w: 0, latency=0.0):
  """Every push and pull crosses its server's link: ``bytes_of(kind)``, at most ``cap`` B/s."""
  return lambda kind, w, k: ((server_of(w), kind), bytes_of(kind), cap, latency)


def _run(protocol, compute, route, link_bandwidth, max_pushes, **kwargs):
  engine = sync.TimelineEngine(protocol, compute, route=route, link_bandwidth=link_bandwidth,
                               **kwargs)
  while engine.num_pushes < max_pushes:
    engine.step()
  return engine


def test_max_min_rates_fill_the_link_and_respect_each_cap():
  assert links_lib.max_min_rates([1.0, 100.0, 100.0], 10.0) == [1.0, 4.5, 4.5]
  assert links_lib.max_min_rates([5.0, 5.0], 100.0) == [5.0, 5.0]
  assert links_lib.max_min_rates([], 3.0) == []
  assert sum(links_lib.max_min_rates([2.0, 7.0, 9.0, 30.0], 12.0)) == pytest.approx(12.0)


def test_bsps_incast_shares_the_servers_link():
  # 3 workers, 1 s of compute, 1 MB pushes and pulls, 1 MB/s links everywhere.
  # Alone each push would take 1 s; together they share the server's 1 MB/s:
  # all three arrive at 1 + 3 = 4 s, and the three pulls end at 4 + 3 = 7 s.
  engine = _run(sync.BSPProtocol(3), lambda w, k: 1.0, _route(lambda kind: MB), MB, 6,
                record=True)
  assert [t for t, _, _ in engine.pushes[:3]] == pytest.approx([4.0, 4.0, 4.0], rel=1e-12)
  starts = [(t, w) for t, w, k in engine.starts if k == 1]
  assert [w for _, w in starts] == [0, 1, 2]
  assert [t for t, _ in starts] == pytest.approx([7.0, 7.0, 7.0], rel=1e-12)
  assert [t for t, _, _ in engine.pushes[3:6]] == pytest.approx([11.0, 11.0, 11.0], rel=1e-12)
  np.testing.assert_allclose(engine.blocked_time, [0.0, 0.0, 0.0])   # transfers are no wait


def test_asynchronous_transfers_share_only_while_they_overlap():
  # ASP, computes of 1.0 and 1.5 s. w0's push runs alone on [1, 1.5) (0.5 MB), then both at
  # 0.5 MB/s: w0 ends at 2.5, w1 has 0.5 MB left and ends alone at 3.0. w0's pull runs alone
  # on [2.5, 3.0), then with w1's: w0 ends at 4.0, w1 at 4.5.
  engine = _run(sync.ASPProtocol(2), lambda w, k: [1.0, 1.5][w], _route(lambda kind: MB), MB,
                2, record=True)
  assert [w for _, w, _ in engine.pushes] == [0, 1]
  assert [t for t, _, _ in engine.pushes] == pytest.approx([2.5, 3.0], rel=1e-12)
  while len(engine.starts) < 4:
    engine.step()
  again = sorted((t, w) for t, w, k in engine.starts if k == 1)
  assert [w for _, w in again] == [0, 1]
  assert [t for t, _ in again] == pytest.approx([4.0, 4.5], rel=1e-12)


def test_a_worker_capped_below_its_share_leaves_the_rest_to_the_others():
  # Server 3 MB/s; worker 0's link 0.5 MB/s, workers 1 and 2 at 10 MB/s. Max-min shares:
  # 0.5, 1.25, 1.25: workers 1 and 2 end at 1 + 0.8; worker 0 then alone at 0.5 MB/s:
  # it had 0.6 MB left -> ends at 1.8 + 1.2 = 3.0.
  caps = [0.5 * MB, 10 * MB, 10 * MB]
  route = lambda kind, w, k: ((0, kind), MB, caps[w], 0.0)
  engine = _run(sync.ASPProtocol(3), lambda w, k: 1.0, route, 3 * MB, 3, record=True)
  times = {w: t for t, w, _ in engine.pushes}
  assert times[1] == pytest.approx(1.8) and times[2] == pytest.approx(1.8)
  assert times[0] == pytest.approx(3.0)


def test_a_fast_server_link_changes_nothing():
  # Server links far faster than the workers' own: each transfer goes at its cap, so the
  # timeline is the one of fixed delays, bytes / cap + latency.
  def delays(w, k=None):
    return 0.01 + MB / (2 * MB)
  protocol = lambda: sync.SSPProtocol(4, 1)
  compute = lambda w, k: [1.0, 1.3, 2.0, 3.1][w] * (1 + 0.1 * (k % 3))
  fixed = _run(protocol(), compute, None, MB, 40, record=True, push_delay=delays,
               pull_delay=delays)
  shared = _run(protocol(), compute, _route(lambda kind: MB, cap=2 * MB, latency=0.01),
                1e6 * MB, 40, record=True)
  assert [(w, k) for _, w, k in shared.pushes] == [(w, k) for _, w, k in fixed.pushes]
  np.testing.assert_allclose([t for t, _, _ in shared.pushes],
                             [t for t, _, _ in fixed.pushes], rtol=1e-12)
  np.testing.assert_allclose(shared.blocked_time, fixed.blocked_time, rtol=1e-9, atol=1e-12)


def test_each_group_server_has_a_link_of_its_own():
  # GSSP, 2 groups of 2: the groups' pushes do not share a link. Each group server's two
  # pushes share its 1 MB/s: both end at 1 + 2 = 3 s (one group alone would say the same).
  scheme = sync.build_scheme("gssp", 4, worker_times=[1.0, 1.0, 1.0, 1.0], num_groups=2,
                             staleness=3)
  protocol = scheme.make_protocol()
  route = _route(lambda kind: MB, server_of=lambda w: int(protocol.route[w]))
  engine = _run(protocol, lambda w, k: 1.0, route, MB, 4, record=True,
                message_delay=lambda m: 0.1)
  assert sorted(t for t, _, _ in engine.pushes[:4]) == pytest.approx([3.0] * 4, rel=1e-12)


def test_a_dropped_worker_leaves_the_link_to_the_others():
  # ASP, 2 workers pushing 1 MB at once on 1 MB/s; worker 1 crashes at 1.5 s (0.25 MB sent
  # each): worker 0 then has the link alone and ends at 1.5 + 0.75 = 2.25 s.
  engine = sync.TimelineEngine(sync.ASPProtocol(2), lambda w, k: 1.0,
                               route=_route(lambda kind: MB), link_bandwidth=MB)
  engine.drop_at(1.5, 1)
  while engine.num_pushes < 1:
    engine.step()
  assert engine.now == pytest.approx(2.25)
  assert 1 not in engine.busy_workers()


def test_a_resumed_engine_continues_its_transfers_exactly():
  make = lambda: sync.TimelineEngine(sync.ASPProtocol(3), lambda w, k: [1.0, 1.2, 1.7][w],
                                     route=_route(lambda kind: MB), link_bandwidth=MB)
  whole = make()
  for _ in range(50):
    whole.step()
  split = make()
  for _ in range(23):
    split.step()
  resumed = make()
  resumed.load_state_dict(pickle.loads(pickle.dumps(split.state_dict())))
  for _ in range(27):
    resumed.step()
  assert resumed.now == whole.now and resumed.num_pushes == whole.num_pushes
  np.testing.assert_array_equal(resumed.iteration, whole.iteration)


def _cluster_engine(scheme_name, shared, num_workers=4, **kw):
  """The simulator's own traffic model (``sim.traffic``) on a cluster of 1 MB/s links."""
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.Cluster(speeds=np.ones([num_workers]), base_time=1.0,
                                bandwidth=MB, latency=0.0, server_bandwidth=MB)
  scheme = sync.build_scheme(scheme_name, num_workers, worker_times=[1.0] * num_workers, **kw)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB, shared=shared)
  return links.engine(scheme.make_protocol(), cluster.compute_time, record=True)


@pytest.mark.parametrize("shared,push_at,start_at", [(True, 5.0, 9.0), (False, 2.0, 3.0)])
def test_the_simulators_bsp_pays_for_its_incast_only_on_a_shared_link(shared, push_at, start_at):
  # 4 workers, 1 s of compute, 1 MB each way on 1 MB/s links and a 1 MB/s server.
  engine = _cluster_engine("bsp", shared)
  while engine.num_pushes < 4:
    engine.step()
  assert engine.now == pytest.approx(push_at, rel=1e-12)
  while len(engine.starts) < 5:
    engine.step()
  assert engine.starts[4][0] == pytest.approx(start_at, rel=1e-12)


def test_inhads_gradients_stay_on_their_node_and_only_its_pulls_share_the_server():
  # The gradients go to the node aggregators over the node's own link (25 GB/s by default,
  # shared by the node's workers); the iteration numbers cost 8 B.
  engine = _cluster_engine("inhad", True, num_nodes=2)
  while engine.num_pushes < 4:
    engine.step()
  assert engine.now < 1.01   # no 1 MB push crossed a 1 MB/s link
  node = engine.protocol.route[0]
  assert engine.route("push", 0, 0)[0] == ("node", node)
  assert engine.route("push", 0, 0)[4] == 2.5e10
  assert engine.route("pull", 0, 0)[0] == (0, "pull")


@pytest.mark.parametrize("shared,arrival", [(True, 3.0), (False, 2.0)])
def test_an_inhad_nodes_workers_share_its_link_to_the_aggregator(shared, arrival):
  # 2 workers on one node, 1 s of compute, 1 MB gradients over a 1 MB/s node link: pushed at
  # once, each gets 0.5 MB/s on a shared link (2 s), 1 MB/s alone (1 s); then the 8-byte
  # iteration number over the worker's 1 MB/s link.
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.Cluster(speeds=np.ones([2]), base_time=1.0, bandwidth=MB, latency=0.0,
                                server_bandwidth=MB, node_bandwidth=MB, node_latency=0.0)
  scheme = sync.build_scheme("inhad", 2, num_nodes=1)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB, shared=shared)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time, record=True)
  while engine.num_pushes < 2:
    engine.step()
  assert [t for t, _, _ in engine.pushes] == pytest.approx([arrival + 8 / MB] * 2, abs=1e-9)


@pytest.mark.parametrize("shared,push_at,start_at", [(True, 4.0, (6.0, 9.0)),
                                                     (False, 2.0, (4.0, 5.0))])
def test_a_casp_communitys_members_share_their_leaders_links(shared, push_at, start_at):
  # One community of 4 (leader 0), 1 s of compute, 1 MB each way, every link 1 MB/s, no
  # latency. Shared: members 1-3 push to the leader at once over its 1 MB/s link (1/3 MB/s
  # each: at 4 s; the leader's own push costs nothing), it uploads the 1 MB sum (1 s, fixed)
  # and all are released at 5 s; the leader's reply from the server takes 1 s (it starts at
  # 6 s), and its forwards to the 3 members share its link (3 s) after that reply's 1 s: they
  # start at 9 s. Alone: every member's push 1 s (at 2 s), the upload 1 s, the reply 1 s (the
  # leader starts at 4 s) and each forward 1 s more (5 s).
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.Cluster(speeds=np.ones([4]), base_time=1.0, bandwidth=MB, latency=0.0,
                                server_bandwidth=MB, server_latency=0.0)
  scheme = sync.build_scheme("casp", 4, casp_max_communities=1)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB, shared=shared)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time, record=True)
  while len(engine.starts) < 8:
    engine.step()
  assert engine.pushes[:4] == [(1.0, 0, 0)] + [(pytest.approx(push_at), w, 0) for w in (1, 2, 3)]
  assert [t for t, _, _ in engine.starts[4:]] == pytest.approx([start_at[0]] + [start_at[1]] * 3)
  assert links.legs.route(engine.protocol, "push", 1, 0)[0] == ("leader", 0, "push")
  assert links.legs.route(engine.protocol, "push", 0, 0) is None   # the leader's own
  # The leader waits for its members' pushes (blocked); the upload is everyone's push time.
  assert engine.blocked_time.tolist() == pytest.approx([push_at - 1.0, 0.0, 0.0, 0.0])



def _transfers(links, events):
  """Runs ``events`` (``(time, "start", key, tag, bytes, cap)`` or ``(time, "cancel", tag)``) on
  ``links`` and every end on the way; returns ``[(end time, tag)]`` in the order they end."""
  ends, pending = [], sorted(events, key=lambda e: e[0])
  while pending or any(links.next_end(k) is not None for k in list(links.version)):
    nxt = min(((links.next_end(k), k) for k in list(links.version)
               if links.next_end(k) is not None), default=(float("inf"), None))
    if pending and pending[0][0] <= nxt[0]:
      event = pending.pop(0)
      if event[1] == "start":
        links.start(event[2], event[0], event[3], event[4], event[5])
      else:
        links.cancel(event[0], lambda tag, gone=event[2]: tag == gone)
      continue
    ends += [(nxt[0], tag) for tag in links.finish(nxt[1], nxt[0])]
  return ends


def test_equal_share_links_end_every_transfer_when_shared_links_do():
  """Random transfers of one cap on two links, some cancelled: the O(log n) links give the
  general max-min links' schedule, ends and order, to float rounding."""
  rng = np.random.default_rng(0)
  events = [(float(t), "start", ("s", int(rng.integers(2))), i, float(b), 2 * MB)
            for i, (t, b) in enumerate(zip(np.sort(rng.uniform(0, 20, 60)),
                                           rng.uniform(0.1, 3.0, 60) * MB))]
  events += [(float(t), "cancel", int(i)) for t, i in zip(rng.uniform(0, 20, 5),
                                                            rng.choice(60, 5, replace=False))]
  want = _transfers(links_lib.SharedLinks(5 * MB), events)
  got = _transfers(links_lib.EqualShareLinks(5 * MB), events)
  assert [tag for _, tag in got] == [tag for _, tag in want]
  np.testing.assert_allclose([t for t, _ in got], [t for t, _ in want], rtol=1e-9)
  assert len(want) >= 50


def test_equal_share_links_refuse_a_second_cap_on_one_link():
  links = links_lib.EqualShareLinks(5 * MB)
  links.start("s", 0.0, "a", MB, MB)
  with pytest.raises(ValueError, match="cap of 2000000.0 bytes/s on a link whose transfers have"):
    links.start("s", 0.1, "b", MB, 2 * MB)


def test_the_simulator_uses_equal_share_links_only_when_every_worker_link_is_the_same():
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  scheme = sync.build_scheme("asp", 3)
  for bandwidth, kind in ((MB, links_lib.EqualShareLinks),
                          ([MB, MB, 2 * MB], links_lib.SharedLinks)):
    cluster = cluster_lib.Cluster(speeds=np.ones([3]), base_time=1.0, bandwidth=bandwidth)
    engine = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB, shared=True).engine(
        scheme.make_protocol(), cluster.compute_time)
    assert type(engine.links) is kind


@pytest.mark.parametrize("kind", [links_lib.SharedLinks, links_lib.EqualShareLinks])
def test_a_link_may_have_its_own_capacity_and_old_checkpoints_keep_the_shared_one(kind):
  # Two 1 MB transfers (caps 2 MB/s) on a link of its own 2 MB/s capacity: 1 MB/s each, done at
  # 1 s; on a link of the links' 1 MB/s: 0.5 MB/s each, done at 2 s.
  links = kind(MB)
  for key, capacity in (("own", 2 * MB), ("shared", None)):
    for tag in (0, 1):
      links.start(key, 0.0, (key, tag), MB, 2 * MB, *([capacity] if capacity else []))
  assert links.next_end("own") == pytest.approx(1.0)
  assert links.next_end("shared") == pytest.approx(2.0)
  # A checkpoint pickled before per-link capacities: every link at the links' capacity.
  state = pickle.loads(pickle.dumps(links))
  if kind is links_lib.SharedLinks:
    del state.__dict__["capacities"]
    state = pickle.loads(pickle.dumps(state))
    assert state.capacities == {}
  else:
    del state.links["own"].__dict__["capacity"]
    assert state.links["own"].capacity is None
  state.start("own", 0.0, ("own", 2), MB, 2 * MB)
  assert state.next_end("own") == pytest.approx(3.0)   # 3 MB over 1 MB/s


@pytest.mark.parametrize("shared,applied_at", [(True, 4.0), (False, 3.0)])
def test_casp_communities_uploading_at_once_share_the_servers_link(shared, applied_at):
  # Two communities of 2 (leaders 0 and 2), 1 s of compute, 1 MB each way, every link 1 MB/s,
  # the server's too, no latency: the members' pushes reach their leaders at 2 s (each alone on
  # its leader's link), and both leaders upload their 1 MB sums at once: 0.5 MB/s each on the
  # server's shared link (2 s: applied at 4 s), 1 s each alone (3 s). Then the leaders' replies
  # (1 s) and the forwards to the members (1 s more).
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.Cluster(speeds=np.ones([4]), base_time=1.0, bandwidth=MB, latency=0.0,
                                server_bandwidth=MB, server_latency=0.0)
  protocol = sync.CASPProtocol(4, max_communities=2, initial_communities=2,
                               reconfigure_every=10_000)
  links = traffic.Traffic(sync.schemes.casp.legs.CommunityLegs, cluster, lambda w, k: MB, MB, MB,
                          shared=shared)
  engine = links.engine(protocol, cluster.compute_time, record=True)
  rounds = []
  while len(engine.starts) < 8:
    rounds += engine.step()
  assert [(r.time, np.flatnonzero(r.arrived).tolist()) for r in rounds] == [
      (pytest.approx(applied_at), [0, 1]), (pytest.approx(applied_at), [2, 3])]
  starts = sorted((w, t) for t, w, k in engine.starts if k == 1)
  assert starts == [(0, pytest.approx(applied_at + 1)), (1, pytest.approx(applied_at + 2)),
                    (2, pytest.approx(applied_at + 1)), (3, pytest.approx(applied_at + 2))]
  # The upload is the members' push time, not blocked time: the leaders wait 1 s for their
  # members, nobody waits for the upload.
  assert engine.blocked_time.tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0])


@pytest.mark.parametrize("shared,starts_at", [(True, 7.0), (False, 3.0 + 2e-6)])
def test_gssp_global_exchanges_share_the_global_servers_link(shared, starts_at):
  # 2 workers in 2 groups of one, 1 s of compute, 1 MB each way; worker links 1 TB/s, every
  # server's interface 1 MB/s, no latency. Shared: each push takes 1 s into its group server
  # (at 2 s), both groups deliver at once into the global server (2 MB at 1 MB/s: at 4 s), its
  # two replies leave at once (at 6 s), then each pull 1 s: the second iterations start at 7 s.
  # Alone: pushes and pulls 1 us, each exchange 1 s.
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.Cluster(speeds=np.ones([2]), base_time=1.0, bandwidth=1e12, latency=0.0,
                                server_bandwidth=MB, server_latency=0.0)
  scheme = sync.build_scheme("gssp", 2, num_groups=2, inter_group="global")
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB, shared=shared)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time, record=True)
  rounds = []
  while len(engine.starts) < 4:
    rounds += engine.step()
  step = 1.0 if shared else 1e-6
  delivered, adopted = (4.0, 6.0) if shared else (2.0 + 1e-6, 3.0 + 1e-6)
  assert [r.time for r in rounds] == pytest.approx([1.0 + step] * 2 + [delivered] * 2
                                                   + [adopted] * 2)
  assert [t for t, _, k in engine.starts if k == 1] == pytest.approx([starts_at] * 2)
  assert links.legs.message_route(engine.protocol, sync.Message("deliver", 0), None)[0] == (
      "servers", 2, "push")
  peer = sync.build_scheme("gssp", 2, num_groups=2)
  assert links.legs.message_route(peer.make_protocol(), sync.Message("deliver", 0), None) is None
