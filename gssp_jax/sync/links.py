"""Links shared by the transfers that overlap on them: a server's network interface, a topology.

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

A link's capacity is the links' ``capacity`` unless its first transfer names
another (``start``'s ``capacity``: a node's local link, say), kept while the
link exists.

With a network topology (``sim/topology.py``) a transfer crosses several shared links (a
region's uplink, the pipe between two regions, the server's interface): :class:`NetworkLinks`
shares each link max-min fairly over the whole network (progressive filling).

Host state only (plain Python and NumPy scalars), pickled with the timeline
engine's checkpoint.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Hashable

from gssp_jax import host_state

# A transfer with less than this many seconds left at its rate is done (float rounding of the
# event times, which are sums of seconds: about 1e-11 s after a day of virtual time).
_DONE_SECONDS = 1e-9


def _checked_capacity(capacity: float) -> float:
  if not capacity > 0:
    raise ValueError(f"a shared link's bandwidth is {capacity!r}; allowed: > 0 bytes/s")
  return float(capacity)


def _start_number(entry: tuple) -> int:
  return entry[1]


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

  @staticmethod
  def event_key(key):
    """The key the engine's events name for a transfer started on ``key``: the link itself
    (its shares change only with its own transfers)."""
    return key

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self.__dict__.setdefault("capacities", {})   # a checkpoint from before per-link capacities

  def __init__(self, capacity: float):
    if not capacity > 0:
      raise ValueError(f"a shared link's bandwidth is {capacity!r}; allowed: > 0 bytes/s")
    self.capacity = float(capacity)
    self.capacities: dict = {}   # the links whose capacity is not ``capacity``
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
    capacity = self.capacities.get(key, self.capacity)
    for t, rate in zip(transfers, max_min_rates([t.cap for t in transfers], capacity)):
      t.rate = rate
    self.version[key] = self.version.get(key, 0) + 1

  def start(self, key, now: float, tag: Hashable, num_bytes: float, cap: float,
            capacity: float | None = None) -> int:
    """A transfer of ``num_bytes`` at most ``cap`` bytes/s starts on ``key``; returns its version.

    The version names the link's state: an end computed for an older version
    is stale (shares changed since). ``capacity``: the link's bytes/s, if not
    the links' (read when the link is made).
    """
    if not cap > 0:
      raise ValueError(f"transfer {tag!r} has a cap of {cap!r} bytes/s; allowed: > 0")
    if key not in self.transfers and capacity is not None:
      self.capacities[key] = _checked_capacity(capacity)
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


@dataclasses.dataclass
class _Link:
  """One link of :class:`EqualShareLinks`: a service clock and its transfers' finish marks.

  Attributes:
    served: bytes each transfer in progress has received since the link was made, at ``since``.
    since: the time of ``served``.
    rate: each transfer's bytes/s now.
    cap: the transfers' common cap (bytes/s).
    capacity: the link's bytes/s, or None: the links' ``capacity``.
    heap: ``(served at which it ends, start number, tag)`` of each transfer in progress.
    starts: transfers started so far (orders ties and tags).
  """
  served: float = 0.0
  since: float = 0.0
  rate: float = 0.0
  cap: float = 0.0
  heap: list = dataclasses.field(default_factory=list)
  starts: int = 0
  capacity: float | None = None


class EqualShareLinks:
  """:class:`SharedLinks` for links whose transfers all have the same cap (``cap`` bytes/s).

  Max-min fairness among equal caps gives every transfer the same rate,
  ``min(cap, capacity / n)``, so one service clock per link (the bytes each
  transfer in progress has received) replaces updating every transfer at
  every event: starting and ending a transfer costs ``O(log n)``, not
  ``O(n)``, which is what 256 workers pushing into one server need. Same
  schedule as :class:`SharedLinks` (to float rounding: a transfer's remaining
  bytes are a difference of two sums here, a running difference there), same
  interface. The simulator uses it when every worker's link has the same
  bandwidth (``sim/traffic.py``).
  """

  event_key = staticmethod(SharedLinks.event_key)

  def __init__(self, capacity: float):
    if not capacity > 0:
      raise ValueError(f"a shared link's bandwidth is {capacity!r}; allowed: > 0 bytes/s")
    self.capacity = float(capacity)
    self.links: dict = {}
    self.version: dict = {}

  def _advance(self, link: _Link, now: float) -> None:
    if now > link.since:
      link.served += link.rate * (now - link.since)
    link.since = now

  def _share(self, key, link: _Link) -> None:
    heap = link.heap
    capacity = self.capacity if link.capacity is None else link.capacity
    link.rate = min(link.cap, capacity / len(heap)) if heap else 0.0
    version = self.version
    version[key] = version.get(key, 0) + 1

  def start(self, key, now: float, tag: Hashable, num_bytes: float, cap: float,
            capacity: float | None = None) -> int:
    """A transfer of ``num_bytes`` at most ``cap`` bytes/s starts on ``key``; returns its version.
    ``capacity``: the link's bytes/s, if not the links' (read when the link is made)."""
    cap = float(cap)
    if not cap > 0:
      raise ValueError(f"transfer {tag!r} has a cap of {cap!r} bytes/s; allowed: > 0")
    link = self.links.get(key)
    if link is None:
      link = self.links[key] = _Link(since=float(now), cap=cap, capacity=(
          None if capacity is None else _checked_capacity(capacity)))
    if now > link.since:   # _advance, inline (every push and pull starts a transfer)
      link.served += link.rate * (now - link.since)
    link.since = now
    if link.heap and cap != link.cap:
      raise ValueError(f"transfer {tag!r} has a cap of {cap!r} bytes/s on a link whose transfers "
                       f"have {link.cap!r}; allowed: the same cap (else use SharedLinks)")
    link.cap = cap
    heapq.heappush(link.heap, (link.served + float(num_bytes), link.starts, tag))
    link.starts += 1
    self._share(key, link)
    return self.version[key]

  def next_end(self, key) -> float | None:
    """When the first transfer on ``key`` ends at the present shares (None: none in progress)."""
    link = self.links.get(key)
    if link is None or not link.heap:
      return None
    return link.since + max(link.heap[0][0] - link.served, 0.0) / link.rate

  def finish(self, key, now: float) -> list:
    """The tags of the transfers on ``key`` that have ended by ``now``, in start order."""
    link = self.links[key]
    self._advance(link, now)
    heap, served, slack = link.heap, link.served, link.rate * _DONE_SECONDS
    done = []
    while heap and heap[0][0] - served <= slack:
      done.append(heapq.heappop(heap))
    if not done:
      return []
    self._share(key, link)
    if len(done) > 1:
      done.sort(key=_start_number)
    return [tag for _, _, tag in done]

  def cancel(self, now: float, drop) -> list:
    """Removes every transfer whose tag satisfies ``drop`` (a crashed worker's); returns the keys."""
    changed = []
    for key, link in self.links.items():
      if any(drop(tag) for _, _, tag in link.heap):
        self._advance(link, now)
        link.heap = [entry for entry in link.heap if not drop(entry[2])]
        heapq.heapify(link.heap)
        self._share(key, link)
        changed.append(key)
    return changed

  def tags(self) -> list:
    """Tags of every transfer in progress."""
    return [tag for link in self.links.values() for _, _, tag in link.heap]


def network_rates(paths: list[tuple], caps: list[float], capacities: dict) -> list[float]:
  """Max-min fair rates of transfers each crossing the links of its path (progressive filling).

  Every transfer not yet fixed grows at one common level; a transfer stops at its own cap, and
  every transfer on a link stops when that link is full. ``paths[i]``: the link keys transfer i
  crosses; ``caps[i]``: its own bytes/s limit; ``capacities``: each link's bytes/s. With one
  link per path this is :func:`max_min_rates`.
  """
  n = len(paths)
  rates = [0.0] * n
  active = set(range(n))
  left = dict(capacities)
  while active:
    on = {}
    for i in sorted(active):
      for key in paths[i]:
        on.setdefault(key, []).append(i)
    shares = {key: left[key] / len(ids) for key, ids in on.items()}
    level = min([caps[i] for i in active] + list(shares.values()))
    slack = level * 1e-12
    fixed = {i for i in active if caps[i] <= level + slack}
    for key, share in shares.items():
      if share <= level + slack:
        fixed.update(on[key])
    for i in sorted(fixed):
      rates[i] = level
      for key in paths[i]:
        left[key] = max(left[key] - level, 0.0)
    active -= fixed
  return rates


class NetworkLinks:
  """Links shared by transfers that each cross several of them (a network topology's path).

  A transfer's rate is its max-min fair share over every link of its path
  (:func:`network_rates`), recomputed whenever a transfer starts or ends anywhere, so between
  those events every transfer moves at a constant rate. Since one start can change the rates
  on every link, the engine sees the network as one link: :meth:`event_key` names it
  (``"network"``), one event is current at a time (the next end anywhere), and an event of
  an older :attr:`version` is stale. ``start``'s ``key`` is the path: ``((link, bytes/s or
  None), ...)``, None meaning the links' ``capacity`` (a server's interface); a link's
  capacity is fixed by the first transfer that names it. Same interface as :class:`SharedLinks`
  otherwise, and the same schedule where every path is one link.
  """

  NETWORK = "network"

  def __init__(self, capacity: float):
    self.capacity = _checked_capacity(capacity)
    self.capacities: dict = {}
    self.transfers: list = []   # [_Transfer, path] in start order
    self.since = 0.0
    self.version = {self.NETWORK: 0}

  @classmethod
  def event_key(cls, key):
    del key
    return cls.NETWORK

  def _advance(self, now: float) -> None:
    dt = now - self.since
    if dt > 0:
      for t, _ in self.transfers:
        t.remaining -= t.rate * dt
    self.since = max(self.since, now)

  def _share(self) -> None:
    paths = [path for _, path in self.transfers]
    rates = network_rates(paths, [t.cap for t, _ in self.transfers], self.capacities)
    for (t, _), rate in zip(self.transfers, rates):
      t.rate = rate
    self.version[self.NETWORK] += 1

  def start(self, key, now: float, tag: Hashable, num_bytes: float, cap: float,
            capacity: float | None = None) -> int:
    """A transfer of ``num_bytes`` at most ``cap`` bytes/s starts on the path ``key``; returns
    the network's version. ``capacity``: the first hop's bytes/s where the path leaves it None."""
    if not cap > 0:
      raise ValueError(f"transfer {tag!r} has a cap of {cap!r} bytes/s; allowed: > 0")
    path = []
    for i, (link, link_capacity) in enumerate(key):
      if link not in self.capacities:
        given = link_capacity if link_capacity is not None else (
            capacity if i == 0 and capacity is not None else self.capacity)
        self.capacities[link] = _checked_capacity(given)
      path.append(link)
    self._advance(now)
    self.transfers.append((_Transfer(tag, float(num_bytes), float(cap)), tuple(path)))
    self._share()
    return self.version[self.NETWORK]

  def next_end(self, key) -> float | None:
    """When the first transfer anywhere ends at the present rates (None: none in progress)."""
    del key
    if not self.transfers:
      return None
    return self.since + min(max(t.remaining, 0.0) / t.rate for t, _ in self.transfers)

  def finish(self, key, now: float) -> list:
    """The tags of the transfers that have ended by ``now``, in start order."""
    del key
    self._advance(now)
    done = [entry for entry in self.transfers
            if entry[0].remaining <= entry[0].rate * _DONE_SECONDS]
    if done:
      ended = set(map(id, done))
      self.transfers = [entry for entry in self.transfers if id(entry) not in ended]
      self._share()
    return [t.tag for t, _ in done]

  def cancel(self, now: float, drop) -> list:
    """Removes every transfer whose tag satisfies ``drop``; returns ``["network"]`` if any."""
    if not any(drop(t.tag) for t, _ in self.transfers):
      return []
    self._advance(now)
    self.transfers = [entry for entry in self.transfers if not drop(entry[0].tag)]
    self._share()
    return [self.NETWORK]

  def tags(self) -> list:
    """Tags of every transfer in progress."""
    return [t.tag for t, _ in self.transfers]


# The links' transfers in flight are host state.
host_state.allow(SharedLinks, _Transfer, EqualShareLinks, _Link, NetworkLinks)
