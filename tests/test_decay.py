"""Weight decay follows training progress (gradient mass), not server steps; or per_step."""

import dataclasses
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from gssp_jax import config as config_lib
from gssp_jax import defaults
from gssp_jax import sync
from gssp_jax.sync import decay
from gssp_jax.sync import replay
from gssp_jax.sync import rounds as rounds_lib
from gssp_jax.base import optim
# The quadratic problem of test_sync.py: worker w minimises 0.5 * |A x - t_w|^2.
from test_sync import _quad_grad
from test_sync import TARGETS4

LR, WD = 0.05, 5e-4
SPEEDS16 = 1.0 + np.arange(16) / 17.0     # distinct, all within 2x: one push each, in order
SPEEDS4 = [1.0, 1.37, 1.91, 2.53]
PARAMS = {"w": jnp.arange(1.0, 7.0).reshape(3, 2) / 4, "b": jnp.ones([2])}
# (scheme, build_scheme kwargs): every scheme, GSSP in both inter-group variants.
SCHEMES16 = [("bsp", {}), ("asp", {}), ("ssp", {}), ("dssp", {}),
             ("gssp", dict(inter_group="peer")), ("gssp", dict(inter_group="global")),
             ("inhad", {}), ("casp", {}), ("casp", dict(initial_communities=4)),
             ("dssync", {})]


def _opt_config(mode, name="sgd", momentum=0.0, weight_decay=WD):
  cfg = config_lib.default_config().optimizer
  cfg.name, cfg.momentum, cfg.weight_decay, cfg.learning_rate = name, momentum, weight_decay, LR
  cfg.weight_decay_mode = mode
  return cfg


def _rounds_of_pushes(protocol, speeds, num_pushes, message_delay=0.3):
  """The rounds of the first ``num_pushes`` pushes, then every server message still in flight."""
  engine = sync.TimelineEngine(protocol, lambda w, k: speeds[w],
                               message_delay=lambda m: message_delay)
  rounds = []
  while engine.num_pushes < num_pushes:
    rounds.extend(engine.step())
  while any(kind == "message" for _, _, kind, _ in engine.queue):
    if engine.queue[0][2] == "push":   # drain messages only: no further gradient
      engine.queue = [e for e in engine.queue if e[2] != "push"]
      heapq.heapify(engine.queue)
      continue
    rounds.extend(engine.step())
  return rounds


def _served(scheme, kw, replica_params):
  """What the simulator evaluates: GSSP-global's server, else the replicas' mean."""
  if scheme.name == "gssp" and kw.get("inter_group") == "global":
    return jax.tree.map(lambda x: x[-1], replica_params)
  return jax.tree.map(lambda x: x.mean(0), replica_params)


def _one_epoch_of_zero_gradients(name, kw, mode):
  k0 = kw.get("initial_communities")
  kw = {k: v for k, v in kw.items() if k != "initial_communities"}
  scheme = sync.build_scheme(name, 16, num_groups=4, num_nodes=4, worker_times=SPEEDS16, **kw)
  if k0:   # CASP with communities of 4 from the start: each community round has mass 4/16
    scheme = dataclasses.replace(scheme, make_protocol=lambda: sync.CASPProtocol(
        16, max_communities=k0, initial_communities=k0))
  tx = optim.make_sync_chain(_opt_config(mode), scheme.transform, scheme.num_replicas)
  rounds = _rounds_of_pushes(scheme.make_protocol(), SPEEDS16, 16)
  zeros = lambda wp, i: jax.tree.map(jnp.zeros_like, wp)
  state = replay.replay(tx, PARAMS, rounds, zeros, num_replicas=scheme.num_replicas,
                        num_workers=16, extra_args={"learning_rate": np.float32(LR)})
  clock = sync.find_sync_state(state.tx_state).clock
  assert np.asarray(clock).tolist() == [1] * 16   # one push per worker, each applied
  served = _served(scheme, kw, state.replica_params)
  return jax.tree.map(lambda s, p: np.asarray(s / p), served, PARAMS)


@pytest.mark.parametrize("name,kw", SCHEMES16, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items()))
def test_one_epoch_of_zero_gradients_decays_every_scheme_as_bsp(name, kw):
  """The issue's numbers: 16 workers, one push each, SGD lr 0.05, wd 5e-4 -> x (1 - lr wd)."""
  ratio = _one_epoch_of_zero_gradients(name, kw, "progress")
  for r in jax.tree.leaves(ratio):
    np.testing.assert_allclose(r, 1 - LR * WD, rtol=0, atol=1e-6)   # 0.999975


def test_per_step_mode_keeps_the_authors_decay_per_server_step():
  """ASP with per_step: 16 server steps of full decay, (1 - lr wd)^16 = 0.999600; BSP unchanged."""
  for r in jax.tree.leaves(_one_epoch_of_zero_gradients("asp", {}, "per_step")):
    np.testing.assert_allclose(r, (1 - LR * WD) ** 16, rtol=0, atol=1e-6)
    assert abs(float(r.flat[0]) - 0.999600) < 1e-6
  for r in jax.tree.leaves(_one_epoch_of_zero_gradients("bsp", {}, "per_step")):
    np.testing.assert_allclose(r, 1 - LR * WD, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- BSP is unchanged



def _replay(tx, protocol, num_replicas, speeds, max_pushes, targets, message_delay=0.0):
  """Replays ``max_pushes`` pushes and the server messages they set off."""
  rounds = _rounds_of_pushes(protocol, speeds, max_pushes, message_delay)
  return replay.replay(tx, {"x": jnp.ones([2])}, rounds, _quad_grad(targets),
                       num_replicas=num_replicas, num_workers=len(speeds),
                       extra_args={"learning_rate": np.float32(LR)})


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_bsp_progress_decay_is_per_step_decay_bit_for_bit(name):
  """One BSP round has gradient mass 1: both modes give the same weights, momentum included."""
  out = []
  for mode in ("progress", "per_step"):
    tx = optim.make_sync_chain(_opt_config(mode, name, momentum=0.9), sync.bsp(4), 1)
    out.append(_replay(tx, sync.BSPProtocol(4), 1, SPEEDS4, 24, TARGETS4).replica_params)
  np.testing.assert_array_equal(out[0]["x"], out[1]["x"])


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_plain_loop_optimizer_is_the_same_in_both_modes(name):
  """The BSP loop's optimizer (no ``gradient_mass`` arg) decays exactly as before in either mode."""
  params = {"x": jnp.array([1.0, -2.0])}
  results = []
  for mode in ("progress", "per_step"):
    tx = optim.make_optimizer(_opt_config(mode, name, momentum=0.9), 10, 10)
    p, s = params, tx.init(params)
    for i in range(5):
      u, s = tx.update({"x": jnp.array([0.3, -0.1]) * (i + 1)}, s, p)
      p = optax.apply_updates(p, u)
    results.append(p["x"])
  np.testing.assert_array_equal(*results)
  assert not np.allclose(results[0], params["x"])


def test_mass_decay_without_mass_arg_is_optax_add_decayed_weights():
  g, p = {"a": jnp.array([0.1, -3.0])}, {"a": jnp.array([2.0, 7.0])}
  ours, _ = decay.add_mass_decayed_weights(WD).update(g, optax.EmptyState(), p)
  theirs, _ = optax.add_decayed_weights(WD).update(g, optax.EmptyState(), p)
  np.testing.assert_array_equal(ours["a"], theirs["a"])
  halved, _ = decay.add_mass_decayed_weights(WD).update(g, optax.EmptyState(), p,
                                                         gradient_mass=0.5)
  np.testing.assert_allclose(halved["a"], g["a"] + 0.5 * WD * p["a"], rtol=1e-7)
  with pytest.raises(ValueError, match=r"weight_decay=-1.0.*>= 0"):
    decay.add_mass_decayed_weights(-1.0)


# ---------------------------------------------------------------- equivalences with decay


def test_ssp_staleness_zero_equals_bsp_with_decay():
  """SSP(0) applies 4 pushes of mass 1/4 where BSP applies one of mass 1: same decay per clock."""
  runs = {}
  for mode in ("progress", "per_step"):
    cfg = _opt_config(mode)
    bsp = _replay(optim.make_sync_chain(cfg, sync.bsp(4), 1), sync.BSPProtocol(4), 1, SPEEDS4,
                  24, TARGETS4)
    ssp = _replay(optim.make_sync_chain(cfg, sync.ssp(4, 0), 1), sync.SSPProtocol(4, 0), 1,
                  SPEEDS4, 24, TARGETS4)
    runs[mode] = np.abs(np.asarray(ssp.replica_params["x"] - bsp.replica_params["x"])).max()
  # Progress: equal but for the second-order term lr^2 wd g (later pushes decay weights that
  # earlier pushes of the clock moved); per_step: three extra decays per clock, first order.
  assert runs["progress"] < 1e-5, runs
  assert runs["per_step"] > 20 * runs["progress"], runs


def test_gssp_one_group_equals_ssp_with_decay():
  cfg = _opt_config("progress", momentum=0.9)
  gssp = _replay(optim.make_sync_chain(cfg, sync.gssp(4, 1), 1),
                 sync.GSSPProtocol(4, np.zeros([4], np.int32), 2), 1, SPEEDS4, 30, TARGETS4, 0.2)
  ssp = _replay(optim.make_sync_chain(cfg, sync.ssp(4, 2), 1), sync.SSPProtocol(4, 2), 1,
                SPEEDS4, 30, TARGETS4)
  np.testing.assert_allclose(gssp.replica_params["x"], ssp.replica_params["x"], rtol=1e-6)


def test_dssync_one_group_of_everyone_equals_bsp_with_momentum_and_decay():
  cfg = _opt_config("progress", momentum=0.9)
  ds = _replay(optim.make_sync_chain(cfg, sync.dssync(4), 4), sync.DSSyncProtocol(4, 4), 4,
               SPEEDS4, 24, TARGETS4)
  bsp = _replay(optim.make_sync_chain(cfg, sync.bsp(4), 1), sync.BSPProtocol(4), 1, SPEEDS4,
                24, TARGETS4)
  for r in range(4):
    np.testing.assert_allclose(ds.replica_params["x"][r], bsp.replica_params["x"][0], rtol=1e-5)


# HALoS is left out: its transform applies its servers' own Delayed Nesterov, no optimizer.
@pytest.mark.parametrize("name", tuple(s for s in sync.SCHEMES if s != "halos") + ("gssp-global",))
def test_one_worker_equals_plain_sgd_with_momentum_and_decay(name):
  kw = dict(num_groups=1, num_nodes=1, group_size=1, casp_max_communities=1,
            casp_reconfigure_every=3, inhad_threshold=1)
  if name == "gssp-global":
    name, kw["inter_group"] = "gssp", "global"
  scheme = sync.build_scheme(name, 1, **kw)
  cfg = _opt_config("progress", momentum=0.9)
  tx = optim.make_sync_chain(cfg, scheme.transform, scheme.num_replicas)
  state = _replay(tx, scheme.make_protocol(), scheme.num_replicas, [1.0], 15, TARGETS4[:1], 0.3)
  opt = optax.chain(optax.add_decayed_weights(WD), optax.sgd(LR, momentum=0.9))
  x = {"x": jnp.ones([2])}
  opt_state = opt.init(x)
  # InHAD's worker pulls before the server's pull of the aggregate lands, so its gradients
  # are one update late (as in test_sync.py); the in-flight update is drained here.
  delay = 1 if name == "inhad" else 0
  seen = [x] * (delay + 1)
  for _ in range(15):
    g = jax.tree.map(lambda v: v[0], _quad_grad(TARGETS4[:1])({"x": seen[0]["x"][None]}, 0))
    u, opt_state = opt.update(g, opt_state, x)
    x = optax.apply_updates(x, u)
    seen = seen[1:] + [x]
  for r in range(scheme.num_replicas):   # GSSP-global's server too, once the last forward lands
    np.testing.assert_allclose(state.replica_params["x"][r], x["x"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- conformance of the chain


@pytest.mark.parametrize("name", sync.SCHEMES)
def test_progress_chain_conformance(name, tmp_path):
  """Jits once, keeps shapes under scan, finds the sync state, round-trips through Orbax."""
  kw = dict(num_groups=2, num_nodes=2, casp_reconfigure_every=4, casp_max_communities=2,
            inter_group="global" if name == "gssp" else "peer")
  scheme = sync.build_scheme(name, 4, worker_times=SPEEDS4, **kw)
  tx = optim.make_sync_chain(_opt_config("progress", momentum=0.9), scheme.transform,
                             scheme.num_replicas)
  rounds = sync.run_timeline(scheme.make_protocol(), lambda w, k: SPEEDS4[w], max_pushes=32,
                             message_delay=lambda m: 0.4).rounds[:8]
  grads = [jax.tree.map(lambda p: jax.random.normal(jax.random.key(i), (4, *p.shape)), PARAMS)
           for i in range(len(rounds))]
  params0 = sync.transforms.stack(PARAMS, scheme.num_replicas)
  state0 = tx.init(PARAMS)
  traces = []

  @jax.jit
  def step(carry, xs):
    traces.append(1)
    params, state = carry
    g, args = xs
    updates, state = tx.update(g, state, params, **args, learning_rate=LR)
    return (optax.apply_updates(params, updates), state), None

  carry = (params0, state0)
  for g, rnd in zip(grads, rounds):
    carry, _ = step(carry, (g, rounds_lib.round_args(rnd)))
  assert len(traces) == 1
  stacked = {k: v for k, v in rounds_lib.stack_rounds(rounds).items() if k != "time"}
  (params, state), _ = jax.lax.scan(step, (params0, state0),
                                    (jax.tree.map(lambda *g: jnp.stack(g), *grads), stacked))
  spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  assert spec(state) == spec(state0) and spec(params) == spec(params0)
  np.testing.assert_allclose(params["w"], carry[0]["w"], rtol=1e-5, atol=1e-6)
  sync_state = sync.find_sync_state(state)
  assert sync.staleness(sync_state).shape == (4,)
  assert sync.versions(sync_state).shape == (scheme.num_replicas,)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "state", state)
  ckptr.wait_until_finished()
  restored = ckptr.restore(tmp_path / "state", state0)
  jax.tree.map(np.testing.assert_array_equal, restored, state)


# ---------------------------------------------------------------- config


def test_weight_decay_mode_is_validated():
  config = config_lib.default_config()
  assert config.optimizer.weight_decay_mode == "progress"
  assert defaults.WEIGHT_DECAY_MODES == optim.WEIGHT_DECAY_MODES
  config.optimizer.weight_decay_mode = "per_step"
  config_lib.validate_config(config)
  config.optimizer.weight_decay_mode = "per_epoch"
  with pytest.raises(ValueError,
                     match="config.optimizer.weight_decay_mode='per_epoch'.*progress, per_step"):
    config_lib.validate_config(config)
  # Not silently ignored where the config is not validated first (the BSP loop's optimizer).
  with pytest.raises(ValueError, match="weight_decay_mode='per_epoch'.*progress, per_step"):
    optim.make_optimizer(config.optimizer, 10, 10)
