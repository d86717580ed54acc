"""Deterministic per-worker sharding of a training set.

Each of ``W`` workers owns a fixed, disjoint shard of the training set (chosen
once from the seed, as a real data-parallel job assigns files to workers) and
walks its shard in an order reshuffled every epoch from ``(seed, worker,
epoch)``. Workers in a heterogeneous cluster progress at different rates, so a
worker's epoch counter is its own: ``worker_order`` depends on nothing else.
"""

from __future__ import annotations

import numpy as np

_SHARD_SALT = 0x5A4D  # separates the shard assignment stream from the epoch streams


def shard_size(num_examples: int, num_workers: int) -> int:
  """Examples per worker; the remainder ``num_examples % num_workers`` is dropped."""
  if num_workers <= 0:
    raise ValueError(f"num_workers must be a positive integer, got {num_workers}")
  if num_examples < num_workers:
    raise ValueError(
        f"cannot shard {num_examples} examples over {num_workers} workers: every"
        " worker needs at least one example")
  return num_examples // num_workers


def worker_shards(num_examples: int, num_workers: int, seed: int) -> np.ndarray:
  """The fixed example indices each worker owns: int32 ``[W, num_examples // W]``."""
  size = shard_size(num_examples, num_workers)
  perm = np.random.default_rng([seed, _SHARD_SALT]).permutation(num_examples)
  return perm[: size * num_workers].reshape(num_workers, size).astype(np.int32)


def worker_order(shards: np.ndarray, seed: int, worker: int, epoch: int) -> np.ndarray:
  """Worker ``worker``'s shard in its epoch-``epoch`` order: int32 ``[S]``."""
  rng = np.random.default_rng([seed, worker, epoch])
  return shards[worker][rng.permutation(shards.shape[1])]


def epoch_order(shards: np.ndarray, seed: int, epoch: int) -> np.ndarray:
  """Every worker's order for the same epoch (the synchronous case): ``[W, S]``."""
  return np.stack([worker_order(shards, seed, w, epoch) for w in range(shards.shape[0])])


class WorkerBatches:
  """Worker ``w``'s batch of its iteration ``k``: ``B`` example ids of its epoch's order.

  The one batching rule of every executor: the simulator's jobs and the real
  runtime's meshes both take a worker's iteration ``k`` from
  ``worker_order(shards, seed, w, k // spe)``, position ``k % spe``. Each
  worker's order of its current epoch is kept (a worker's iterations only go
  forward, so older epochs are dropped).
  """

  def __init__(self, shards: np.ndarray, seed: int, batch_size: int):
    self.shards, self.seed, self.B = shards, seed, batch_size
    self.spe = shards.shape[1] // batch_size
    self._orders: dict[int, tuple[int, np.ndarray]] = {}

  def indices(self, w: int, k: int) -> np.ndarray:
    epoch, pos = divmod(int(k), self.spe)
    return self._order(w, epoch)[pos * self.B:(pos + 1) * self.B]

  def indices_many(self, workers: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """``[n, B]``: :meth:`indices` of each ``(workers[i], ks[i])``, one gather per worker epoch."""
    workers, ks = np.asarray(workers, np.int64), np.asarray(ks, np.int64)
    out = np.empty((workers.size, self.B), self.shards.dtype)
    epochs, positions = np.divmod(ks, self.spe)
    keys = workers * (int(epochs.max(initial=0)) + 1) + epochs
    for key in np.unique(keys).tolist():   # by worker, then epoch: each order made once
      rows = np.flatnonzero(keys == key)
      w, epoch = int(workers[rows[0]]), int(epochs[rows[0]])
      order = self._order(w, epoch)[:self.spe * self.B].reshape(self.spe, self.B)
      out[rows] = order[positions[rows]]
    return out

  def span(self, w: int, k: int, n: int) -> np.ndarray:
    """``[n, B]``: worker ``w``'s batches of iterations ``k .. k + n - 1`` (:meth:`indices`)."""
    epoch, pos = divmod(int(k), self.spe)
    if pos + n <= self.spe:   # within one epoch: one slice of its order
      return self._order(w, epoch)[pos * self.B:(pos + n) * self.B].reshape(n, self.B)
    return np.stack([self.indices(w, k + j) for j in range(n)])

  def _order(self, w: int, epoch: int) -> np.ndarray:
    held = self._orders.get(w)
    if held is None or held[0] != epoch:
      held = self._orders[w] = (epoch, worker_order(self.shards, self.seed, w, epoch))
    return held[1]
