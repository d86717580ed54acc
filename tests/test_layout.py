"""The real runtime's bodies: a shard's push packs and unpacks exactly, and only finite values pass."""

import warnings

import jax
import numpy as np
import pytest

from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import wire


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
    assert nnz == -1 and wire.body_bytes(body) == layout.push_limit(s, -1)
    # As the sender holds it (segments), as one buffer, and as the messages it travels in.
    for form in (body, _flat(body).view(np.uint8),
                 [np.frombuffer(m, np.uint8) for m in wire.chunks(body)]):
      got, got_stats = layout.unpack_push(s, form, nnz)
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
  assert nnz == 3 and wire.body_bytes(body) == layout.push_limit(0, 3)
  got, _ = layout.unpack_push(0, body, nnz)
  for leaf, want in zip(got, grads):
    np.testing.assert_array_equal(leaf, want)


@pytest.mark.parametrize("where", ["grad", "stats"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_anywhere_is_refused(where, bad):
  layout, params, stats = _layout(1)
  grads, stat_leaves = jax.tree.leaves(params), jax.tree.leaves(stats)
  body, nnz = layout.pack_push(0, grads, stat_leaves, sparse=False)
  flat = _flat(body)
  flat[-1 if where == "stats" else 7] = bad
  with pytest.raises(layout_lib.NonFinite, match="non-finite"):
    layout.unpack_push(0, flat.view(np.uint8), nnz)


def test_finite_values_whose_sum_overflows_are_accepted():
  layout, params, stats = _layout(1)
  body, nnz = layout.pack_push(0, jax.tree.leaves(params), jax.tree.leaves(stats), sparse=False)
  flat = _flat(body)
  flat[:] = np.finfo(np.float32).max   # the sum is infinite; every value is finite
  with np.errstate(over="ignore"):
    assert not np.isfinite(flat.sum())
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # and the check's own overflow is no warning
    layout.unpack_push(0, flat.view(np.uint8), nnz)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_finiteness_check_sees_one_bad_value_at_any_place_of_any_length(bad):
  # The check is one BLAS dot product (x . x): a vectorised kernel with tails of every length.
  # Unaligned arrays (a Flight batch lies wherever gRPC put it) take another path: both.
  def ones(n, unaligned):
    if not unaligned:
      return np.ones([n], np.float32)
    x = np.zeros([4 * n + 1], np.uint8)[1:].view(np.float32)
    x[:] = 1.0
    assert not x.flags.aligned
    return x
  for unaligned in (False, True):
    for n in [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 1000, 4099]:
      for where in sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))):
        x = ones(n, unaligned)
        x[where] = bad
        assert not layout_lib.all_finite([x]), (n, where, unaligned)
      assert layout_lib.all_finite([ones(n, unaligned)])
  mixed = np.zeros([100], np.float32)
  mixed[[3, 60]] = [np.inf, -np.inf]   # cannot cancel: squares are never negative
  assert not layout_lib.all_finite([mixed])
  huge = np.full([50], 1e30, np.float32)   # squares overflow; min and max decide: finite
  assert layout_lib.all_finite([huge, -huge])


def test_a_non_finite_value_in_any_message_of_a_chunked_push_is_refused():
  layout, params, stats = _layout(1)
  body, nnz = layout.pack_push(0, jax.tree.leaves(params), jax.tree.leaves(stats), sparse=False)
  flat = _flat(body)
  raw = flat.view(np.uint8)
  for where in (0, 20, flat.size - 1):
    flat[where] = np.nan
    parts = [raw[:40], raw[40:100], raw[100:]]   # the value lies in the first, second, last
    with pytest.raises(layout_lib.NonFinite, match="non-finite"):
      layout.unpack_push(0, parts, nnz)
    flat[where] = 1.0
  layout.unpack_push(0, [raw[:40], raw[40:100], raw[100:]], nnz)


def test_a_pull_body_is_one_segment_when_it_travels_as_one_message(monkeypatch):
  layout, params, stats = _layout(1)
  row = np.arange(layout.pull_bytes(0) // 4, dtype=np.float32)
  whole = layout.segments(0, row)
  assert len(whole) == 1 and np.shares_memory(whole[0], row)
  monkeypatch.setattr(wire, "CHUNK_BYTES", 64)   # now it is streamed: one view per tensor
  views = layout.segments(0, row)
  assert len(views) == len(layout.shapes) + len(layout.stats_shapes)
  np.testing.assert_array_equal(np.concatenate(views), row)
  for got in (whole, views):
    weights, got_stats = layout.unpack_pull(0, [np.frombuffer(wire.join(got), np.uint8)])
    assert [w.shape for w in weights] == list(layout.shapes)
    np.testing.assert_array_equal(np.concatenate([w.reshape(-1) for w in weights + got_stats]),
                                  row)


def test_a_push_of_the_wrong_size_is_refused():
  layout, params, stats = _layout(1)
  body, nnz = layout.pack_push(0, jax.tree.leaves(params), jax.tree.leaves(stats), sparse=False)
  with pytest.raises(wire.BadMessage, match="expected"):
    layout.unpack_push(0, _flat(body).view(np.uint8)[:-1], nnz)


def _flat(body) -> np.ndarray:
  """A body's segments joined into one writable float32 array."""
  return np.frombuffer(bytearray(wire.join(body)), np.float32)


@pytest.mark.parametrize("cuts", [[], [4], [6], [4, 8, 9, 40], list(range(1, 60, 3))])
def test_leaves_come_out_of_any_messages_exactly_and_in_place_where_they_lie_whole(cuts):
  values = np.arange(15, dtype=np.float32)
  raw = values.view(np.uint8)
  ends = [0] + cuts + [raw.size]
  parts = [raw[a:b] for a, b in zip(ends[:-1], ends[1:])]
  sizes = [3, 0, 5, 1, 6]
  got = layout_lib.leaf_views(parts, sizes)
  start = 0
  for leaf, size in zip(got, sizes):
    np.testing.assert_array_equal(leaf, values[start:start + size])
    start += size
  # Cut at every leaf boundary, each non-empty leaf is the very memory it came in.
  bounds = np.cumsum([0] + sizes) * 4
  parts = [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
  for leaf in layout_lib.leaf_views(parts, sizes):
    assert leaf.size == 0 or np.shares_memory(leaf, raw)


def test_a_senders_messages_end_on_its_tensors_and_stay_within_the_cap():
  sizes = [10, 300_000, 2_000_000, 3_000_000, 7, 1_100_000, 1_100_000]   # float32 entries
  body = [np.full([n], i, np.float32) for i, n in enumerate(sizes)]
  messages = list(wire.chunks(body))
  assert max(len(m) for m in messages) <= wire.MAX_MESSAGE_BYTES
  assert b"".join(messages) == wire.join(body)
  cuts = np.cumsum([len(m) for m in messages])
  for n, end in zip(sizes, np.cumsum(sizes) * 4):
    inside = [c for c in cuts if end - 4 * n < c < end]
    if 4 * n <= wire.CHUNK_BYTES:
      assert not inside   # a tensor up to a chunk is never cut
    else:                 # a larger one travels alone, whole up to SEGMENT_BYTES
      assert not inside and {end - 4 * n, end} <= set(cuts.tolist()) | {0}
  # A tensor larger than SEGMENT_BYTES is cut into messages of at most that size.
  big = [np.zeros([(wire.SEGMENT_BYTES // 4) + 5], np.float32)]
  assert [len(m) for m in wire.chunks(big)] == [wire.SEGMENT_BYTES, 20]
