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
  """DSSP (Zhao et al., ICDCS 2019): SSP whose threshold is re-decided in ``[s_L, s_U]``.

  The paper's server rule (Sec. III, Algorithms 1-2, as we read it): a worker
  within ``s_L`` iterations of the slowest goes on at once. When the *fastest*
  worker pushes beyond ``s_L``, the synchronization controller predicts, from
  the last two push timestamps kept per worker, the slowest worker's next push
  (``t_slow + I_slow``) and the fastest worker's iteration time ``I_fast``,
  simulates the fastest worker's next pushes ``now + r * I_fast`` and gives it
  the ``r`` extra iterations whose push lands **closest** to the slowest's
  next push, so that when it must wait it waits least. This is re-decided at
  **every** push of the fastest worker beyond ``s_L`` (the prediction uses the
  newest timestamps each time), never granted once for good.

  Here: the extra iterations ``r`` count from now, and the worker never runs
  more than ``s_U`` ahead, so the candidates are ``r in [0, s_U - ahead + 1]``
  (exactly the paper's ``[0, s_U - s_L]`` at the first push beyond ``s_L``);
  ties go to the smaller ``r``. The decision sets the worker's threshold to
  ``ahead - 1 + r``: ``r = 0`` blocks it until the slowest pushes, ``r >= 1``
  lets it start its next iteration. Without two pushes of both workers there
  is nothing to predict from and the worker waits at ``s_L`` (SSP(s_L)).
  Every other worker beyond ``s_L`` waits at ``s_L``; a waiting worker keeps
  its last threshold until someone's push releases it.
  ``thresholds`` records ``(time, worker, threshold)`` of every controller
  decision.
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
    self._pusher = -1

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.prev[worker], self.last[worker] = self.last[worker], float(time)
    self._pusher = worker
    return super().on_push(worker, time)

  def extra_iterations(self, worker: int, time: float) -> int | None:
    """The controller's ``r`` for ``worker`` pushing at ``time`` (None: no history yet)."""
    slow = int(np.argmin(self.clock))
    i_fast = self.last[worker] - self.prev[worker]
    i_slow = self.last[slow] - self.prev[slow]
    if not (np.isfinite(i_fast) and np.isfinite(i_slow)) or i_fast <= 0:
      return None
    slow_next = self.last[slow] + i_slow
    ahead = int(self.clock[worker] - self.clock.min())
    candidates = np.arange(0, self.high - ahead + 2)
    return int(candidates[np.argmin(np.abs(time + candidates * i_fast - slow_next))])

  def allowance(self, worker, time):
    ahead = self.clock[worker] - self.clock.min()
    if ahead <= self.low or self.clock[worker] != self.clock.max():
      self.granted[worker] = self.low
    elif worker == self._pusher:   # the fastest pushed beyond s_L: the controller decides
      r = self.extra_iterations(worker, time)
      self.granted[worker] = self.low if r is None else min(ahead - 1 + r, self.high)
      self.thresholds.append((float(time), int(worker), int(self.granted[worker])))
    return self.granted[worker]
