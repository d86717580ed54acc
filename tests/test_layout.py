"""The real runtime's bodies: a shard's push packs and unpacks exactly, and only finite values pass."""

import jax
import numpy as np
import pytest

from gssp_jax.dist import layout as layout_lib
from gssp_jax.dist import wire


def _layout(num_shards: int):
  rng = np.random.default_rng(0)
  params = {"a": rng.standard_normal([3, 5]).astype(np.float32),
            "b": rng.standard_normal([100]).astype(np.float32),
            "c": rng.standard_normal([7]).astype(np.float32)}
  stats = {"mean": rng.standard_normal([4]).astype(np.float32)}
  return layout_lib.ShardLayout.balanced(params, stats, num_shards), params, stats


@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_dense_push_unpacks_to_its_leaves_and_statistics(num_shards):
  layout, params, stats = _layout(num_shards)
  grads, stat_leaves = jax.tree.leaves(params), jax.tree.leaves(stats)
  for s in range(num_shards):
    body, nnz = layout.pack_push(s, grads, stat_leaves, sparse=False)
    assert nnz == -1 and body.nbytes == layout.push_limit(s, -1)
    got, got_stats = layout.unpack_push(s, body.view(np.uint8), nnz)
    for i, leaf in zip(layout.leaves(s), got):
      np.testing.assert_array_equal(leaf, grads[i])
    assert len(got_stats) == (1 if s == 0 else 0)
    for leaf, want in zip(got_stats, stat_leaves):
      np.testing.assert_array_equal(leaf, want)


def test_a_sparse_push_unpacks_to_its_dense_leaves():
  layout, params, stats = _layout(1)
  grads = [np.zeros_like(x) for x in jax.tree.leaves(params)]
  grads[1][[3, 50, 99]] = [1.5, -2.0, 3.25]
  body, nnz = layout.pack_push(0, grads, jax.tree.leaves(stats), sparse=True)
  assert nnz == 3 and body.nbytes == layout.push_limit(0, 3)
  got, _ = layout.unpack_push(0, body.view(np.uint8), nnz)
  for leaf, want in zip(got, grads):
    np.testing.assert_array_equal(leaf, want)


@pytest.mark.parametrize("where", ["grad", "stats"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_anywhere_is_refused(where, bad):
  layout, params, stats = _layout(1)
  grads, stat_leaves = jax.tree.leaves(params), jax.tree.leaves(stats)
  body, nnz = layout.pack_push(0, grads, stat_leaves, sparse=False)
  body[-1 if where == "stats" else 7] = bad
  with pytest.raises(layout_lib.NonFinite, match="non-finite"):
    layout.unpack_push(0, body.view(np.uint8), nnz)


def test_finite_values_whose_sum_overflows_are_accepted():
  layout, params, stats = _layout(1)
  body, nnz = layout.pack_push(0, jax.tree.leaves(params), jax.tree.leaves(stats), sparse=False)
  body[:] = np.finfo(np.float32).max   # the sum is infinite; every value is finite
  assert not np.isfinite(body.sum())
  layout.unpack_push(0, body.view(np.uint8), nnz)


def test_a_push_of_the_wrong_size_is_refused():
  layout, params, stats = _layout(1)
  body, nnz = layout.pack_push(0, jax.tree.leaves(params), jax.tree.leaves(stats), sparse=False)
  with pytest.raises(wire.BadMessage, match="expected"):
    layout.unpack_push(0, body[:-1].view(np.uint8), nnz)


def test_the_wire_tunes_glibcs_allocator_where_there_is_one():
  import platform  # pylint: disable=g-import-not-at-top
  if platform.libc_ver()[0] != "glibc":
    pytest.skip("mallopt is glibc's")
  assert wire.tune_allocator() and wire.tune_allocator()   # idempotent
