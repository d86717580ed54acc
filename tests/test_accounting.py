"""What a comparison counts, pinned where it was wrong.

* Bytes past 2 GiB. ``SimState.push_bytes`` was one int32 per worker: 38 VGG-19 pushes
  (80,206,120 B each, 3,047,832,560 B) came out as -1,247,134,736, so the asynchronous
  schemes' fastest workers, which push most between two evaluations, reported far too few
  bytes while BSP's stayed right.
* InHAD's BatchNorm statistics. Its rounds carry node ids as ``groups``, read as replica ids:
  its one replica kept the statistics of node 0's workers only.
* CASP's blocked time. A community's upload through its leader counted as its members' blocked
  time; every other scheme counts a worker's upload as push time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gssp_jax import sync
from gssp_jax.sim import executor
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.sync import timeline as timeline_lib
from gssp_jax.sim import levels
from gssp_jax.train import optim
from test_clip import PARAMS, SPEEDS4, _linear_loss, _one_epoch_steps, _sgd_config

VGG19_PUSH = 80_206_120   # bytes of one dense VGG-19 push (float32 weights and statistics)


@pytest.mark.parametrize("runner", ["rounds", "levels"])
def test_push_bytes_past_two_gib_are_counted_exactly(runner):
  """ASP, 4 workers, 160 pushes of a VGG-19's size between two evaluations: 40 per worker."""
  scheme = sync.build_scheme("asp", 4, worker_times=SPEEDS4)
  tx = optim.make_sync_chain(_sgd_config(grad_clip=0.0), scheme.transform, scheme.num_replicas)
  state = executor.init_state(PARAMS, {}, tx, None, 4, scheme.num_replicas, jax.random.key(0))
  if runner == "rounds":
    run = executor.make_round_runner(executor.make_job_fn(_linear_loss, None, VGG19_PUSH),
                                     executor.make_round_fn(tx))
  else:
    run = levels.make_level_runner(_linear_loss, None, tx, VGG19_PUSH, 0, 4)
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
    levels.make_level_runner(_linear_loss, None, optax.identity(), 2**31 - 8, 8, 4)


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
