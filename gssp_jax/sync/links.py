"""Links shared by the transfers that overlap on them: a server's network interface.

A parameter server receives every push through one network interface and
sends every pull through it. When W workers push at once (BSP's incast) they
share that interface: each transfer gets a share of the server's bandwidth,
and none goes faster than its own worker's link. :class:`SharedLinks` models
each server's interface as two links (in: pushes; out: pulls; full duplex),
each dividing its bandwidth among the transfers in progress by **max-min
fairness** (water-filling): a transfer capped by its worker's link below an
equal share gets its cap, and what it leaves is shared by the others, as TCP
flows into one bottleneck converge to. Shares change only when a transfer
starts or ends, so between those events every transfer moves at a constant
rate and its end is exact: :meth:`next_end` is when the first of them ends.

Host state only (plain Python and NumPy scalars), pickled with the timeline
engine's checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable

# A transfer with less than this many seconds left at its rate is done (float rounding of the
# event times, which are sums of seconds: about 1e-11 s after a day of virtual time).
_DONE_SECONDS = 1e-9


@dataclasses.dataclass
class _Transfer:
  tag: Hashable
  remaining: float
  cap: float
  rate: float = 0.0


def max_min_rates(caps: list[float], capacity: float) -> list[float]:
  """Max-min fair rates of transfers with ``caps`` sharing ``capacity`` (water-filling)."""
  rates = [0.0] * len(caps)
  left, count = float(capacity), len(caps)
  for i in sorted(range(len(caps)), key=lambda i: caps[i]):
    rates[i] = min(caps[i], left / count)
    left -= rates[i]
    count -= 1
  return rates


class SharedLinks:
  """Links of ``capacity`` bytes/s each, each shared by its transfers in progress (max-min fair).

  A link is named by any hashable key (the engine uses ``(server, "in")`` and
  ``(server, "out")``) and exists from its first transfer.
  """

  def __init__(self, capacity: float):
    if not capacity > 0:
      raise ValueError(f"a shared link's bandwidth is {capacity!r}; allowed: > 0 bytes/s")
    self.capacity = float(capacity)
    self.transfers: dict = {}
    self.since: dict = {}
    self.version: dict = {}

  def _advance(self, key, now: float) -> None:
    dt = now - self.since.get(key, now)
    if dt > 0:
      for t in self.transfers[key]:
        t.remaining -= t.rate * dt
    self.since[key] = now

  def _share(self, key) -> None:
    transfers = self.transfers[key]
    for t, rate in zip(transfers, max_min_rates([t.cap for t in transfers], self.capacity)):
      t.rate = rate
    self.version[key] = self.version.get(key, 0) + 1

  def start(self, key, now: float, tag: Hashable, num_bytes: float, cap: float) -> int:
    """A transfer of ``num_bytes`` at most ``cap`` bytes/s starts on ``key``; returns its version.

    The version names the link's state: an end computed for an older version
    is stale (shares changed since).
    """
    if not cap > 0:
      raise ValueError(f"transfer {tag!r} has a cap of {cap!r} bytes/s; allowed: > 0")
    self.transfers.setdefault(key, [])
    self._advance(key, now)
    self.transfers[key].append(_Transfer(tag, float(num_bytes), float(cap)))
    self._share(key)
    return self.version[key]

  def next_end(self, key) -> float | None:
    """When the first transfer on ``key`` ends at the present shares (None: none in progress)."""
    transfers = self.transfers.get(key)
    if not transfers:
      return None
    return self.since[key] + min(max(t.remaining, 0.0) / t.rate for t in transfers)

  def finish(self, key, now: float) -> list:
    """The tags of the transfers on ``key`` that have ended by ``now``, in start order.

    They leave the link, and the others' shares are recomputed.
    """
    self._advance(key, now)
    transfers = self.transfers[key]
    done = [t for t in transfers if t.remaining <= t.rate * _DONE_SECONDS]
    if done:
      self.transfers[key] = [t for t in transfers if t not in done]
      self._share(key)
    return [t.tag for t in done]

  def cancel(self, now: float, drop) -> list:
    """Removes every transfer whose tag satisfies ``drop`` (a crashed worker's); returns the keys."""
    changed = []
    for key, transfers in self.transfers.items():
      if any(drop(t.tag) for t in transfers):
        self._advance(key, now)
        self.transfers[key] = [t for t in transfers if not drop(t.tag)]
        self._share(key)
        changed.append(key)
    return changed

  def tags(self) -> list:
    """Tags of every transfer in progress."""
    return [t.tag for transfers in self.transfers.values() for t in transfers]
