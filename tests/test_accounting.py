"""What a comparison counts, pinned where it was wrong.

* Bytes past 2 GiB. ``SimState.push_bytes`` was one int32 per worker: 38 VGG-19 pushes
  (80,206,120 B each, 3,047,832,560 B) came out as -1,247,134,736, so the asynchronous
  schemes' fastest workers, which push most between two evaluations, reported far too few
  bytes while BSP's stayed right.
* InHAD's BatchNorm statistics. Its rounds carry node ids as ``groups``, read as replica ids:
  its one replica kept the statistics of node 0's workers only.
* CASP's blocked time. A community's upload through its leader counted as its members' blocked
  time; every other scheme counts a worker's upload as push time.
* Staleness in two units. It was counted in updates of the gradient's server only, so a GSSP
  delivery of K pushes or an InHAD aggregate counted 1, and GSSP's 6.0 sat beside ASP's 15.0.
  It is now also counted in worker iterations of data (``staleness_data``), labelled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers

from gssp_jax import sync
from gssp_jax.sim import executor
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.sync import timeline as timeline_lib
from gssp_jax.base import optim
from test_clip import PARAMS, SPEEDS4, _linear_loss, _one_epoch_steps, _sgd_config

VGG19_PUSH = 80_206_120   # bytes of one dense VGG-19 push (float32 weights and statistics)


@pytest.mark.parametrize("runner", ["rounds", "levels"])
def test_push_bytes_past_two_gib_are_counted_exactly(runner):
  """ASP, 4 workers, 160 pushes of a VGG-19's size between two evaluations: 40 per worker."""
  scheme = sync.build_scheme("asp", 4, worker_times=SPEEDS4)
  tx = optim.make_sync_chain(_sgd_config(grad_clip=0.0), scheme.transform, scheme.num_replicas)
  if runner == "rounds":
    state = executor.init_state(PARAMS, {}, tx, None, 4, scheme.num_replicas, jax.random.key(0))
    run = executor.make_round_runner(executor.make_job_fn(_linear_loss, None, VGG19_PUSH),
                                     executor.make_round_fn(tx))
  else:
    state, run, _ = helpers.level_runner(_linear_loss, None, tx, VGG19_PUSH, 0, scheme, PARAMS,
                                         {}, jax.random.key(0))
  state = run(state, {"x": jnp.zeros([4, 1])}, _one_epoch_steps(scheme, 160))
  pushes = np.asarray(sync.find_sync_state(state.tx_state).clock, np.int64)
  assert pushes.sum() == 160 and pushes.max() * VGG19_PUSH > 2**31   # past one int32
  np.testing.assert_array_equal(executor.push_bytes_total(state.push_bytes),
                                pushes * VGG19_PUSH)


def test_a_push_larger_than_a_job_slot_holds_is_refused_before_compiling():
  with pytest.raises(ValueError, match=r"one push of 2,147,483,648 bytes; allowed: at most "
                                       r"2,146,435,072"):
    executor.make_job_fn(_linear_loss, None, 2**31)
  with pytest.raises(ValueError, match=r"one push of 2,147,483,648 bytes"):   # the level runner
    helpers.level_runner(_linear_loss, None, optax.identity(), 2**31 - 8, 8,
                         sync.build_scheme("asp", 4), PARAMS, {}, jax.random.key(0))


def test_inhad_takes_the_statistics_of_workers_on_every_node():
  """2 nodes of 2 workers, one replica: node 1's workers arrive; their statistics' mean is kept."""
  scheme = sync.build_scheme("inhad", 4, num_nodes=2, worker_times=SPEEDS4)
  tx = optim.make_sync_chain(_sgd_config(grad_clip=0.0), scheme.transform, scheme.num_replicas)
  replica_stats = {"mean": jnp.zeros([1, 1])}
  worker_stats = {"mean": jnp.array([[1.0], [2.0], [3.0], [4.0]])}
  replicas = jax.tree.map(lambda p: p[None], PARAMS)
  workers = jax.tree.map(lambda p: jnp.stack([p] * 4), PARAMS)
  node_one = np.array([False, False, True, True])
  rnd = rounds_lib.empty_round(0.0, 4, 1, 1, np.array([0, 0, 1, 1], np.int32))
  rnd = rnd._replace(arrived=node_one, pulls=node_one)
  *_, replica_stats, worker_stats = rounds_lib.apply_round(
      tx, replicas, tx.init(PARAMS), workers, workers, sync.round_args(rnd),
      replica_stats, worker_stats)
  np.testing.assert_array_equal(replica_stats["mean"], [[3.5]])
  np.testing.assert_array_equal(worker_stats["mean"], [[1.0], [2.0], [3.5], [3.5]])


def test_a_casp_communitys_upload_is_push_time_not_blocked_time():
  """Hand timeline, one community of 2; compute 1 s and 2 s, member -> leader 0.25 s, upload 0.5 s.

  Pushes reach the leader at 1.25 (worker 0) and 2.25 (worker 1); the community's push leaves
  then and reaches the server at 2.75, which releases both. Worker 0 waited 1.0 s for worker 1
  (blocked); the 0.5 s upload is push time, as a worker's own upload is for every other scheme.
  """
  engine = timeline_lib.TimelineEngine(
      sync.CASPProtocol(2, max_communities=1), lambda w, k: (1.0, 2.0)[w],
      push_delay=lambda w, k: 0.25, message_delay=lambda m: 0.5)
  while engine.num_pushes < 2:
    engine.step()
  assert engine.now == 2.25 and [e[2] for e in engine.queue] == ["message"]   # the upload
  np.testing.assert_array_equal(engine.blocked_time_so_far(), [1.0, 0.0])
  kind = None
  while kind != "message":
    engine.step()
    kind = engine.events[-1][0]
  assert engine.now == 2.75
  np.testing.assert_array_equal(engine.blocked_time, [1.0, 0.0])   # was [1.5, 0.5]
  np.testing.assert_array_equal(engine.blocked_time_so_far(), [1.0, 0.0])


def _round(W, R, G, route, **fields):
  rnd = rounds_lib.empty_round(0.0, W, R, G, np.asarray(route, np.int32))
  for name, value in fields.items():
    getattr(rnd, name)[...] = value
  return rnd


def _stale(acct, rnd):
  """Applies ``rnd``: ({worker: staleness in updates}, sorted staleness in data of its gradients)."""
  hist = acct.data_hist.copy()
  workers, values = acct.apply(rnd)
  new = acct.data_hist - hist
  return dict(zip(workers.tolist(), values.tolist())), np.repeat(np.arange(new.size), new).tolist()


def test_a_gssp_delivery_of_two_pushes_is_one_update_but_two_iterations_of_data():
  # 4 workers, 2 groups (peer): workers 0, 1 at group server 0; 2, 3 at group server 1.
  acct = sync.accounting.Accounting(4, 2)
  route = [0, 0, 1, 1]
  _stale(acct, _round(4, 2, 2, route, arrived=[1, 0, 0, 0], pulls=[1, 0, 0, 0],
                      applies=[1, 0]))
  got, data = _stale(acct, _round(4, 2, 2, route, arrived=[0, 1, 0, 0], pulls=[0, 1, 0, 0],
                                  applies=[1, 0], forward=[1, 0]))
  assert got == {1: 1} and data == [1]            # w0's push came first: one of each
  _stale(acct, _round(4, 2, 2, route, applies=[0, 1], deliver=[1, 0]))   # group 0's sum of 2
  got, data = _stale(acct, _round(4, 2, 2, route, arrived=[0, 0, 1, 0], applies=[0, 1]))
  assert got == {2: 1} and data == [2]            # one update of group server 1: 2 gradients
  assert acct.data.tolist() == [2, 3] and acct.version.tolist() == [2, 2]
  assert acct.data_summary()["unit"] != acct.summary()["unit"]


def test_a_bsp_round_and_asp_pushes_count_the_same_in_both_units_where_they_should():
  bsp = sync.accounting.Accounting(3, 1)
  for _ in range(2):
    got, data = _stale(bsp, _round(3, 1, 1, [0, 0, 0], arrived=[1, 1, 1], pulls=[1, 1, 1],
                                   applies=[1]))
    assert got == {0: 0, 1: 0, 2: 0} and data == [0, 0, 0]
  assert bsp.data.tolist() == [6] and bsp.version.tolist() == [2]
  asp = sync.accounting.Accounting(2, 1)
  for w in (0, 1, 0, 0, 1):
    arrived = [w == 0, w == 1]
    asp.apply(_round(2, 1, 1, [0, 0], arrived=arrived, pulls=arrived, applies=[1]))
  assert asp.data_summary()["hist"] == asp.summary()["hist"]


def test_an_inhad_aggregate_counts_every_waiting_gradient():
  # 2 workers on 2 nodes, one replica; nothing applies until the aggregate.
  acct = sync.accounting.Accounting(2, 1, aggregating=True)
  for w in (0, 0, 1):
    arrived = [w == 0, w == 1]
    acct.apply(_round(2, 1, 2, [0, 1], arrived=arrived, pulls=arrived))
  acct.apply(_round(2, 1, 2, [0, 1], applies=[1], aggregate=True))
  assert acct.data.tolist() == [3] and acct.version.tolist() == [1]
  # Worker 1 read version 0 (data 0) before the aggregate: its next gradient is 1 update
  # and 3 iterations of data stale.
  acct.apply(_round(2, 1, 2, [0, 1], arrived=[0, 1]))
  workers, values = acct.apply(_round(2, 1, 2, [0, 1], applies=[1], aggregate=True))
  assert workers.tolist() == [1] and values.tolist() == [1]
  assert acct.data_max == 3


def test_a_ds_sync_average_merges_what_each_member_took_once():
  # 3 workers, each its own replica; replicas 0 and 1 average after 2 and 1 pushes.
  acct = sync.accounting.Accounting(3, 3)
  route = [0, 1, 2]
  for arrived in ([1, 0, 0], [1, 1, 0], [0, 0, 1]):
    acct.apply(_round(3, 3, 1, route, arrived=arrived, pulls=arrived, applies=arrived))
  acct.apply(_round(3, 3, 1, route, average=[0, 0, -1], pulls=[1, 1, 0]))
  assert acct.data.tolist() == [3, 3, 1]
  acct.apply(_round(3, 3, 1, route, arrived=[1, 0, 0], pulls=[1, 0, 0], applies=[1, 0, 0]))
  acct.apply(_round(3, 3, 1, route, average=[0, 0, -1]))
  assert acct.data.tolist() == [4, 4, 1]   # not 7: the shared 3 counted once


def test_a_checkpoint_from_before_the_data_counters_still_loads():
  old = sync.accounting.Accounting(2, 1)
  old.apply(_round(2, 1, 1, [0, 0], arrived=[1, 0], pulls=[1, 0], applies=[1]))
  state = {k: v for k, v in old.state_dict().items()
           if k in ("version", "read", "pending", "aggregating", "hist", "applied",
                    "staleness_sum", "staleness_max")}
  acct = sync.accounting.Accounting(2, 1)
  acct.load_state_dict(state)
  acct.apply(_round(2, 1, 1, [0, 0], arrived=[0, 1], pulls=[0, 1], applies=[1]))
  assert acct.summary()["applied"] == 2 and acct.data_summary()["mean"] == 0.0


@pytest.mark.parametrize("name,inter_group", [(n, "peer") for n in sync.SCHEMES]
                         + [("gssp", "global")])
def test_accounting_many_rounds_at_once_equals_one_by_one(name, inter_group):
  """``apply_many`` (the simulator's, vectorised) leaves exactly ``apply``'s state, whatever the
  rounds' split into calls: 6 workers of mixed speeds, jittered, data iterations 1 to 3."""
  speeds = [1.0, 1.37, 1.91, 2.53, 1.2, 2.9]
  groups = 3 if name in ("gssp", "halos") else 2
  scheme = sync.build_scheme(name, 6, worker_times=speeds, num_groups=groups, num_nodes=2,
                             casp_reconfigure_every=4, casp_max_communities=2,
                             inter_group=inter_group)
  timeline = sync.run_timeline(scheme.make_protocol(),
                               lambda w, k: speeds[w] * (1 + 0.1 * ((k * 7 + w) % 3)),
                               max_pushes=300, message_delay=lambda m: 0.45)
  iterations = [1, 2, 1, 3, 1, 2]
  one, many = (sync.accounting.Accounting(6, scheme.num_replicas, aggregating=name == "inhad",
                                          push_iterations=iterations) for _ in range(2))
  for rnd in timeline.rounds:
    one.apply(rnd)
  rng, start = np.random.default_rng(0), 0
  while start < len(timeline.rounds):
    size = int(rng.integers(1, 40))
    many.apply_many(timeline.rounds[start:start + size])
    start += size
  assert len(timeline.rounds) >= 50
  want, got = one.state_dict(), many.state_dict()
  assert set(want) == set(got)
  for key in want:
    if isinstance(want[key], np.ndarray) or isinstance(got[key], np.ndarray):
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    else:
      assert got[key] == want[key], key
  assert one.summary() == many.summary() and one.data_summary() == many.data_summary()


@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_accounting_many_rounds_follows_forwards_that_find_a_full_outbox(split, monkeypatch):
  """Two forwards of a group with no delivery between (not GSSP's order, which the vectorised
  path relies on): ``apply_many`` takes the event-by-event path and still equals ``apply``."""
  route = [0, 0, 1, 1]
  rounds = [_round(4, 2, 2, route, arrived=[1, 0, 0, 0], pulls=[1, 0, 0, 0], applies=[1, 0]),
            _round(4, 2, 2, route, arrived=[0, 1, 0, 0], applies=[1, 0], forward=[1, 0]),
            _round(4, 2, 2, route, arrived=[1, 0, 0, 0], applies=[1, 0], forward=[1, 0]),
            _round(4, 2, 2, route, arrived=[0, 0, 1, 0], pulls=[0, 0, 1, 0], applies=[0, 1]),
            _round(4, 2, 2, route, applies=[0, 1], deliver=[1, 0], pulls=[0, 0, 0, 1]),
            _round(4, 2, 2, route, arrived=[0, 0, 0, 1], applies=[0, 1], forward=[0, 1]),
            _round(4, 2, 2, route, applies=[1, 0], deliver=[0, 1], pulls=[1, 1, 0, 0]),
            _round(4, 2, 2, route, arrived=[1, 1, 0, 0], applies=[1, 0])]
  one, many = sync.accounting.Accounting(4, 2), sync.accounting.Accounting(4, 2)
  for rnd in rounds:
    one.apply(rnd)
  events = []
  by_event = sync.accounting.Accounting._exchange_events
  monkeypatch.setattr(sync.accounting.Accounting, "_exchange_events",
                      lambda self, *args: events.append(1) or by_event(self, *args))
  for start in range(0, len(rounds), split):
    many.apply_many(rounds[start:start + split])
  assert events   # the second forward finds the first one's sum still in the outbox
  assert one.data.tolist() == many.data.tolist() and one.data[1] == 5   # 1 + 2 + 1 + 1 + ...
  assert one.summary() == many.summary() and one.data_summary() == many.data_summary()
  np.testing.assert_array_equal(one.group_pending, many.group_pending)
  np.testing.assert_array_equal(one.group_outbox, many.group_outbox)
