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
