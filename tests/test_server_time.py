"""Servers' update time (``cluster.server_update_time``) and compression's compute time
(``compress.compute_time``): hand-computed timelines, the refusals, exact resumption."""

import pickle

import numpy as np
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import traffic

MB = 1e6


def _starts(engine, count):
  """Steps ``engine`` until ``count`` iterations started; their ``(time, worker, iteration)``."""
  while len(engine.starts) < count:
    engine.step()
  return [(pytest.approx(t, abs=1e-12), w, k) for t, w, k in engine.starts[:count]]


def _cluster(num_workers, **kw):
  """Compute 1 s per iteration, instant links (unless ``kw`` says otherwise)."""
  kw = {"bandwidth": 1e15, "latency": 0.0, "server_bandwidth": 1e15, "server_latency": 0.0,
        **kw}
  return cluster_lib.Cluster(speeds=np.ones([num_workers]), base_time=1.0, **kw)


# -- the server's update time ------------------------------------------------------------------

def test_bsp_starts_its_next_iteration_one_update_later():
  """BSP, 2 workers of 1 s: the barrier at 1.0 releases both when the update is done."""
  for update, second in ((0.0, 1.0), (0.5, 1.5)):
    engine = sync.TimelineEngine(sync.BSPProtocol(2), lambda w, k: 1.0, update_time=update)
    assert _starts(engine, 4)[2:] == [(second, 0, 1), (second, 1, 1)]


def test_an_update_arriving_at_a_busy_server_waits_for_it():
  """ASP, pushes at 1.0 and 1.1, update 0.3: the first is done at 1.3; the second waits for
  it, is done at 1.6 (0.6 after the first's arrival), and only then does its pull leave."""
  engine = sync.TimelineEngine(sync.ASPProtocol(2), lambda w, k: [1.0, 1.1][w], update_time=0.3)
  assert _starts(engine, 4)[2:] == [(1.3, 0, 1), (1.6, 1, 1)]
  assert engine.server_busy.tolist() == pytest.approx([1.6])
  # The wait for the update is not blocked time: the protocol released them at their push.
  assert engine.blocked_time.tolist() == [0.0, 0.0]


def test_two_servers_apply_their_updates_side_by_side():
  """GSSP, two groups of one worker, both pushing at 1.0: each group server updates its own
  weights, so neither waits for the other (both restart at 1.3, not 1.3 and 1.6)."""
  scheme = sync.build_scheme("gssp", 2, worker_times=np.ones(2), num_groups=2, staleness=1)
  links = traffic.Traffic(scheme.legs, _cluster(2, server_update_time=0.3), lambda w, k: 0, 0, 0)
  engine = links.engine(scheme.make_protocol(), lambda w, k: 1.0, record=True)
  assert _starts(engine, 4)[2:] == [(1.3, 0, 1), (1.3, 1, 1)]


def test_a_global_server_queues_the_groups_deliveries():
  """GSSP ``global``, two groups of one worker, pushes at 1.0, updates of 0.3 s, free links.
  Each group server is done at 1.3 and forwards then; the global server applies the two
  deliveries one after the other (1.3-1.6, 1.6-1.9) and replies after each; each group server
  adopts the reply (0.3 s) and only then releases its worker: at 1.9 and 2.2."""
  scheme = sync.build_scheme("gssp", 2, worker_times=np.ones(2), num_groups=2, staleness=1,
                             inter_group="global")
  links = traffic.Traffic(scheme.legs, _cluster(2, server_update_time=0.3), lambda w, k: 0, 0, 0)
  engine = links.engine(scheme.make_protocol(), lambda w, k: 1.0, record=True)
  assert _starts(engine, 4)[2:] == [(1.9, 0, 1), (2.2, 1, 1)]
  assert engine.server_busy[:3].tolist() == pytest.approx([1.9, 2.2, 1.9])   # groups, global


@pytest.mark.parametrize("name, second", [("diloco", [1.5, 1.5]), ("local_sgd", [1.5, 1.5]),
                                          ("async_local_sgd", [1.5, 2.0])])
def test_a_local_update_round_is_one_outer_update(name, second):
  """Two workers whose jobs end at 1.0, updates of 0.5 s: DiLoCo's and Local SGD's barrier is
  one outer update (both restart at 1.5); asynchronous Local SGD's two pushes queue."""
  engine = sync.TimelineEngine(sync.build_scheme(name, 2).make_protocol(), lambda w, k: 1.0,
                               update_time=0.5)
  assert [t for t, _, _ in _starts(engine, 4)[2:]] == second


def test_a_routed_pull_leaves_when_the_update_is_done():
  """ASP, free pushes at 1.0 and 1.1, 1 MB pulls sharing a 1 MB/s server interface.

  Without update time the pulls start at 1.0 and 1.1: worker 0 has 0.1 MB alone, then each
  gets 0.5 MB/s; worker 0 ends at 1.1 + 0.9 / 0.5 = 2.9, worker 1 (0.9 MB by then) at 3.0.
  With 0.3 s the updates are done at 1.3 and 1.6 and the pulls leave then: worker 0 has 0.3 MB
  alone, ends at 1.6 + 0.7 / 0.5 = 3.0, worker 1 at 3.0 + 0.3 = 3.3.
  """
  scheme = sync.build_scheme("asp", 2)
  for update, expected in ((0.0, [(2.9, 0, 1), (3.0, 1, 1)]), (0.3, [(3.0, 0, 1), (3.3, 1, 1)])):
    cluster = _cluster(2, server_bandwidth=MB, server_update_time=update)
    links = traffic.Traffic(scheme.legs, cluster, lambda w, k: 0, 1, MB, shared=True)
    engine = links.engine(scheme.make_protocol(), lambda w, k: [1.0, 1.1][w], record=True)
    assert _starts(engine, 4)[2:] == expected


def test_bsp_over_a_ring_applies_on_every_worker_at_once():
  """bsp_allreduce has no server: the update time is each worker's own apply of the averaged
  gradient, all in parallel, so the next iteration starts one update after the ring ends."""
  scheme = sync.build_scheme("bsp_allreduce", 2)
  cluster = _cluster(2, bandwidth=MB, server_update_time=0.25)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: MB, MB, MB)
  ring = links.legs.allreduce_time   # 2 (W - 1) steps of MB / 2 at 1 MB/s: 1 s
  assert ring == pytest.approx(1.0)
  engine = links.engine(scheme.make_protocol(), lambda w, k: 1.0, record=True)
  assert _starts(engine, 4)[2:] == [(2.25, 0, 1), (2.25, 1, 1)]


def test_a_worker_dropped_while_its_pull_waits_never_starts():
  """ASP, update 0.3: worker 0's push at 1.0 lets its pull go at 1.3; it crashes at 1.1, so
  the pull vanishes with it (worker 1 goes on)."""
  engine = sync.TimelineEngine(sync.ASPProtocol(2), lambda w, k: [1.0, 5.0][w], update_time=0.3)
  engine.drop_at(1.1, 0)
  for _ in range(3):   # the two starts, worker 0's push
    engine.step()
  assert 0 in engine.busy_workers()   # its pull waits for the update: not blocked
  engine.step()   # the drop
  assert 0 not in engine.busy_workers()
  assert _starts(engine, 3)[2:] == [(5.3, 1, 1)]


def test_a_resumed_engine_with_busy_servers_continues_exactly():
  make = lambda: sync.TimelineEngine(sync.ASPProtocol(3), lambda w, k: [1.0, 0.2, 0.3][w],
                                     update_time=0.15)
  whole, split = make(), make()
  for _ in range(40):
    whole.step()
  for _ in range(17):
    split.step()
  assert split.server_busy[0] > split.now   # saved while the server is still updating
  resumed = make()
  resumed.load_state_dict(pickle.loads(pickle.dumps(split.state_dict())))
  for _ in range(23):
    resumed.step()
  assert resumed.starts[-5:] == whole.starts[-5:] and resumed.now == whole.now
  np.testing.assert_array_equal(resumed.server_busy, whole.server_busy)


def test_a_state_saved_before_server_times_loads_with_idle_servers():
  engine = sync.TimelineEngine(sync.ASPProtocol(2), lambda w, k: 1.0)
  for _ in range(3):
    engine.step()
  old = {k: v for k, v in engine.state_dict().items() if k != "server_busy"}
  resumed = sync.TimelineEngine(sync.ASPProtocol(2), lambda w, k: 1.0)
  resumed.load_state_dict(pickle.loads(pickle.dumps(old)))
  assert resumed.server_busy.tolist() == [0.0]


# -- compression's compute time ----------------------------------------------------------------

@pytest.mark.parametrize("shared", [False, True])
def test_compression_time_comes_before_the_push_leaves(shared):
  """ASP, 1 s compute, a 1 MB push on a 1 MB/s worker link: it arrives at 2.0 without
  compression's time, at 2.05 with 0.05 s of it (the transfer starts when it is compressed)."""
  scheme = sync.build_scheme("asp", 1)
  for seconds, arrival in ((0.0, 2.0), (0.05, 2.05)):
    links = traffic.Traffic(scheme.legs, _cluster(1, bandwidth=MB), lambda w, k: MB, MB, 1,
                            shared=shared, compress_time=seconds)
    engine = links.engine(scheme.make_protocol(), lambda w, k: 1.0, record=True)
    while not engine.pushes:
      engine.step()
    assert engine.pushes[0][0] == pytest.approx(arrival, abs=1e-12)


@pytest.mark.parametrize("compressor", ["topk", "gdtopk"])
def test_a_simulated_compressed_push_arrives_compute_time_later(tmp_path, data_dir, compressor):
  """The simulator's own engine (top-k under SSP, GDTopK under GSSP): every first push arrives
  exactly ``compress.compute_time`` later than without it."""
  from gssp_jax.sim import simulate  # pylint: disable=g-import-not-at-top
  from gssp_jax.base import run as run_lib  # pylint: disable=g-import-not-at-top
  arrivals = []
  for seconds in (0.0, 0.02):
    config = helpers.cluster_config("gssp" if compressor == "gdtopk" else "ssp", data_dir,
                                    **{"compress.name": compressor,
                                       "compress.compute_time": seconds})
    config_lib.validate_config(config)
    workdir = str(tmp_path / f"{compressor}{seconds}")
    sim = simulate.Simulation(config, run_lib.prepare_run(config, workdir), workdir)
    sim.engine.record = True
    first = {}   # each worker's first push: one compression each
    while len(first) < 4:
      sim.engine.step()
      first.update({w: t for t, w, k in sim.engine.pushes if k == 0})
    arrivals.append(np.array([first[w] for w in range(4)]))
  np.testing.assert_allclose(arrivals[1] - arrivals[0], 0.02, rtol=0, atol=1e-12)


# -- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["cluster.server_update_time", "compress.compute_time"])
@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan"), "1"])
def test_a_bad_time_is_refused(key, value):
  config = helpers.cluster_config("ssp", **{"compress.name": "topk"})
  section, leaf = key.split(".")
  with config[section].ignore_type():   # its types would refuse a string before validation
    config[section][leaf] = value
  with pytest.raises(ValueError, match=rf"config\.{key}={value!r} is invalid; allowed: a finite "
                                       r"number (of seconds )?>= 0"):
    config_lib.validate_config(config)


def test_compression_time_without_a_compressor_is_refused():
  with pytest.raises(ValueError, match=r"config\.compress\.compute_time=0\.01 cannot apply with "
                                       r"compress\.name='none'"):
    config_lib.validate_config(helpers.cluster_config("ssp", **{"compress.compute_time": 0.01}))


@pytest.mark.parametrize("key", ["cluster.server_update_time", "compress.compute_time"])
def test_the_real_runtime_refuses_simulated_times(key):
  config = helpers.cluster_config("ssp", **{key: 0.01, "compress.name": "topk",
                                            "executor": "dist"})
  with pytest.raises(ValueError, match=rf"runs as 'dist'\) cannot go with config\.{key}=0\.01: "
                                       "the real runtime's servers and workers take their own"):
    config_lib.validate_config(config)


def test_the_fused_loop_refuses_compression_time():
  config = helpers.mnist_smoke(**{"compress.name": "topk", "compress.compute_time": 0.01})
  with pytest.raises(ValueError, match=r"runs as 'fused'\) cannot go with "
                                       r"config\.compress\.compute_time=0\.01"):
    config_lib.validate_config(config)


def test_a_server_update_time_simulates_bsp():
  """Like any cluster timing key, it takes BSP off the fused loop (which has no clock)."""
  config = helpers.mnist_smoke(**{"cluster.server_update_time": 0.01})
  config_lib.validate_config(config)
  assert cluster_lib.cluster_is_set(config)


def test_a_config_recorded_before_the_times_is_unchanged(tmp_path):
  helpers.recorded_without(helpers.mnist_smoke(), tmp_path, "cluster.server_update_time",
                           "compress.compute_time")


def test_a_bsp_run_ends_one_update_later_per_barrier_before_its_last(tmp_path, data_dir):
  """4 BSP workers, 4 iterations each (one epoch): the 3 barriers before the last each hold
  the next iteration back by the update, so the run ends 3 x 0.05 s later; the summary's
  cluster states the update time."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  summaries = [loop.train_and_evaluate(
      helpers.cluster_config("bsp", data_dir, eval_every=1.0,
                             **{"cluster.server_update_time": seconds}),
      str(tmp_path / str(seconds)), progress=False) for seconds in (0.0, 0.05)]
  times = [s["totals"]["virtual_time"] for s in summaries]
  assert times[1] == pytest.approx(times[0] + 0.15, abs=1e-9)
  assert summaries[1]["cluster"]["server_update_time"] == 0.05
  assert "server_update_time" not in summaries[0]["cluster"]
