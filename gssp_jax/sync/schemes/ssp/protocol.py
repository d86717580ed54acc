"""Single-server protocols: BSP, ASP, SSP(s) and DSSP([s_L, s_U])."""

from __future__ import annotations

import bisect
import math

import numpy as np

from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import all_of
from gssp_jax.sync.protocol import alive_min
from gssp_jax.sync.protocol import any_of
from gssp_jax.sync.protocol import greatest
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction
from gssp_jax.sync.protocol import release_ids
from gssp_jax.sync.protocol import release_where


class BSPProtocol(Protocol):
  """Everyone pushes, the server applies once, everyone pulls.

  Membership: the barrier waits for the alive workers only. A push that
  reached the barrier before its worker was dropped is kept and applied with
  the others (``orphans``); if the worker rejoins first, it is discarded, since
  the worker computes this round's gradient again from the same weights.
  A rejoining worker joins the round in progress: the barrier now waits for
  it too (it starts from the weights everyone else's gradient is computed on).
  """

  name = "bsp"
  round_fields = ()
  barrier = True
  supports_membership = True

  def __init__(self, num_workers: int):
    super().__init__(arguments.check_int("bsp", "num_workers", num_workers, 1))

  def _membership_defaults(self):
    # orphans: ``[W]`` bool, pushes of dropped workers waiting for the barrier.
    return {**super()._membership_defaults(), "orphans": np.zeros([self.num_workers], bool)}

  def on_push(self, worker, time):
    return self._push(self.check_worker(worker), time)

  def _push(self, worker: int, time: float) -> Reaction:
    """:meth:`on_push` of a checked ``worker``."""
    self.clock[worker] += 1
    self.blocked[worker] = True
    reaction = Reaction()
    self._maybe_barrier(time, reaction)
    return reaction

  def round_bounds(self):
    return self.num_workers, 1   # the barrier: everyone's push, one server

  def _maybe_barrier(self, time, reaction) -> None:
    """Applies the round once every alive worker has pushed; everyone alive pulls."""
    if not (any_of(self.alive) and all_of(self.blocked[self.alive])):
      return
    rnd = self.new_round(time)
    rnd.arrived[:] = self.alive | self.orphans
    rnd.applies[0] = True
    self.orphans[:] = False
    release_where(self, rnd, self.alive, reaction)
    reaction.rounds.append(rnd)

  def _after_drop(self, worker, time, was_blocked):
    self.orphans[worker] = was_blocked   # its push this round still counts
    reaction = Reaction()
    self._maybe_barrier(time, reaction)
    return reaction

  def _after_rejoin(self, worker, time):
    self.orphans[worker] = False


class SSPProtocol(Protocol):
  """SSP(s): a push is applied at once; a worker more than ``s`` clocks ahead of the slowest waits.

  A worker that has pushed ``c`` times may start its next iteration only while
  ``c - min(clock) <= s``; ``staleness=None`` is ASP (never wait). The waiting
  worker pulls when it is released, so it starts from the freshest weights.

  Membership: ``min(clock)`` is over the alive workers, so a dropped worker
  holds nobody back; the drop releases whom the new minimum lets go.
  """

  name = "ssp"
  round_fields = ()
  supports_membership = True

  def __init__(self, num_workers: int, staleness: int | None = 3):
    num_workers = arguments.check_int(self.name, "num_workers", num_workers, 1)
    super().__init__(num_workers)
    self.staleness = (None if staleness is None
                      else arguments.check_int(self.name, "staleness", staleness, 0))

  def round_bounds(self):
    return 1, 1   # one push per round, at the one server

  def allowance(self, worker: int, time: float) -> float:
    """How many clocks ``worker`` may be ahead of the slowest (called after its push)."""
    return np.inf if self.staleness is None else self.staleness

  def ahead(self) -> np.ndarray:
    """``[W]`` clocks ahead of the slowest alive worker."""
    return self.clock - alive_min(self.clock, self.alive)

  def on_push(self, worker, time):
    return self._push(self.check_worker(worker), time)

  def _push(self, worker: int, time: float) -> Reaction:
    """:meth:`on_push` of a checked ``worker``."""
    self.clock[worker] += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    rnd.applies[0] = True
    reaction = Reaction(rounds=[rnd])
    self.blocked[worker] = True
    self._release_within_bound(rnd, reaction, time)
    return reaction

  def _release_within_bound(self, rnd, reaction, time) -> None:
    """Releases the blocked workers within their allowance of the slowest alive one."""
    blocked = self.blocked.nonzero()[0]
    if not blocked.size:
      return
    if self.staleness is None and type(self).allowance is SSPProtocol.allowance:
      release_ids(self, rnd, blocked, reaction)   # ASP: no bound, everyone goes on
      return
    ahead = self.clock[blocked] - alive_min(self.clock, self.alive)
    release_ids(self, rnd, blocked[self._within(blocked, ahead, time)], reaction)

  def _within(self, blocked: np.ndarray, ahead: np.ndarray, time: float) -> np.ndarray:
    """Which ``blocked`` workers (ascending; ``ahead`` clocks ahead of the slowest) are within
    their :meth:`allowance`, which is called for each of them in that order."""
    if type(self).allowance is SSPProtocol.allowance:
      return ahead <= self.staleness   # the same bound for everyone
    return ahead <= np.array([self.allowance(w, time) for w in blocked.tolist()], np.float64)

  def _after_drop(self, worker, time, was_blocked):
    rnd = self.new_round(time)
    reaction = Reaction()
    self._release_within_bound(rnd, reaction, time)
    if reaction.release:
      reaction.rounds.append(rnd)
    return reaction


class ASPProtocol(SSPProtocol):
  """ASP: SSP without a bound; nobody ever waits."""

  name = "asp"

  def __init__(self, num_workers: int):
    super().__init__(num_workers, staleness=None)


class DSSPProtocol(SSPProtocol):
  """DSSP (Zhao, An, Liu, Chen, ICDCS 2019, arXiv 1908.11848): SSP with credited extra iterations.

  Sources: the paper's text was not available to us; the rule follows a close
  paraphrase of its Algorithm 1 and a public reimplementation of its
  Algorithm 2.

  Server rule (Algorithm 1). Each worker ``p`` holds a credit ``r_p`` (extra
  iterations it may still run beyond ``s_L``; starts at 0). On a push from
  ``p`` (its clock ``t_p`` grows by one, the update is applied):

  * ``r_p > 0``: ``r_p -= 1`` and ``p`` goes on, with no staleness check;
  * else, ``t_p - t_slowest <= s_L``: ``p`` goes on;
  * else, ``p`` is the fastest (its clock is the largest): the
    synchronization controller sets ``r_p``; if ``r_p > 0``, ``p`` goes on and
    this go-ahead counts as one of the ``r_p`` (our choice: the paraphrase
    leaves open whether it is ``r`` or ``r + 1`` further iterations), so
    ``r_p - 1`` credit is left;
  * else ``p`` waits, and is released (it pulls) by the first push after
    which ``t_p - t_slowest <= s_L`` again. A waiting worker neither spends
    credit nor consults the controller: only the pushing worker does.

  Synchronization controller (Algorithm 2). The last two push times of every
  worker give the fastest worker's iteration interval ``I_f`` and the slowest
  worker's ``I_s``. The fastest worker's next pushes are simulated at
  ``now + i * I_f`` for ``i = 0..r_max`` (``r_max = s_U - s_L``), the slowest
  worker's at ``last_s + k * I_s`` for ``k = 1..K`` (K covers the fastest's
  horizon), and ``r`` is the ``i`` whose time is closest to *any* of the
  slowest's simulated pushes: the least estimated waiting time. Ties go to the
  smaller ``i``. Without two pushes of both workers there is nothing to
  predict from: ``r = 0`` (SSP(s_L)).

  Our safety bound (not in the paraphrase): a worker never starts an
  iteration more than ``s_U`` clocks ahead of the slowest. Credit is spent
  without checks, so the candidates are also capped at ``s_U - ahead + 1``
  (``ahead`` counted after the push): the go-ahead now starts at ``ahead``, the
  last credited one at most at ``ahead + r - 1 <= s_U``. At the first push
  beyond ``s_L`` (``ahead = s_L + 1``) the cap is exactly ``r_max``.

  Membership: the slowest and the fastest are the alive ones. A drop is no
  push: the waiting workers it may release wait for ``s_L`` (nobody spends
  credit or meets the controller). A rejoining worker has no credit and no
  push history (its last push times predate its absence).

  Attributes:
    credit: ``[W]`` int64, the credit ``r_p`` each worker has left.
    thresholds: ``(time, worker, r)`` of every controller decision, ``r = 0``
      included (also when there was no history to predict from).
  """

  name = "dssp"

  def __init__(self, num_workers: int, staleness_range=(3, 15)):
    low, high = arguments.check_staleness_range("dssp", staleness_range)
    super().__init__(num_workers, staleness=low)
    self.low, self.high = low, high
    self.last = np.full([self.num_workers], np.nan)   # last push time
    self.prev = np.full([self.num_workers], np.nan)   # the one before
    self.credit = np.zeros([self.num_workers], np.int64)
    self.thresholds: list[tuple[float, int, int]] = []
    self._pusher = -1

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.prev[worker], self.last[worker] = self.last[worker], float(time)
    self._pusher = worker
    return self._push(worker, time)

  def extra_iterations(self, worker: int, time: float) -> int | None:
    """The controller's ``r`` for ``worker`` pushing at ``time`` (None: no history yet).

    Reads the clocks (after the push) and the push times; changes nothing. The fastest
    worker's candidate pushes are ``time + i * I_f``; each one's waiting time is its distance to
    the nearest of the slowest's pushes ``last_s + k * I_s`` (``k = 1..K``), which rise with
    ``k``, so the nearest is one of the two around it, found by bisection (the same floats as
    comparing with every ``k``, in plain Python: this runs at many pushes of the fastest worker).
    """
    clock = self.clock
    if all_of(self.alive):   # nobody dropped: no gather (the first slowest alive worker)
      slow = int(clock.argmin())
    else:
      alive = self.alive.nonzero()[0]
      slow = int(alive[clock[alive].argmin()])
    last, prev = self.last, self.prev
    last_s = float(last[slow])
    i_fast = float(last[worker] - prev[worker])
    i_slow = last_s - float(prev[slow])
    if not (math.isfinite(i_fast) and math.isfinite(i_slow)) or i_fast <= 0 or i_slow <= 0:
      return None
    ahead = int(clock[worker] - clock[slow])
    r_cap = max(0, min(self.high - self.low, self.high - ahead + 1))
    num_slow = max(1, math.ceil((time + r_cap * i_fast - last_s) / i_slow) + 1)
    slow_pushes = [last_s + k * i_slow for k in range(1, num_slow + 1)]
    first, final, after = slow_pushes[0], slow_pushes[-1], bisect.bisect_right
    best, best_r = math.inf, 0
    for r in range(r_cap + 1):
      fast = time + r * i_fast
      if fast <= first:
        wait = first - fast
      elif fast >= final:
        wait = fast - final
      else:   # slow_pushes[k - 1] <= fast < slow_pushes[k]
        k = after(slow_pushes, fast)
        wait, later = fast - slow_pushes[k - 1], slow_pushes[k] - fast
        if later < wait:
          wait = later
      if wait < best:   # the first minimum: ties go to the smaller r
        best, best_r = wait, r
    return best_r

  def _within(self, blocked, ahead, time):
    """Only the pusher's allowance is more than ``s_L`` (:meth:`allowance`): one call, not one
    per waiting worker (which returned ``s_L`` and changed nothing)."""
    within = ahead <= self.low
    pusher = self._pusher
    if pusher >= 0:
      ids = blocked.tolist()
      if pusher in ids:
        i = ids.index(pusher)
        within[i] = ahead[i] <= self._pusher_allowance(pusher, time, int(ahead[i]))
    return within

  def allowance(self, worker, time):
    if worker != self._pusher:      # a waiting worker waits until it is within s_L
      return self.low
    return self._pusher_allowance(worker, time,
                                  int(self.clock[worker] - alive_min(self.clock, self.alive)))

  def _pusher_allowance(self, worker: int, time: float, ahead: int) -> float:
    """:meth:`allowance` of the pusher, ``ahead`` clocks ahead of the slowest alive worker."""
    if self.credit[worker] > 0:     # credited: goes on without a check
      self.credit[worker] -= 1
      return np.inf
    if ahead <= self.low or self.clock[worker] != self._alive_max():
      return self.low
    r = self.extra_iterations(worker, time) or 0
    self.thresholds.append((float(time), int(worker), int(r)))
    if r > 0:                       # this go-ahead is one of the r
      self.credit[worker] = r - 1
      return np.inf
    return self.low

  def _alive_max(self) -> int:
    """The largest clock of the alive workers (some are: the pusher is)."""
    alive = self.alive
    return int(greatest(self.clock) if all_of(alive) else greatest(self.clock[alive]))

  def _after_drop(self, worker, time, was_blocked):
    self._pusher = -1   # nobody pushed: every waiting worker waits for s_L
    self.credit[worker] = 0
    return super()._after_drop(worker, time, was_blocked)

  def _after_rejoin(self, worker, time):
    self.credit[worker] = 0
    self.last[worker] = self.prev[worker] = np.nan
