"""gssp_jax.compress: conformance over every compressor, equivalences, golden values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from gssp_jax import compress

W = 2
PARAMS = {"w": jnp.zeros((3, 5)), "b": jnp.zeros((4,))}

# Every compressor, built for W workers; gdtopk needs ratios every round.
FACTORIES = {
    "topk": lambda: compress.topk(W, 0.3),
    "topk_global": lambda: compress.topk(W, 0.3, scope="global"),
    "dgc": lambda: compress.dgc(W, 0.3, sample_ratio=0.5),
    "gdtopk": lambda: compress.gdtopk(W),
}
RATIOS = jnp.array([0.3, 0.6], jnp.float32)


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": jax.random.normal(keys[0], (W, 3, 5)), "b": jax.random.normal(keys[1], (W, 4))}


def _mean_over_workers():
  """The simplest aggregator: [W, ...] -> mean over workers."""
  def update(updates, state, params=None, **extra):
    del params, extra
    return jax.tree.map(lambda u: jnp.mean(u, axis=0), updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("name", sorted(FACTORIES))
class TestConformance:

  def test_ignores_unknown_extra_args(self, name):
    tx = FACTORIES[name]()
    state = tx.init(PARAMS)
    a, _ = tx.update(_grads(0), state, ratios=RATIOS)
    b, _ = tx.update(_grads(0), state, ratios=RATIOS, foo=1, pulls=jnp.ones(W))
    _assert_trees_equal(a, b)

  def test_jit_without_recompilation(self, name):
    tx = FACTORIES[name]()
    traces = []

    def step(grads, state, ratios, arrived):
      traces.append(1)
      return tx.update(grads, state, ratios=ratios, arrived=arrived, flush=jnp.array(False))

    step = jax.jit(step)
    state = tx.init(PARAMS)
    sent, state = step(_grads(0), state, RATIOS, jnp.array([True, False]))
    sent, state = step(_grads(1), state, RATIOS * 0.5, jnp.array([True, True]))
    assert len(traces) == 1
    assert step._cache_size() == 1
    assert int(state.count) == 2

  def test_stable_dtypes_and_shapes_under_scan(self, name):
    tx = FACTORIES[name]()
    state = tx.init(PARAMS)
    grads = jax.tree.map(lambda *xs: jnp.stack(xs), *[_grads(i) for i in range(3)])

    def body(state, g):
      sent, state = tx.update(g, state, ratios=RATIOS)
      return state, sent

    final, sent = jax.lax.scan(body, state, grads)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    after = jax.tree.map(lambda x: (x.shape, x.dtype), final)
    assert before == after
    assert final.last_bytes.dtype == jnp.int32 and final.count.dtype == jnp.int32
    assert final.rng.dtype == jnp.uint32 and final.rng.shape == (2,)
    assert jax.tree.map(lambda s: s.shape, sent) == jax.tree.map(lambda g: g.shape, grads)

  def test_orbax_round_trip(self, name, tmp_path):
    tx = FACTORIES[name]()
    state = tx.init(PARAMS)
    _, state = tx.update(_grads(0), state, ratios=RATIOS)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "state", state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "state", tx.init(PARAMS))
    _assert_trees_equal(restored, state)
    # The restored state continues exactly like the original.
    _assert_trees_equal(tx.update(_grads(1), restored, ratios=RATIOS),
                        tx.update(_grads(1), state, ratios=RATIOS))

  def test_chains_with_aggregator_and_sgd(self, name):
    tx = optax.chain(FACTORIES[name](), _mean_over_workers(), optax.sgd(0.1))
    params = {"w": jnp.ones((3, 5)), "b": jnp.ones((4,))}
    state = tx.init(params)
    arrived = jnp.array([True, True])
    step = jax.jit(lambda g, s, p: tx.update(g, s, p, ratios=RATIOS, arrived=arrived))
    for i in range(2):
      updates, state = step(_grads(i), state, params)
      params = optax.apply_updates(params, updates)
    assert jax.tree.map(jnp.shape, params) == {"w": (3, 5), "b": (4,)}
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    assert not np.allclose(np.asarray(params["w"]), 1.0)

  def test_error_feedback_conserves_mass(self, name):
    tx = FACTORIES[name]()
    state = tx.init(PARAMS)
    total_sent = jax.tree.map(jnp.zeros_like, _grads(0))
    total_grads = jax.tree.map(jnp.zeros_like, _grads(0))
    for i in range(4):
      g = _grads(i)
      acc = jax.tree.map(jnp.add, state.residual, g)
      sent, state = tx.update(g, state, ratios=RATIOS)
      # Per round the split is exact, bit for bit.
      _assert_trees_equal(jax.tree.map(jnp.add, sent, state.residual), acc)
      total_sent = jax.tree.map(jnp.add, total_sent, sent)
      total_grads = jax.tree.map(jnp.add, total_grads, g)
    jax.tree.map(lambda s, r, g: np.testing.assert_allclose(s + r, g, rtol=1e-5, atol=1e-5),
                 total_sent, state.residual, total_grads)

  def test_absent_workers_send_nothing_and_keep_residual(self, name):
    tx = FACTORIES[name]()
    _, state = tx.update(_grads(0), tx.init(PARAMS), ratios=RATIOS)
    sent, new = tx.update(_grads(1), state, ratios=RATIOS, arrived=jnp.array([False, True]))
    leaves = zip(*map(jax.tree.leaves, (sent, state.residual, new.residual)))
    for s, r_old, r_new in leaves:
      np.testing.assert_array_equal(s[0], 0.0)
      np.testing.assert_array_equal(r_new[0], r_old[0])
    assert int(new.last_bytes[0]) == 0 and int(new.last_bytes[1]) > 0

  def test_flush_sends_everything(self, name):
    tx = FACTORIES[name]()
    _, state = tx.update(_grads(0), tx.init(PARAMS), ratios=RATIOS)
    acc = jax.tree.map(jnp.add, state.residual, _grads(1))
    sent, new = tx.update(_grads(1), state, ratios=RATIOS, flush=jnp.array(True))
    _assert_trees_equal(sent, acc)
    assert all(bool(jnp.all(r == 0)) for r in jax.tree.leaves(new.residual))
    dense = 4 * (15 + 4)
    np.testing.assert_array_equal(compress.push_bytes(new), [dense, dense])
    np.testing.assert_array_equal(compress.residual_norm(new), [0.0, 0.0])


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("scope", ["tensor", "global"])
def test_topk_ratio_one_is_identity(scope):
  tx = compress.topk(W, 1.0, scope=scope)
  state = tx.init(PARAMS)
  for i in range(2):
    sent, state = tx.update(_grads(i), state)
    _assert_trees_equal(sent, _grads(i))
    assert all(bool(jnp.all(r == 0)) for r in jax.tree.leaves(state.residual))


def test_topk_golden_two_workers():
  tx = compress.topk(2, 0.5)  # n = 4, k = ceil(0.5 * 4) = 2
  state = tx.init(jnp.zeros(4))
  g1 = jnp.array([[1., -3., 2., 2.],
                  [4., 4., 4., 4.]])
  sent, state = tx.update(g1, state)
  # Worker 0: |.| = [1, 3, 2, 2]; keep 3 (idx 1), then the tie 2 == 2 goes to idx 2.
  # Worker 1: all tie at 4; keep the two lowest indices 0, 1.
  np.testing.assert_array_equal(sent, [[0., -3., 2., 0.], [4., 4., 0., 0.]])
  np.testing.assert_array_equal(state.residual, [[1., 0., 0., 2.], [0., 0., 4., 4.]])
  # Sparse 2 * (4 + 4) = 16 equals dense 4 * 4 = 16, so the push counts 16 either way.
  np.testing.assert_array_equal(state.last_bytes, [16, 16])
  g2 = jnp.array([[1., -3., 2., 2.],
                  [1., 0., -1., 0.]])
  sent, state = tx.update(g2, state)
  # Worker 0: acc = [1+1, 0-3, 0+2, 2+2] = [2, -3, 2, 4]; keep 4 (idx 3) and -3 (idx 1).
  # Worker 1: acc = [0+1, 0+0, 4-1, 4+0] = [1, 0, 3, 4]; keep 4 (idx 3) and 3 (idx 2).
  np.testing.assert_array_equal(sent, [[0., -3., 0., 4.], [0., 0., 3., 4.]])
  np.testing.assert_array_equal(state.residual, [[2., 0., 2., 0.], [1., 0., 0., 0.]])
  # Worker 0 residual norm sqrt(4 + 4); worker 1 sqrt(1).
  np.testing.assert_allclose(compress.residual_norm(state), [np.sqrt(8.0), 1.0], rtol=1e-6)
  assert int(state.count) == 2


def test_topk_per_worker_ratios_and_no_error_feedback():
  tx = compress.topk(2, 0.5, error_feedback=False)
  state = tx.init(jnp.zeros(4))
  g = jnp.array([[1., 2., 3., 4.], [1., 2., 3., 4.]])
  # Worker 0 keeps ceil(0.25 * 4) = 1 entry, worker 1 keeps ceil(0.75 * 4) = 3.
  sent, state = tx.update(g, state, ratios=jnp.array([0.25, 0.75]))
  np.testing.assert_array_equal(sent, [[0., 0., 0., 4.], [0., 2., 3., 4.]])
  np.testing.assert_array_equal(state.residual, np.zeros((2, 4)))
  # 1 * 8 = 8 bytes; 3 * 8 = 24 >= 16 dense, so 16.
  np.testing.assert_array_equal(state.last_bytes, [8, 16])
  # Without error feedback nothing carries over: the same gradient gives the same push.
  sent2, _ = tx.update(g, state, ratios=jnp.array([0.25, 0.75]))
  np.testing.assert_array_equal(sent2, sent)


def test_topk_ratio_is_a_traceable_hyperparameter():
  static = ("num_workers", "scope", "error_feedback", "value_bytes", "index_bytes")
  tx = optax.inject_hyperparams(compress.topk, static_args=static)(num_workers=2, ratio=0.5)
  step = jax.jit(tx.update)
  g = jnp.array([[1., 2., 3., 4.], [4., 3., 2., 1.]])
  sent, state = step(g, tx.init(jnp.zeros(4)))
  np.testing.assert_array_equal(sent, [[0., 0., 3., 4.], [4., 3., 0., 0.]])
  state.hyperparams["ratio"] = jnp.asarray(0.25, jnp.float32)
  sent, state = step(g, state)
  # Worker 0: acc = [1+1, 2+2, 0+3, 0+4] = [2, 4, 3, 4]; k = 1, the tie 4 == 4 goes to idx 1.
  # Worker 1: acc = [0+4, 0+3, 2+2, 1+1] = [4, 3, 4, 2]; k = 1, the tie goes to idx 0.
  np.testing.assert_array_equal(sent, [[0., 4., 0., 0.], [4., 0., 0., 0.]])
  assert step._cache_size() == 1


@pytest.mark.parametrize("ratio, expected", [(0.01, 10 * (4 + 4)), (0.6, 1000 * 4)])
def test_topk_bytes_tensor_scope(ratio, expected):
  tx = compress.topk(2, ratio)
  g = jax.random.normal(jax.random.key(0), (2, 1000))
  sent, state = tx.update(g, tx.init(jnp.zeros(1000)))
  np.testing.assert_array_equal(compress.push_bytes(state), [expected, expected])
  np.testing.assert_array_equal(jnp.sum(sent != 0, axis=1), [round(ratio * 1000)] * 2)


def test_topk_bytes_global_scope():
  params = {"a": jnp.zeros(1000), "b": jnp.zeros((10, 100))}
  g = {"a": jax.random.normal(jax.random.key(1), (2, 1000)),
       "b": jax.random.normal(jax.random.key(2), (2, 10, 100))}
  # One k over N = 2000 entries: ceil(0.01 * 2000) = 20 -> 20 * 8 = 160 bytes.
  tx = compress.topk(2, 0.01, scope="global")
  sent, state = tx.update(g, tx.init(params))
  np.testing.assert_array_equal(state.last_bytes, [160, 160])
  nnz = sum(jnp.sum(s.reshape(2, -1) != 0, axis=1) for s in jax.tree.leaves(sent))
  np.testing.assert_array_equal(nnz, [20, 20])
  # The kept entries are the 20 largest of the whole flattened model.
  flat = np.concatenate([np.asarray(x).reshape(2, -1) for x in jax.tree.leaves(g)], axis=1)
  sent_flat = np.concatenate([np.asarray(x).reshape(2, -1) for x in jax.tree.leaves(sent)], axis=1)
  for w in range(2):
    top = np.argsort(-np.abs(flat[w]), kind="stable")[:20]
    np.testing.assert_array_equal(np.nonzero(sent_flat[w])[0], np.sort(top))
  # ratio 0.6 over the whole model: 1200 * 8 >= 2000 * 4, so dense: 8000 bytes.
  _, state = compress.topk(2, 0.6, scope="global").update(g, tx.init(params))
  np.testing.assert_array_equal(state.last_bytes, [8000, 8000])


@pytest.mark.parametrize("scope", ["tensor", "global"])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.0125, 0.1, 0.35, 0.5, 0.6, 1.0])
def test_expected_push_bytes_equals_the_device_count(scope, ratio):
  """The simulator times a push with the host formula; it must equal what is counted."""
  params = {"a": jnp.zeros(1000), "b": jnp.zeros((10, 100)), "c": jnp.zeros(7), "d": jnp.zeros(150)}
  g = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), (2, *p.shape)), params)
  tx = compress.topk(2, ratio, scope=scope)
  _, state = tx.update(g, tx.init(params))
  sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
  assert int(state.last_bytes[0]) == compress.expected_push_bytes(sizes, ratio, scope=scope)


# ---------------------------------------------------------------- DGC


def test_dgc_full_sample_is_exact_topk():
  g = jax.random.normal(jax.random.key(3), (2, 1000))  # continuous values: no ties
  tx = compress.dgc(2, 0.05, sample_ratio=1.0)
  sent, state = tx.update(g, tx.init(jnp.zeros(1000)))
  np.testing.assert_array_equal(jnp.sum(sent != 0, axis=1), [50, 50])
  ref, _ = compress.topk(2, 0.05).update(g, compress.topk(2, 0.05).init(jnp.zeros(1000)))
  np.testing.assert_array_equal(sent, ref)
  np.testing.assert_array_equal(state.last_bytes, [50 * 8, 50 * 8])


def test_dgc_sampled_counts_actual_nnz_and_is_reproducible():
  g = {"a": jax.random.normal(jax.random.key(4), (2, 5000))}
  tx = compress.dgc(2, 0.01, sample_ratio=0.1, seed=7)
  sent, state = jax.jit(tx.update)(g, tx.init({"a": jnp.zeros(5000)}))
  nnz = np.asarray(jnp.sum(sent["a"] != 0, axis=1))
  np.testing.assert_array_equal(state.last_bytes, np.minimum(nnz * 8, 5000 * 4))
  assert np.all(nnz > 0) and np.all(nnz < 5000)
  again, _ = tx.update(g, tx.init({"a": jnp.zeros(5000)}))
  _assert_trees_equal(again, sent)


# ---------------------------------------------------------------- GDTopK


def test_gdtopk_requires_ratios():
  tx = compress.gdtopk(2)
  with pytest.raises(ValueError, match="ratios"):
    tx.update(jnp.ones((2, 4)), tx.init(jnp.zeros(4)))


def test_gdtopk_matches_topk_with_same_ratios():
  g = _grads(5)
  gd, tk = compress.gdtopk(W), compress.topk(W)
  a, sa = gd.update(g, gd.init(PARAMS), ratios=RATIOS)
  b, sb = tk.update(g, tk.init(PARAMS), ratios=RATIOS)
  _assert_trees_equal((a, sa), (b, sb))


def test_gdtopk_scope_global_selects_over_the_whole_model():
  g = _grads(5)
  ratios = jnp.array([0.3, 0.3], jnp.float32)
  gd, tk = compress.gdtopk(W, scope="global"), compress.topk(W, scope="global")
  a, sa = gd.update(g, gd.init(PARAMS), ratios=ratios)
  b, sb = tk.update(g, tk.init(PARAMS), ratios=ratios)
  _assert_trees_equal((a, sa), (b, sb))
  per_tensor, _ = compress.gdtopk(W).update(g, compress.gdtopk(W).init(PARAMS), ratios=ratios)
  # Globally the 6 largest of 19 entries per worker; per tensor 5 of "w" and 2 of "b".
  assert [int(jnp.sum(x != 0)) for x in jax.tree.leaves(a)] != [
      int(jnp.sum(x != 0)) for x in jax.tree.leaves(per_tensor)]
  assert all(int(jnp.sum(jnp.concatenate([x[i].ravel() for x in jax.tree.leaves(a)]) != 0)) == 6
             for i in range(W))
  with pytest.raises(ValueError, match=r"scope='layer'"):
    compress.gdtopk(W, scope="layer")


def test_group_schedule_matches_the_authors_table():
  """0.35 until two epochs are completed, then b ** (completed - 1), floored at b ** 4."""
  ranks = [1, 2, 0]  # group 0 middle, group 1 slowest, group 2 fastest
  fastest, middle, slowest = 0.25, 0.30, 0.35
  table = {1: [0.35] * 3, 2: [0.35] * 3}
  for epoch, power in ((3, 1), (4, 2), (5, 3), (6, 4), (7, 4)):
    table[epoch] = [middle ** power, slowest ** power, fastest ** power]
  for epoch in range(1, 8):
    r = compress.gdtopk_group_ratios(epoch, ranks)
    assert r.dtype == np.float32 and r.shape == (3,)
    np.testing.assert_allclose(r, table[epoch], rtol=1e-6, err_msg=f"epoch {epoch}")
    if epoch > 2:
      assert r[1] > r[0] > r[2]   # the slowest group sends the densest
  np.testing.assert_allclose(compress.gdtopk_group_ratios(9, ranks),
                             [0.30**4, 0.35**4, 0.25**4], rtol=1e-6)
  np.testing.assert_allclose(compress.gdtopk_group_ratios(9, ranks, floor_power=2),
                             [0.30**2, 0.35**2, 0.25**2], rtol=1e-6)


def test_group_schedule_classes_and_initial_ratio():
  np.testing.assert_array_equal(compress.gdtopk_group_ratios(4, [0, 1], classes_known=False),
                                np.float32([0.35, 0.35]))
  np.testing.assert_allclose(compress.gdtopk_group_ratios(3, [0]), [0.30])  # one group: middle
  # Two groups: slowest and fastest.
  np.testing.assert_allclose(compress.gdtopk_group_ratios(3, [1, 0]), [0.35, 0.25])


def test_continuous_schedule_monotone_in_time():
  times = [3.0, 1.0, 2.0, 5.0]
  for epoch in range(2, 7):
    r = compress.gdtopk_continuous_ratios(epoch, times)
    order = np.argsort(times)
    assert np.all(np.diff(r[order]) > 0)
  # Epoch 2 exposes the bases: the fastest gets base_fast, the slowest base_slow.
  np.testing.assert_allclose(compress.gdtopk_continuous_ratios(2, times)[[1, 3]], [0.25, 0.35],
                             rtol=1e-6)
  # Equal times: nobody is faster, every group takes the midpoint base.
  np.testing.assert_allclose(compress.gdtopk_continuous_ratios(2, [2.0, 2.0]), [0.30, 0.30],
                             rtol=1e-6)


def test_worker_ratios_maps_groups():
  r = compress.worker_ratios(np.array([0.1, 0.5], np.float32), [1, 0, 1])
  np.testing.assert_array_equal(r, np.array([0.5, 0.1, 0.5], np.float32))
  with pytest.raises(ValueError, match="worker_group"):
    compress.worker_ratios(np.array([0.1, 0.5]), [2])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("build, match", [
    (lambda: compress.topk(2, 1.5), r"ratio=1\.5 is invalid; allowed: a number in \(0, 1\]"),
    (lambda: compress.topk(2, 0.0), r"ratio=0\.0"),
    (lambda: compress.topk(0), r"num_workers=0"),
    (lambda: compress.topk(2.0), r"num_workers=2\.0"),
    (lambda: compress.topk(2, scope="layer"), r"scope='layer'.*tensor, global"),
    (lambda: compress.topk(2, value_bytes=0), r"value_bytes=0"),
    (lambda: compress.dgc(2, sample_ratio=2), r"sample_ratio=2"),
    (lambda: compress.dgc(2, index_bytes=-1), r"index_bytes=-1"),
    (lambda: compress.gdtopk(-1), r"num_workers=-1"),
    (lambda: compress.make_compressor("x", 2),
     r"unknown compressor 'x'; allowed: none, topk, dgc, gdtopk"),
    (lambda: compress.gdtopk_group_ratios(0, [0]), r"epoch=0"),
    (lambda: compress.gdtopk_group_ratios(1, [0, 2]), r"group_speed_rank=\[0, 2\]"),
    (lambda: compress.gdtopk_group_ratios(1, [0], bases=(0.2, 1.5, 0.3)), r"bases=1\.5"),
    (lambda: compress.gdtopk_group_ratios(1, [0], initial_ratio=0), r"initial_ratio=0"),
    (lambda: compress.gdtopk_group_ratios(1, [0], floor_power=-1), r"floor_power=-1"),
    (lambda: compress.gdtopk_continuous_ratios(1, [1.0, -2.0]), r"group_iteration_times"),
    (lambda: compress.gdtopk_continuous_ratios(1, [1.0], base_fast=0.4, base_slow=0.3),
     r"base_slow=0\.3"),
])
def test_bad_arguments_rejected(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_make_compressor():
  assert compress.make_compressor("none", 2) is None
  tx = compress.make_compressor("topk", 2, ratio=0.5, scope="global")
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert set(compress.COMPRESSORS) == {"topk", "dgc", "gdtopk"}
