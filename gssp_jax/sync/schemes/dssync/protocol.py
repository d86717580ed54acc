"""DS-Sync: disjoint groups average parameters each iteration; membership shuffles every iteration."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import all_of
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction


def dssync_partition(num_workers: int, group_size: int, iteration: int, seed: int) -> np.ndarray:
  """``[W]`` group ids of ``iteration``: disjoint groups of ``group_size``, union connected.

  Iterations come in periods of two drawing one random permutation ``p`` of
  the workers (seeded by ``(seed, period)``). The even iteration cuts ``p``
  into consecutive blocks; the odd one cuts ``p`` rotated by one place. Block
  ``k + 1`` of the odd cut holds the last worker of even block ``k`` and the
  first of even block ``k + 1``, so the union of the period's groups is
  connected whenever ``group_size >= 2``.
  """
  period, phase = divmod(int(iteration), 2)
  perm = np.random.default_rng([int(seed), period]).permutation(num_workers)
  if phase:
    perm = np.roll(perm, 1)
  ids = np.empty([num_workers], np.int32)
  ids[perm] = np.arange(num_workers) // group_size
  return ids


class DSSyncProtocol(Protocol):
  """No server: replica ``w`` is worker ``w``'s weights (R = W).

  A worker finishing iteration ``i`` waits only for the members of its group of
  iteration ``i`` (``dssync_partition``). When the group is complete its
  members apply their own gradients, average their weights and start ``i + 1``.

  Args:
    num_workers: W.
    group_size: m, a divisor of W, >= 2 unless W == 1.
    seed: seed of the shuffles.
  """

  name = "dssync"
  round_fields = ("average",)
  membership_unsupported = (
      "a worker's group of iteration i is fixed by the shared shuffle, so its mates wait "
      "for it at i, and a rejoining worker (its replica is its own weights, stale since it "
      "left) has no consistent iteration to join: excluding it would need a new partition "
      "agreed on by workers that are at different iterations")

  def __init__(self, num_workers: int, group_size: int = 2, seed: int = 0):
    num_workers = arguments.check_int("dssync", "num_workers", num_workers, 1)
    group_size = arguments.check_int("dssync", "group_size", group_size, 1)
    if num_workers % group_size or (group_size < 2 and num_workers > 1):
      raise ValueError(f"dssync group_size={group_size} is invalid for num_workers="
                       f"{num_workers}; allowed: a divisor of {num_workers} that is >= 2 "
                       "(groups must be equal and must mix)")
    super().__init__(num_workers, num_workers, 1, np.arange(num_workers))
    self.group_size = group_size
    self.seed = int(seed)

  def round_bounds(self):
    """A round is one group: its members arrive, apply to and average their own replicas."""
    return self.group_size, self.group_size

  def partition(self, iteration: int) -> np.ndarray:
    return dssync_partition(self.num_workers, self.group_size, iteration, self.seed)

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    iteration = int(self.clock[worker])
    self.clock[worker] += 1
    self.blocked[worker] = True
    ids = self.partition(iteration)
    members = (ids == ids[worker]).nonzero()[0]
    # Members finished iteration ``iteration`` iff they pushed it and still wait.
    if not all_of(self.blocked[members] & (self.clock[members] == iteration + 1)):
      return Reaction()
    rnd = self.new_round(time)
    rnd.arrived[members] = True
    rnd.applies[members] = True
    rnd.average[members] = ids[worker]
    rnd.pulls[members] = True
    self.blocked[members] = False
    return Reaction(rounds=[rnd], release=[int(m) for m in members])
