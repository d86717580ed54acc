"""Single-server protocols: BSP, ASP, SSP(s) and DSSP([s_L, s_U])."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import transforms
from gssp_jax.sync.protocols.base import Protocol
from gssp_jax.sync.protocols.base import Reaction
from gssp_jax.sync.protocols.base import release_where


class BSPProtocol(Protocol):
  """Everyone pushes, the server applies once, everyone pulls."""

  name = "bsp"

  def __init__(self, num_workers: int):
    super().__init__(transforms.check_int("bsp", "num_workers", num_workers, 1))

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.clock[worker] += 1
    self.blocked[worker] = True
    reaction = Reaction()
    if self.blocked.all():
      rnd = self.new_round(time)
      rnd.arrived[:] = True
      rnd.applies[0] = True
      release_where(self, rnd, np.ones([self.num_workers], bool), reaction)
      reaction.rounds.append(rnd)
    return reaction


class SSPProtocol(Protocol):
  """SSP(s): a push is applied at once; a worker more than ``s`` clocks ahead of the slowest waits.

  A worker that has pushed ``c`` times may start its next iteration only while
  ``c - min(clock) <= s``; ``staleness=None`` is ASP (never wait). The waiting
  worker pulls when it is released, so it starts from the freshest weights.
  """

  name = "ssp"

  def __init__(self, num_workers: int, staleness: int | None = 3):
    num_workers = transforms.check_int(self.name, "num_workers", num_workers, 1)
    super().__init__(num_workers)
    self.staleness = (None if staleness is None
                      else transforms.check_int(self.name, "staleness", staleness, 0))

  def allowance(self, worker: int, time: float) -> float:
    """How many clocks ``worker`` may be ahead of the slowest (called after its push)."""
    return np.inf if self.staleness is None else self.staleness

  def ahead(self) -> np.ndarray:
    return self.clock - self.clock.min()

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.clock[worker] += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    rnd.applies[0] = True
    reaction = Reaction(rounds=[rnd])
    self.blocked[worker] = True
    ahead = self.ahead()
    ok = np.array([ahead[w] <= self.allowance(w, time) if self.blocked[w] else False
                   for w in range(self.num_workers)])
    release_where(self, rnd, ok, reaction)
    return reaction


class ASPProtocol(SSPProtocol):
  """ASP: SSP without a bound; nobody ever waits."""

  name = "asp"

  def __init__(self, num_workers: int):
    super().__init__(num_workers, staleness=None)


class DSSPProtocol(SSPProtocol):
  """DSSP (Zhao et al. 2019): SSP whose threshold moves in ``[s_L, s_U]``.

  A worker within ``s_L`` of the slowest goes on. When the *fastest* worker
  (the one with the most pushes) would exceed ``s_L``, the controller predicts
  from the last two push timestamps the slowest worker's next push and the
  fastest worker's iteration time, and grants the fastest
  ``r = floor((t_slowest_next - now) / t_iter_fastest)`` extra iterations,
  clipped to ``[0, s_U - s_L]``: the most it can run without outpacing the
  slowest's next push, so it waits as little as possible. Everyone else waits
  at ``s_L``. A grant lasts until the worker is back within ``s_L`` or is no
  longer the fastest.
  ``thresholds`` records ``(time, worker, threshold)`` for every decision.
  """

  name = "dssp"

  def __init__(self, num_workers: int, staleness_range=(3, 15)):
    low, high = transforms.check_staleness_range("dssp", staleness_range)
    super().__init__(num_workers, staleness=low)
    self.low, self.high = low, high
    self.last = np.full([self.num_workers], np.nan)   # last push time
    self.prev = np.full([self.num_workers], np.nan)   # the one before
    self.granted = np.full([self.num_workers], low, np.int64)
    self.thresholds: list[tuple[float, int, int]] = []

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.prev[worker], self.last[worker] = self.last[worker], float(time)
    return super().on_push(worker, time)

  def _extra(self, worker: int, time: float) -> int:
    slow = int(np.argmin(self.clock))
    t_fast = self.last[worker] - self.prev[worker]
    t_slow = self.last[slow] - self.prev[slow]
    if not (np.isfinite(t_fast) and np.isfinite(t_slow)) or t_fast <= 0:
      return 0  # Not enough history to predict: behave as SSP(s_L).
    slow_next = self.last[slow] + t_slow
    r = int(np.floor((slow_next - time) / t_fast))
    return int(np.clip(r, 0, self.high - self.low))

  def allowance(self, worker, time):
    ahead = self.clock[worker] - self.clock.min()
    if ahead <= self.low or self.clock[worker] != self.clock.max():
      self.granted[worker] = self.low
    elif self.granted[worker] == self.low:
      self.granted[worker] = self.low + self._extra(worker, time)
    self.thresholds.append((float(time), int(worker), int(self.granted[worker])))
    return self.granted[worker]
