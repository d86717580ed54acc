"""Sync schemes: transform conformance, equivalences, two-worker golden values, protocols, bad args."""

import ast
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from gssp_jax import compress
from gssp_jax import sync
from gssp_jax.sync import replay
from gssp_jax.sync import rounds as rounds_lib

SPEEDS4 = [1.0, 1.37, 1.91, 2.53]   # no two workers push at the same instant early on
KW4 = dict(num_groups=2, num_nodes=2, casp_reconfigure_every=4, casp_max_communities=2)
PARAMS = {"w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 10, "b": jnp.ones([2])}


def _scheme(name, num_workers=4, speeds=SPEEDS4, **kw):
  kw = {**KW4, **kw} if num_workers == 4 else kw
  return sync.build_scheme(name, num_workers, worker_times=speeds, **kw)


def _timeline(protocol, speeds, max_pushes, message_delay=0.0):
  return sync.run_timeline(protocol, lambda w, k: speeds[w], max_pushes=max_pushes,
                           message_delay=lambda m: message_delay)


def _worker_grads(seed):
  key = jax.random.key(seed)
  return jax.tree.map(lambda p: jax.random.normal(key, (4, *p.shape)), PARAMS)


def _replica_params(num_replicas):
  return jax.tree.map(lambda p: jnp.broadcast_to(p, (num_replicas, *p.shape)), PARAMS)


def _close(a, b, tol=1e-5):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol,
                                                       atol=tol), a, b)


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("name", sync.SCHEMES)
class TestConformance:
  """Every scheme's transform, chained with a compressor and a momentum optimizer."""

  def _setup(self, name):
    scheme = _scheme(name)
    opt = None if scheme.own_optimizer else optax.sgd(0.1, momentum=0.9)
    tx = scheme.chain(opt, compress.topk(4, 0.5))
    rounds = _timeline(scheme.make_protocol(), SPEEDS4, 32, message_delay=0.4).rounds[:6]
    assert rounds, name
    return scheme, tx, rounds

  def test_ignores_unknown_extra_args(self, name):
    scheme, tx, rounds = self._setup(name)
    state = tx.init(PARAMS)
    params = _replica_params(scheme.num_replicas)
    args = rounds_lib.round_args(rounds[0])
    _equal(tx.update(_worker_grads(0), state, params, **args),
           tx.update(_worker_grads(0), state, params, **args, not_a_field=3, other=None))

  def test_jit_without_recompilation(self, name):
    scheme, tx, rounds = self._setup(name)
    traces = []

    @jax.jit
    def update(grads, state, params, args):
      traces.append(1)
      return tx.update(grads, state, params, **args)
    state = tx.init(PARAMS)
    params = _replica_params(scheme.num_replicas)
    for i, rnd in enumerate(rounds[:3]):
      updates, state = update(_worker_grads(i), state, params, rounds_lib.round_args(rnd))
    assert len(traces) == 1
    # Jitted equals eager.
    eager = tx.update(_worker_grads(9), state, params, **rounds_lib.round_args(rounds[-1]))
    _close(update(_worker_grads(9), state, params, rounds_lib.round_args(rounds[-1])), eager)

  def test_stable_dtypes_and_shapes_under_scan(self, name):
    scheme, tx, rounds = self._setup(name)
    state0 = tx.init(PARAMS)
    params0 = _replica_params(scheme.num_replicas)
    stacked = {k: v for k, v in rounds_lib.stack_rounds(rounds).items() if k != "time"}
    grads = jax.tree.map(lambda *g: jnp.stack(g), *[_worker_grads(i) for i in range(len(rounds))])

    def body(carry, xs):
      params, state = carry
      g, args = xs
      updates, state = tx.update(g, state, params, **args)
      return (optax.apply_updates(params, updates), state), None
    (params, state), _ = jax.lax.scan(body, (params0, state0), (grads, stacked))
    spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    assert spec(state) == spec(state0)
    assert spec(params) == spec(params0)
    # The scan agrees with a host loop of the same rounds.
    p, s = params0, state0
    for i, rnd in enumerate(rounds):
      u, s = tx.update(_worker_grads(i), s, p, **rounds_lib.round_args(rnd))
      p = optax.apply_updates(p, u)
    _close(params, p)
    _equal(sync.find_sync_state(state).version, sync.find_sync_state(s).version)

  def test_orbax_round_trip(self, name, tmp_path):
    scheme, tx, rounds = self._setup(name)
    params = _replica_params(scheme.num_replicas)
    _, state = tx.update(_worker_grads(0), tx.init(PARAMS), params,
                         **rounds_lib.round_args(rounds[0]))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "state", state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "state", tx.init(PARAMS))
    _equal(restored, state)
    args = rounds_lib.round_args(rounds[1])
    _equal(tx.update(_worker_grads(1), restored, params, **args),
           tx.update(_worker_grads(1), state, params, **args))

  def test_state_has_explicit_staleness(self, name):
    scheme, tx, rounds = self._setup(name)
    state = sync.find_sync_state(tx.init(PARAMS))
    assert sync.staleness(state).shape == (4,) and sync.staleness(state).dtype == jnp.int32
    assert sync.clocks(state).dtype == jnp.int32
    assert sync.versions(state).shape == (scheme.num_replicas,)


# ---------------------------------------------------------------- equivalences

A = jnp.array([[2.0, 0.5], [0.5, 1.0]])
TARGETS4 = jnp.array([[1.0, -1.0], [2.0, 0.0], [0.0, 3.0], [-1.0, 1.0]])


def _quad_grad(targets):
  """Worker w minimises 0.5 * |A x - t_w|^2; its gradient is A^T (A x - t_w)."""
  def grad_fn(worker_params, index):
    del index
    x = worker_params["x"]
    return {"x": jnp.einsum("ji,wj->wi", A, jnp.einsum("ij,wj->wi", A, x) - targets)}
  return grad_fn


def _run(scheme_tx, protocol, num_replicas, speeds, max_pushes, targets, opt, message_delay=0.0):
  tl = _timeline(protocol, speeds, max_pushes, message_delay)
  tx = optax.chain(scheme_tx, sync.replicated(opt, num_replicas))
  state = replay.replay(tx, {"x": jnp.zeros([2])}, tl.rounds, _quad_grad(targets),
                        num_replicas=num_replicas, num_workers=len(speeds))
  return tl, state


def test_ssp_staleness_zero_equals_bsp_protocol_level():
  """Staggered pushes, SGD: SSP(0) applies each push separately yet ends where BSP does."""
  opt = optax.sgd(0.05)
  _, bsp = _run(sync.bsp(4), sync.BSPProtocol(4), 1, SPEEDS4, 24, TARGETS4, opt)
  tl, ssp = _run(sync.ssp(4, 0), sync.SSPProtocol(4, 0), 1, SPEEDS4, 24, TARGETS4, opt)
  assert len(tl.rounds) == 24   # one round per push, not one per clock
  _close(ssp.replica_params, bsp.replica_params)


def test_ssp_staleness_zero_equals_bsp_transform_level_with_momentum():
  """When a round carries every worker's push, SSP's transform is BSP's, momentum included."""
  opt = optax.sgd(0.05, momentum=0.9)
  tl = _timeline(sync.BSPProtocol(4), SPEEDS4, 20)
  results = []
  for tx in (sync.bsp(4), sync.ssp(4, 0)):
    chain = optax.chain(tx, sync.replicated(opt, 1))
    results.append(replay.replay(chain, {"x": jnp.zeros([2])}, tl.rounds, _quad_grad(TARGETS4),
                                 num_replicas=1, num_workers=4).replica_params)
  _equal(*results)


@pytest.mark.parametrize("name", [s for s in sync.SCHEMES if s != "halos"])   # own optimizers
def test_one_worker_equals_plain_optimizer(name):
  opt = optax.sgd(0.1, momentum=0.9)
  kw = dict(num_groups=1, num_nodes=1, group_size=1, casp_max_communities=1,
            casp_reconfigure_every=3, inhad_threshold=1)
  scheme = sync.build_scheme(name, 1, **kw)
  target = TARGETS4[:1]
  _, state = _run(scheme.transform, scheme.make_protocol(), scheme.num_replicas, [1.0], 15,
                  target, opt, message_delay=0.3)
  x, opt_state = {"x": jnp.zeros([2])}, opt.init({"x": jnp.zeros([2])})
  # InHAD's worker pulls right after its iteration number reaches the server, before the
  # server's pull of the aggregate lands: its gradients are one update late (and the 15th
  # update is still in flight after the 15th push).
  delay = 1 if name == "inhad" else 0
  seen = [x] * (delay + 1)
  for _ in range(15 - delay):
    g = jax.tree.map(lambda v: v[0], _quad_grad(target)({"x": seen[0]["x"][None]}, 0))
    u, opt_state = opt.update(g, opt_state, x)
    x = optax.apply_updates(x, u)
    seen = seen[1:] + [x]
  for r in range(scheme.num_replicas):   # GSSP-global's server holds the same weights
    _close(jax.tree.map(lambda v: v[r], state.replica_params), x)


@pytest.mark.parametrize("inter_group", ["peer"])
def test_gssp_one_group_equals_ssp(inter_group):
  opt = optax.sgd(0.05, momentum=0.9)
  groups = np.zeros([4], np.int32)
  tl_g, gssp = _run(sync.gssp(4, 1, inter_group=inter_group),
                    sync.GSSPProtocol(4, groups, 2, inter_group=inter_group), 1, SPEEDS4, 30,
                    TARGETS4, opt, message_delay=0.2)
  tl_s, ssp = _run(sync.ssp(4, 2), sync.SSPProtocol(4, 2), 1, SPEEDS4, 30, TARGETS4, opt)
  _close(gssp.replica_params, ssp.replica_params)
  assert [p[:2] for p in tl_g.pushes] == [p[:2] for p in tl_s.pushes]
  _equal(sync.find_sync_state(gssp.tx_state).staleness, sync.find_sync_state(ssp.tx_state).staleness)


def test_gssp_one_worker_per_group_no_delay_is_asp():
  """Each push is applied at its group server and, with no delay, at every other one next."""
  opt = optax.sgd(0.05, momentum=0.9)
  runs = {}
  for name, tx, protocol, num_replicas in [
      ("gssp", sync.gssp(4, 4), sync.GSSPProtocol(4, np.arange(4), 0), 4),
      ("asp", sync.asp(4), sync.ASPProtocol(4), 1)]:
    tl = _timeline(protocol, SPEEDS4, 30)
    seen = []
    chain = optax.chain(tx, sync.replicated(opt, num_replicas))
    replay.replay(chain, {"x": jnp.zeros([2])}, tl.rounds, _quad_grad(TARGETS4),
                  num_replicas=num_replicas, num_workers=4,
                  on_round=lambda i, s: seen.append(np.asarray(s.replica_params["x"])))
    runs[name] = (tl, seen)
  (tl_g, gssp), (tl_a, asp) = runs["gssp"], runs["asp"]
  assert [p[:2] for p in tl_g.pushes] == [p[:2] for p in tl_a.pushes]
  # GSSP's rounds come in pairs: the push at its group, then the zero-delay delivery to
  # the others. After each delivery every group server holds ASP's weights.
  assert len(gssp) == 2 * len(asp) - 1   # the last push's delivery is still queued
  for i, x_asp in enumerate(asp[:-1]):
    assert tl_g.rounds[2 * i + 1].deliver.any()
    np.testing.assert_allclose(gssp[2 * i + 1], np.broadcast_to(x_asp, (4, 2)), rtol=1e-5,
                               atol=1e-6)


def test_topk_keeping_everything_is_identity_in_front_of_gssp():
  scheme = _scheme("gssp")
  rounds = _timeline(scheme.make_protocol(), SPEEDS4, 10, 0.3).rounds
  params = _replica_params(scheme.num_replicas)
  outs = []
  for chain in (scheme.chain(optax.sgd(0.1, momentum=0.9)),
                scheme.chain(optax.sgd(0.1, momentum=0.9), compress.topk(4, 1.0))):
    state, p = chain.init(PARAMS), params
    for i, rnd in enumerate(rounds):
      u, state = chain.update(_worker_grads(i), state, p, **rounds_lib.round_args(rnd))
      p = optax.apply_updates(p, u)
    outs.append(p)
  _equal(*outs)


def test_gssp_forwards_conserve_gradient_mass():
  """Whatever is in flight, pending + outbox + delivered = everything pushed (scaled)."""
  scheme = _scheme("gssp")
  tx = scheme.transform
  state = tx.init(PARAMS)
  rounds = _timeline(scheme.make_protocol(), SPEEDS4, 14, 0.7).rounds
  pushed = jax.tree.map(jnp.zeros_like, PARAMS)
  delivered = jax.tree.map(jnp.zeros_like, PARAMS)
  for i, rnd in enumerate(rounds):
    g = _worker_grads(i)
    args = rounds_lib.round_args(rnd)
    outbox = state.outbox
    _, state = tx.update(g, state, None, **args)
    arrived = jnp.asarray(rnd.arrived)
    pushed = jax.tree.map(lambda s, x: s + jnp.tensordot(arrived.astype(jnp.float32), x, 1) / 4,
                          pushed, g)
    delivered = jax.tree.map(lambda d, o: d + (o * jnp.asarray(rnd.deliver)
                                               .reshape((-1,) + (1,) * (o.ndim - 1))).sum(0),
                             delivered, outbox)
  total = jax.tree.map(lambda p, o, d: p.sum(0) + o.sum(0) + d, state.pending, state.outbox,
                       delivered)
  _close(total, pushed)
  assert any(r.deliver.any() for r in rounds)


@pytest.mark.parametrize("inter_group", ["peer", "global"])
def test_gssp_listed_rows_equal_the_masks_bit_for_bit(inter_group):
  """The level executor's GSSP round (``no_branches`` with the arrival's id: pending and
  outbox rows of the one exchanging group) gives the mask path's updates and state exactly,
  over a real timeline with forwards, deliveries (and, global, adopts)."""
  scheme = _scheme("gssp", inter_group=inter_group)
  protocol = scheme.make_protocol()
  assert protocol.one_exchange_per_round
  tx = scheme.transform
  rounds = _timeline(protocol, SPEEDS4, 24, 0.7).rounds
  assert any(r.deliver.any() for r in rounds) and any(r.forward.any() for r in rounds)
  masks = listed = tx.init(PARAMS)
  for i, rnd in enumerate(rounds):
    g = _worker_grads(i)
    args = {**rounds_lib.round_args(rnd), "no_branches": True}
    assert np.count_nonzero(rnd.forward | rnd.deliver) <= 1
    arrived = np.flatnonzero(rnd.arrived)
    ids = np.asarray(arrived.tolist() or [4], np.int32)     # padding: past W
    want, masks = tx.update(g, masks, None, **args)
    got, listed = tx.update(g, listed, None, worker_ids=ids, **args)
    _equal(got, want)
    _equal(listed, masks)


def test_level_planner_rejects_a_round_with_two_exchanging_groups():
  from gssp_jax.sim import chunk, planner as planner_lib  # pylint: disable=g-import-not-at-top
  shape = chunk.Shape(pieces=2, jobs=4, rounds=4, arrivals=1, pulls=4, replicas=2)
  plan = planner_lib.Planner(shape, num_workers=4, num_replicas=2, num_groups=2, job_shape=(2,),
                             local=False,
                             route=np.array([0, 0, 1, 1]), one_exchange=True,
                             round_fields=("forward", "deliver", "adopt", "stats_mean"))
  rnd = rounds_lib.empty_round(1.5, 4, 2, 2, np.array([0, 0, 1, 1]),
                               writable=("forward", "deliver"))
  rnd.forward[0] = rnd.deliver[1] = True
  plan.add_round(rnd, 0.1)   # checked as its chunk's rows are written, before any runs
  with pytest.raises(ValueError, match=r"exchanges groups \[0, 1\].*one_exchange_per_round"):
    plan.flush()
  assert not plan.take()


def test_dssync_one_group_of_everyone_equals_bsp_with_momentum():
  opt = optax.sgd(0.05, momentum=0.9)
  _, ds = _run(sync.dssync(4), sync.DSSyncProtocol(4, 4), 4, SPEEDS4, 24, TARGETS4, opt)
  _, bsp = _run(sync.bsp(4), sync.BSPProtocol(4), 1, SPEEDS4, 24, TARGETS4, opt)
  for r in range(4):
    _close(jax.tree.map(lambda v: v[r], ds.replica_params),
           jax.tree.map(lambda v: v[0], bsp.replica_params))


def test_gssp_with_gdtopk_from_config_trains_lenet_rounds():
  """``sync.scheme=gssp`` + ``compress.name=gdtopk`` from a config, on LeNet-5 gradients."""
  from gssp_jax import config as config_lib
  from gssp_jax import models
  from gssp_jax.train import loop
  config = config_lib.default_config()
  config.num_workers, config.sync.scheme, config.compress.name = 8, "gssp", "gdtopk"
  config.sync.num_groups, config.sync.staleness = 2, 1
  config_lib.validate_config(config)
  speeds = np.array([3.0, 1.0, 3.0, 1.0, 1.0, 3.0, 1.0, 3.0])
  scheme = sync.scheme_from_config(config, worker_times=speeds)
  assert scheme.groups.tolist() == [1, 0, 1, 0, 0, 1, 0, 1]   # grouped by speed, 0 fastest
  ranks = sync.grouping.group_speed_rank(scheme.groups, speeds)
  ratios = compress.worker_ratios(compress.gdtopk_group_ratios(3, ranks), scheme.groups)
  tx = scheme.chain(optax.sgd(0.05, momentum=0.9), loop.make_compressor(config))
  model = models.create_model("lenet5", num_classes=10)
  images = jax.random.normal(jax.random.key(0), (8, 4, 32, 32, 1))
  labels = jax.random.randint(jax.random.key(1), (8, 4), 0, 10)
  params = model.init(jax.random.key(2), images[0])["params"]

  def grad_fn(worker_params, index):
    def loss(p, x, y):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return jax.vmap(jax.grad(loss))(worker_params, images, labels)
  tl = sync.run_timeline(scheme.make_protocol(), lambda w, k: speeds[w], max_pushes=24,
                         message_delay=lambda m: 0.5)
  bytes_seen = []
  state = replay.replay(tx, params, tl.rounds, grad_fn, num_replicas=scheme.num_replicas,
                        num_workers=8, extra_args={"ratios": ratios},
                        on_round=lambda i, s: bytes_seen.append(
                            np.asarray(compress.push_bytes(s.tx_state[0]))))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.replica_params))
  pushed = np.max(np.stack(bytes_seen), axis=0)
  # The slow group sends a denser (so larger) payload than the fast group.
  assert pushed[speeds == 3.0].min() > pushed[speeds == 1.0].max() > 0
  assert int(sync.find_sync_state(state.tx_state).clock.sum()) == 24


# ---------------------------------------------------------------- golden values
# Two workers, scalar x, worker w minimises 0.5 (x - c_w)^2 with c = (1, 3), so
# its gradient is x_read - c_w. Every gradient is scaled by 1/W = 1/2 and plain
# SGD has lr 0.5, so an applied gradient g moves x by -g/4. Worker 0 takes 1 s
# per iteration, worker 1 takes 2 s; at equal times the event scheduled first
# (worker 1's push, scheduled at t=0) goes first. Server messages take 0.5 s.

C2 = jnp.array([1.0, 3.0])


def _golden(tx, protocol, num_replicas, max_pushes):
  tl = _timeline(protocol, [1.0, 2.0], max_pushes, message_delay=0.5)
  seen = []
  chain = optax.chain(tx, sync.replicated(optax.sgd(0.5), num_replicas))
  replay.replay(chain, {"x": jnp.zeros([])}, tl.rounds, lambda wp, i: {"x": wp["x"] - C2},
                num_replicas=num_replicas, num_workers=2,
                on_round=lambda i, s: seen.append(np.asarray(s.replica_params["x"]).tolist()))
  return tl, seen


def test_golden_bsp():
  # t=2: both read 0: g = (-1, -3), x = 0 + (1 + 3)/4 = 1.
  # t=4: g = (0, -2), x = 1 + 2/4 = 1.5.   t=6: g = (0.5, -1.5), x = 1.5 + 1/4 = 1.75.
  _, xs = _golden(sync.bsp(2), sync.BSPProtocol(2), 1, 6)
  assert xs == [[1.0], [1.5], [1.75]]


def test_golden_asp():
  # t=1 w0 on 0: g=-1, x=0.25.  t=2 w1 on 0: g=-3, x=1.0.  t=2 w0 on 0.25: g=-0.75,
  # x=1.1875.  t=3 w0 on 1.1875: g=0.1875, x=1.140625.  t=4 w1 on 1.0: g=-2, x=1.640625.
  # t=4 w0 on 1.140625: g=0.140625, x=1.60546875.
  tl, xs = _golden(sync.asp(2), sync.ASPProtocol(2), 1, 6)
  assert xs == [[0.25], [1.0], [1.1875], [1.140625], [1.640625], [1.60546875]]
  assert tl.blocked_time.tolist() == [0.0, 0.0]


def test_golden_ssp():
  # SSP(1) as ASP until t=3: w0 has pushed 3, w1 1 -> w0 is 2 ahead and waits
  # (x=1.140625, w0 does not pull). t=4 w1 on 1.0: g=-2, x=1.640625; w0 is released
  # and pulls it. t=5 w0 on 1.640625: g=0.640625, x=1.48046875; w0 is 2 ahead again.
  tl, xs = _golden(sync.ssp(2, 1), sync.SSPProtocol(2, 1), 1, 6)
  assert xs == [[0.25], [1.0], [1.1875], [1.140625], [1.640625], [1.48046875]]
  assert [np.flatnonzero(r.pulls).tolist() for r in tl.rounds] == [[0], [1], [0], [], [0, 1], []]
  assert tl.blocked_time.tolist() == [1.0, 0.0]


def test_golden_dssp():
  # DSSP([2, 4]) runs as ASP to t=4 (w0 at most 2 ahead): x as in test_golden_asp.
  # t=5: w0 is 3 ahead, the fastest, no credit: the controller decides. w0's pushes at 4
  # and 5 give I_f = 1, w1's at 2 and 4 give I_s = 2; w0's simulated pushes 5, 6, 7
  # (r_max = 2), w1's 6, 8, 10: 6 is closest, r = 1 (this go-ahead; no credit left).
  # w0 on 1.60546875: g=0.60546875, x=1.4541015625.
  # t=6 w1 on 1.640625: g=-1.359375, x=1.7939453125; w0 on 1.4541015625:
  # g=0.4541015625, x=1.680419921875. w0 is 3 ahead again: w0's 6, 7, 8, w1's 8, 10:
  # r = 2, so w0 goes on with one credit. t=7: w0 on 1.680419921875:
  # g=0.680419921875, x=1.51031494140625; w0 is 4 ahead and spends its credit: no
  # decision. t=8: w1 pushes (w0 still 3 ahead); w0 is 4 ahead, no credit: the cap
  # s_U - 4 + 1 = 1 leaves w0's 8, 9 against w1's 10, 12: r = 1. t=9: w0 is 5 ahead,
  # the cap is 0: r = 0, w0 waits until it is within s_L = 2 again: w1's pushes at 10
  # (w0 4 ahead) and 12 (3 ahead) do not release it, the one at 14 (2 ahead) does.
  protocol = sync.DSSPProtocol(2, (2, 4))
  tl, xs = _golden(sync.dssp(2, (2, 4)), protocol, 1, 16)
  assert xs[:10] == [[0.25], [1.0], [1.1875], [1.140625], [1.640625], [1.60546875],
                     [1.4541015625], [1.7939453125], [1.680419921875], [1.51031494140625]]
  assert protocol.thresholds == [(5.0, 0, 1), (6.0, 0, 2), (8.0, 0, 1), (9.0, 0, 0)]
  assert [np.flatnonzero(r.pulls).tolist() for r in tl.rounds[6:]] == [
      [0], [1], [0], [0], [1], [0], [], [1], [1], [0, 1]]   # granted at 5, 6, 7, 8
  assert tl.blocked_time.tolist() == [5.0, 0.0]


def _dssp_at(clock, last, prev, staleness_range=(1, 6)):
  """A DSSP server with the given clocks and last two push times per worker."""
  protocol = sync.DSSPProtocol(len(clock), staleness_range)
  protocol.clock[:], protocol.last[:], protocol.prev[:] = clock, last, prev
  return protocol


def test_dssp_credit_is_spent_without_checks_then_the_controller_decides_again():
  # Hand-computed: 3 workers, s=(1, 6), r_max = 5. w2 (slowest) pushed at 1 and 5
  # (I_s = 4); w0 (fastest) at 4 and 5 (I_f = 1). w0 pushes at 6 and is 4 - 1 = 3 ahead:
  # the cap is min(5, 6 - 3 + 1) = 4, w0's simulated pushes 6, 7, 8, 9, 10, w2's 9, 13:
  # 9 is hit exactly, r = 3. This go-ahead is one of them: credit 2.
  protocol = _dssp_at([3, 2, 1], [5.0, 5.5, 5.0], [4.0, 3.0, 1.0])
  assert protocol.on_push(0, 6.0).release == [0]
  assert protocol.thresholds == [(6.0, 0, 3)]
  assert protocol.credit.tolist() == [2, 0, 0]
  # Two more pushes (4 and 5 ahead) go on with no check and no decision: credit spent.
  assert protocol.on_push(0, 7.0).release == [0]
  assert protocol.on_push(0, 8.0).release == [0]
  assert protocol.credit.tolist() == [0, 0, 0]
  assert len(protocol.thresholds) == 1
  # The next push (6 ahead) meets the controller again: the cap 6 - 6 + 1 = 1 leaves
  # w0's 9, 10 against w2's 9, 13: r = 0, w0 waits.
  assert protocol.on_push(0, 9.0).release == []
  assert protocol.thresholds == [(6.0, 0, 3), (9.0, 0, 0)]
  # A waiting worker neither spends credit nor meets the controller; it waits until it
  # is within s_L = 1 of the slowest: w2 and w1 push in turn from clocks 1 and 2, and
  # only w2's fifth push (min clock 6, w0 at 7) releases w0.
  released = [protocol.on_push(w, 9.5 + k).release for k in range(5) for w in (2, 1)]
  assert released == [[2], [1]] * 4 + [[0, 2], [1]]
  assert protocol.clock.tolist() == [7, 7, 6]
  assert len(protocol.thresholds) == 2


def test_dssp_controller_picks_the_push_closest_to_any_of_the_slowest_ones():
  # Hand-computed: 3 workers, s=(1, 6). w2 (slowest) pushed at 7.875 and 9.25
  # (I_s = 1.375): its simulated pushes are 10.625, 12, 13.375. w0 (fastest) pushed at 9
  # and 10 (I_f = 1) and is 3 ahead: its simulated pushes 10, 11, 12, 13, 14 (cap 4).
  # Nearest to w2's next push (10.625) is r = 1 (0.375 away); nearest to any is w2's
  # second push, hit exactly at r = 2.
  protocol = _dssp_at([3, 2, 1], [9.0, 9.5, 9.25], [8.0, 8.5, 7.875])
  protocol.clock[0] += 1            # as after w0's push at 10
  protocol.prev[0], protocol.last[0] = 9.0, 10.0
  assert protocol.extra_iterations(0, 10.0) == 2
  protocol = _dssp_at([3, 2, 1], [9.0, 9.5, 9.25], [8.0, 8.5, 7.875])
  assert protocol.on_push(0, 10.0).release == [0]
  assert protocol.thresholds == [(10.0, 0, 2)]
  assert protocol.credit.tolist() == [1, 0, 0]
  # Ties go to the smaller r: w2 pushed at 8 and 9.5, so its simulated pushes are 11,
  # 12.5, 14, 15.5; w0's 10..14 hit 11 (r = 1) and 14 (r = 4) exactly: r = 1.
  protocol = _dssp_at([3, 2, 1], [9.0, 9.5, 9.5], [8.0, 8.5, 8.0])
  assert protocol.on_push(0, 10.0).release == [0]
  assert protocol.thresholds == [(10.0, 0, 1)]
  assert protocol.credit.tolist() == [0, 0, 0]
  # The slowest's next push is now: r = 0, w0 waits; that push leaves w0 2 > s_L ahead
  # (w1 is at 2 too), so w0 keeps waiting.
  protocol = _dssp_at([3, 2, 1], [9.0, 9.5, 7.0], [8.0, 8.5, 4.0])
  assert protocol.on_push(0, 10.0).release == []
  assert protocol.thresholds == [(10.0, 0, 0)]
  assert protocol.on_push(2, 10.0).release == [2]         # w0 is still 2 > 1 ahead
  # No history for the slowest: r = 0 (SSP(s_L)).
  protocol = _dssp_at([3, 2, 1], [9.0, 9.5, 7.0], [8.0, 8.5, np.nan])
  assert protocol.extra_iterations(0, 10.0) is None
  assert protocol.on_push(0, 10.0).release == []
  assert protocol.thresholds == [(10.0, 0, 0)]


def _controller_by_definition(protocol, worker, time):
  """Algorithm 2 as written: every candidate against every simulated push of the slowest."""
  alive = np.flatnonzero(protocol.alive)
  slow = int(alive[np.argmin(protocol.clock[alive])])
  i_fast = protocol.last[worker] - protocol.prev[worker]
  i_slow = protocol.last[slow] - protocol.prev[slow]
  if not (np.isfinite(i_fast) and np.isfinite(i_slow)) or i_fast <= 0 or i_slow <= 0:
    return None
  ahead = int(protocol.clock[worker] - protocol.clock[alive].min())
  r_cap = max(0, min(protocol.high - protocol.low, protocol.high - ahead + 1))
  fast = time + np.arange(r_cap + 1) * i_fast
  num_slow = max(1, int(np.ceil((fast[-1] - protocol.last[slow]) / i_slow)) + 1)
  slow_pushes = protocol.last[slow] + np.arange(1, num_slow + 1) * i_slow
  return int(np.argmin(np.abs(fast[:, None] - slow_pushes[None, :]).min(axis=1)))


def test_dssp_controller_equals_its_definition_on_random_and_regular_clusters():
  """The controller searches only the slowest's two pushes around each candidate; the answer
  must be the definition's, ties included (regular intervals make exact ties)."""
  rng = np.random.default_rng(0)
  for case in range(3000):
    protocol = sync.DSSPProtocol(16, (3, 15))
    protocol.clock[:] = rng.integers(10, 20, 16)
    w = int(rng.integers(16))
    protocol.clock[w] = 10 + int(rng.integers(3, 20))
    if case % 3 == 0:   # regular tiers: exact ties between candidates
      protocol.last[:] = 1.0 + rng.integers(0, 8, 16) * 0.005
      protocol.prev[:] = protocol.last - 0.01 * np.repeat([1.0, 1.5, 2.0, 3.0], 4)
    else:   # intervals within 5x of each other: the definition's [r, K] array stays small
      scale = rng.choice([0.01, 1.0, 100.0])
      protocol.last[:] = 1.0 + rng.random(16) * 3 * scale
      protocol.prev[:] = protocol.last - rng.uniform(0.2, 1.0, 16) * scale
    if case % 11 == 0:
      protocol.alive[rng.integers(16)] = False
      protocol.alive[w] = True
    time = float(protocol.last[w])
    assert protocol.extra_iterations(w, time) == _controller_by_definition(protocol, w, time), case


def test_dssp_re_decides_under_persistent_heterogeneity():
  # Speeds 1 s and 3 s, s=(3, 15): the fastest is never back within s_L. Its credit runs
  # out and the controller decides again, many times, with the newest timestamps.
  speeds = [1.0, 3.0]
  dssp = sync.DSSPProtocol(2, (3, 15))
  tl_dssp = sync.run_timeline(dssp, lambda w, k: speeds[w], max_pushes=400)
  tl_ssp = sync.run_timeline(sync.SSPProtocol(2, 3), lambda w, k: speeds[w], max_pushes=400)
  decisions = [r for _, w, r in dssp.thresholds if w == 0]
  assert len(decisions) > 50
  assert len(set(decisions)) >= 3                      # several distinct decisions over time
  assert all(0 <= r <= 15 - 3 for r in decisions)
  assert [w for _, w, _ in dssp.thresholds] == [0] * len(decisions)   # only the fastest
  assert tl_dssp.blocked_time[0] < tl_ssp.blocked_time[0]
  assert tl_dssp.end_time < tl_ssp.end_time


def test_golden_gssp_peer():
  # One worker per group (s=0 never binds), forward every push, delivered 0.5 s later.
  # t=1 w0 on 0: g=-1, x0=0.25.  t=1.5 g0's sum -0.5 reaches group 1: x1=0.25.
  # t=2 w1 on 0: g=-3, x1=1.0;  w0 on 0.25: g=-0.75, x0=0.4375.
  # t=2.5 deliveries: x0=0.4375+0.75=1.1875 (w1's), x1=1.0+0.1875=1.1875 (w0's).
  tl, xs = _golden(sync.gssp(2, 2), sync.GSSPProtocol(2, [0, 1], 0), 2, 4)
  assert xs[:6] == [[0.25, 0.0], [0.25, 0.25], [0.25, 1.0], [0.4375, 1.0], [1.1875, 1.0],
                    [1.1875, 1.1875]]


def test_golden_gssp_global():
  # Replicas (group 0, group 1, global, reply slot 0, reply slot 1). A group server
  # waits for the global server's reply: pushes and pulls at it wait meanwhile.
  # t=1 w0: x0=0.25, forward (w0 waits for the reply). t=1.5 global applies it:
  # xg=0.25, kept in slot 0 and sent back.  t=2 w1 on 0: x1=0.75, forward; then
  # group 0 adopts slot 0 (0.25) and w0 pulls it.  t=2.5 global applies w1's -1.5:
  # xg=1.0 = slot 1.  t=3 w0 on 0.25: g=-0.75, x0=0.4375, forward; group 1 adopts
  # 1.0, w1 pulls.  t=3.5 global applies w0's -0.375: xg=1.1875 = slot 0, adopted at t=4.
  tl, xs = _golden(sync.gssp(2, 2, inter_group="global"),
                   sync.GSSPProtocol(2, [0, 1], 3, inter_group="global"), 5, 4)
  assert xs[:9] == [[0.25, 0.0, 0.0, 0.0, 0.0], [0.25, 0.0, 0.25, 0.25, 0.0],
                    [0.25, 0.75, 0.25, 0.25, 0.0], [0.25, 0.75, 0.25, 0.25, 0.0],
                    [0.25, 0.75, 1.0, 0.25, 1.0], [0.4375, 0.75, 1.0, 0.25, 1.0],
                    [0.4375, 1.0, 1.0, 0.25, 1.0], [0.4375, 1.0, 1.1875, 1.1875, 1.0],
                    [1.1875, 1.0, 1.1875, 1.1875, 1.0]]
  assert [np.flatnonzero(r.pulls).tolist() for r in tl.rounds[:9]] == [
      [], [], [], [0], [], [], [1], [], [0]]
  assert tl.blocked_time.tolist() == [2.0, 1.0]   # each waited for its group's round trip


def test_golden_inhad():
  # One node, threshold 3 iteration numbers; the server's pull of the aggregates takes
  # 0.5 s. t=1 w0 on 0: g=-1; t=2 w1 on 0: g=-3; t=2 w0 on 0: g=-1 -> 3 counted, the pull
  # starts; w0 and w1 pull 0 (the update is not there yet). t=2.5: x = (1+3+1)/4 = 1.25.
  # t=3 w0 on 0: g=-1; t=4 w1 on 0: -3; t=4 w0 on 1.25 (pulled at 3): 0.25 -> pull;
  # t=4.5: x = 1.25 + (1 + 3 - 0.25)/4 = 2.1875; w0's and w1's first gradients were 1 stale.
  tl, xs = _golden(sync.inhad(2, 1), sync.InHADProtocol(2, [0, 0], 3), 1, 7)
  assert xs[:8] == [[0.0], [0.0], [0.0], [1.25], [1.25], [1.25], [1.25], [2.1875]]
  assert [r.time for r in tl.rounds if r.aggregate] == [2.5, 4.5]


def test_golden_dssync():
  # Groups of 2 = everyone: each applies its own gradient unscaled (lr 0.5), then the
  # pair averages. t=2: x0 = 0+0.5, x1 = 0+1.5 -> both 1.0.  t=4: x0 = 1.0, x1 = 1.0+1.0
  # -> 1.5.  t=6: x0 = 1.5-0.25, x1 = 1.5+0.75 -> 1.75.
  _, xs = _golden(sync.dssync(2), sync.DSSyncProtocol(2, 2), 2, 6)
  assert xs == [[1.0, 1.0], [1.5, 1.5], [1.75, 1.75]]


def test_golden_casp_two_communities():
  # Two communities of one worker each push asynchronously: exactly ASP's values.
  protocol = sync.CASPProtocol(2, max_communities=2, initial_communities=2, reconfigure_every=100)
  _, xs = _golden(sync.casp(2), protocol, 1, 6)
  assert xs == [[0.25], [1.0], [1.1875], [1.140625], [1.640625], [1.60546875]]


def test_golden_casp_one_community():
  protocol = sync.CASPProtocol(2, max_communities=2, initial_communities=1, reconfigure_every=100)
  # One community: w1's push and w0's reach the leader (w0) at t=2, the community's one
  # push reaches the server 0.5 s later (t=2.5, 5.0, 7.5): BSP's values.
  tl, xs = _golden(sync.casp(2), protocol, 1, 7)
  assert xs[:3] == [[1.0], [1.5], [1.75]]
  assert [r.time for r in tl.rounds][:3] == [2.5, 5.0, 7.5]


# ---------------------------------------------------------------- protocols on timelines


def _jittered(speeds, seed=0):
  rng = np.random.default_rng(seed)
  table = rng.lognormal(0.0, 0.3, size=(len(speeds), 500)) * np.asarray(speeds)[:, None]
  return lambda w, k: float(table[w, k])


def _walk(timeline, num_workers):
  """Yields (event, clock before it) in processing order."""
  clock = np.zeros([num_workers], np.int64)
  for kind, time, who in timeline.events:
    yield kind, time, who, clock.copy()
    if kind == "push":
      clock[who] += 1


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_never_runs_more_than_s_ahead(s):
  speeds = [1.0, 1.5, 2.0, 3.0, 1.0, 5.0]
  tl = sync.run_timeline(sync.SSPProtocol(6, s), _jittered(speeds), max_pushes=300)
  worst = max(c[w] - c.min() for kind, _, w, c in _walk(tl, 6) if kind == "start")
  assert worst <= s
  assert worst == s   # the bound is reached: fast workers do run ahead
  assert tl.blocked_time[0] > 0   # ... and then wait for the slowest


def test_asp_never_blocks():
  tl = sync.run_timeline(sync.ASPProtocol(4), _jittered([1, 2, 4, 8]), max_pushes=200)
  assert tl.blocked_time.tolist() == [0.0] * 4


def test_bsp_round_takes_the_slowest_worker():
  tl = sync.run_timeline(sync.BSPProtocol(4), lambda w, k: [1.0, 1.5, 2.0, 3.0][w],
                         max_pushes=40, push_delay=lambda w: 0.25, pull_delay=lambda w: 0.5)
  times = [r.time for r in tl.rounds]
  # slowest compute 3 + push 0.25 = first round; every later one adds pull 0.5 + 3 + 0.25.
  assert times == pytest.approx([3.25 + 3.75 * i for i in range(10)])


@pytest.mark.parametrize("low,high,seed", [(1, 4, 1), (0, 3, 2), (3, 15, 0)])
def test_dssp_runs_beyond_s_l_only_on_credit_and_never_beyond_s_u(low, high, seed):
  speeds = [1.0, 1.2, 3.0, 3.1]
  protocol = sync.DSSPProtocol(4, (low, high))
  tl = sync.run_timeline(protocol, _jittered(speeds, seed), max_pushes=400)
  assert all(0 <= r <= high - low for _, _, r in protocol.thresholds)
  fastest_at_push = {}
  beyond = np.zeros([4], np.int64)
  worst = 0
  for kind, time, w, c in _walk(tl, 4):
    if kind == "push":
      c[w] += 1
      fastest_at_push[(time, w)] = c[w] == c.max() and c[w] - c.min() > low
    elif kind == "start":
      worst = max(worst, c[w] - c.min())
      beyond[w] += c[w] - c.min() > low
  assert worst == high                 # the bound is reached ...
  # ... and never passed (our safety bound).
  # The controller only decides for the fastest pushing beyond s_L, and every start
  # beyond s_L is paid for by credit it granted.
  assert all(fastest_at_push[(t, w)] for t, w, _ in protocol.thresholds)
  granted = np.zeros([4], np.int64)
  for _, w, r in protocol.thresholds:
    granted[w] += r
  assert (beyond <= granted).all() and beyond.sum() > 0


def test_gssp_blocks_only_within_a_group():
  groups = np.array([0, 0, 1, 1])
  def run(slow_factor):
    speeds = [1.0, 1.3, 2.0, 2.0 * slow_factor]
    return sync.run_timeline(sync.GSSPProtocol(4, groups, 1), _jittered(speeds, 2),
                             max_pushes=300, message_delay=lambda m: 0.1)
  base, slow = run(1.0), run(10.0)
  # Group 0's whole history is the same whether group 1 has a 10x straggler or not.
  first = lambda tl: [(t, w) for t, w, _ in tl.pushes if groups[w] == 0][:100]
  assert first(base) == first(slow)
  for tl in (base, slow):
    for kind, _, w, c in _walk(tl, 4):
      if kind == "start":
        mine = groups == groups[w]
        assert c[w] - c[mine].min() <= 1   # SSP(1) holds inside the group
  assert slow.blocked_time[3] == 0.0 and slow.blocked_time[2] > 0


def test_gssp_forwards_every_group_size_pushes():
  protocol = sync.GSSPProtocol(4, [0, 0, 1, 1], 3)
  tl = sync.run_timeline(protocol, lambda w, k: [1.0, 1.0, 2.0, 2.0][w], max_pushes=40,
                         message_delay=lambda m: 0.1)
  forwards = sum(int(r.forward.sum()) for r in tl.rounds)
  delivers = sum(int(r.deliver.sum()) for r in tl.rounds)
  assert forwards == 20 and delivers in (19, 20)   # every 2 pushes; the last may be in flight


def _gssp_global_replay(protocol, speeds, max_pushes, message_delay, targets):
  """Scalar x, worker w's gradient x_read - targets[w], SGD lr 0.5; states after each round."""
  tl = sync.run_timeline(protocol, lambda w, k: speeds[w], max_pushes=max_pushes,
                         message_delay=message_delay)
  W, G = protocol.num_workers, protocol.num_groups
  chain = optax.chain(sync.gssp(W, G, inter_group="global", assignment=protocol.route),
                      sync.replicated(optax.sgd(0.5), protocol.num_replicas))
  seen = []
  replay.replay(chain, {"x": jnp.zeros([])}, tl.rounds,
                lambda wp, i: {"x": wp["x"] - jnp.asarray(targets)},
                num_replicas=protocol.num_replicas, num_workers=W,
                on_round=lambda i, st: seen.append(jax.tree.map(np.asarray, st)))
  return tl, seen


def test_gssp_global_adopts_the_weights_sent_not_those_at_arrival():
  # Group 0's reply takes 1 s; group 1's sum reaches the global server meanwhile.
  delay = lambda m: 1.0 if (m.kind, m.group) == ("adopt", 0) else 0.1
  protocol = sync.GSSPProtocol(2, [0, 1], 3, inter_group="global")
  tl, seen = _gssp_global_replay(protocol, [1.0, 1.3], 6, delay, [1.0, 3.0])
  sent = next(i for i, r in enumerate(tl.rounds) if r.deliver[0])
  adopt = next(i for i, r in enumerate(tl.rounds) if r.adopt[0] >= 0)
  assert any(r.deliver[1] for r in tl.rounds[sent + 1:adopt])   # group 1 lands in between
  x = lambda i: seen[i].replica_params["x"]
  assert x(adopt - 1)[2] != x(sent)[2]          # the global server moved on ...
  assert x(adopt)[0] == x(sent)[2]              # ... group 0 adopts what was sent to it


def test_gssp_global_group_server_waits_for_the_reply():
  # Group 0 = workers 0, 1 (forward every 2 pushes), group 1 = worker 2 (never pushes
  # here). t=1.5 w1's push completes group 0's sum: it is forwarded (delivered at 2,
  # reply at 2.5). w0's push at t=2 waits for the reply, then is applied on top of it.
  protocol = sync.GSSPProtocol(3, [0, 0, 1], 3, inter_group="global")
  targets = np.array([1.0, 3.0, 5.0])
  tl, seen = _gssp_global_replay(protocol, [1.0, 1.5, 10.0], 4, lambda m: 0.5, targets)
  adopt = next(i for i, r in enumerate(tl.rounds) if r.adopt[0] >= 0)
  pushes0 = [i for i, r in enumerate(tl.rounds) if r.arrived[0]]
  assert pushes0[1] == adopt + 1 and tl.rounds[adopt + 1].time == 2.5
  read = seen[adopt].worker_params["x"][0]    # what w0 computed its gradient on (t=1)
  after = seen[adopt + 1].replica_params["x"]
  expected = seen[adopt].replica_params["x"][0] - 0.5 * (read - targets[0]) / 3
  np.testing.assert_allclose(after[0], expected, rtol=1e-6)
  assert seen[adopt].replica_params["x"][0] == seen[adopt].replica_params["x"][3]  # slot 0
  # w0 waited from its push (t=2) to the reply (2.5); w1 from the forward (1.5).
  np.testing.assert_allclose(tl.blocked_time[:2], [0.5, 1.0])


def test_gssp_regrouping_restarts_ssp_clocks():
  # Speed groups {0, 1} fast and {2, 3} slow for 40 s; then 1 and 2 swap speeds and the
  # workers regroup into the new homogeneous pairs {0, 2} and {1, 3}. Their push counts
  # differ by about 40 and 20 from the old groups; that must not make anyone wait.
  speeds = [1.0, 1.0, 2.0, 2.0]
  protocol = sync.GSSPProtocol(4, [0, 0, 1, 1], 3)
  engine = sync.TimelineEngine(protocol, lambda w, k: speeds[w])
  while engine.now < 40.0:
    engine.step()
  protocol.request_regroup([0, 1, 0, 1])
  speeds[:] = [1.0, 2.0, 1.0, 2.0]
  while not protocol.regroups:
    engine.step()
  assert np.abs(protocol.clock[[0, 1]] - protocol.clock[[2, 3]]).min() > 10
  start, blocked = engine.now, engine.blocked_time.copy()
  while engine.now < start + 60.0:
    engine.step()
  assert (engine.blocked_time - blocked).max() < 1.0   # was 20 s and 40 s


def test_gssp_server_payloads_count_every_message():
  peer = sync.GSSPProtocol(3, [0, 1, 2], 3)
  deliver = peer.on_message(sync.Message("deliver", 0), 0.0).rounds[0]
  assert peer.server_payloads(deliver) == 2          # to each of the G - 1 others
  glob = sync.GSSPProtocol(3, [0, 1, 2], 3, inter_group="global")
  deliver = glob.on_message(sync.Message("deliver", 0), 0.0).rounds[0]
  reply = glob.on_message(sync.Message("adopt", 0), 0.5).rounds[0]
  assert glob.server_payloads(deliver) == 1 and glob.server_payloads(reply) == 1


@pytest.mark.parametrize("num_workers,group_size", [(16, 4), (16, 2), (12, 3), (8, 8), (6, 2)])
def test_dssync_partitions_disjoint_and_connected_over_a_period(num_workers, group_size):
  for seed, period in itertools.product(range(3), range(5)):
    edges = set()
    for it in (2 * period, 2 * period + 1):
      ids = sync.dssync_partition(num_workers, group_size, it, seed)
      assert np.bincount(ids).tolist() == [group_size] * (num_workers // group_size)
      for g in range(num_workers // group_size):
        members = np.flatnonzero(ids == g)
        edges |= {(int(a), int(b)) for a in members for b in members}
    seen, frontier = {0}, [0]
    while frontier:
      a = frontier.pop()
      for x, y in edges:
        if x == a and y not in seen:
          seen.add(y)
          frontier.append(y)
    assert seen == set(range(num_workers))
  # It does shuffle: consecutive periods differ.
  assert not np.array_equal(sync.dssync_partition(16, 4, 0, 0), sync.dssync_partition(16, 4, 2, 0))


def test_dssync_waits_only_for_its_group():
  protocol = sync.DSSyncProtocol(4, 2, seed=0)
  tl = sync.run_timeline(protocol, lambda w, k: [1.0, 1.0, 1.0, 10.0][w], max_pushes=60)
  for rnd in tl.rounds:
    members = np.flatnonzero(rnd.arrived)
    assert len(members) == 2 and len(set(rnd.average[members].tolist())) == 1
    assert (rnd.pulls == rnd.arrived).all()
  # Groups shuffle, so the straggler slows everyone down, but only through the
  # groups it is in: a fast worker is not blocked the whole time.
  assert max(tl.blocked_time[:3]) < 0.95 * tl.end_time


def test_gdtopk_gives_the_slowest_group_the_densest_ratio():
  speeds = [1.0] * 4 + [1.5] * 4 + [2.0] * 4 + [3.0] * 4
  groups = sync.make_groups("speed", 16, 4, np.random.default_rng(0).permutation(speeds))
  times = np.random.default_rng(0).permutation(speeds)
  ranks = sync.grouping.group_speed_rank(groups, times)
  for epoch in (3, 4, 7):   # epochs 1 and 2 send the initial 0.35 in every group
    ratios = compress.worker_ratios(compress.gdtopk_group_ratios(epoch, ranks), groups)
    slowest = times == 3.0
    assert ratios[slowest].min() >= ratios.max() - 1e-9
    assert ratios[slowest].min() > ratios[times == 1.0].max()


def test_inhad_updates_every_threshold_and_never_blocks():
  protocol = sync.InHADProtocol(4, [0, 0, 1, 1], threshold=6)
  # The 60th iteration number starts the 10th pull of the aggregates; it lands before the 61st.
  tl = sync.run_timeline(protocol, _jittered([1, 2, 3, 4]), max_pushes=61)
  assert sum(bool(r.aggregate) for r in tl.rounds) == 10
  assert tl.blocked_time.tolist() == [0.0] * 4


def test_casp_communities_are_synchronous_and_speed_sorted():
  speeds = [3.0, 1.0, 2.0, 1.1, 2.9, 1.9, 1.05, 3.1]
  protocol = sync.CASPProtocol(8, max_communities=4, reconfigure_every=8, seed=1)
  tl = sync.run_timeline(protocol, lambda w, k: speeds[w], max_pushes=600)
  assert len(protocol.history) > 5
  assert all(1 <= k <= 4 for _, k in protocol.history)
  for rnd in tl.rounds:
    members = np.flatnonzero(rnd.arrived)
    # Every community push carries whole communities of speed-contiguous workers.
    order = np.argsort(speeds)
    pos = sorted(np.flatnonzero(np.isin(order, members)).tolist())
    assert pos == list(range(pos[0], pos[0] + len(pos)))


def test_actor_critic_learns_the_better_action():
  agent = sync.ActorCritic(3, 2, seed=0, actor_lr=0.5)
  features = np.array([1.0, 0.0])
  for _ in range(300):
    a = agent.act(features)
    agent.learn(1.0 if a == 2 else 0.0)
  assert agent.probabilities(features)[2] > 0.9


def test_protocols_are_deterministic():
  for name in sync.SCHEMES:
    a = _timeline(_scheme(name).make_protocol(), SPEEDS4, 50, 0.3)
    b = _timeline(_scheme(name).make_protocol(), SPEEDS4, 50, 0.3)
    assert a.events == b.events
    _equal(rounds_lib.stack_rounds(a.rounds), rounds_lib.stack_rounds(b.rounds))


def test_protocols_use_no_jax():
  """The host half imports no JAX (the real runtime's coordinator runs it without devices)."""
  root = pathlib.Path(sync.__file__).parent
  paths = sorted((root / "schemes").glob("*/protocol.py"))
  assert len(paths) == 6, paths   # ssp, gssp, inhad, casp, dssync, halos
  for path in paths + [root / "protocol.py", root / "arguments.py", root / "timeline.py",
                       root / "grouping.py"]:
    tree = ast.parse(path.read_text())
    mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not any(m and (m == "jax" or m.startswith(("jax.", "optax", "flax"))) for m in mods), path


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("build,match", [
    (lambda: sync.ssp(4, -1), r"ssp staleness=-1 is invalid; allowed: an int >= 0"),
    (lambda: sync.SSPProtocol(4, -2), r"staleness=-2 is invalid"),
    (lambda: sync.dssp(4, (5, 2)), r"s_L=5 > s_U=2"),
    (lambda: sync.DSSPProtocol(4, (3, 1)), r"s_L=3 > s_U=1"),
    (lambda: sync.dssp(4, 3), r"staleness_range=3 is invalid"),
    (lambda: sync.gssp(16, 3), r"num_groups=3 does not divide num_workers=16"),
    (lambda: sync.build_scheme("gssp", 16, num_groups=3),
     r"num_groups=3 does not divide num_workers=16"),
    (lambda: sync.build_scheme("gssp", 4, num_groups=2, inter_group="ring"),
     r"inter_group='ring' is invalid; allowed: peer, global"),
    (lambda: sync.build_scheme("gsp", 4), r"scheme='gsp' is invalid; allowed: bsp, asp"),
    (lambda: sync.build_scheme("gssp", 4, num_groups=2, grouping_method="random"),
     r"grouping='random' is invalid"),
    (lambda: sync.DSSyncProtocol(8, 3), r"group_size=3 is invalid for num_workers=8"),
    (lambda: sync.InHADProtocol(4, [0, 0, 1, 1], threshold=0), r"threshold=0 is invalid"),
    (lambda: sync.CASPProtocol(4, max_communities=5), r"max_communities=5 is invalid"),
    (lambda: sync.GSSPProtocol(4, [0, 0, 2, 2], 1), r"every id in 0..2 used"),
    (lambda: sync.make_groups("speed", 4, 2, [1.0, 0.0, 2.0, 1.0]), r"positive finite"),
    (lambda: compress.topk(4, 1.5), r"ratio=1.5 is invalid; allowed: a number in \(0, 1\]"),
    (lambda: compress.topk(4, 0.0), r"ratio=0.0 is invalid"),
])
def test_bad_arguments_rejected(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_kmeans_grouping_separates_speed_classes():
  times = [1.0, 1.1, 5.0, 5.2, 1.05, 9.0]
  groups = sync.make_groups("kmeans", 6, 3, times)
  assert groups.tolist() == [0, 0, 1, 1, 0, 2]
  assert sync.make_groups("speed", 4, 2, [3.0, 1.0, 2.0, 4.0]).tolist() == [1, 0, 0, 1]
  assert sync.make_groups("round_robin", 4, 2).tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("name,inter_group", [(n, "peer") for n in sync.SCHEMES]
                         + [("gssp", "global")])
def test_every_round_keeps_to_its_protocols_declared_bounds_and_fields(name, inter_group):
  """``round_bounds`` (the level executor's slots) and ``round_fields`` hold for every round a
  built-in protocol emits, drops and rejoins included: at most that many arrivals and touched
  replicas, and every optional field it does not declare is the shared read-only empty one."""
  speeds = [1.0, 1.37, 1.91, 2.53, 1.2, 2.9]
  scheme = sync.build_scheme(name, 6, worker_times=speeds, num_groups=3 if name in (
      "gssp", "halos") else 2, num_nodes=2, casp_reconfigure_every=4, casp_max_communities=2,
      inter_group=inter_group)
  protocol = scheme.make_protocol()
  engine = sync.TimelineEngine(protocol, lambda w, k: speeds[w], message_delay=lambda m: 0.45,
                               record=False)
  if protocol.supports_membership:
    engine.drop_at(7.3, 4)
    engine.rejoin_at(15.1, 4)
  rounds = []
  while engine.num_pushes < 200:
    rounds.extend(engine.step())
  arrivals, replicas = protocol.round_bounds()
  assert max(int(r.arrived.sum()) for r in rounds) <= arrivals
  touched = [int((r.applies | (r.average >= 0) | (r.adopt >= 0)).sum()) for r in rounds]
  assert max(touched) <= replicas
  for field in rounds_lib.OPTIONAL_FIELDS:
    if field not in protocol.round_fields:
      assert not any(getattr(r, field).flags.writeable for r in rounds), field
  with pytest.raises(ValueError, match="read-only"):
    sync.SSPProtocol(4).new_round(0.0).adopt[0] = 1   # SSP declares no optional field


@pytest.mark.parametrize("num_replicas", [4, 17])
def test_replicated_listed_replicas_equal_every_replica_bit_for_bit(num_replicas):
  """``transforms.replicated`` with ``replica_ids``: the loop that stops at the listed count
  and, in a device program of many rounds (``no_branches``), the fixed-trip form (up to
  ``ONE_HOT_MAX`` replicas the updates one select, above it the write-back loop) give every
  replica's step bit for bit; a listed replica that does not apply keeps its momentum and gets
  a zero update."""
  R, P = num_replicas, 7
  tx = sync.transforms.replicated(optax.sgd(0.1, momentum=0.9), R)
  rng = np.random.default_rng(0)
  params = jnp.asarray(rng.standard_normal((R, P)), jnp.float32)
  state = {form: tx.init(params[0]) for form in ("dense", "listed", "fixed")}
  for step in range(3):
    updates = jnp.asarray(rng.standard_normal((R, P)), jnp.float32)
    applies = np.zeros([R], bool)
    applies[[1, R - 1]] = True
    ids = np.array([1, 2, R - 1, R, R + 1], np.int32)     # 2 is listed (averaged) but not applying
    out = {"dense": tx.update(updates, state["dense"], params, applies=applies),
           "listed": tx.update(updates, state["listed"], params, applies=applies,
                               replica_ids=ids),
           "fixed": tx.update(updates, state["fixed"], params, applies=applies,
                              replica_ids=ids, no_branches=True)}
    for form in ("listed", "fixed"):
      for a, b in zip(jax.tree.leaves(out["dense"]), jax.tree.leaves(out[form])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{form} {step}")
    state = {form: new for form, (_, new) in out.items()}
    assert not np.asarray(out["fixed"][0])[~applies].any()
