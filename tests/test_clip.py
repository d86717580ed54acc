"""``optimizer.grad_clip`` clips each worker's gradient, before its 1/W scale and its compressor.

The issue: the clip sat in every server replica's optimizer, so BSP clipped the mean
gradient, ASP/SSP/DSSP clipped g/W and a GSSP delivery K/W of a sum, about W times
looser for the asynchronous schemes. Gradients of norm 3, clip 1, SGD lr 1: one epoch
of pushes moved the weights BSP 1.0, ASP 3.0, SSP 3.0, GSSP 2.5. Now every scheme
moves them by 1.0, and the fused BSP executor clips as the simulated one does.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers

from gssp_jax import compress
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import chunk
from gssp_jax.sim import executor
from gssp_jax.base import optim
from gssp_jax.base import step as step_lib
from test_decay import _rounds_of_pushes

CLIP = 1.0
# Every worker's gradient is C, of global norm 3 (sqrt(1 + 4 + 4)), whatever the weights.
C = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([2.0])}
PARAMS = {"a": jnp.zeros([2]), "b": jnp.zeros([1])}
DENSE_BYTES = 12
SPEEDS4 = [1.0, 1.13, 1.37, 1.61]   # distinct, all within 2x: one push each, in order
# (scheme, build_scheme kwargs): every scheme, GSSP (2 groups of 2) in both variants.
SCHEMES4 = [("bsp", {}), ("asp", {}), ("ssp", {}), ("dssp", {}),
            ("gssp", dict(inter_group="peer")), ("gssp", dict(inter_group="global")),
            ("inhad", {}), ("casp", {}), ("casp", dict(initial_communities=2)),
            ("dssync", {})]


def _linear_loss(params, model_state, batch, rng):
  """``sum(params * C)``: its gradient is C everywhere (norm 3); the batch is not read."""
  del rng
  loss = sum(jnp.sum(p * c) for p, c in zip(jax.tree.leaves(params), jax.tree.leaves(C)))
  return loss + 0.0 * jnp.sum(batch["x"]), model_state


def _sgd_config(grad_clip=CLIP):
  """Plain SGD, lr 1, no momentum, no weight decay."""
  cfg = config_lib.default_config().optimizer
  cfg.name, cfg.learning_rate, cfg.momentum, cfg.weight_decay = "sgd", 1.0, 0.0, 0.0
  cfg.grad_clip = grad_clip
  return cfg


def _one_epoch_steps(scheme, num_pushes):
  """The executor's steps of ``num_pushes`` pushes and the server messages they set off."""
  dispatched = np.zeros([scheme.num_workers], np.int64)

  def jobs(workers):
    workers = np.asarray(workers, np.int32)
    ks = dispatched[workers].copy()
    dispatched[workers] += 1
    return executor.Jobs(workers=workers, idx=np.zeros([workers.size, 1], np.int32),
                         iters=ks.astype(np.int32), ratios=np.ones([workers.size], np.float32),
                         flushes=np.zeros([workers.size], bool))

  steps = [executor.Step(None, jobs(np.arange(scheme.num_workers)))]
  for rnd in _rounds_of_pushes(scheme.make_protocol(), SPEEDS4, num_pushes):
    args = sync.round_args(rnd)
    args["learning_rate"] = np.float32(1.0)
    pulled = np.flatnonzero(rnd.pulls)
    steps.append(executor.Step(args, jobs(pulled) if pulled.size else None))
  return steps


def _one_epoch(name, kw, runner="rounds"):
  """The served weights' displacement after one push per worker (4 workers), and the clocks."""
  k0 = kw.get("initial_communities")
  kw = {k: v for k, v in kw.items() if k != "initial_communities"}
  scheme = sync.build_scheme(name, 4, num_groups=2, num_nodes=2, group_size=2,
                             worker_times=SPEEDS4, **kw)
  if k0:   # CASP with communities of 2 from the start
    scheme = dataclasses.replace(scheme, make_protocol=lambda: sync.CASPProtocol(
        4, max_communities=k0, initial_communities=k0))
  cfg = _sgd_config()
  tx = optim.make_sync_chain(cfg, scheme.transform, scheme.num_replicas)
  eval_replica = (scheme.num_replicas - 1
                  if name == "gssp" and kw.get("inter_group") == "global" else None)
  steps = _one_epoch_steps(scheme, 4)
  if runner == "rounds":
    state = executor.init_state(PARAMS, {}, tx, None, 4, scheme.num_replicas, jax.random.key(0))
    run = executor.make_round_runner(
        executor.make_job_fn(_linear_loss, None, DENSE_BYTES, grad_clip=cfg.grad_clip),
        executor.make_round_fn(tx))
    state = run(state, {"x": jnp.zeros([4, 1])}, steps)
    served, _ = executor.served_weights(state, eval_replica)
  else:
    state, run, layout = helpers.level_runner(_linear_loss, None, tx, DENSE_BYTES, 0, scheme,
                                              PARAMS, {}, jax.random.key(0),
                                              grad_clip=cfg.grad_clip)
    state = run(state, {"x": jnp.zeros([4, 1])}, steps)
    served, _ = chunk.served_weights(layout, state, eval_replica)
  clock = np.asarray(sync.find_sync_state(state.tx_state).clock)
  return jax.tree.map(lambda s, p: np.asarray(s - p), served, PARAMS), clock


def _norm(tree):
  return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


@pytest.mark.parametrize("name,kw", SCHEMES4, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_one_epoch_of_clipped_pushes_moves_every_scheme_as_bsp(name, kw):
  """The issue's numbers: gradients of norm 3, clip 1, SGD lr 1: one epoch moves the weights 1."""
  moved, clock = _one_epoch(name, kw)
  assert clock.tolist() == [1] * 4   # one push per worker, each applied
  np.testing.assert_allclose(_norm(moved), 1.0, rtol=0, atol=1e-6)
  # Along -C: the clipped gradient C / 3, applied in full over the epoch.
  jax.tree.map(lambda m, c: np.testing.assert_allclose(m, -np.asarray(c) / 3, atol=1e-6),
               moved, C)


@pytest.mark.parametrize("name,kw", [("asp", {}), ("gssp", dict(inter_group="peer"))],
                         ids=["asp", "gssp-peer"])
def test_the_levels_runner_clips_as_the_rounds_runner(name, kw):
  moved, _ = _one_epoch(name, kw, runner="levels")
  np.testing.assert_allclose(_norm(moved), 1.0, rtol=0, atol=1e-6)


def test_the_worker_gradient_is_clipped_before_its_compressor():
  """Top-k of one entry: the pushed value and the residual come from C / 3, not from C."""
  compressor = compress.topk(1, ratio=0.3)   # ceil(0.3 * 2) = 1 of "a", ceil(0.3) = 1 of "b"
  comp = compressor.init(PARAMS)
  gradient = executor.make_worker_gradient(_linear_loss, compressor, DENSE_BYTES,
                                           grad_clip=CLIP)
  args = (PARAMS, {}, comp, {"x": jnp.zeros([1, 1])}, jax.random.key(0), jnp.float32(0.3),
          jnp.bool_(False))
  _, sent, _, comp, _ = jax.jit(gradient)(*args)
  np.testing.assert_allclose(sent["a"], [0.0, 2.0 / 3], rtol=1e-6)   # the larger entry
  np.testing.assert_allclose(sent["b"], [2.0 / 3], rtol=1e-6)
  np.testing.assert_allclose(comp.residual["a"][0], [1.0 / 3, 0.0], rtol=1e-6)
  # Off (0): the gradient as computed, and no norm is taken.
  off = executor.make_worker_gradient(_linear_loss, compressor, DENSE_BYTES)
  _, sent, _, _, _ = jax.jit(off)(*args[:2], compressor.init(PARAMS), *args[3:])
  np.testing.assert_allclose(sent["a"], [0.0, 2.0], rtol=1e-6)
  assert "sqrt" not in str(jax.make_jaxpr(off)(*args))


def test_a_gradient_below_the_clip_is_unchanged():
  gradient = executor.make_worker_gradient(_linear_loss, None, DENSE_BYTES, grad_clip=5.0)
  _, grad, _, _, _ = jax.jit(gradient)(PARAMS, {}, (), {"x": jnp.zeros([1, 1])},
                                       jax.random.key(0), jnp.float32(1.0), jnp.bool_(False))
  jax.tree.map(lambda g, c: np.testing.assert_array_equal(g, c), grad, C)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1", True])
def test_a_bad_clip_is_refused_with_its_value(bad):
  with pytest.raises(ValueError, match="grad_clip"):
    executor.make_worker_gradient(_linear_loss, None, DENSE_BYTES, grad_clip=bad)


def test_the_server_optimizer_does_not_clip():
  """The replicas' chain leaves a large gradient whole (the workers clipped it already)."""
  scheme = sync.build_scheme("bsp", 1)
  tx = optim.make_sync_chain(_sgd_config(), scheme.transform, 1)
  grads = jax.tree.map(lambda c: 10.0 * c[None], C)
  updates, _ = tx.update(grads, tx.init(PARAMS), None, **sync.round_args(
      sync.rounds.empty_round(0.0, 1, 1, 1, np.zeros([1], np.int32))._replace(
          arrived=np.ones([1], bool), applies=np.ones([1], bool))), learning_rate=1.0)
  np.testing.assert_allclose(_norm(jax.tree.map(lambda u: u[0], updates)), 30.0, rtol=1e-6)


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
@pytest.mark.slow
def test_fused_bsp_and_simulated_bsp_clip_alike():
  """Three BSP rounds of 4 workers (``helpers.TinyCNN``), clip 0.05: every gradient clipped."""
  from test_train import _synthetic_task
  task = _synthetic_task()
  W, B, rounds = 4, 8, 3
  cfg = _sgd_config(grad_clip=0.05)
  cfg.learning_rate, cfg.momentum = 0.1, 0.9
  order = np.arange(W * B * rounds, dtype=np.int32).reshape(W, -1)
  arrays = jax.device_put(task.train)

  # The fused executor's step: every worker's gradient on the same weights.
  tx = optim.make_optimizer(cfg, 10, 10)
  fused = step_lib.init_train_state(task, tx, 0)
  run = step_lib.make_chunk_runner(step_lib.make_bsp_step(task.loss, tx, W,
                                                          grad_clip=cfg.grad_clip), B)
  fused, _ = run(fused, arrays, jnp.asarray(order), 0, rounds)

  # The simulator's BSP rounds on the same weights, batches and dropout keys.
  scheme = sync.build_scheme("bsp", W)
  chain = optim.make_sync_chain(cfg, scheme.transform, 1)
  sim = executor.init_state(*task.init(jax.random.split(jax.random.PRNGKey(0))[0]), chain, None,
                            W, 1, jax.random.PRNGKey(0))
  gradient = jax.jit(executor.make_worker_gradient(task.loss, None, 0, grad_clip=cfg.grad_clip))
  round_fn = executor.make_round_fn(chain)
  bsp_rounds = _rounds_of_pushes(sync.BSPProtocol(W), SPEEDS4, W * rounds)
  assert len(bsp_rounds) == rounds and all(r.arrived.all() for r in bsp_rounds)
  for t, rnd in enumerate(bsp_rounds):
    rngs = step_lib.worker_rngs(fused.rng, jnp.int32(t), W)
    grads = []
    for w in range(W):
      batch = jax.tree.map(lambda a: a[order[w, t * B:(t + 1) * B]], arrays)
      _, g, _, _, _ = gradient(jax.tree.map(lambda x: x[w], sim.worker_params), {}, (), batch,
                               rngs[w], jnp.float32(1.0), jnp.bool_(False))
      grads.append(g)
    sim = sim.replace(grad_buf=jax.tree.map(lambda *g: jnp.stack(g), *grads))
    sim = round_fn(sim, {**sync.round_args(rnd), "learning_rate": np.float32(cfg.learning_rate)})
  for a, b in zip(jax.tree.leaves(fused.params), jax.tree.leaves(sim.replica_params)):
    np.testing.assert_allclose(a, b[0], rtol=1e-5, atol=1e-6)
  # And the clip mattered: the run without it ends elsewhere.
  unclipped = step_lib.init_train_state(task, tx, 0)
  unclipped, _ = step_lib.make_chunk_runner(step_lib.make_bsp_step(task.loss, tx, W), B)(
      unclipped, arrays, jnp.asarray(order), 0, rounds)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(fused.params), jax.tree.leaves(unclipped.params))) > 1e-3


def test_a_real_runtime_mesh_clips_its_gradient():
  """``runtime/worker.make_mesh_step`` (a mesh of one device here) pushes the clipped gradient."""
  from jax.sharding import Mesh
  from gssp_jax.runtime import worker as dist_worker
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  step, _, _ = dist_worker.make_mesh_step(_linear_loss, None, mesh, DENSE_BYTES, grad_clip=CLIP)
  _, grad, _, _, _ = step(PARAMS, {}, (), {"x": jnp.zeros([1, 1])}, jax.random.PRNGKey(0),
                          jnp.int32(0), jnp.int32(0), jnp.float32(1.0), jnp.bool_(False))
  for mesh in (None,):   # a one-process mesh runs a plain jit
    step, _, _ = dist_worker.make_mesh_step(_linear_loss, None, mesh, DENSE_BYTES,
                                            grad_clip=CLIP)
    _, plain, _, _, _ = step(PARAMS, {}, (), {"x": jnp.zeros([1, 1])}, jax.random.PRNGKey(0),
                             jnp.int32(0), jnp.int32(0), jnp.float32(1.0), jnp.bool_(False))
    jax.tree.map(lambda g, c: np.testing.assert_allclose(g, np.asarray(c) / 3, rtol=1e-6),
                 plain, C)
  jax.tree.map(lambda g, c: np.testing.assert_allclose(g, np.asarray(c) / 3, rtol=1e-6), grad, C)


@pytest.mark.parametrize("schedule,warmup", [("constant", 0.0), ("cosine", 0.0),
                                             ("cosine", 0.5)])
def test_the_learning_rate_table_is_the_schedule_and_holds_its_last_value(schedule, warmup):
  """The simulator's and the real runtime's rates: ``learning_rate_schedule`` at every step,
  from one jitted call (to float rounding: an eager schedule rounds 1 ulp apart), constant past
  the last step as the schedule is."""
  cfg = _sgd_config()
  cfg.learning_rate, cfg.schedule, cfg.warmup_epochs = 0.1, schedule, warmup
  table = optim.learning_rate_table(cfg, 10, 100)
  schedule_fn = optim.learning_rate_schedule(cfg, 10, 100)
  for step in (0, 1, 4, 5, 6, 50, 99, 100):
    assert table(step) == pytest.approx(float(schedule_fn(step)), rel=1e-6, abs=1e-9)
  assert table(100) == table(10_000) == pytest.approx(float(schedule_fn(10_000)), abs=1e-9)
  assert table.values.dtype == np.float32 and table.values.size == 101
