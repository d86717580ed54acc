"""The level-batched executor (``sim/levels.py``, ``planner.py``, ``chunk.py``) against the reference.

The per-round runner (``executor.make_round_runner``) is the oracle: the level
runner must leave the same state after the same steps, for every scheme, with
and without compression and BatchNorm statistics, however the steps are split
into calls. Then the planner's cutting rule on hand-made steps, the chunk
program's shape (compiled once, no conditional, no copy of a ``[W, P]``
buffer), and the executor in the training loop: equal to ``rounds``, exact
through a resume, and nothing eager, no transfer and no compilation between
evaluations.
"""

import collections
import copy
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from gssp_jax import compress
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import chunk
from gssp_jax.sim import executor
from gssp_jax.sim import levels
from gssp_jax.sim import planner as planner_lib
from gssp_jax.sim import simulate
from gssp_jax.sim import watch
from gssp_jax.sync import local as local_lib
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax import executors as executors_lib
from gssp_jax.base import optim
from gssp_jax.base import tasks

W, B, N = 4, 4, 64
SPEEDS = [1.0, 1.37, 1.91, 2.53]   # a heterogeneous cluster: levels of 1 to 4 jobs


class _Net(nn.Module):
  batch_norm: bool

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=False, momentum=0.5)(x)
    return nn.Dense(2)(nn.relu(x))


def _model(batch_norm: bool):
  """A tiny model with dropout (the job's rng) and, optionally, BatchNorm statistics."""
  net = _Net(batch_norm)
  variables = net.init(jax.random.key(0), jnp.ones([B, 3]))
  params = variables["params"]
  model_state = {"batch_stats": variables["batch_stats"]} if batch_norm else {}

  def loss_fn(p, ms, batch, rng):
    keep = jax.random.bernoulli(rng, 0.8, batch["x"].shape)   # dropout: the key must match
    x = jnp.where(keep, batch["x"] / 0.8, 0.0)
    if batch_norm:
      out, new = net.apply({"params": p, **ms}, x, mutable=["batch_stats"])
      ms = {"batch_stats": new["batch_stats"]}
    else:
      out = net.apply({"params": p}, x)
    return jnp.mean((out - batch["y"]) ** 2), ms
  return params, model_state, loss_fn


def _compressor(name):
  if name == "none":
    return None
  if name == "topk":
    return compress.topk(1, 0.3)
  if name == "dgc":
    return compress.dgc(1, 0.3, sample_ratio=0.5)
  return compress.gdtopk(1)


def _steps(scheme, max_pushes, compressed, seed=0):
  """Steps as simulate.py builds them, with per-worker ratios, an epoch-end flush every 5th
  iteration (GDTopK's) when ``compressed``, and a decaying learning rate."""
  return helpers.timeline_steps(
      scheme, SPEEDS, max_pushes, N, B, seed=seed,
      ratios=lambda workers: (0.2 + 0.1 * workers).astype(np.float32),
      flushes=lambda iters: (iters % 5 == 4) & compressed,
      learning_rate=lambda pushes: 0.05 / (1 + pushes / 16))


def _setup(name, comp_name="none", batch_norm=False, inter_group="peer"):
  scheme = sync.build_scheme(name, W, worker_times=SPEEDS, num_groups=2, num_nodes=2,
                             casp_reconfigure_every=4, casp_max_communities=2,
                             inter_group=inter_group)
  params, model_state, loss_fn = _model(batch_norm)
  tx = optax.chain(scheme.transform,
                   sync.replicated(optax.sgd(1.0, momentum=0.9), scheme.num_replicas),
                   optim.scale_by_learning_rate_arg())
  compressor = _compressor(comp_name)
  state = executor.init_state(params, model_state, tx, compressor, W, scheme.num_replicas,
                              jax.random.key(3))
  arrays = {"x": jax.random.normal(jax.random.key(1), (N, 3)),
            "y": jax.random.normal(jax.random.key(2), (N, 2))}
  dense = sum(x.size * 4 for x in jax.tree.leaves(params))
  stats = sum(x.size * 4 for x in jax.tree.leaves(model_state))
  return scheme, tx, compressor, state, arrays, loss_fn, dense, stats, params, model_state


def _assert_same_state(got, want):
  """Integer leaves (counts, bytes, keys) exactly; floats closely; the sync clocks exactly.

  Tolerance: both runners compute the same float32 operations, but ``vmap``
  batches the jobs' matmuls (grouped convolutions for a CNN), which a backend
  may sum in another order: a few ulp, ~1e-7 relative, per gradient. 40 pushes
  of momentum SGD on this small, well-conditioned model keep that far below
  1e-5 relative. (Measured on the CPU at highest precision: most schemes
  bit-identical.) The optimizers' moments are not compared leaf by leaf (one
  flat vector against the model's pytree); the weights they moved are.
  """
  for field in ("replica_params", "worker_params", "grad_buf", "replica_model_state",
                "worker_model_state", "comp_state", "loss_sum", "loss_count", "push_bytes",
                "job_loss", "job_bytes", "rng"):
    flat_got, tree_got = jax.tree_util.tree_flatten_with_path(getattr(got, field))
    flat_want, tree_want = jax.tree_util.tree_flatten_with_path(getattr(want, field))
    assert tree_got == tree_want, field
    for (path, g), (_, w) in zip(flat_got, flat_want):
      if jnp.issubdtype(getattr(g, "dtype", None), jax.dtypes.prng_key):
        g, w = jax.random.key_data(g), jax.random.key_data(w)
      g, w = np.asarray(g), np.asarray(w)
      name = field + jax.tree_util.keystr(path)
      assert g.dtype == w.dtype, name
      if np.issubdtype(g.dtype, np.floating):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
      else:
        np.testing.assert_array_equal(g, w, err_msg=name)
  got_sync, want_sync = (sync.find_sync_state(s.tx_state) for s in (got, want))
  for field in ("clock", "read", "staleness", "version"):
    np.testing.assert_array_equal(getattr(got_sync, field), getattr(want_sync, field),
                                  err_msg=field)


def _compare(name, comp_name="none", batch_norm=False, inter_group="peer", max_pushes=40,
             shapes=(None,), job_batches=(0,), unroll_pieces=False):
  """The level runner (one per shape, and per job batch on the first shape; with
  ``unroll_pieces``, its pieces unrolled where the job batch is not one vmap) against one run of
  the round runner."""
  scheme, tx, compressor, state, arrays, loss_fn, dense, stats, params, ms = _setup(
      name, comp_name, batch_norm, inter_group)
  steps = _steps(scheme, max_pushes, comp_name != "none")
  reference = executor.make_round_runner(executor.make_job_fn(loss_fn, compressor, dense, stats),
                                         executor.make_round_fn(tx))
  with jax.default_matmul_precision("highest"):
    want = reference(jax.tree.map(jnp.copy, state), arrays, steps)
  runs = []
  for shape, job_batch in [(shapes[0], b) for b in job_batches] + [(s, 0) for s in shapes[1:]]:
    flat_state, run, layout = helpers.level_runner(loss_fn, compressor, tx, dense, stats,
                                                   scheme, params, ms, jax.random.key(3),
                                                   shape=shape, job_shape=(B,),
                                                   job_batch=job_batch,
                                                   unroll_pieces=unroll_pieces and job_batch != 0)
    with jax.default_matmul_precision("highest"):
      # Two calls, split mid-run: pending jobs are computed at the end of each.
      half = len(steps) // 2
      got = run(flat_state, arrays, steps[:half])
      got = run(got, arrays, steps[half:])
    _assert_same_state(helpers.as_trees(layout, got), want)
    assert int(got.loss_count) >= max_pushes - W
    assert run.runner.traces == 1   # one program, whatever the pieces held
    runs.append(run.runner)
  return runs


_SMALL = chunk.Shape(pieces=1, jobs=1, rounds=4, arrivals=4, pulls=1, replicas=3)


# Every scheme with BatchNorm; the schemes whose rounds carry fields of their own (GSSP global's
# adoption and statistics mean, InHAD's aggregate, DS-Sync's averaging) also with the smallest
# pieces (1 job slot, 1 pull slot: many pull-only slots) and dense slot counts (every round
# over all W workers and R replicas), each against one reference run.
@pytest.mark.parametrize("name,inter_group,more", [
    ("bsp", "peer", False), ("asp", "peer", False), ("ssp", "peer", False),
    ("dssp", "peer", False), ("gssp", "peer", False), ("gssp", "global", True),
    ("inhad", "peer", True), ("dssync", "peer", True), ("casp", "peer", False)])
@pytest.mark.slow
def test_level_runner_equals_round_runner_every_scheme_batchnorm(name, inter_group, more):
  shapes = [None]
  if more:
    R = sync.build_scheme(name, W, worker_times=SPEEDS, num_groups=2, num_nodes=2,
                          inter_group=inter_group).num_replicas
    shapes += [_SMALL._replace(replicas=R), chunk.Shape(4, W, 8, W, W, R)]
  runner, *_ = _compare(name, batch_norm=True, inter_group=inter_group, shapes=shapes)
  if name != "bsp":   # pieces really batch: some piece holds several jobs
    assert runner.planner.totals["jobs"] > runner.planner.totals["pieces"]


# Top-k and GDTopK (on ASP) and DGC (on SSP): the compressor runs in the job. GDTopK on GSSP
# runs in the test below, with BatchNorm, all of a piece's jobs at once among its job batches.
@pytest.mark.parametrize("name,comp_name", [("asp", "topk"), ("asp", "gdtopk"), ("ssp", "dgc")])
@pytest.mark.slow
def test_level_runner_equals_round_runner_compressed(name, comp_name):
  _compare(name, comp_name)


# A piece's 4 job slots one at a time and 3 at a time (a vmap of 3, then the one left), traced
# in turn, in the CPU's program (levels.unrolled_for: the pieces unrolled too), with BatchNorm
# statistics and GDTopK's error feedback carried through; GSSP with GDTopK also all 4 at once
# (one vmap, the pieces in a scan), against the same reference run.
@pytest.mark.parametrize("name,comp_name,job_batches", [("gssp", "gdtopk", (0, 1, 3)),
                                                        ("ssp", "none", (1, 3))],
                         ids=["gssp-gdtopk", "ssp-none"])
@pytest.mark.slow
def test_level_runner_equals_round_runner_with_jobs_one_or_some_at_a_time(name, comp_name,
                                                                          job_batches):
  runs = _compare(name, comp_name, batch_norm=True, job_batches=job_batches, unroll_pieces=True)
  assert all(r.shape.pieces > 1 for r in runs)   # several pieces per call were unrolled


@pytest.mark.slow
def test_level_runner_runs_local_update_jobs_as_the_round_runner():
  """Local-update jobs of 1 to 3 inner steps (DyLU-like), each worker keeping its own momentum."""
  scheme = sync.build_scheme("asp", W, worker_times=SPEEDS)
  params, model_state, loss_fn = _model(True)
  # Inner SGD with momentum: AdamW would normalise the float noise of a bias that BatchNorm
  # cancels (its gradient is ~1e-9) into steps of its learning rate, in either runner.
  local = executor.LocalJob(optax.sgd(0.05, momentum=0.9), 3)
  tx = optax.chain(scheme.transform, sync.replicated(optax.sgd(0.7, momentum=0.9), 1),
                   optim.scale_by_learning_rate_arg())
  dense = sum(x.size * 4 for x in jax.tree.leaves(params))
  stats = sum(x.size * 4 for x in jax.tree.leaves(model_state))
  arrays = {"x": jax.random.normal(jax.random.key(1), (N, 3)),
            "y": jax.random.normal(jax.random.key(2), (N, 2))}
  steps = helpers.timeline_steps(scheme, SPEEDS, 24, N, B)
  rng = np.random.default_rng(5)
  h = np.array([3, 2, 2, 1], np.int32)   # H_w: DyLU-like, the slowest takes one step
  steps = [s._replace(jobs=None if s.jobs is None else s.jobs._replace(
      idx=rng.integers(0, N, (s.jobs.workers.size, 3, B)).astype(np.int32),
      steps=h[s.jobs.workers])) for s in steps]
  state = executor.init_state(params, model_state, tx, None, W, 1, jax.random.key(3),
                              inner=local.inner)
  reference = executor.make_round_runner(
      executor.make_job_fn(loss_fn, None, dense, stats, local=local), executor.make_round_fn(tx))
  with jax.default_matmul_precision("highest"):
    want = reference(state, arrays, steps)
  for job_batch in (0, 1):   # one vmap of the piece's jobs; one job at a time
    flat_state, run, layout = helpers.level_runner(
        loss_fn, None, tx, dense, stats, scheme, params, model_state, jax.random.key(3),
        local=local, job_shape=(3, B), job_batch=job_batch)
    with jax.default_matmul_precision("highest"):
      got = run(flat_state, arrays, steps)
    _assert_same_state(helpers.as_trees(layout, got), want)
    for g, w in zip(jax.tree.leaves(got.inner_state), jax.tree.leaves(want.inner_state)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_level_runner_equals_round_runner_through_drops_and_rejoins():
  """GSSP and SSP losing a worker mid-run and getting it back: the drop's releases and the
  rejoin's pull-only round are rounds like the others (BatchNorm, 4 workers)."""
  for name in ("gssp", "ssp"):
    scheme, tx, compressor, state, arrays, loss_fn, dense, stats, params, ms = _setup(
        name, batch_norm=True)
    engine = sync.TimelineEngine(scheme.make_protocol(), lambda w, k: SPEEDS[w],
                                 message_delay=lambda m: 0.45, record=False)
    engine.drop_at(6.1, 2)
    engine.rejoin_at(13.7, 2)
    rng, dispatched = np.random.default_rng(7), np.zeros([W], np.int64)

    def jobs(workers):
      ks = dispatched[workers].copy()
      dispatched[workers] += 1
      return executor.Jobs(workers=workers.astype(np.int32),
                           idx=rng.integers(0, N, (workers.size, B)).astype(np.int32),
                           iters=ks.astype(np.int32),
                           ratios=np.ones([workers.size], np.float32),
                           flushes=np.zeros([workers.size], bool))
    steps = [executor.Step(None, jobs(np.arange(W)))]
    while engine.num_pushes < 40:
      for rnd in engine.step():
        args = sync.round_args(rnd)
        args["learning_rate"] = np.float32(0.05)
        pulled = np.flatnonzero(rnd.pulls)
        steps.append(executor.Step(args, jobs(pulled) if pulled.size else None))
    assert not engine.protocol.alive.all() or dispatched[2] > 3   # it left and came back
    reference = executor.make_round_runner(executor.make_job_fn(loss_fn, None, dense, stats),
                                           executor.make_round_fn(tx))
    flat_state, run, layout = helpers.level_runner(loss_fn, None, tx, dense, stats, scheme,
                                                   params, ms, jax.random.key(3),
                                                   job_shape=(B,))
    with jax.default_matmul_precision("highest"):
      want = reference(jax.tree.map(jnp.copy, state), arrays, steps)
      got = run(flat_state, arrays, steps)
    _assert_same_state(helpers.as_trees(layout, got), want)


# -- the planner -----------------------------------------------------------------------------


def _round(arrived=(), pulls=(), *, workers=3, replicas=1, groups=None, applies=()):
  rnd = rounds_lib.empty_round(0.0, workers, replicas, 1,
                               np.zeros([workers], np.int32) if groups is None else groups)
  rnd.arrived[list(arrived)] = True
  rnd.pulls[list(pulls)] = True
  rnd.applies[list(applies)] = True
  return rnd


def _planner(shape, workers=3, replicas=1, route=None):
  return planner_lib.Planner(shape, num_workers=workers, num_replicas=replicas, num_groups=1,
                             job_shape=(1,), local=False,
                             route=np.zeros([workers], np.int32) if route is None else route)


def _add_jobs(planner, workers, tag=0):
  workers = np.asarray(workers, np.int32)
  planner.add_jobs(workers, np.zeros([workers.size, 1], np.int32),
                   np.full([workers.size], tag, np.int32), np.ones([workers.size], np.float32),
                   np.zeros([workers.size], bool))


def _pieces(chunks):
  """``[(job workers, [(arrivals, pulls) per slot])]`` of every real piece of ``chunks``."""
  out = []
  for c in chunks:
    for p in range(c.pieces):
      jobs = [int(w) for w in c.jobs["workers"][p] if w < 3]
      slots = []
      for a, q, lr in zip(c.rounds["arrive_ids"][p], c.rounds["pull_ids"][p],
                          c.rounds["learning_rate"][p]):
        if lr:   # real slots carry a learning rate here
          slots.append(([int(x) for x in a if x < 3], [int(x) for x in q if x < 3]))
      out.append((jobs, slots))
  return out


def test_planner_cuts_where_a_job_is_needed_and_splits_large_pulls():
  p = _planner(chunk.Shape(pieces=2, jobs=3, rounds=3, arrivals=1, pulls=2, replicas=1))
  _add_jobs(p, [0, 1, 2])                      # the first jobs: piece 0 computes them
  p.add_round(_round([0], [0]), 0.1)           # 0 arrives (computed in piece 0), pulls: new job
  _add_jobs(p, [0])
  p.add_round(_round([1], [1]), 0.1)
  _add_jobs(p, [1])
  p.add_round(_round([0], [0]), 0.1)           # 0's new job not computed yet: cut before
  _add_jobs(p, [0])
  p.add_round(_round([2], []), 0.1)            # 2 (piece 0's job) arrives: no cut
  p.add_round(_round([], [1, 2, 0]), 0.1)      # 3 pulls in 2 slots; 0 is fresh: cut
  _add_jobs(p, [1, 2, 0])
  p.flush(jobs=True)
  assert _pieces(p.take()) == [
      ([0, 1, 2], [([0], [0]), ([1], [1])]),
      ([0, 1], [([0], [0]), ([2], [])]),
      ([0], [([], [0, 1]), ([], [2])]),        # the pull-only second slot
      ([1, 2, 0], [])]                         # pending at the end: run because jobs=True


def test_planner_pads_with_distinct_out_of_range_ids_and_empty_rounds():
  p = _planner(chunk.Shape(pieces=2, jobs=2, rounds=2, arrivals=2, pulls=2, replicas=1))
  _add_jobs(p, [1])
  p.add_round(_round([1], [1], applies=[0]), 0.5)
  p.flush()
  (c,) = p.take()
  assert c.pieces == 1
  assert c.jobs["workers"].tolist() == [[1, 4], [3, 4]]          # padding: 3, 4 (W = 3)
  assert c.rounds["arrive_ids"][0].tolist() == [[1, 4], [3, 4]]
  assert c.rounds["replica_ids"][0].tolist() == [[0], [1]]       # padding: R = 1
  empty = {k: v[0, 1] for k, v in c.rounds.items()}
  assert not empty["applies"].any() and not empty["aggregate"] and empty["learning_rate"] == 0
  assert (empty["adopt"] == -1).all() and (empty["average"] == -1).all()
  assert not c.rounds["applies"][1].any()                        # the padded piece


def test_a_piece_runs_its_round_slots_up_to_the_last_used_one():
  """``chunk.rounds_used``: one past a piece's last slot holding anything but padding (a
  pull-only slot too), 0 for a piece of jobs only; a row with no padding value is refused."""
  p = _planner(chunk.Shape(pieces=2, jobs=3, rounds=3, arrivals=1, pulls=2, replicas=1))
  _add_jobs(p, [0, 1, 2])
  p.add_round(_round([0], [0]), 0.1)
  _add_jobs(p, [0])
  p.add_round(_round([1], []), 0.0)            # a learning rate of 0: still a round
  p.add_round(_round([0], [0]), 0.1)           # cut: 0's job is fresh
  _add_jobs(p, [0])
  p.add_round(_round([], [1, 2, 0]), 0.1)      # cut; 3 pulls in 2 slots, the second pull-only
  _add_jobs(p, [1, 2, 0])
  p.flush(jobs=True)
  used = [int(chunk.rounds_used(3, 1, {k: v[i] for k, v in c.rounds.items()}))
          for c in p.take() for i in range(c.pieces)]
  assert used == [2, 1, 2, 0]
  rows = {k: v[0] for k, v in p.empty_chunk().rounds.items()}
  assert int(chunk.rounds_used(3, 1, rows)) == 0
  rows["pull_ids"] = rows["pull_ids"].copy()
  rows["pull_ids"][2, 1] = 2                   # the last slot pulls worker 2
  assert int(chunk.rounds_used(3, 1, rows)) == 3
  with pytest.raises(ValueError, match="round row 'extra' has no padding value"):
    chunk.rounds_used(3, 1, {**rows, "extra": np.zeros([3], np.int32)})


def test_planner_refuses_a_round_over_the_declared_bounds():
  p = _planner(chunk.Shape(pieces=1, jobs=2, rounds=2, arrivals=1, pulls=2, replicas=1))
  with pytest.raises(ValueError, match="has 2 arrivals; allowed: at most 1"):
    p.add_round(_round([0, 1], []), 0.1)
  with pytest.raises(ValueError, match="distinct workers"):
    _add_jobs(p, [1, 1])
  with pytest.raises(ValueError, match="rounds=1 x pulls=1 is invalid for 3 workers"):
    _planner(chunk.Shape(pieces=1, jobs=2, rounds=1, arrivals=1, pulls=1, replicas=1))
  with pytest.raises(ValueError, match="jobs=4 is invalid; allowed: an int >= 1 and <= 3"):
    _planner(chunk.Shape(pieces=1, jobs=4, rounds=4, arrivals=1, pulls=1, replicas=1))


def test_planner_starts_a_piece_at_a_new_route_and_a_chunk_when_its_table_is_full():
  shape = chunk.Shape(pieces=4, jobs=3, rounds=4, arrivals=1, pulls=1, replicas=2, routes=2)
  routes = [np.array(r, np.int32) for r in ([0, 0, 1], [0, 1, 1], [1, 1, 0])]
  p = _planner(shape, replicas=2, route=routes[0])
  _add_jobs(p, [0, 1, 2])
  for route in routes:
    p.add_round(_round([], [], replicas=2, groups=route), 0.1)
    p.add_round(_round([], [], replicas=2, groups=route), 0.1)
  p.flush()
  chunks = p.take()
  assert [c.pieces for c in chunks] == [2, 1]   # the third route opened a new chunk
  assert chunks[0].routes.tolist() == [[0, 0, 1], [0, 1, 1]]
  assert chunks[0].rounds["route"][:2, :2].tolist() == [[0, 0], [1, 1]]
  assert chunks[1].routes[chunks[1].rounds["route"][0, 0]].tolist() == [1, 1, 0]


def test_planner_state_resumes_the_same_chunks():
  def feed(p, rounds, start=0):
    for i, (a, q) in enumerate(rounds, start):
      p.add_round(_round(a, q), 0.1 * (i + 1))
      if q:
        _add_jobs(p, q, tag=i)
  rounds = [([0], [0]), ([1], [1]), ([0], [0]), ([2], [2]), ([1], [1]), ([0], [0]),
            ([2], [2]), ([1], [1]), ([0], [0])]

  def pieces_of(chunks):   # every real piece's rows, whatever the chunks they came in
    return [{part: {k: v[i] for k, v in getattr(c, part).items()} for part in ("jobs", "rounds")}
            for c in chunks for i in range(c.pieces)]
  shape = chunk.Shape(pieces=2, jobs=3, rounds=3, arrivals=1, pulls=1, replicas=1)
  whole = _planner(shape)
  _add_jobs(whole, [0, 1, 2])
  feed(whole, rounds)
  whole.flush()
  want = whole.take()
  # Resumed with the same number of pieces per chunk, or another; and from a state saved before
  # the planner noted each round's arrived and pulled ids (its rounds 6-tuples).
  for pieces, old in ((2, False), (1, False), (4, False), (2, True)):
    first = _planner(shape)
    _add_jobs(first, [0, 1, 2])
    feed(first, rounds[:5])
    first_chunks = first.take()
    second = _planner(shape._replace(pieces=pieces))
    state = first.state_dict()
    if old:
      assert state["rounds"] and all(len(r) == 8 for r in state["rounds"])
      state = {**state, "rounds": [r[:6] for r in state["rounds"]]}
    second.load_state_dict(state)
    feed(second, rounds[5:], 5)
    second.flush()
    got = first_chunks + second.take()
    if pieces == 2:
      assert len(got) == len(want)
    for a, b in zip(pieces_of(got), pieces_of(want), strict=True):
      for part in ("jobs", "rounds"):
        for k in a[part]:
          np.testing.assert_array_equal(a[part][k], b[part][k], err_msg=f"{pieces} {k}")


def test_planner_notes_rounds_and_jobs_in_piece_order():
  """``Planner._emit`` takes a chunk's rounds and jobs as a prefix of what is noted: random
  rounds and job lists (several jobs per step, splits over pieces, jobs of workers that are
  still fresh) keep both lists in piece order, and every chunk written holds them all."""
  rng = np.random.default_rng(0)
  shape = chunk.Shape(pieces=3, jobs=2, rounds=2, arrivals=3, pulls=2, replicas=1)
  p, written = _planner(shape), 0
  for _ in range(400):
    if rng.random() < 0.5:
      p.add_round(_round(np.flatnonzero(rng.random(3) < 0.4), np.flatnonzero(
          rng.random(3) < 0.4)), 0.1)
    else:
      _add_jobs(p, rng.permutation(3)[:rng.integers(1, 4)])
    for noted in (p.rounds, p.jobs):
      pieces = [x[0] for x in noted]
      assert pieces == sorted(pieces) and all(0 <= q <= p.piece + 1 for q in pieces)
    written += sum(int((c.rounds["learning_rate"] > 0).sum()) for c in p.take())
  p.flush(jobs=True)
  written += sum(int((c.rounds["learning_rate"] > 0).sum()) for c in p.take())
  assert written == p.totals["round_slots"]


def test_choose_shape_sizes_the_pieces_from_the_opening():
  scheme = sync.build_scheme("ssp", 16, worker_times=np.repeat([1.0, 1.5, 2.0, 3.0], 4))
  engine = sync.TimelineEngine(scheme.make_protocol(), lambda w, k: [1.0, 1.5, 2.0, 3.0][w // 4],
                               record=False)
  rounds = []
  while engine.num_pushes < 256:
    rounds.extend(engine.step())
  shape = levels.choose_shape(rounds, np.arange(16), num_workers=16, num_replicas=1,
                              bounds=(1, 1), rounds_per_evaluation=128)
  per_piece, pulls, _ = levels.profile(rounds, np.arange(16), 16, 16)
  assert shape.jobs == 16 and shape.arrivals == 1 and shape.replicas == 1
  assert shape.rounds >= np.percentile(per_piece, 90) and shape.rounds & (shape.rounds - 1) == 0
  assert shape.pulls >= np.percentile(pulls, 99) and shape.rounds * shape.pulls >= 16
  assert shape.pieces == levels._power_of_two_at_least(128 / per_piece.mean() / 2)
  fixed = levels.choose_shape(rounds, np.arange(16), num_workers=16, num_replicas=1,
                              bounds=(1, 1), job_slots=4, pieces=8)
  assert (fixed.jobs, fixed.pieces) == (4, 8)


def _opening(name: str, num_workers: int = 16, pushes: int = 256, **kwargs) -> list:
  times = np.repeat([1.0, 1.5, 2.0, 3.0], max(1, num_workers // 4))[:num_workers]
  scheme = sync.build_scheme(name, num_workers, worker_times=times, **kwargs)
  engine = sync.TimelineEngine(scheme.make_protocol(), lambda w, k: times[w], record=False)
  rounds = []
  while engine.num_pushes < pushes:
    rounds.extend(engine.step())
  return rounds


def test_padding_costs_halves_the_job_slots_until_the_opening_fills_them():
  """Where an empty job slot costs a gradient (a CPU), J is the largest of 16, 8, 4 whose pieces
  the opening fills to ``JOB_FILL``: BSP's 16 jobs a round keep 16, GSSP's pieces (two thirds of
  16 slots) get 8; ``job_slots`` set, or no padding cost, keep ``min(W, 64)``."""
  workers = np.arange(16)
  bsp, gssp = _opening("bsp"), _opening("gssp", num_groups=4)
  assert levels.job_fill(bsp, workers, 16, 16) == 1.0
  assert levels.job_fill(gssp, workers, 16, 16) < levels.JOB_FILL <= levels.job_fill(
      gssp, workers, 16, 8)
  choose = lambda rounds, **kw: levels.choose_shape(rounds, workers, num_workers=16,
                                                    num_replicas=4, bounds=(1, 3), **kw)
  assert choose(bsp, padding_costs=True).jobs == 16
  shape = choose(gssp, padding_costs=True)
  per_piece, _, jobs = levels.profile(gssp, workers, 16, 8)
  assert shape.jobs == 8 and shape.rounds == np.ceil(np.percentile(per_piece, 90))
  assert jobs.max() <= 8 and jobs.sum() / (8 * len(jobs)) >= levels.JOB_FILL
  assert choose(gssp).jobs == 16 and choose(gssp, padding_costs=True, job_slots=16).jobs == 16
  # Never below MIN_JOB_SLOTS (nor above W): DSSP asked to fill 95 % gets 4, 2 workers keep 2.
  dssp = _opening("dssp")
  assert levels.job_slots_filled(dssp, workers, 16, fill=0.95) == levels.MIN_JOB_SLOTS
  assert levels.job_slots_filled(_opening("asp", num_workers=2), np.arange(2), 2) == 2
  # Split over devices, J stays a multiple of their count: 16 devices keep GSSP's 16 slots.
  assert [levels.job_slots_filled(gssp, workers, 16, multiple_of=d) for d in (4, 8, 16)] == [
      8, 8, 16]


# -- the compiled chunk program --------------------------------------------------------------


def _hlo_ops(text: str) -> collections.Counter:
  return collections.Counter(re.findall(r"\s(while|conditional|copy|fusion|scatter|gather)\(",
                                        text))


def _copies_at_least(text: str, elements: int) -> list[str]:
  big = []
  for m in re.finditer(r"= \w+\[([0-9,]*)\]\S* copy\(", text):
    size = int(np.prod([int(x) for x in m.group(1).split(",") if x])) if m.group(1) else 1
    if size >= elements:
      big.append(m.group(0))
  return big


@pytest.mark.parametrize("name,inter_group,job_batch,unroll", [
    ("ssp", "peer", 0, False), ("gssp", "global", 0, False), ("bsp", "peer", 0, False),
    ("ssp", "peer", 1, False), ("gssp", "global", 1, True), ("gssp", "peer", 1, True)])
def test_chunk_program_has_no_conditional_and_copies_no_worker_buffer(name, inter_group,
                                                                      job_batch, unroll):
  """Compiled HLO of a 16-worker chunk: static-trip loops only, and no ``[W, P]``-sized copy;
  also with its jobs one at a time (``job_batch=1``: 16 jobs traced in turn) and with the
  pieces unrolled as on a CPU (then the only loops are the pieces' round scans, one each).

  A conditional (or a loop whose trip count is data) is a round trip to the
  host on a GPU; a copy of a ``[W, P]`` buffer per round would cost what
  the round's work does. The model has 10,858 weights, so a copy of one
  worker buffer (173,728 values) cannot hide among the small ones.
  """
  num_workers = 16

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(96)(x))
      return nn.Dense(10)(nn.relu(x))
  net = Net()
  variables = net.init(jax.random.key(0), jnp.ones([4, 100]))
  params, ms = variables["params"], {"batch_stats": variables["batch_stats"]}

  def loss_fn(p, m, batch, rng):
    del rng
    out, new = net.apply({"params": p, **m}, batch["x"], mutable=["batch_stats"])
    return jnp.mean((out - batch["y"]) ** 2), {"batch_stats": new["batch_stats"]}
  scheme = sync.build_scheme(name, num_workers, num_groups=4, inter_group=inter_group,
                             worker_times=np.linspace(1, 3, num_workers))
  tx = optim.make_sync_chain(config_lib.default_config().optimizer, scheme.transform,
                             scheme.num_replicas)
  arrivals, replicas = scheme.make_protocol().round_bounds()
  # 8 pieces in a scan; 2 unrolled (each piece its own 16 job traces: the program's size).
  shape = chunk.Shape(pieces=2 if unroll else 8, jobs=num_workers, rounds=16, arrivals=arrivals,
                      pulls=min(2, num_workers) if arrivals < num_workers else num_workers,
                      replicas=min(replicas, scheme.num_replicas))
  state, run, layout = helpers.level_runner(loss_fn, None, tx, 4, 4, scheme, params, ms,
                                            jax.random.key(1), shape=shape, job_shape=(8,),
                                            job_batch=job_batch, unroll_pieces=unroll)
  planner = run.runner.planner
  _add_jobs_for(planner, num_workers)
  planner.flush(jobs=True)
  (plan,) = planner.take()
  arrays = {"x": jnp.zeros([64, 100]), "y": jnp.zeros([64, 10])}
  packed = chunk.pack(run.runner.packing, plan.device_tree())
  text = run.runner.chunk_fn.lower(state, arrays, packed).compile().as_text()
  ops = _hlo_ops(text)
  assert ops["conditional"] == 0, "a conditional in the chunk program"
  loops = [line for line in text.splitlines() if " while(" in line]
  # Unrolled (the CPU's form), each piece's round loop stops after its last used slot: a trip
  # count that is data. Every other loop has a known trip count (no host trips on a GPU).
  data_loops = [line for line in loops if '"known_trip_count"' not in line]
  assert loops and len(data_loops) == (shape.pieces if unroll else 0), loops
  assert not _copies_at_least(text, num_workers * layout.num_params)
  if name == "gssp":   # nor of a group buffer (pending, outbox: [G, P], G = 4) in a round
    assert not _copies_at_least(text, 4 * layout.num_params), _copies_at_least(
        text, 4 * layout.num_params)
  round_scans = sum(f'"known_trip_count":{{"n":"{shape.rounds}"}}' in line for line in loops)
  # Unrolled: no loop over pieces, each piece's round loop its own; else one scan, nested.
  assert round_scans == (0 if unroll else 1), loops


@pytest.mark.parametrize("name", ["ssp", "gssp"])
def test_a_round_leaves_out_the_passes_of_fields_its_protocol_never_sets(name):
  """``benchmarks.round_ops``' count of a compiled round: with the protocol's own round fields
  (SSP: none; GSSP peer: forward and deliver) a round has fewer kernels than when every field
  travels as data, since averaging and adoption drop out (``rounds.never``); no round holds a
  matmul of the averaging or a scatter of the arrival masks, which a piece makes at once."""
  from benchmarks import round_ops
  own, every = (round_ops.round_and_piece(
      round_ops.compiled_chunk(name, 8, 6, 2, every_field=flag), 6) for flag in (False, True))
  assert sum(own[0].values()) < sum(every[0].values()), (own[0], every[0])
  assert not any("dot(" in line or "ynn_fusion" in line for line in own[2]), own[2]
  assert not any(re.match(r"%\S*scatter\S* = pred\[8\]", line) for line in own[2]), own[2]


def test_a_chunk_crosses_as_one_int32_buffer_and_unpacks_to_its_rows_exactly():
  """pack -> one int32 buffer (float bits, bools as 0/1) -> unpack (traced) gives every row,
  dtype and value back, negative zeros, NaNs and the largest ids included."""
  rng = np.random.default_rng(0)
  tree = {"jobs": {"workers": np.arange(6, dtype=np.int32).reshape(2, 3),
                   "ratios": rng.standard_normal((2, 3)).astype(np.float32),
                   "flushes": rng.random((2, 3)) < 0.5},
          "rounds": {"learning_rate": np.array([[-0.0, np.nan], [np.inf, 1e-38]], np.float32),
                     "pull_ids": np.array([[2**31 - 1, -1], [0, 7]], np.int32),
                     "applies": np.array([[True, False], [False, True]])},
          "routes": np.array([[0, 1, 1]], np.int32)}
  packing = chunk.packing_of(tree)
  buffer = chunk.pack(packing, tree)
  assert buffer.dtype == np.int32 and buffer.ndim == 1
  back = jax.jit(lambda b: chunk.unpack(packing, b))(jax.device_put(buffer))
  for part in ("jobs", "rounds"):
    for name, value in tree[part].items():
      got = np.asarray(back[part][name])
      assert got.dtype == value.dtype and got.shape == value.shape, (part, name)
      assert got.tobytes() == value.tobytes(), (part, name)
  np.testing.assert_array_equal(np.asarray(back["routes"]), tree["routes"])
  with pytest.raises(ValueError, match="dtype <f8"):
    chunk.packing_of({**tree, "routes": np.zeros((1, 3))})


def _add_jobs_for(planner, num_workers):
  workers = np.arange(num_workers, dtype=np.int32)
  planner.add_jobs(workers, np.zeros([num_workers, 8], np.int32), np.zeros([num_workers],
                                                                             np.int32),
                   np.ones([num_workers], np.float32), np.zeros([num_workers], bool))


# -- the levels executor in the one training loop ---------------------------------------------


def _run_config(scheme, compressor, **extra):
  # 512 examples: 4 iterations per worker per epoch, 16 pushes in the epoch. A tiny CNN: the
  # runners' agreement does not depend on the model, and LeNet-5 was most of the compile time.
  return helpers.cluster_config(scheme, **{"compress.name": compressor,
                                           "model": "helpers:TinyCNN", **extra})


_metric_lines = helpers.metric_lines


def test_auto_picks_levels_but_rounds_for_a_barrier_or_local_update_scheme_on_a_cpu():
  from gssp_jax import executors  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync import registry  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync.schemes.ssp import protocol as ssp_protocols  # pylint: disable=g-import-not-at-top
  ssp = config_lib.override(config_lib.default_config(), {"sync.scheme": "ssp"})
  for backend in ("cpu", "gpu", "tpu"):
    assert executors.executor_name(ssp, backend=backend) == "levels"
  # BSPProtocol's barrier (bsp, local_sgd, diloco), and local-update jobs (the last three).
  for name in ("bsp", "local_sgd", "diloco", "async_local_sgd", "halos"):
    rounds = config_lib.override(config_lib.default_config(),
                                 {"sync.scheme": name, "cluster.profile": "tiers"})
    assert executors.executor_name(rounds, backend="cpu") == "rounds", name
    assert executors.executor_name(rounds, backend="gpu") == "levels", name
  assert executors.executor_name(config_lib.default_config(), backend="cpu") == "fused"
  forced = config_lib.override(ssp, {"executor": "rounds"})
  assert executors.executor_name(forced, backend="gpu") == "rounds"

  # A researcher's scheme: by its protocol's declaration, not its name.
  class Gate(ssp_protocols.BSPProtocol):
    pass

  def build(config, worker_times):
    del worker_times
    base = registry.build_scheme("bsp", config.num_workers)
    return registry.Scheme("gate", base.transform, lambda: Gate(config.num_workers),
                           config.num_workers, 1, base.groups)
  registry.register_scheme("gate", build, sync_keys=())
  try:
    gate = config_lib.override(config_lib.default_config(), {"sync.scheme": "gate"})
    assert executors.executor_name(gate, backend="cpu") == "rounds"
    Gate.barrier = False
    assert executors.executor_name(gate, backend="cpu") == "levels"
  finally:
    registry.unregister_scheme("gate")
  # A researcher's local-update scheme with an asynchronous server: by its declaration.
  registry.register_scheme(
      "my_async_local",
      lambda config, times: dataclasses.replace(registry.build_scheme("asp", config.num_workers),
                                                name="my_async_local"),
      sync_keys=(), local=local_lib.LocalUpdate())
  try:
    mine = config_lib.override(config_lib.default_config(), {"sync.scheme": "my_async_local",
                                                             "cluster.profile": "tiers"})
    assert not executors._barrier_scheme(mine)   # pylint: disable=protected-access
    assert executors.executor_name(mine, backend="cpu") == "rounds"
    assert executors.executor_name(mine, backend="gpu") == "levels"
  finally:
    registry.unregister_scheme("my_async_local")


def test_an_auto_run_resumes_with_the_executor_its_checkpoint_was_written_by(data_dir,
                                                                            tmp_path,
                                                                            monkeypatch):
  """A run started when ``auto`` picked ``rounds`` on a CPU resumes with ``rounds`` (not the
  other layout's error); a new run, or one with a ``levels``-only key set, gets ``levels``."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  auto = _run_config("ssp", "none", data_dir=data_dir, executor="auto")
  run, new = str(tmp_path / "run"), str(tmp_path / "new")
  with monkeypatch.context() as m:   # `auto` as it was on a CPU
    m.setattr(executors_lib, "executor_name", lambda config, backend=None: "rounds")
    first = loop.train_and_evaluate(
        config_lib.override(copy.deepcopy(auto), {"train.stop_after_updates": 8}), run)
  assert first["status"] == "stopped" and simulate.written_executor(run) == "rounds"
  assert simulate.written_executor(new) is None
  assert executors_lib.resolved_for(auto, run) == "rounds"
  assert executors_lib.resolved_for(auto, new) == "levels"
  keyed = config_lib.override(copy.deepcopy(auto), {"level_job_slots": 2})
  assert executors_lib.resolved_for(keyed, run) == "levels"
  summary = loop.train_and_evaluate(auto, run)   # resumed, to the end
  assert summary["status"] == "done" and simulate.written_executor(run) == "rounds"
  assert summary["totals"]["updates"] > first["totals"]["updates"]


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
@pytest.mark.parametrize("scheme,compressor,workers,extra", [
    ("gssp", "gdtopk", 4, {"level_job_batch": 4}), ("ssp", "dgc", 2, {}),
    ("diloco", "none", 4, {"local.steps": 2, "local.optimizer.name": "adamw",
                           "local.optimizer.learning_rate": 1e-3}),
    ("gssp", "none", 4, {"sync.inter_group": "global", "optimizer.name": "lion",
                         "optimizer.learning_rate": 1e-3}),
    ("gssp", "none", 4, {"sync.regroup_every_epoch": True, "train.num_epochs": 2.0,
                         "train.eval_every": 1.0, "cluster.jitter": 0.5,
                         "cluster.profile": "lognormal", "cluster.sigma": 0.3,
                         "cluster.tiers": (1.0, 1.5, 2.0, 3.0)})])
@pytest.mark.slow
def test_levels_executor_equals_rounds_in_the_training_loop(tmp_path, data_dir, scheme,
                                                            compressor, workers, extra):
  # DGC's push times read its sent bytes from the device, which flushes the planned pieces at
  # every read; GDTopK flushes its residual at each worker's epoch end; DiLoCo's jobs are
  # local-update jobs; Lion is a per-tensor-agnostic optax optimizer named by the config (the
  # replicas step it through the model's pytree, flat.on_tree, since it is not a built-in);
  # the last regroups GSSP at its first epoch's end (a new route: the planner cuts there).
  # The levels runs compute their jobs one at a time (a CPU's level_job_batch), but GDTopK's,
  # whose 4 job slots are one vmap (a grouped convolution).
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  runs = {}
  for name in ("rounds", "levels"):
    config = _run_config(scheme, compressor, executor=name, data_dir=data_dir,
                         num_workers=workers, **{k: v for k, v in extra.items()
                                                 if name == "levels" or not k.startswith("level")})
    runs[name] = loop.train_and_evaluate(config, str(tmp_path / name))
  want, got = _metric_lines(tmp_path / "rounds"), _metric_lines(tmp_path / "levels")
  assert len(got) == len(want) == 2
  for a, b in zip(got, want):
    # The host's timeline and accounting do not depend on the runner: exact.
    for key in ("pushes", "updates", "staleness", "bytes_pulled", "bytes_between_servers",
                "updates_per_replica"):
      assert a[key] == b[key], key
    if compressor != "dgc":
      for key in ("bytes_pushed", "virtual_time", "blocked_time_per_worker"):
        assert a[key] == b[key], key
    else:   # DGC's counts depend on the gradient's values, and push times on the counts
      assert a["bytes_pushed"] == pytest.approx(b["bytes_pushed"], rel=1e-3)
      for key in ("virtual_time", "blocked_time_per_worker"):   # an H200 moved them by 1e-7 s
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    # Gradients to float tolerance (vmap reorders the convolutions' sums, ~1e-7 relative).
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=0.01)
  assert runs["levels"]["status"] == runs["rounds"]["status"] == "done"
  history = runs["levels"]["scheme"]["groups_history"]
  assert history == runs["rounds"]["scheme"]["groups_history"]
  if extra.get("sync.regroup_every_epoch"):
    assert len(history) == 2   # it did regroup: [[0, 0, 1, 1], [0, 1, 1, 0]]


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_levels_executor_resumes_exactly_and_levels_per_call_changes_nothing(tmp_path, data_dir,
                                                                            monkeypatch):
  """An interrupted run resumes bit for bit; pieces per call (1 or 4) change no figure. The
  resumed run keeps the job slots its checkpoint was planned with, where its own rule would
  pick others (another device count or backend, or a checkpoint from an older rule)."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  for n in (1, 4):
    loop.train_and_evaluate(_run_config("gssp", "none", executor="levels", data_dir=data_dir,
                                        levels_per_call=n), str(tmp_path / str(n)))
  config = _run_config("gssp", "none", executor="levels", data_dir=data_dir, levels_per_call=4)
  config.train.stop_after_updates = 11   # 16 pushes in all, evaluations every 8
  first = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert first["status"] == "stopped" and first["totals"]["pushes"] == 11
  config.train.stop_after_updates = 0
  config.levels_per_call = 2   # a resumed run may change how often it dispatches
  chosen, built = levels.choose_shape, []
  monkeypatch.setattr(levels, "choose_shape",
                      lambda *a, **k: chosen(*a, **k)._replace(jobs=2, rounds=8))
  runner_init = levels.LevelRunner.__init__

  def note_shape(self, *a, **k):
    runner_init(self, *a, **k)
    built.append(self.shape)
  monkeypatch.setattr(levels.LevelRunner, "__init__", note_shape)
  summary = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert summary["status"] == "done"
  assert [(s.jobs, s.rounds) for s in built][0] == (2, 8) and built[-1].jobs == 4, built
  strip = lambda lines: [{k: v for k, v in m.items() if k != "wall_time"} for m in lines]
  assert strip(_metric_lines(tmp_path / "split")) == strip(_metric_lines(tmp_path / "4"))
  assert strip(_metric_lines(tmp_path / "4")) == strip(_metric_lines(tmp_path / "1"))


def test_the_watch_counters_see_eager_ops_and_host_reads_and_stop_when_closed():
  """The hot-path counters the quiet test relies on: eager ``jnp`` calls, array operators and a
  primitive bound outside a trace are counted, a jitted call's cached program is not, a host
  read is counted, and closing restores JAX (nothing counted after). (A jitted ufunc called
  directly, ``jnp.cos(x)``, is not seen: ``watch.EagerOps`` says so.)"""
  from jax._src import array as jax_array  # pylint: disable=g-import-not-at-top
  from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top
  x = jnp.arange(3.0)
  double = jax.jit(lambda v: v * 2)
  double(x).block_until_ready()   # compiled before the watch
  eager, reads = watch.EagerOps(), watch.HostReads()
  before = (jax_core.EvalTrace.process_primitive, jax_array.ArrayImpl._value)
  with eager.active(), reads.active():
    y = jnp.zeros(3) + x
    jax.lax.add_p.bind(x, x)
    double(x)
    jax.device_get(y)
  assert {"zeros", "_operator_add", "add"} <= set(eager.names), eager.names
  assert reads.shapes == [(3,)]
  assert (jax_core.EvalTrace.process_primitive, jax_array.ArrayImpl._value) == before
  counted = (eager.count, reads.count)
  jax.device_get(jnp.zeros(3) + x)
  assert (eager.count, reads.count) == counted


def test_levels_hot_path_is_quiet_between_evaluations(tmp_path, data_dir):
  """No eager op, no device-to-host read, no implicit host-to-device transfer and no compilation
  between evaluations; a handful of compilations in all, none after the first evaluation.

  The transfer guards hold on an accelerator; on a CPU, whose arrays live in host memory, JAX
  guards nothing, so the reads are counted (``watch.HostReads``)."""
  from gssp_jax import executors
  from gssp_jax.base import run as run_lib  # pylint: disable=g-import-not-at-top
  config = _run_config("gssp", "none", executor="levels", data_dir=data_dir,
                       **{"train.num_epochs": 3.0})
  compilations = watch.compilations()
  start = compilations.mark()
  task = run_lib.prepare_run(config, str(tmp_path))
  run = executors.make_executor(config, task, str(tmp_path))
  run.restore()
  evaluations, first_evaluation = 0, None
  while not run.finished():
    eager, reads, mark = watch.EagerOps(), watch.HostReads(), compilations.mark()
    with eager.active(), reads.active(), \
        jax.transfer_guard_device_to_host("disallow_explicit"), \
        jax.transfer_guard_host_to_device("disallow"), \
        jax.transfer_guard_device_to_device("disallow"):
      run.advance()
    assert eager.names == [], "eager operations between evaluations"
    assert reads.shapes == [], "device-to-host reads between evaluations"
    if evaluations:
      assert not compilations.since(mark), "a compilation after the first evaluation"
    run.evaluate()
    evaluations += 1
    if first_evaluation is None:
      first_evaluation = compilations.mark()
  run.close()
  assert evaluations == 6
  assert compilations.mark() == first_evaluation   # nothing compiled after it
  assert len(compilations.since(start)) <= 8


@pytest.mark.parametrize("key,value,executor,backend,error", [
    ("levels_per_call", 3, "levels", "gpu", "0 .chosen by the run. or a power of two from 1 to 64"),
    ("levels_per_call", 128, "levels", "gpu", "a power of two from 1 to 64"),
    ("levels_per_call", 4, "rounds", "gpu", "this run uses 'rounds'"),
    ("levels_per_call", 4, "rounds", "cpu", "this run uses 'rounds' .config.executor='rounds'."),
    ("levels_per_call", 4, "dist", "gpu", "this run uses 'dist'"),
    ("level_job_slots", 5, "levels", "gpu", r"1..num_workers \(4\)"),
    ("level_job_slots", -1, "levels", "gpu", r"1..num_workers \(4\)"),
    ("level_job_slots", 2, "rounds", "gpu", "this run uses 'rounds'"),
    ("level_job_batch", 5, "levels", "gpu", r"0 .chosen by the run. or 1..num_workers \(4\)"),
    ("level_job_batch", -1, "levels", "gpu", r"1..num_workers \(4\)"),
    ("level_job_batch", 1, "dist", "cpu", "this run uses 'dist'"),
])
def test_level_keys_are_validated_and_never_ignored(key, value, executor, backend, error):
  config = config_lib.override(config_lib.default_config(),
                               {"sync.scheme": "ssp", "executor": executor})
  config[key] = value
  with pytest.raises(ValueError, match=f"config.{key}={value!r}.*" + error):
    executors_lib.validate_levels_per_call(config, backend=backend)
  config[key] = 2
  config.executor = "auto"
  executors_lib.validate_levels_per_call(config, backend="gpu")   # auto -> levels on a GPU: fine


def test_an_abstract_run_compiles_its_chunk_and_sizes_its_memory_without_allocating(data_dir,
                                                                                   tmp_path):
  """``Simulation(abstract=True)`` holds the state as shapes only, the same shapes a real run
  allocates; ``chunk_memory`` compiles the chunk program for them and counts the ``[W, P]``
  worker weights and gradients among its arguments, reused by its outputs (donated)."""
  config = helpers.cluster_config("gssp", data_dir, executor="levels", model="helpers:TinyCNN")
  task = tasks.make_task(config)
  sim = simulate.Simulation(config, task, str(tmp_path / "abstract"), runner="levels",
                            abstract=True)
  try:
    leaves = jax.tree.leaves(sim.state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(sim.arrays))
    memory = sim.chunk_memory()
    for call in (sim.restore, sim.advance, sim.evaluate):   # shapes only: nothing to run
      with pytest.raises(ValueError, match="built with abstract=True"):
        call()
  finally:
    sim.close()
  real = simulate.Simulation(config, task, str(tmp_path / "real"), runner="levels")
  try:
    assert ([(x.shape, x.dtype) for x in jax.tree.leaves(real.state)]
            == [(x.shape, x.dtype) for x in leaves])
  finally:
    real.close()
  buffers = 2 * config.num_workers * sim.layout.num_params * 4   # worker weights, gradients
  state = sum(x.size * x.dtype.itemsize for x in leaves)
  assert memory["arguments"] >= state > buffers and memory["aliased"] >= buffers
  assert memory["temporaries"] > 0
  assert memory["peak"] == (memory["arguments"] + memory["outputs"] - memory["aliased"]
                            + memory["temporaries"])
  rounds = simulate.Simulation(config, task, str(tmp_path / "rounds"), runner="rounds",
                               abstract=True)
  try:
    with pytest.raises(ValueError, match="needs the levels runner"):
      rounds.chunk_memory()
  finally:
    rounds.close()
