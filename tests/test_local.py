"""The local-update schemes: their job, Delayed Nesterov, DyLU, the reductions, exact resume."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax.runtime import settings as runtime_settings
from gssp_jax.sim import executor
from gssp_jax.sync import local as local_lib
from gssp_jax.train import loop

# Plain SGD at 0.05: the server's for BSP and ASP, the workers' for local_sgd (whose server
# averages) and async_local_sgd (whose server takes SGD at rate 1), so a reduction is exact up
# to rounding.
_SGD = {"optimizer.momentum": 0.0, "optimizer.weight_decay": 0.0,
        "optimizer.schedule": "constant"}
_AVERAGING = {**_SGD, "optimizer.learning_rate": 1.0}
_INNER_SGD = {"local.optimizer.learning_rate": 0.05}


def _config(scheme, data_dir, **changes):
  # 512 examples on 4 workers of speeds 1 and 2.5 (jitter 0.1): 4 iterations per worker per
  # epoch, 2 epochs, an evaluation every half epoch (``changes`` may override any of it).
  # A tiny CNN (helpers.TinyCNN): these are equalities between schemes and executors.
  changes = {"train_size": 512, "num_epochs": 2.0, "model": "helpers:TinyCNN", **changes}
  config = helpers.cluster_config(scheme, **changes)
  config.data_dir = data_dir
  return config


def _run(config, workdir):
  summary = loop.train_and_evaluate(config, str(workdir))
  return summary, helpers.metric_lines(workdir)


def _assert_same_run(got, want, rtol):
  """Same evaluation points, times and bytes exactly; losses and accuracies to ``rtol``."""
  assert len(got) == len(want)
  for a, b in zip(got, want):
    for key in ("epoch", "virtual_time", "bytes_pushed", "bytes_pulled", "updates"):
      assert a[key] == b[key], key
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=rtol)
    # At most one example of 200 (counted: 0.49 - 0.485 is 0.0050000000000000044 in floats).
    assert round(abs(a["test_accuracy"] - b["test_accuracy"]) * 200) <= 1


# -- the job ---------------------------------------------------------------------------------


def _linear_loss(params, model_state, batch, rng):
  del rng
  pred = batch["x"] @ params["w"]
  return jnp.mean((pred - batch["y"]) ** 2), model_state


def test_a_local_job_takes_its_steps_and_pushes_pulled_minus_local():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=[3]), jnp.float32)}
  batches = {"x": jnp.asarray(rng.normal(size=[4, 5, 3]), jnp.float32),
             "y": jnp.asarray(rng.normal(size=[4, 5]), jnp.float32)}
  inner = optax.sgd(0.1, momentum=0.5)
  update = executor.make_local_update(_linear_loss, None, 12, executor.LocalJob(inner, 4))
  key = jax.random.PRNGKey(0)
  for steps in (4, 2):
    loss, push, _, opt, _, nbytes = jax.jit(update)(
        params, {}, inner.init(params), (), batches, key, jnp.int32(8), jnp.int32(steps),
        jnp.float32(1.0), jnp.bool_(False))
    # The same steps by hand: the first `steps` batches, momentum carried between them.
    p, state, losses = params, inner.init(params), []
    for i in range(steps):
      batch = {k: v[i] for k, v in batches.items()}
      (l, _), g = jax.value_and_grad(_linear_loss, has_aux=True)(p, {}, batch, None)
      u, state = inner.update(g, state, p)
      p, losses = optax.apply_updates(p, u), losses + [l]
    np.testing.assert_allclose(push["w"], params["w"] - p["w"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-6)
    np.testing.assert_allclose(opt[0].trace["w"], state[0].trace["w"], rtol=1e-6, atol=1e-7)
    assert int(nbytes) == 12
  # Its 4 steps unrolled, a skipped one a select: no loop and no conditional (on a GPU, a round
  # trip to the host; on a CPU, the slow path of a convolution, executor.MAX_UNROLLED_STEPS).
  args = (params, {}, inner.init(params), (), batches, key, jnp.int32(8), jnp.int32(2),
          jnp.float32(1.0), jnp.bool_(False))
  text = jax.jit(update).lower(*args).compile().as_text()
  assert " conditional(" not in text and " while(" not in text


def test_dylu_gives_the_fastest_worker_h_and_the_others_in_proportion():
  np.testing.assert_array_equal(local_lib.local_steps(8, [1.0, 1.5, 2.0, 3.0], True),
                                [8, 5, 4, 2])
  np.testing.assert_array_equal(local_lib.local_steps(8, [1.0, 100.0], True), [8, 1])
  np.testing.assert_array_equal(local_lib.local_steps(8, [1.0, 3.0], False), [8, 8])


def test_delayed_nesterov_follows_the_reference_algorithm():
  """``DelayedNesterovOptimizer`` of utnslab/halos (c = 0), on pushes scaled by 1/W."""
  W, N, beta, lr = 4, 3, 0.9, 0.7
  rng = np.random.default_rng(1)
  grads = rng.normal(size=[10, 5]).astype(np.float32)
  dn = local_lib.delayed_nesterov(beta, N, num_workers=W)
  theta = jnp.zeros([5], jnp.float32)
  state = dn.init(theta)
  ref_theta, m, acc = np.zeros(5), np.zeros(5), np.zeros(5)
  for t, g in enumerate(grads):
    u, state = dn.update(jnp.asarray(g / W), state)
    theta = theta + lr * u
    acc += g
    if (t + 1) % N == 0:
      m = beta * m + acc / N
      ref_theta -= lr * (beta * m + g / N)
      acc[:] = 0
    else:
      ref_theta -= lr * g / N
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-6)


# -- the reductions (end to end, through the configs) ------------------------------------------


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_local_sgd_with_one_sgd_step_equals_bsp_and_h_steps_cost_h_iterations(tmp_path,
                                                                             data_dir):
  _, bsp = _run(_config("bsp", data_dir, **_SGD), tmp_path / "bsp")
  one, local = _run(_config("local_sgd", data_dir, **_SGD), tmp_path / "local")
  _assert_same_run(local, bsp, rtol=1e-5)
  four, lines = _run(_config("local_sgd", data_dir, **_SGD, **{"local.steps": 4}),
                     tmp_path / "h4")
  assert lines[-1]["epoch"] == 2.0
  # The same data (two epochs of iterations) in 4x fewer rounds: the same compute in virtual
  # time, 4x fewer barriers and pushes.
  assert four["totals"]["samples"] == one["totals"]["samples"]
  assert four["totals"]["pushes"] * 4 == one["totals"]["pushes"]
  assert four["totals"]["virtual_time"] < one["totals"]["virtual_time"]
  assert four["scheme"]["local_steps"] == [4, 4, 4, 4]


def test_diloco_with_outer_sgd_at_rate_one_equals_local_sgd(tmp_path, data_dir):
  adamw = {"name": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01, "momentum": 0.0,
           "schedule": "cosine"}
  local_sgd = {"local.steps": 3, **{f"optimizer.{k}": v for k, v in adamw.items()}}
  _, local = _run(_config("local_sgd", data_dir, **local_sgd), tmp_path / "local")
  diloco = {"local.steps": 3, **_AVERAGING, **{f"local.optimizer.{k}": v for k, v in adamw.items()}}
  _, outer = _run(_config("diloco", data_dir, **diloco), tmp_path / "diloco")
  assert outer == local   # the same program: bit for bit


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_async_local_sgd_with_one_step_equals_asp(tmp_path, data_dir):
  _, asp = _run(_config("asp", data_dir, **_SGD), tmp_path / "asp")
  _, local = _run(_config("async_local_sgd", data_dir, **_AVERAGING, **_INNER_SGD),
                  tmp_path / "local")
  _assert_same_run(local, asp, rtol=1e-5)


# -- executors and resume --------------------------------------------------------------------

_ASYNC = {"local.steps": 4, "local.dylu": True, "local.delayed_nesterov": 4,
          "local.optimizer.name": "adamw", "local.optimizer.learning_rate": 2e-3,
          "local.optimizer.weight_decay": 0.01, "local.optimizer.schedule": "cosine",
          "optimizer.learning_rate": 0.5, "optimizer.momentum": 0.9,
          "optimizer.nesterov": True, "optimizer.weight_decay": 0.0}


# Two workers (speeds 1 and 2.5): levels of 1 or 2 jobs, so each runner compiles its local job
# for two job counts only. LeNet-5: with these rates the tiny CNN collapses to one class, and a
# run must finish ``done`` for the resume's check.
_ASYNC2 = {"num_workers": 2, "model": "lenet5", **_ASYNC}


@pytest.mark.slow
def test_async_local_sgd_levels_equal_rounds_and_a_resume_is_exact(tmp_path, data_dir):
  """DyLU, Delayed Nesterov, AdamW inside: the inner state survives a kill exactly."""
  whole, rounds = _run(_config("async_local_sgd", data_dir, **_ASYNC2), tmp_path / "whole")
  assert whole["scheme"]["local_steps"] == [4, 1]   # DyLU: floor(4 * 1 / 2.5)
  _, levels = _run(_config("async_local_sgd", data_dir, executor="levels", **_ASYNC2),
                   tmp_path / "levels")
  _assert_same_run(levels, rounds, rtol=1e-4)

  config = _config("async_local_sgd", data_dir, **_ASYNC2, **{"train.checkpoint_every": 1})
  config.train.stop_after_updates = whole["totals"]["pushes"] // 2 + 1   # between evaluations
  first, _ = _run(config, tmp_path / "split")
  assert first["status"] == "stopped"
  ckpts = sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert len(ckpts) >= 2   # an evaluation's checkpoint before the stop's
  shutil.rmtree(tmp_path / "split" / "checkpoints" / str(ckpts[-1]))   # killed before that save
  config.train.stop_after_updates = 0
  summary, lines = _run(config, tmp_path / "split")
  assert summary["status"] == "done"
  assert lines == rounds
  assert summary["totals"]["virtual_time"] == whole["totals"]["virtual_time"]


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, changes, match", [
    ("local_sgd", {"local.optimizer.learning_rate": 0.1},
     r"local.optimizer.learning_rate=0.1 cannot apply to sync.scheme='local_sgd'"),
    ("bsp", {"local.steps": 2}, r"local.steps=2 cannot apply: sync.scheme='bsp'"),
    ("asp", {"local.optimizer.name": "adamw"}, r"local.optimizer.name='adamw' cannot apply"),
    ("diloco", {"local.dylu": True}, r"local.dylu=True cannot apply: .*async_local_sgd"),
    ("diloco", {"local.steps": 0}, r"local.steps=0 is invalid; allowed: an integer >= 1"),
    ("async_local_sgd", {"local.delayed_nesterov": 4, "optimizer.name": "adam"},
     r"optimizer.name='adam' cannot apply with local.delayed_nesterov=4"),
    ("async_local_sgd", {"local.delayed_nesterov": 4, "optimizer.weight_decay": 0.0},
     r"optimizer.nesterov=False cannot apply"),
    ("diloco", {"local.optimizer.name": "lyon"}, r"local.optimizer.name='lyon' is not an optax"),
])
def test_bad_local_configs_are_rejected_before_any_compilation(scheme, changes, match):
  config = helpers.cluster_config(scheme, **changes)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_the_real_runtime_runs_every_local_update_scheme():
  for scheme in ("local_sgd", "diloco", "async_local_sgd", "halos"):
    runtime_settings.check_real_run(helpers.cluster_config(scheme))   # bit for bit: tests/test_shards.py


def test_halos_drops_and_takes_back_a_worker_without_holding_anyone():
  from gssp_jax.sync.schemes.halos.protocol import HALoSProtocol  # pylint: disable=g-import-not-at-top
  p = HALoSProtocol(4, [0, 0, 1, 1], forward_every=2)
  p.on_push(1, 1.0)
  dropped = p.drop(1, 2.0)
  assert not dropped.rounds and not dropped.release and not p.alive[1]
  assert p.on_push(0, 3.0).release == [0]   # its group's server goes on
  with pytest.raises(ValueError, match="pushed while dropped"):
    p.on_push(1, 3.5)
  back = p.rejoin(1, 4.0)
  assert back.release == [1] and back.rounds[0].pulls.tolist() == [False, True, False, False]
  # Its push counted towards its group's exchange (2 updates: the progress is in flight).
  assert p.clock.tolist() == [1, 1, 0, 0] and p.since_merge.tolist() == [2, 0]
  assert p.in_flight.tolist() == [True, False]


# -- HALoS ------------------------------------------------------------------------------------


def test_halos_protocol_never_blocks_and_merges_after_k_updates():
  from gssp_jax.sync.schemes.halos.protocol import HALoSProtocol  # pylint: disable=g-import-not-at-top
  p = HALoSProtocol(4, [0, 0, 1, 1], forward_every=2, merge_weight=0.25)
  assert (p.num_replicas, p.global_replica, p.reply_slot(1)) == (5, 2, 4)
  first = p.on_push(0, 1.0)
  assert first.release == [0] and not first.messages           # pulls at once, 1 update of 2
  second = p.on_push(1, 2.0)
  (rnd,) = second.rounds
  assert rnd.forward.tolist() == [True, False] and rnd.arrived[1] and rnd.pulls[1]
  (deliver,) = second.messages
  assert not p.on_push(0, 2.5).messages and not p.on_push(1, 2.6).messages   # one in flight
  at_global = p.on_message(deliver, 3.0)
  (rnd,) = at_global.rounds
  assert rnd.deliver[0] and rnd.applies[2] and rnd.adopt[3] == 2 and rnd.stats_mean[2] == 2
  (reply,) = at_global.messages
  (merge,) = p.on_message(reply, 4.0).rounds
  assert merge.adopt.tolist()[:2] == [3, -1] and merge.adopt_weight[0] == np.float32(0.25)
  # K updates counted from the merge: the two pushes in flight do not count.
  assert not p.on_push(0, 5.0).messages and p.on_push(0, 6.0).messages
  with pytest.raises(ValueError, match="merge_weight=0 is invalid"):
    HALoSProtocol(4, [0, 0, 1, 1], merge_weight=0)


def _halos_reference(rounds, grad, theta0, *, W, G, route, lr_local, beta_local, n_local,
                     lr_global, beta_global, n_global, alpha):
  """HALoS as ``utnslab/halos`` writes it (theta_ref, explicit Delayed Nesterov), in NumPy."""
  def dn(state, theta, g, lr, beta, n):
    m, acc, t = state
    acc = acc + g
    if (t + 1) % n == 0:
      m = beta * m + acc / n
      theta = theta - lr * (beta * m + g / n)
      acc = np.zeros_like(acc)
    else:
      theta = theta - lr * g / n
    return (m, acc, t + 1), theta
  zeros = lambda: (np.zeros_like(theta0), np.zeros_like(theta0), 0)
  local = [theta0.copy() for _ in range(G)]
  ref = [theta0.copy() for _ in range(G)]
  local_dn, global_dn = [zeros() for _ in range(G)], zeros()
  glob, slots, outbox = theta0.copy(), [None] * G, [None] * G
  pulled = [theta0.copy() for _ in range(W)]
  for rnd in rounds:
    for w in np.flatnonzero(rnd.arrived):
      g = route[w]
      local_dn[g], local[g] = dn(local_dn[g], local[g], grad(pulled[w], w), lr_local,
                                 beta_local, n_local)
    for g in np.flatnonzero(rnd.deliver):
      global_dn, glob = dn(global_dn, glob, outbox[g], lr_global, beta_global, n_global)
      slots[g] = glob.copy()
    for g in np.flatnonzero(rnd.forward):
      outbox[g] = ref[g] - local[g]
    for g in np.flatnonzero(rnd.adopt[:G] >= 0):
      local[g] = (1 - alpha) * local[g] + alpha * slots[g]
      ref[g] = local[g].copy()
    for w in np.flatnonzero(rnd.pulls):
      pulled[w] = local[route[w]].copy()
  return local, glob


def test_halos_transform_follows_the_reference_algorithm():
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync.schemes.halos import transform as halos_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync import replay  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync.schemes.halos.protocol import HALoSProtocol  # pylint: disable=g-import-not-at-top
  W, G = 6, 2
  route = np.array([0, 0, 0, 1, 1, 1])
  speeds = [1.0, 1.3, 1.7, 2.0, 2.9, 3.1]
  timeline = sync.run_timeline(HALoSProtocol(W, route, forward_every=3, merge_weight=0.3),
                               lambda w, k: speeds[w], max_pushes=120,
                               message_delay=lambda m: 0.8)
  settings = dict(local_learning_rate=1.5, local_momentum=0.9, local_period=4,
                  global_momentum=0.5, global_period=2)
  tx = halos_lib.halos(W, G, assignment=route, **settings)
  targets = np.arange(W, dtype=np.float32)[:, None] * np.ones([W, 3], np.float32)
  grad_fn = lambda params, i: {"w": params["w"] - targets}   # a pseudo-gradient per worker
  state = replay.replay(tx, {"w": jnp.zeros([3])}, timeline.rounds, grad_fn,
                        num_replicas=2 * G + 1, num_workers=W,
                        extra_args={"learning_rate": np.float32(0.3)})
  # The transform's pushes arrive scaled by 1/W (as every push here): the reference's g is
  # the raw pseudo-gradient, so its local step is lr * g / N.
  local, glob = _halos_reference(
      timeline.rounds, lambda theta, w: (theta - targets[w]) / W, np.zeros(3, np.float32),
      W=W, G=G, route=route, lr_local=1.5 * W, beta_local=0.9, n_local=4, lr_global=0.3,
      beta_global=0.5, n_global=2, alpha=0.3)
  assert sum(r.deliver.any() for r in timeline.rounds) >= 10   # many exchanges
  np.testing.assert_allclose(state.replica_params["w"][:G], np.stack(local), rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(state.replica_params["w"][G], glob, rtol=1e-4, atol=1e-5)


def test_halos_with_one_group_and_no_local_momentum_reduces_to_async_local_sgd(tmp_path,
                                                                                data_dir):
  # Servers 0 s apart (no push lands between a send and its merge); every update sent (K = 1);
  # the local server's Delayed Nesterov without momentum and N = W is ASP's step g / W; the
  # global server takes the progress whole (rate 1, no momentum, N = 1).
  instant = {"cluster.server_latency": 0.0, "cluster.server_bandwidth": 1e18}
  inner = {"local.steps": 2, "local.optimizer.learning_rate": 0.05}
  asl_outer = {**_AVERAGING, "optimizer.learning_rate": 0.5}
  _, asl = _run(_config("async_local_sgd", data_dir, **asl_outer, **inner, **instant),
                tmp_path / "async")
  halos = {"sync.num_groups": 1, "sync.forward_every": 1, "local.halos.merge_weight": 0.5,
           "local.halos.local_learning_rate": 0.5, "local.halos.local_momentum": 0.0,
           "local.halos.local_period": 4, "local.halos.global_period": 1,
           "optimizer.learning_rate": 1.0, "optimizer.momentum": 0.0, "optimizer.nesterov": True,
           "optimizer.weight_decay": 0.0, "optimizer.schedule": "constant"}
  summary, hal = _run(_config("halos", data_dir, **inner, **instant, **halos), tmp_path / "halos")
  assert summary["scheme"]["num_replicas"] == 3
  assert len(hal) == len(asl)
  for a, b in zip(hal, asl):
    for key in ("epoch", "virtual_time", "bytes_pushed", "bytes_pulled"):
      assert a[key] == b[key], key
    # The workers' losses: the local server's weights. (Evaluation serves the global server,
    # which may lag the last push by its exchange.)
    np.testing.assert_allclose(a["train_loss"], b["train_loss"], rtol=1e-5)


def test_data_staleness_counts_a_local_push_as_its_h_iterations():
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync import rounds as rounds_lib  # pylint: disable=g-import-not-at-top
  acct = sync.accounting.Accounting(2, 1, push_iterations=[4, 1])   # DyLU's H_w
  groups = np.zeros([2], np.int32)

  def push(w):   # an ASP push of worker w, which then pulls
    rnd = rounds_lib.empty_round(0.0, 2, 1, 1, groups)
    rnd.arrived[w] = rnd.pulls[w] = rnd.applies[0] = True
    acct.apply(rnd)
  push(0)
  push(0)    # worker 1 read before both: 2 updates, 8 iterations of data
  push(1)
  assert acct.summary()["max"] == 2 and acct.data_summary()["max"] == 8


def test_a_run_recorded_before_the_local_keys_still_resumes(tmp_path):
  import json as json_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  config = helpers.cluster_config("gssp")
  old = json_lib.loads(config.to_json())
  del old["local"]   # what a run of an earlier version recorded
  path = tmp_path / "config.json"
  path.write_text(json_lib.dumps(old))
  workdir_lib.check_resumable(config, str(path))
  assert workdir_lib.config_changes(old, config) == []
  config.local.steps = 2
  assert [k for k, _, _ in workdir_lib.config_changes(old, config)] == ["local.steps"]


def test_the_server_chain_follows_what_a_scheme_declares_not_its_name():
  """``base.optim.server_chain``: a scheme declaring ``own_optimizer`` (HALoS, or a researcher's
  under any name) is its own chain; any other gets the config's server optimizer after it."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  from gssp_jax.base import optim  # pylint: disable=g-import-not-at-top
  config = config_lib.default_config()
  ssp = sync.build_scheme("ssp", 4)
  own = dataclasses.replace(ssp, name="my_scheme", own_optimizer=True)
  assert optim.server_chain(config, own) is own.transform
  chained = optim.server_chain(config, ssp)
  assert chained is not ssp.transform
  params = {"w": jnp.ones([3])}
  state = chained.init(params)
  updates, _ = chained.update({"w": jnp.ones([4, 3])}, state, {"w": jnp.ones([1, 3])},
                              learning_rate=jnp.float32(0.1))
  assert updates["w"].shape == (1, 3)
