"""The level-batched executor (``sim/levels.py``) against the per-round reference runner."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from gssp_jax import compress
from gssp_jax import sync
from gssp_jax.sim import executor
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.sim import levels
from gssp_jax.train import optim

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
  return scheme, tx, compressor, state, arrays, loss_fn, dense, stats


def _assert_same_state(got, want):
  """Integer leaves (clocks, staleness, versions, counts, bytes, keys) exactly; floats closely.

  Tolerance: both runners compute the same float32 operations, but ``vmap``
  batches the jobs' matmuls (grouped convolutions for a CNN), which a backend
  may sum in another order: a few ulp, ~1e-7 relative, per gradient. 40 pushes
  of momentum SGD on this small, well-conditioned model keep that far below
  1e-5 relative. (Measured on the CPU at highest precision: bit-identical.)
  """
  flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  for (path, g), (_, w) in zip(flat_got, flat_want):
    if jnp.issubdtype(getattr(g, "dtype", None), jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    g, w = np.asarray(g), np.asarray(w)
    name = jax.tree_util.keystr(path)
    assert g.dtype == w.dtype, name
    if np.issubdtype(g.dtype, np.floating):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    else:
      np.testing.assert_array_equal(g, w, err_msg=name)


def _compare(name, comp_name="none", batch_norm=False, inter_group="peer", max_pushes=40,
             levels_per_call=(1,)):
  """Each level runner (one per ``levels_per_call``) against one run of the round runner."""
  scheme, tx, compressor, state, arrays, loss_fn, dense, stats = _setup(
      name, comp_name, batch_norm, inter_group)
  steps = _steps(scheme, max_pushes, comp_name != "none")
  reference = executor.make_round_runner(executor.make_job_fn(loss_fn, compressor, dense, stats),
                                         executor.make_round_fn(tx))
  with jax.default_matmul_precision("highest"):
    want = reference(jax.tree.map(jnp.copy, state), arrays, steps)
  for per_call in levels_per_call:
    runner = levels.make_level_runner(loss_fn, compressor, tx, dense, stats, W, max_rounds=8,
                                      levels_per_call=per_call)
    with jax.default_matmul_precision("highest"):
      # Two calls, split mid-run: pending jobs are computed at the end of each.
      half = len(steps) // 2
      got = runner(jax.tree.map(jnp.copy, state), arrays, steps[:half])
      got = runner(got, arrays, steps[half:])
    _assert_same_state(got, want)
    assert int(got.loss_count) >= max_pushes - W
    if per_call > 1:   # the multi-level path really ran, not only its one-level fallback
      assert runner.traces["levels"] >= 1
  return levels.plan_levels(steps)


# One level per call for every scheme; four (the multi-level function, which runs the same
# ``round_body``) for the schemes whose rounds carry fields of their own: GSSP global's adoption
# and statistics mean, InHAD's aggregate, DS-Sync's averaging. Each against one reference run.
@pytest.mark.parametrize("name,inter_group,levels_per_call", [
    ("bsp", "peer", (1,)), ("asp", "peer", (1,)), ("ssp", "peer", (1,)), ("dssp", "peer", (1,)),
    ("gssp", "peer", (1,)), ("gssp", "global", (1, 4)), ("inhad", "peer", (1, 4)),
    ("dssync", "peer", (1, 4)), ("casp", "peer", (1,))])
def test_level_runner_equals_round_runner_every_scheme_batchnorm(name, inter_group,
                                                                 levels_per_call):
  plan = _compare(name, batch_norm=True, inter_group=inter_group,
                  levels_per_call=levels_per_call)
  if name != "bsp":   # levels really batch: some level holds several jobs
    assert max(l.jobs.workers.size for l in plan if l.jobs is not None) > 1


# Top-k (on ASP) and GDTopK (on GSSP) on the multi-level path and the one-level path (the same
# compressor body). DGC runs in the training loop below, on the path the simulator takes with it: its
# push times read its sent bytes, so every level is flushed to the host and runs one level
# per call (its multi-level case was 67 s of the suite's time for a path DGC never takes).
@pytest.mark.parametrize("name,levels_per_call,comp_name", [
    ("gssp", (1, 4), "gdtopk"), ("asp", (1, 4), "topk"), ("asp", (1,), "gdtopk")])
def test_level_runner_equals_round_runner_compressed(name, comp_name, levels_per_call):
  _compare(name, comp_name, levels_per_call=levels_per_call)


def _jobs(workers, first_iter=0):
  workers = np.asarray(workers, np.int32)
  return executor.Jobs(workers=workers, idx=np.zeros([workers.size, 1], np.int32),
                       iters=np.full([workers.size], first_iter, np.int32),
                       ratios=np.ones([workers.size], np.float32),
                       flushes=np.zeros([workers.size], bool))


def _args(arrived=(), pulls=(), tag=0):
  """A whole round's args on 3 workers and 1 replica (plus a ``tag`` to follow it)."""
  args = rounds_lib.round_args(rounds_lib.empty_round(0.0, 3, 1, 1, np.zeros([3], np.int32)))
  args["arrived"][list(arrived)] = True
  args["pulls"][list(pulls)] = True
  return {**args, "tag": tag}


def test_plan_levels_on_hand_made_steps():
  S = executor.Step
  steps = [
      S(None, _jobs([0, 1, 2])),                 # level 0's jobs
      S(_args([0], [0], tag=1), _jobs([0])),     # 0 arrives (computed in level 0), pulls: new job
      S(_args([1], [1], tag=2), _jobs([1])),     # 1 likewise
      S(_args([0], [0], tag=3), _jobs([0])),     # 0's new job not computed yet: cut before
      S(_args([2], [], tag=4), None),            # 2 (level 0's job) arrives: no cut
      S(_args([], [0], tag=5), _jobs([0])),      # 0 pulls again before its job ran: cut
      S(_args([], [], tag=6), _jobs([2])),
      S(None, _jobs([2])),                       # a second job for 2 before its first ran: cut
  ]
  plan = levels.plan_levels(steps)
  got = [(None if l.jobs is None else l.jobs.workers.tolist(), [r["tag"] for r in l.rounds])
         for l in plan]
  assert got == [([0, 1, 2], [1, 2]),   # all first jobs, then rounds 1-2
                 ([0, 1], [3, 4]),      # the jobs dispatched in rounds 1-2
                 ([0], [5, 6]),         # round 3's job, then from the cut at round 5
                 ([0, 2], []),          # round 5's and round 6's jobs, cut by the second job of 2
                 ([2], [])]             # pending at the end: computed before run returns
  with pytest.raises(ValueError, match="distinct workers"):
    levels.plan_levels([S(None, _jobs([1, 1]))])


def test_plan_levels_rounds_only_and_empty():
  assert levels.plan_levels([]) == []
  plan = levels.plan_levels([executor.Step(_args([], [], tag=t), None) for t in range(3)])
  assert [(l.jobs, [r["tag"] for r in l.rounds]) for l in plan] == [(None, [0, 1, 2])]


def test_make_level_runner_rejects_bad_arguments():
  with pytest.raises(ValueError, match="max_rounds=48"):
    levels.make_level_runner(None, None, None, 1, 0, 4, max_rounds=48)
  with pytest.raises(ValueError, match="num_workers=0"):
    levels.make_level_runner(None, None, None, 1, 0, 0)
  for bad in (0, 3, 2.0, True):
    with pytest.raises(ValueError, match=f"levels_per_call={bad!r}"):
      levels.make_level_runner(None, None, None, 1, 0, 4, levels_per_call=bad)


def test_plan_calls_groups_pieces_and_pads_to_their_buckets():
  plan = [levels.Level(_jobs([0, 1, 2]), [_args(tag=t) for t in range(5)]),   # 2 pieces (4 + 1)
          levels.Level(_jobs([0]), [_args(tag=5)]),
          levels.Level(None, [_args(tag=6), _args(tag=7)]),
          levels.Level(_jobs([1, 2]), [])]
  calls = levels.plan_calls(plan, num_workers=3, max_rounds=4, levels_per_call=2)
  got = [([None if p.jobs is None else p.jobs.workers.tolist() for p in c.pieces],
          [[r["tag"] for r in p.rounds] for p in c.pieces], c.jobs_size, c.rounds_size)
         for c in calls]
  assert got == [([[0, 1, 2], None], [[0, 1, 2, 3], [4]], 3, 4),   # jobs capped at W = 3
                 ([[0], None], [[5], [6, 7]], 1, 2),
                 ([[1, 2]], [[]], 2, 1)]                          # no rounds: one-level path
  jobs, has_jobs, stacked, valid = levels.stack_call(calls[1], num_workers=3, levels_per_call=4)
  assert jobs.workers.tolist() == [[0], [3], [3], [3]]            # padding is for worker W
  assert jobs.idx.shape == (4, 1, 1)
  assert has_jobs.tolist() == [True, False, False, False]
  assert stacked["tag"].tolist() == [[5, 5], [6, 7], [5, 5], [5, 5]]
  assert valid.tolist() == [[True, False], [True, True], [False, False], [False, False]]


def test_compilations_bounded_by_shape_buckets():
  """Two step lists of different lengths trace no more than the padded shape buckets."""
  scheme, tx, compressor, state, arrays, loss_fn, dense, stats = _setup("asp")
  runner = levels.make_level_runner(loss_fn, compressor, tx, dense, stats, W, max_rounds=4)
  job_buckets, round_buckets = set(), set()
  for pushes, seed in ((24, 0), (37, 1)):
    steps = _steps(scheme, pushes, False, seed)
    for level in levels.plan_levels(steps):
      if level.jobs is not None:
        job_buckets.add(levels._bucket(level.jobs.workers.size, W))
      for start in range(0, len(level.rounds), 4):
        round_buckets.add(levels._bucket(len(level.rounds[start:start + 4]), 4))
    state = runner(state, arrays, steps)
  assert runner.traces["jobs"] == len(job_buckets) <= 3      # 1, 2, 4 jobs
  assert runner.traces["rounds"] == len(round_buckets) <= 3  # 1, 2, 4 rounds
  before = dict(runner.traces)
  runner(state, arrays, _steps(scheme, 30, False, 2))
  assert runner.traces["jobs"] <= 3 and runner.traces["rounds"] <= 3
  assert runner.traces["jobs"] >= before["jobs"]


def test_multi_level_compilations_bounded_by_shape_buckets():
  """levels_per_call=4: one trace per (jobs bucket, rounds bucket) pair, and fewer dispatches."""
  scheme, tx, compressor, state, arrays, loss_fn, dense, stats = _setup("gssp")
  runner = levels.make_level_runner(loss_fn, compressor, tx, dense, stats, W, max_rounds=4,
                                    levels_per_call=4)
  pairs, fallback, num_levels, num_calls = set(), 0, 0, 0
  for pushes, seed in ((24, 0), (37, 1), (30, 2)):
    steps = _steps(scheme, pushes, False, seed)
    plan = levels.plan_levels(steps)
    calls = levels.plan_calls(plan, W, 4, 4)
    for call in calls:
      if any(p.rounds for p in call.pieces) and any(p.jobs is not None for p in call.pieces):
        stacked = levels.stack_call(call, W, 4)[2]   # sparse rounds: the call's id sizes too
        pairs.add((call.jobs_size, call.rounds_size, stacked["worker_ids"].shape[-1],
                   stacked["replica_ids"].shape[-1]))
      else:
        fallback += 1
    num_levels += len(plan)
    num_calls += len(calls)
    state = runner(state, arrays, steps)
  # One trace per shape: (1, 2, 4 jobs) x (1, 2, 4 rounds) x the id buckets met.
  ids = {(w, r) for _, _, w, r in pairs}
  assert runner.traces["levels"] == len(pairs) <= 3 * 3 * len(ids)
  assert runner.traces["jobs"] + runner.traces["rounds"] <= fallback
  assert num_calls <= num_levels / 2   # many levels per dispatch
  assert int(state.loss_count) > 0


# -- the levels executor in the one training loop ---------------------------------------------


def _run_config(scheme, compressor, **extra):
  # 512 examples: 4 iterations per worker per epoch, 16 pushes in the epoch. A tiny CNN: the
  # runners' agreement does not depend on the model, and LeNet-5 was most of the compile time.
  return helpers.cluster_config(scheme, **{"compress.name": compressor,
                                           "model": "helpers:TinyCNN", **extra})


_metric_lines = helpers.metric_lines


def test_auto_picks_levels_on_an_accelerator_and_rounds_on_a_cpu():
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.train import executors  # pylint: disable=g-import-not-at-top
  ssp = config_lib.override(config_lib.default_config(), {"sync.scheme": "ssp"})
  assert executors.executor_name(ssp, backend="cpu") == "rounds"
  assert executors.executor_name(ssp, backend="gpu") == "levels"
  assert executors.executor_name(ssp, backend="tpu") == "levels"
  assert executors.executor_name(config_lib.default_config(), backend="gpu") == "fused"
  forced = config_lib.override(ssp, {"executor": "rounds"})
  assert executors.executor_name(forced, backend="gpu") == "rounds"


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
@pytest.mark.parametrize("scheme,compressor,workers", [("gssp", "gdtopk", 4), ("ssp", "dgc", 2)])
def test_levels_executor_equals_rounds_in_the_training_loop(tmp_path, data_dir, scheme,
                                                            compressor, workers):
  # DGC's push times read its sent bytes from the device, which flushes the level buffer at
  # every read; GDTopK flushes its residual at each worker's epoch end. SSP runs on 2 workers
  # (speeds 1 and 2.5, levels of 1 or 2 jobs): both runners compile DGC's jobs once per job
  # count, and with 4 workers those compilations were most of this test's time.
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  runs = {}
  for name in ("rounds", "levels"):
    config = _run_config(scheme, compressor, executor=name, data_dir=data_dir,
                         num_workers=workers)
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


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_levels_executor_resumes_exactly_and_levels_per_call_changes_no_host_figure(tmp_path,
                                                                                  data_dir):
  """An interrupted run of 4 levels per call resumes exactly; it equals 1 level per call."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top
  for n in (1, 4):
    loop.train_and_evaluate(_run_config("gssp", "none", executor="levels", data_dir=data_dir,
                                        levels_per_call=n), str(tmp_path / str(n)))
  config = _run_config("gssp", "none", executor="levels", data_dir=data_dir, levels_per_call=4)
  config.train.stop_after_updates = 11   # 16 pushes in all, evaluations every 8
  first = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert first["status"] == "stopped" and first["totals"]["pushes"] == 11
  config.train.stop_after_updates = 0
  summary = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert summary["status"] == "done"
  assert _metric_lines(tmp_path / "split") == _metric_lines(tmp_path / "4")
  # The host's quantities exactly; the losses to float tolerance (XLA fuses a scan of levels
  # differently from one call per level).
  values = lambda line: {k: v for k, v in line.items() if "loss" not in k and "accuracy" not in k}
  for a, b in zip(_metric_lines(tmp_path / "4"), _metric_lines(tmp_path / "1"), strict=True):
    assert values(a) == values(b)
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)


@pytest.mark.parametrize("value,executor,backend,error", [
    (3, "levels", "gpu", "a power of two from 1 to 64"),
    (128, "levels", "gpu", "a power of two from 1 to 64"),
    (0, "levels", "gpu", "a power of two from 1 to 64"),
    (4, "rounds", "gpu", "this run uses 'rounds'"),
    (4, "auto", "cpu", "this run uses 'rounds' (config.executor='auto')"),
    (4, "dist", "gpu", "this run uses 'dist'"),
])
def test_levels_per_call_is_validated_and_never_ignored(value, executor, backend, error):
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.override(config_lib.default_config(),
                               {"sync.scheme": "ssp", "executor": executor})
  config.levels_per_call = value
  with pytest.raises(ValueError, match=f"config.levels_per_call={value!r}.*" + re.escape(error)):
    config_lib.validate_levels_per_call(config, backend=backend)
  config.levels_per_call = 8
  config.executor = "auto"
  config_lib.validate_levels_per_call(config, backend="gpu")   # auto -> levels on a GPU: fine
