"""Per-worker deterministic sharding."""

import numpy as np
import pytest

from gssp_jax.data import sharding


def test_shards_are_disjoint_and_cover_all_but_the_remainder():
  shards = sharding.worker_shards(103, 4, seed=0)
  assert shards.shape == (4, 25) and shards.dtype == np.int32
  flat = shards.ravel()
  assert len(np.unique(flat)) == flat.size  # disjoint
  assert flat.min() >= 0 and flat.max() < 103


def test_shards_depend_only_on_the_seed():
  np.testing.assert_array_equal(sharding.worker_shards(100, 4, 3),
                                sharding.worker_shards(100, 4, 3))
  assert not np.array_equal(sharding.worker_shards(100, 4, 3), sharding.worker_shards(100, 4, 4))


def test_each_epoch_reshuffles_within_the_workers_own_shard():
  shards = sharding.worker_shards(1000, 4, seed=1)
  e0 = sharding.epoch_order(shards, seed=1, epoch=0)
  e1 = sharding.epoch_order(shards, seed=1, epoch=1)
  for w in range(4):
    assert set(e0[w]) == set(shards[w]) == set(e1[w])
  assert not np.array_equal(e0, e1)
  np.testing.assert_array_equal(e1, sharding.epoch_order(shards, seed=1, epoch=1))
  # A worker's order is its own: it does not depend on how many epochs others ran.
  np.testing.assert_array_equal(e1[2], sharding.worker_order(shards, 1, worker=2, epoch=1))


@pytest.mark.parametrize("n,w", [(10, 0), (3, 4)])
def test_bad_sizes_are_rejected(n, w):
  with pytest.raises(ValueError, match="workers"):
    sharding.worker_shards(n, w, 0)


def test_a_span_of_batches_is_the_batches_one_by_one_across_an_epoch_end():
  shards = sharding.worker_shards(700, 3, seed=4)
  batches = sharding.WorkerBatches(shards, seed=4, batch_size=32)   # 7 batches per epoch
  for k, n in ((0, 4), (5, 2), (5, 5), (13, 3)):
    np.testing.assert_array_equal(batches.span(1, k, n),
                                  np.stack([batches.indices(1, k + j) for j in range(n)]))


def test_many_batches_at_once_are_the_batches_one_by_one():
  shards = sharding.worker_shards(700, 3, seed=4)
  batches = sharding.WorkerBatches(shards, seed=4, batch_size=32)   # 7 batches per epoch
  workers = np.array([2, 0, 2, 1, 0, 2, 1])
  ks = np.array([6, 0, 7, 13, 21, 15, 3])                           # epochs 0 to 3, unsorted
  want = np.stack([sharding.WorkerBatches(shards, seed=4, batch_size=32).indices(w, k)
                   for w, k in zip(workers.tolist(), ks.tolist())])
  np.testing.assert_array_equal(batches.indices_many(workers, ks), want)
  assert batches.indices_many(np.zeros([0], int), np.zeros([0], int)).shape == (0, 32)
