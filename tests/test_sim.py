"""The cluster simulator: cluster model, timelines over it, accounting, determinism, exact resume."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import executor
from gssp_jax.sim import records
from gssp_jax.sim import traffic
from gssp_jax.sync import replay
from gssp_jax.train import loop


def _config(**changes):
  config = config_lib.default_config()
  config.num_workers = 4
  return config_lib.override(config, changes, check_types=False)


# ---------------------------------------------------------------- cluster model


@pytest.mark.parametrize("changes,match", [
    ({"cluster.profile": "tiers", "cluster.speeds": (1.0, 0.0, 2.0, 1.0)}, r"cluster.speeds"),
    ({"cluster.profile": "tiers", "cluster.speeds": (1.0, -2.0, 2.0, 1.0)}, r"positive finite"),
    ({"cluster.profile": "tiers", "cluster.speeds": (1.0, 2.0)}, r"4 positive finite"),
    ({"cluster.profile": "tiers", "cluster.bandwidth": 0.0}, r"cluster.bandwidth=0.0.*never deliver"),
    ({"cluster.profile": "tiers", "cluster.latency": -1.0}, r"cluster.latency"),
    ({"cluster.profile": "tiers", "cluster.tiers": (1.0, 2.0, 3.0)}, r"divide num_workers=4"),
    ({"cluster.profile": "warp"}, r"cluster.profile='warp' is invalid; allowed: none"),
    ({"cluster.base_time": 0.0}, r"cluster.base_time=0.0"),
    ({"cluster.straggler_prob": 1.5}, r"straggler_prob"),
    ({"cluster.profile": "trace", "cluster.trace_file": "/nonexistent.csv"}, r"trace_file"),
])
def test_bad_cluster_configs_rejected(changes, match):
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(_config(**changes))


def test_trace_with_fewer_replicas_than_workers_is_rejected(tmp_path):
  path = tmp_path / "trace.csv"
  path.write_text("w0,w1,w2\n0.1,0.2,0.3\n0.1,0.25,0.3\n")
  with pytest.raises(ValueError, match=r"3 replica\(s\) for num_workers=4; allowed: "
                                       r"num_workers <= 3, or cluster.trace_map='cycle'"):
    config_lib.validate_config(_config(**{"cluster.profile": "trace",
                                          "cluster.trace_file": str(path)}))
  path.write_text("0.1,0.2,0.3,0.4\n0.1,0.25,0.3,0.5\n")
  cluster = cluster_lib.cluster_from_config(_config(**{
      "cluster.profile": "trace", "cluster.trace_file": str(path),
      "cluster.trace_units": "seconds"}))
  assert [cluster.compute_time(3, k) for k in range(3)] == [0.4, 0.5, 0.4]


@pytest.mark.parametrize("units", ["relative", "seconds"])
@pytest.mark.parametrize("key,value", [
    ("speeds", (1.0, 2.0, 1.0, 1.0)), ("tiers", (1.0, 2.0)), ("sigma", 0.1),
    ("jitter", 0.1), ("straggler_prob", 0.01), ("straggler_slowdown", 3.0),
    ("straggler_duration", 4), ("base_time", 0.1), ("calibrate", True)])
def test_trace_rejects_the_compute_time_model_keys(tmp_path, key, value, units):
  """A trace gives every iteration's time; in relative units base_time (or calibrate) sets its
  pace, in seconds nothing does."""
  path = tmp_path / "trace.csv"
  path.write_text("0.1,0.2,0.3,0.4\n")
  changes = {"cluster.profile": "trace", "cluster.trace_file": str(path),
             "cluster.trace_units": units}
  config_lib.validate_config(_config(**changes))
  if units == "relative" and key in ("base_time", "calibrate"):
    config_lib.validate_config(_config(**changes, **{f"cluster.{key}": value}))
    return
  with pytest.raises(ValueError, match=rf"^config.cluster.{key}=.* cannot apply with "
                                       r"cluster.profile='trace': the trace gives"):
    config_lib.validate_config(_config(**changes, **{f"cluster.{key}": value}))


def test_presets_and_determinism():
  tiers = cluster_lib.cluster_from_config(_config(**{
      "num_workers": 8, "cluster.profile": "tiers", "cluster.base_time": 0.1}))
  assert tiers.speeds.tolist() == [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0]
  assert tiers.compute_time(6, 5) == pytest.approx(0.3)
  logn = cluster_lib.cluster_from_config(_config(**{"num_workers": 8,
                                                    "cluster.profile": "lognormal"}))
  assert len(set(logn.speeds.tolist())) == 8 and np.all(logn.speeds > 0)
  noisy = dict(num_workers=4, **{"cluster.profile": "homogeneous", "cluster.jitter": 0.2,
                                 "cluster.straggler_prob": 0.02,
                                 "cluster.straggler_duration": 5})
  a = cluster_lib.cluster_from_config(_config(**noisy))
  b = cluster_lib.cluster_from_config(_config(**noisy))
  times = [a.compute_time(1, k) for k in range(3000)]
  assert times == [b.compute_time(1, k) for k in reversed(range(3000))][::-1]
  slow = np.mean(np.array(times) > 0.05 * 2.5)
  assert 0.05 < slow < 0.15      # about 1 - 0.98 ** 5 = 9.6 % of iterations straggle
  assert a.link_time(0, 1_250_000) == pytest.approx(1e-4 + 1e-3)
  # A span of iterations (a local-update job's) is the same floats, across a block's end too.
  for first, count in ((0, 4), (1021, 7), (2040, 2048)):
    assert b.compute_span(2, first, count) == [a.compute_time(2, first + j)
                                               for j in range(count)]
  b.base_time = 4 * a.base_time   # a changed base time is not served from the kept block
  assert b.compute_time(2, 5) == pytest.approx(4 * a.compute_time(2, 5))


# ---------------------------------------------------------------- timelines on the cluster


def _engine_run(name, speeds, pushes, base=0.1, **kw):
  config = _config(**{"num_workers": len(speeds), "cluster.profile": "tiers",
                      "cluster.speeds": tuple(speeds), "cluster.base_time": base})
  cluster = cluster_lib.cluster_from_config(config)
  scheme = sync.build_scheme(name, len(speeds), worker_times=speeds, **kw)
  engine = sync.TimelineEngine(scheme.make_protocol(), cluster.compute_time,
                               push_delay=lambda w, k: cluster.link_time(w, 250_000),
                               pull_delay=lambda w: cluster.link_time(w, 250_000),
                               message_delay=lambda m: cluster.server_time(250_000))
  rounds = []
  while engine.num_pushes < pushes:
    rounds.extend(engine.step())
  return engine, rounds


def test_bsp_round_is_the_slowest_worker_plus_communication():
  engine, rounds = _engine_run("bsp", [1.0, 1.5, 2.0, 3.0], 40)
  comm = 1e-4 + 250_000 / 1.25e9
  first = 0.3 + comm
  times = [r.time for r in rounds]
  assert times == pytest.approx([first + i * (first + comm) for i in range(10)])


def test_homogeneous_cluster_bsp_and_gssp_same_time_per_epoch():
  per = {}
  for name in ("bsp", "gssp"):
    engine, _ = _engine_run(name, [1.0] * 16, 16 * 50, num_groups=4)
    per[name] = engine.now / 50
  assert per["gssp"] == pytest.approx(per["bsp"], rel=0.01)


def test_one_worker_ten_times_slower_slows_bsp_tenfold_not_asp():
  per = {}
  for name in ("bsp", "asp"):
    base, _ = _engine_run(name, [1.0] * 8, 8 * 40)
    slow, _ = _engine_run(name, [1.0] * 7 + [10.0], 8 * 40)
    per[name] = slow.now / base.now
  assert per["bsp"] == pytest.approx(10.0, rel=0.02)
  assert per["asp"] < 1.2   # the fast workers keep pushing; the slow one pushes less often


def _traffic_run(name, pushes, bandwidth, payload=1_000_000, **kw):
  """A timeline with the simulator's traffic model; returns (engine, rounds, host counters)."""
  speeds = [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0]
  config = _config(**{"num_workers": 8, "cluster.profile": "tiers", "cluster.base_time": 0.1,
                      "cluster.speeds": tuple(speeds), "cluster.bandwidth": bandwidth})
  cluster = cluster_lib.cluster_from_config(config)
  scheme = sync.build_scheme(name, 8, worker_times=speeds, num_nodes=2, **kw)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: payload, payload, payload)
  engine = sync.TimelineEngine(
      scheme.make_protocol(), cluster.compute_time,
      push_delay=lambda w, k: links.push_delay(engine.protocol, w, k),
      pull_delay=lambda w: links.pull_delay(engine.protocol, w),
      message_delay=lambda m: links.message_delay(engine.protocol, m, engine.iteration))
  host = records.new_counters(8)
  rounds = []
  while engine.num_pushes < pushes:
    for rnd in engine.step():
      links.count_round(engine.protocol, rnd, engine.iteration, host)
      rounds.append(rnd)
  return engine, rounds, host


def test_inhad_pushes_iteration_numbers_and_node_aggregates_not_gradients():
  # 8 workers on 2 nodes, 1 MB gradients, slow worker links (10 MB/s: 0.1 s a push).
  asp, _, asp_host = _traffic_run("asp", 800, 1e7)
  inhad, rounds, host = _traffic_run("inhad", 800, 1e7)
  updates = sum(bool(r.aggregate) for r in rounds)
  assert 90 <= updates <= 100   # about one per 8 iteration numbers (fewer: pulls take time)
  node_to_server = host["class_bytes"]["node_to_server"]
  to_server = host["pushed_per_worker"].sum() + node_to_server
  assert host["pushed_per_worker"].sum() == 8 * inhad.num_pushes          # the INs
  assert node_to_server == updates * 2 * 1_000_000                        # 2 aggregates each
  assert host["class_bytes"]["worker_to_node"] == inhad.num_pushes * 1_000_000   # stay local
  assert to_server < 0.3 * asp.num_pushes * 1_000_000   # ASP: every push a dense gradient
  # Same pulls, but no gradient crosses a slow worker link: the 800 pushes take less time.
  assert inhad.now < 0.85 * asp.now


def test_casp_sends_one_payload_per_community_round():
  engine, rounds, host = _traffic_run("casp", 400, 1e8, casp_max_communities=2,
                                      casp_reconfigure_every=10_000)
  protocol = engine.protocol
  k = len(set(protocol.communities.tolist()))
  assert k == 1 and protocol.members(0).size == 8    # the first partition: one community
  community_rounds = [r for r in rounds if r.arrived.any()]
  assert all(r.arrived.sum() == 8 for r in community_rounds)
  # One payload per community round reaches the server (from the leader), 7 go to it.
  assert host["pushed_per_worker"].tolist() == [len(community_rounds) * 1_000_000] + [0] * 7
  assert host["class_bytes"]["member_leader"] == (len(community_rounds) * 7 * 1_000_000
                                                 * 2)   # reduce + broadcast
  assert host["pulls_per_worker"].tolist() == [len(community_rounds)] + [0] * 7
  # Each round: the slowest member's compute, its 0.01 s push to the leader, the leader's
  # 0.01 s push to the server, then the reply to the leader and on to the members.
  comm = 1e-4 + 1e6 / 1e8
  times = [r.time for r in community_rounds]
  assert times[0] == pytest.approx(0.3 + 2 * comm)
  assert times[1] - times[0] == pytest.approx(2 * comm + 0.3 + 2 * comm)


def test_casp_with_two_communities_pushes_two_payloads_per_round_of_both():
  # The registry's CASP starts with one community; build two directly.
  speeds = [1.0, 1.0, 1.5, 1.5, 2.0, 2.0, 3.0, 3.0]
  config = _config(**{"num_workers": 8, "cluster.profile": "tiers", "cluster.base_time": 0.1,
                      "cluster.speeds": tuple(speeds), "cluster.bandwidth": 1e8})
  cluster = cluster_lib.cluster_from_config(config)
  links = traffic.Traffic(sync.schemes.casp.legs.CommunityLegs, cluster, lambda w, k: 1_000_000, 1_000_000,
                          1_000_000)
  protocol = sync.CASPProtocol(8, max_communities=2, initial_communities=2,
                               reconfigure_every=10_000)
  engine = sync.TimelineEngine(
      protocol, cluster.compute_time,
      push_delay=lambda w, k: links.push_delay(protocol, w, k),
      pull_delay=lambda w: links.pull_delay(protocol, w),
      message_delay=lambda m: links.message_delay(protocol, m, engine.iteration))
  host = records.new_counters(8)
  applied = []
  while engine.num_pushes < 400:
    for rnd in engine.step():
      links.count_round(protocol, rnd, engine.iteration, host)
      applied.append(np.flatnonzero(rnd.arrived).tolist())
  assert sorted(set(map(tuple, applied))) == [(0, 1, 2, 3), (4, 5, 6, 7)]
  per = {c: sum(a == list(range(4 * c, 4 * c + 4)) for a in applied) for c in (0, 1)}
  # k = 2 payloads per round of both communities reach the server, not W = 8.
  assert host["pushed_per_worker"].tolist() == [per[0] * 1_000_000, 0, 0, 0,
                                                per[1] * 1_000_000, 0, 0, 0]


def test_blocked_time_so_far_counts_waits_in_progress():
  engine = sync.TimelineEngine(sync.build_scheme("bsp", 3).make_protocol(),
                               lambda w, k: [1.0, 2.0, 4.0][w])
  while engine.now < 2.0:   # worker 0 pushed at 1, worker 1 at 2, worker 2 computes until 4
    engine.step()
  before = {k: np.copy(v) for k, v in engine.state_dict().items() if isinstance(v, np.ndarray)}
  np.testing.assert_array_equal(engine.blocked_time_so_far(), [1.0, 0.0, 0.0])
  np.testing.assert_array_equal(engine.blocked_time, [0.0, 0.0, 0.0])   # a pure accessor
  for k, v in before.items():
    np.testing.assert_array_equal(getattr(engine, k), v)
  engine.step()   # worker 2 pushes at 4 and releases everyone
  np.testing.assert_array_equal(engine.blocked_time_so_far(), [3.0, 2.0, 0.0])
  np.testing.assert_array_equal(engine.blocked_time, [3.0, 2.0, 0.0])


# ---------------------------------------------------------------- accounting = device staleness


@pytest.mark.parametrize("name", sync.SCHEMES)
def test_host_accounting_matches_device_staleness(name):
  speeds = [1.0, 1.37, 1.91, 2.53]
  scheme = sync.build_scheme(name, 4, worker_times=speeds, num_groups=2, num_nodes=2,
                             casp_reconfigure_every=4, casp_max_communities=2,
                             inter_group="global" if name == "gssp" else "peer")
  tl = sync.run_timeline(scheme.make_protocol(), lambda w, k: speeds[w], max_pushes=40,
                         message_delay=lambda m: 0.45)
  protocol = scheme.make_protocol()
  acct = sync.accounting.Accounting(4, scheme.num_replicas, aggregating=protocol.aggregating)
  tx = scheme.chain(None if scheme.own_optimizer else optax.sgd(0.01))
  checked = []
  before = {"clock": np.zeros([4], np.int64), "total": np.zeros([4], np.int64)}

  def check(i, state):
    workers, values = acct.apply(tl.rounds[i])
    sync_state = sync.find_sync_state(state.tx_state)
    device = np.asarray(sync_state.staleness)
    clock = np.asarray(sync_state.clock)
    # Every applied gradient: per worker, how many (clock), the latest one's staleness,
    # and (InHAD, where a worker may have several) the sum of their staleness.
    for w in range(4):
      mine = values[workers == w]
      assert clock[w] - before["clock"][w] == mine.size
      if mine.size:
        assert device[w] == mine[-1]
      if name == "inhad":
        total = np.asarray(sync_state.staleness_total)
        assert total[w] - before["total"][w] == mine.sum()
        before["total"][w] = total[w]
    before["clock"][:] = clock
    np.testing.assert_array_equal(np.asarray(sync_state.version), acct.version)
    checked.append(len(workers))
  replay.replay(tx, {"x": jnp.zeros([2])}, tl.rounds, lambda wp, i: {"x": wp["x"] - 1.0},
                num_replicas=scheme.num_replicas, num_workers=4, on_round=check)
  assert sum(checked) >= 30
  if name not in ("bsp", "bsp_allreduce", "dssync", "local_sgd", "diloco"):   # synchronous
    assert acct.staleness_max > 0 or name == "casp"


def test_inhad_and_casp_report_their_traffic_end_to_end(tmp_path, data_dir):
  lines = {}
  for scheme in ("asp", "inhad", "casp"):
    nodes = {"sync.num_nodes": 2} if scheme == "inhad" else {}
    config = _sim_config(scheme, **nodes, **{"cluster.bandwidth": 1e7})
    config.data_dir = data_dir
    config.train.num_epochs = 1.0
    loop.train_and_evaluate(config, str(tmp_path / scheme))
    lines[scheme] = _metrics(tmp_path / scheme)[-1]
  assert lines["inhad"]["bytes_pushed"] < 0.5 * lines["asp"]["bytes_pushed"]
  assert lines["inhad"]["bytes_local"] > 0 and lines["asp"]["bytes_local"] == 0
  assert lines["inhad"]["virtual_time"] < lines["asp"]["virtual_time"]
  assert lines["casp"]["bytes_local"] >= 0


def test_inhad_counts_every_push_between_aggregations():
  # Node 0 = workers 0, 1; threshold 4; the aggregates' pull takes no time. w0 (1 s) pushes
  # at 1, 2, 3 while w1 (3.6 s) has not pushed; w1 pushes at 3.6: 4 counted, the server
  # applies. w0's three gradients and w1's one are all applied: 4 gradients, none stale
  # (nothing was applied before). Then w0 (pulled at 3) pushes at 4, 5, 6, 7: 4 counted;
  # its gradient of 4 was computed on version 0 (read at 3) -> staleness 1, the others on
  # version 1 -> 0.
  protocol = sync.InHADProtocol(2, [0, 0], threshold=4)
  tl = sync.run_timeline(protocol, lambda w, k: [1.0, 3.6][w], max_pushes=9)
  acct = sync.accounting.Accounting(2, 1, aggregating=True)
  applied = [acct.apply(r) for r in tl.rounds]
  got = [(w.tolist(), v.tolist()) for w, v in applied if w.size]
  assert got == [([0, 0, 0, 1], [0, 0, 0, 0]), ([0, 0, 0, 0], [1, 0, 0, 0])]
  assert acct.summary()["hist"] == [7, 1] and acct.applied == 8
  tx = optax.chain(sync.inhad(2, 1), sync.replicated(optax.sgd(0.1), 1))
  states = []
  replay.replay(tx, {"x": jnp.zeros([2])}, tl.rounds, lambda wp, i: {"x": wp["x"] - 1.0},
                num_replicas=1, num_workers=2, on_round=lambda i, s: states.append(s))
  first = sync.find_sync_state(states[4].tx_state)    # the update after w1's push at 3.6
  assert np.asarray(first.clock).tolist() == [3, 1]
  last = sync.find_sync_state(states[-1].tx_state)
  assert np.asarray(last.clock).tolist() == [7, 1]
  assert np.asarray(last.staleness_total).tolist() == [1, 0]
  assert np.asarray(last.staleness).tolist() == [0, 0]


# ---------------------------------------------------------------- end to end


def _sim_config(scheme, **extra):
  # 1,024 examples: 8 iterations per worker per epoch, 64 pushes in 2 epochs. A tiny CNN
  # (helpers.TinyCNN): what these tests check (timelines, bytes, groups, resume) does not depend
  # on the model, and LeNet-5's compilations were most of their time.
  return helpers.cluster_config(scheme, train_size=1024, num_epochs=2.0,
                                **{"model": "helpers:TinyCNN", **extra})


_metrics = helpers.metric_lines


def test_same_config_same_metrics_bit_for_bit(tmp_path, data_dir):
  runs = []
  for i in range(2):
    config = _sim_config("gssp", **{"compress.name": "gdtopk"})
    config.data_dir = data_dir
    loop.train_and_evaluate(config, str(tmp_path / f"run{i}"))
    runs.append(_metrics(tmp_path / f"run{i}"))
  assert runs[0] == runs[1]
  assert len(runs[0]) == 4 and runs[0][-1]["virtual_time"] > 0
  assert runs[0][-1]["staleness"]["applied"] > 0
  last = runs[0][-1]
  # Both units, labelled: a GSSP delivery carries several pushes, so data is staler.
  assert last["staleness"]["unit"] == "updates of its server"
  assert last["staleness_data"]["unit"].startswith("worker iterations of data")
  assert last["staleness_data"]["applied"] == last["staleness"]["applied"]
  assert last["staleness_data"]["mean"] > last["staleness"]["mean"]
  assert last["bytes_pushed"] < last["bytes_pulled"]   # pushes are sparse
  assert sum(last["bytes_pushed_per_worker"]) == last["bytes_pushed"]
  assert sum(last["bytes_pulled_per_worker"]) == last["bytes_pulled"]


@pytest.mark.parametrize("scheme", ["ssp", "gssp"])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, data_dir, scheme):
  config = _sim_config(scheme, **{"train.checkpoint_every": 1})
  config.data_dir = data_dir
  loop.train_and_evaluate(config, str(tmp_path / "whole"))
  # 64 pushes in all, evaluations (and checkpoints) every 16. Stop cleanly at 21 ...
  config.train.stop_after_updates = 21
  first = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert first["status"] == "stopped" and first["totals"]["pushes"] == 21
  # ... resume and stop at 43, then lose that checkpoint as a killed run would: the next
  # run restarts from the evaluation checkpoint at 32 and redoes pushes 33..43.
  config.train.stop_after_updates = 43
  loop.train_and_evaluate(config, str(tmp_path / "split"))
  ckpts = tmp_path / "split" / "checkpoints"
  shutil.rmtree(ckpts / "43")   # killed before that save (Orbax writes a step whole or not)
  assert (ckpts / "32").exists()
  config.train.stop_after_updates = 0
  summary = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert summary["status"] == "done"
  assert _metrics(tmp_path / "split") == _metrics(tmp_path / "whole")
  whole = json.load(open(tmp_path / "whole" / "summary.json"))
  assert summary["totals"]["virtual_time"] == whole["totals"]["virtual_time"]
  assert summary["time_to_target"] == whole["time_to_target"]


def test_hetero_config_smoke_runs_from_the_command_line(tmp_path, data_dir):
  import os
  import subprocess
  import sys
  cmd = [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5_hetero.py:smoke",
         f"--workdir={tmp_path}", "--config.data.test_size=200"]
  env = {**os.environ, "GSSP_DATA_DIR": data_dir}
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["status"] == "done" and summary["scheme"]["name"] == "gssp"
  assert summary["scheme"]["groups"] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  assert summary["totals"]["virtual_time"] > 0
  assert "virtual" in out.stderr   # the progress line shows virtual time
  assert "virtual" in (tmp_path / "log.txt").read_text()   # and the workdir keeps it


class _BatchNormSim:
  """Four workers in two GSSP groups training a tiny BatchNorm model, stepped round by round."""

  def __init__(self, inter_group: str = "peer", x_shift: float = 0.0):
    import flax.linen as nn
    import jax
    from gssp_jax.sim import executor

    class Net(nn.Module):
      @nn.compact
      def __call__(self, x, train=True):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(8)(x))
        return nn.Dense(2)(nn.relu(x))

    net = Net()
    variables = net.init(jax.random.key(0), jnp.ones([4, 3]))
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(p, ms, batch, rng):
      del rng
      out, new = net.apply({"params": p, **ms}, batch["x"], mutable=["batch_stats"])
      return jnp.mean((out - batch["y"]) ** 2), {"batch_stats": new["batch_stats"]}

    self.arrays = {"x": x_shift + jax.random.normal(jax.random.key(1), (64, 3)),
                   "y": jax.random.normal(jax.random.key(2), (64, 2))}
    self.scheme = sync.build_scheme("gssp", 4, num_groups=2, staleness=1,
                                    inter_group=inter_group)
    tx = optax.chain(self.scheme.transform,
                     sync.replicated(optax.sgd(0.1), self.scheme.num_replicas))
    self.state = executor.init_state(params, model_state, tx, None, 4,
                                     self.scheme.num_replicas, jax.random.key(3))
    self.job_fn = executor.make_job_fn(loss_fn, None, 100)
    self.round_fn = executor.make_round_fn(tx)
    self.rng = np.random.default_rng(0)
    self.jobs = np.zeros([4], np.int64)
    self.dispatch(np.arange(4))

  def dispatch(self, workers):
    from gssp_jax.sim import executor
    for part in executor.split_jobs(np.asarray(workers)):
      idx = self.rng.integers(0, 64, size=(part.size, 4)).astype(np.int32)
      self.state = self.job_fn(self.state, self.arrays, part.astype(np.int32), idx,
                               self.jobs[part].astype(np.int32), np.ones([part.size], np.float32))
      self.jobs[part] += 1

  def apply(self, rnd):
    self.state = self.round_fn(self.state, sync.round_args(rnd))


def test_batchnorm_statistics_follow_the_rounds():
  """A model with BatchNorm: a replica takes the mean statistics of the workers it applies."""
  import jax
  sim = _BatchNormSim()
  tl = sync.run_timeline(sim.scheme.make_protocol(), lambda w, k: [1.0, 1.3, 2.0, 2.7][w],
                         max_pushes=12, message_delay=lambda m: 0.2)
  for rnd in tl.rounds:
    before = jax.tree.map(np.asarray, sim.state.worker_model_state)
    sim.apply(rnd)
    after = jax.tree.map(np.asarray, sim.state.replica_model_state)
    for g in range(2):
      members = np.flatnonzero(rnd.arrived & (rnd.groups == g))
      if members.size:
        jax.tree.map(lambda b, a: np.testing.assert_allclose(a[g], b[members].mean(0), rtol=1e-6),
                     before, after)
    sim.dispatch(np.flatnonzero(rnd.pulls))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(sim.state.replica_params))


def test_gssp_global_batchnorm_statistics_follow_the_groups():
  """GSSP global: the global server's statistics are its groups' mean, and groups adopt them."""
  import jax
  from gssp_jax.sim import executor
  sim = _BatchNormSim("global", x_shift=3.0)
  protocol = sim.scheme.make_protocol()
  tl = sync.run_timeline(protocol, lambda w, k: [1.0, 1.3, 2.0, 2.7][w], max_pushes=16,
                         message_delay=lambda m: 0.2)
  stats = lambda: jax.tree.map(np.asarray, sim.state.replica_model_state)
  initial = stats()
  G = 2   # group servers 0, 1; the global server 2; reply slots 3, 4
  slot = lambda g: G + 1 + g
  seen = {"deliver": 0, "adopt": 0}
  for rnd in tl.rounds:
    before = stats()
    sim.apply(rnd)
    after = stats()
    for g in np.flatnonzero(rnd.deliver):   # global = mean of the groups; the reply keeps it
      seen["deliver"] += 1
      jax.tree.map(lambda b, a: np.testing.assert_allclose(a[G], b[:G].mean(0), rtol=1e-6),
                   before, after)
      jax.tree.map(lambda a: np.testing.assert_array_equal(a[slot(g)], a[G]),
                   after)
    for g in np.flatnonzero(rnd.adopt[:G] >= 0):   # a group adopts the statistics sent
      seen["adopt"] += 1
      jax.tree.map(lambda a, i: (np.testing.assert_array_equal(a[g], a[slot(g)]),
                                 np.testing.assert_array_less(1e-3, np.abs(a[g] - i[g]).max())),
                   after, initial)
    sim.dispatch(np.flatnonzero(rnd.pulls))
  assert seen["deliver"] >= 3 and seen["adopt"] >= 3 and protocol.global_replica == G
  served = executor.served_weights(sim.state, G)[1]
  jax.tree.map(lambda s, i: np.testing.assert_array_less(1e-3, np.abs(s - i[G]).max()),
               served, initial)


@pytest.mark.parametrize("inter_group,copies", [("peer", 3), ("global", 1)])
def test_gssp_bytes_between_servers_count_every_copy(tmp_path, data_dir, inter_group, copies):
  """Four groups: a peer delivery goes to 3 servers; global sends one sum and one reply."""
  import jax
  from gssp_jax.base import step as step_lib
  from gssp_jax.base import tasks
  config = _sim_config("gssp", **{"sync.num_groups": 4, "sync.inter_group": inter_group,
                                  "train.num_epochs": 0.5, "train.eval_every": 0.5})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path))
  params, model_state = tasks.make_task(config).init(jax.random.PRNGKey(0))
  payload = step_lib.tree_bytes(params) + step_lib.tree_bytes(model_state)
  totals = summary["totals"]
  # One round per delivery (and reply); global: a push held at the end has none yet.
  messages = totals["rounds"] - totals["pushes"]
  assert messages > 0 and totals["bytes_between_servers"] % (copies * payload) == 0
  sent = totals["bytes_between_servers"] // (copies * payload)
  assert messages <= sent <= messages + (config.num_workers if inter_group == "global" else 0)
  assert 0 < summary["final"]["test_accuracy"] <= 1


def test_calibration_measures_the_base_time(tmp_path, data_dir):
  config = _sim_config("asp", **{"cluster.calibrate": True, "train.num_epochs": 0.5})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path))
  measured = summary["cluster"]["calibrated_base_time"]
  assert 0 < measured < 5 and summary["cluster"]["base_time"] == measured


def test_gssp_regroups_by_measured_speed_at_epoch_ends(tmp_path, data_dir):
  # A trace in which workers 0, 1 are fast for their first 8 iterations, then slow.
  fast, slow = "0.01", "0.03"
  rows = [[fast, fast, slow, slow]] * 8 + [[slow, slow, fast, fast]] * 100
  path = tmp_path / "trace.csv"
  path.write_text("\n".join(",".join(r) for r in rows) + "\n")
  config = _sim_config("gssp", **{"cluster.profile": "trace", "cluster.trace_file": str(path),
                                  "cluster.trace_units": "seconds",
                                  "cluster.tiers": (1.0, 1.5, 2.0, 3.0), "cluster.jitter": 0.0,
                                  "sync.regroup_every_epoch": True, "compress.name": "gdtopk",
                                  "train.num_epochs": 3.0, "train.eval_every": 1.0})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  # The summary reports the trace's mean times, not speed factors of ones.
  assert "speeds" not in summary["cluster"]
  assert summary["cluster"]["trace_mean_iteration_time"] == pytest.approx(
      [(8 * 0.01 + 100 * 0.03) / 108] * 2 + [(8 * 0.03 + 100 * 0.01) / 108] * 2)
  history = summary["scheme"]["groups_history"]
  assert history[0] == [1, 1, 0, 0]   # by the trace's mean times: 2 and 3 are faster overall
  assert history[1] == [0, 0, 1, 1]   # measured over epoch 1, 0 and 1 were the fast ones
  assert history[-1] == [1, 1, 0, 0]  # ... and later they are slow again
  assert len(history) == 3   # regrouped at the ends of epochs 1 and 2, not after the last
  # And the regrouped run is still exactly reproducible across a resume.
  config.train.stop_after_updates = 80   # after the regrouping at 64 pushes
  loop.train_and_evaluate(config, str(tmp_path / "split"))
  config.train.stop_after_updates = 0
  loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert _metrics(tmp_path / "split") == _metrics(tmp_path / "run")


def test_gssp_protocol_regroups_at_a_barrier():
  protocol = sync.GSSPProtocol(4, [0, 0, 1, 1], 2)
  engine = sync.TimelineEngine(protocol, lambda w, k: [1.0, 1.1, 3.0, 3.3][w])
  rounds = []
  while engine.num_pushes < 10:
    rounds.extend(engine.step())
  protocol.request_regroup([0, 1, 0, 1])
  while not protocol.regroups:
    rounds.extend(engine.step())
  barrier = rounds[-1]
  assert not barrier.arrived.any() and barrier.pulls.all()
  assert barrier.groups.tolist() == [0, 1, 0, 1]
  assert protocol.blocked.sum() == 0
  with pytest.raises(ValueError, match="every id in 0..1 used"):
    protocol.request_regroup([0, 0, 0, 0])


# ---------------------------------------------------------------- what is timed, counted, reported


def _recording_engine(monkeypatch):
  """Patches the simulator's engine to record every push's timed delay; returns the log."""
  log = {"push": {}, "engines": []}

  class Recording(sync.TimelineEngine):
    def __init__(self, protocol, compute_time, *, push_delay, **kw):
      def timed(w, k):
        log["push"][(w, k)] = push_delay(w, k)
        return log["push"][(w, k)]
      super().__init__(protocol, compute_time, push_delay=timed, **kw)
      log["engines"].append(self)
  monkeypatch.setattr(sync, "TimelineEngine", Recording)
  return log


# Every compressor (timing differs) and each kind of arrival (all at once, one at a time,
# GSSP's groups, InHAD's nodes, DS-Sync's groups) at least once; CASP's community traffic
# is pinned by the traffic tests above.
@pytest.mark.parametrize("scheme,compressor", [
    ("bsp", "dgc"), ("ssp", "none"), ("gssp", "gdtopk"), ("inhad", "topk"), ("dssync", "topk")])
def test_timed_push_bytes_equal_reported_bytes_pushed(tmp_path, data_dir, monkeypatch, scheme,
                                                      compressor):
  """With 1 byte/s links and no latency a push's delay is its byte count; summed over the
  pushes that arrived it must equal ``bytes_pushed`` (what the device counted), per worker.

  InHAD's gradient goes to its node (1 byte/s here too) and only its iteration number to
  the server: the delay is both, and ``bytes_local`` holds the gradients.
  """
  log = _recording_engine(monkeypatch)
  config = _sim_config(scheme, **{"compress.name": compressor, "compress.ratio": 0.05,
                                  "cluster.bandwidth": 1.0, "cluster.latency": 0.0,
                                  "cluster.node_bandwidth": 1.0, "cluster.node_latency": 0.0,
                                  # each push alone: its delay is its bytes (the fixed path)
                                  "cluster.shared_server_links": False,
                                  "train.num_epochs": 1.5 if compressor == "gdtopk" else 1.0,
                                  "train.eval_every": 1.0})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path))
  engine = log["engines"][-1]
  arrived = [sum(t for (w, k), t in log["push"].items() if w == v and k < engine.iteration[v])
             for v in range(4)]
  final = summary["final"]
  if scheme == "inhad":
    assert final["bytes_pushed_per_worker"] == [traffic.IN_BYTES * int(n)
                                                for n in engine.iteration]
    assert sum(arrived) == sum(final["bytes_pushed_per_worker"]) + final["bytes_local"]
    assert final["bytes_local"] > 0
    return
  assert final["bytes_pushed_per_worker"] == arrived
  assert summary["totals"]["bytes_pushed"] == sum(arrived) > 0
  assert engine.iteration.sum() == summary["totals"]["pushes"]
  if compressor == "gdtopk":   # the last iteration of a worker's epoch is flushed: dense
    import jax
    from gssp_jax.base import step as step_lib
    from gssp_jax.base import tasks
    dense = step_lib.tree_bytes(tasks.make_task(config).init(jax.random.key(0))[0])
    spe = 1024 // 4 // 32
    assert all(log["push"][(w, spe - 1)] == dense for w in range(4))
    assert all(log["push"][(w, spe - 2)] < dense for w in range(4))


def test_blocked_time_and_totals_include_waits_in_progress(tmp_path, data_dir, monkeypatch):
  log = _recording_engine(monkeypatch)
  # Under SSP(1) with 4x slower workers, the run ends with worker 0 waiting for them.
  config = _sim_config("ssp", **{"sync.staleness": 1, "cluster.tiers": (1.0, 4.0),
                                 "train.num_epochs": 1.0, "train.eval_every": 1.0})
  config.data_dir = data_dir
  summary = loop.train_and_evaluate(config, str(tmp_path))
  engine = log["engines"][-1]
  busy = engine.busy_workers()   # computing, or a push or pull on a link
  waiting = [w for w in range(4) if w not in busy]
  assert waiting   # fast workers wait for the slow ones under SSP(1)
  expected = engine.blocked_time + np.where(np.isin(np.arange(4), waiting),
                                            engine.now - engine.pushed_at, 0.0)
  assert np.any(expected[waiting] > engine.blocked_time[waiting])   # a wait in progress
  np.testing.assert_array_equal(summary["final"]["blocked_time_per_worker"], expected)
  np.testing.assert_array_equal(summary["totals"]["blocked_time_per_worker"], expected)
  assert summary["final"]["blocked_time"] == pytest.approx(expected.mean())


def _two_worker_jobs(compressor):
  import jax
  from gssp_jax.sim import executor

  def loss_fn(p, ms, batch, rng):
    del rng
    return jnp.sum((p["w"] - batch["x"]) ** 2), ms

  scheme = sync.build_scheme("asp", 2)
  tx = optax.chain(scheme.transform, sync.replicated(optax.sgd(0.1), scheme.num_replicas))
  state = executor.init_state({"w": jnp.zeros([6])}, {}, tx, compressor, 2, scheme.num_replicas,
                              jax.random.key(0))
  job_fn = executor.make_job_fn(loss_fn, compressor, 24)
  args = (state, {"x": jnp.arange(24, dtype=jnp.float32).reshape(4, 6)},
          np.array([0, 1], np.int32), np.array([[1], [2]], np.int32), np.zeros([2], np.int32),
          np.full([2], 0.5, np.float32))
  return scheme, executor.make_round_fn(tx), job_fn, args


def test_a_job_counts_in_loss_and_bytes_only_once_its_push_arrives():
  from gssp_jax import compress
  scheme, round_fn, job_fn, args = _two_worker_jobs(compress.topk(1))
  state = job_fn(*args)
  assert int(state.loss_count) == 0 and float(state.loss_sum) == 0.0   # computed, not pushed
  np.testing.assert_array_equal(executor.push_bytes_total(state.push_bytes), [0, 0])
  rnd = sync.rounds.empty_round(0.0, 2, scheme.num_replicas, 1, np.zeros([2], np.int32))
  state = round_fn(state, sync.round_args(rnd._replace(
      arrived=np.array([False, True]), applies=np.ones([scheme.num_replicas], bool))))
  assert int(state.loss_count) == 1   # worker 1's gradient arrived, worker 0's did not
  assert float(state.loss_sum) == pytest.approx(float(jnp.sum(jnp.arange(12, 18.0) ** 2)))
  np.testing.assert_array_equal(executor.push_bytes_total(state.push_bytes),
                                [0, 3 * 8])   # 3 of 6 entries + indices


def test_a_flushed_job_sends_dense_bytes_and_clears_its_residual():
  from gssp_jax import compress
  _, _, job_fn, args = _two_worker_jobs(compress.gdtopk(1))
  state = job_fn(*args, np.array([False, True]))
  np.testing.assert_array_equal(state.job_bytes, [3 * 8, 24])
  res = np.asarray(state.comp_state.residual["w"])
  assert np.count_nonzero(res[0]) == 3 and not res[1].any()
