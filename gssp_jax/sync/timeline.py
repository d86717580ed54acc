"""A discrete-event run of a protocol over given compute and communication times.

This is the gradient-free half of a simulation: it produces the rounds, in
order, that an executor replays with real gradients (``rounds.apply_round``).
The cluster model (speeds, jitter, stragglers, bandwidth) only supplies the
callables; protocols never see times other than event timestamps. A server's
update time (``update_time``) queues its updates and delays what leaves it (a
pull, a message); a compressor's time (``compress_time``) delays every push's
departure. The protocol sees neither: it decides at each event as before.
:class:`TimelineEngine` runs event by event (the simulator interleaves it with
the executor and checkpoints it); :func:`run_timeline` runs it to the end.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Callable

import numpy as np

from gssp_jax.sync import links as links_lib
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol


@dataclasses.dataclass
class Timeline:
  """What a run of a protocol produced.

  Attributes:
    rounds: the rounds in event order.
    starts: ``(time, worker, iteration)`` of every iteration start.
    pushes: ``(time, worker, iteration)`` of every push reaching the server.
    blocked_time: ``[W]`` virtual time each worker spent waiting to be released.
    end_time: time of the last event.
    events: ``(kind, time, worker_or_message)`` of every processed event, in
      processing order (kinds "start", "push", "message", and "drop", "rejoin"
      when scheduled with :meth:`TimelineEngine.drop_at` / ``rejoin_at``).
  """
  rounds: list
  starts: list
  pushes: list
  blocked_time: np.ndarray
  end_time: float
  events: list


class TimelineEngine:
  """The event loop: a heap of (time, sequence, kind, payload), processed one at a time.

  Events at the same time are processed in the order they were scheduled, so a
  run is deterministic. Host state only (``state_dict`` pickles it for exact
  resumption); the time callables are supplied again on restore.

  Args:
    protocol: a fresh protocol.
    compute_time: ``(worker, iteration) -> seconds`` of one local iteration.
    push_delay: ``(worker, iteration) -> seconds`` from the end of compute to arrival.
    pull_delay: ``worker -> seconds`` from release to the next start (weights' transfer).
    message_delay: ``message -> seconds`` for server-to-server messages.
    record: keep ``starts``/``pushes``/``events`` lists (tests, small runs).
    route: ``(kind, worker, iteration) -> (link, bytes, cap, latency[, capacity])
      | None``: with it, a push (kind "push", at the end of compute) or a pull
      ("pull", at the release) that is routed crosses ``link``, shared with
      the other transfers on it (``links.SharedLinks``): ``bytes`` at most
      ``cap`` bytes/s, then ``latency`` seconds; ``capacity``: the link's
      bytes/s, if not ``link_bandwidth``. A transfer routed None (and every
      one without ``route``) takes ``push_delay`` / ``pull_delay`` alone.
    message_route: ``message -> (link, bytes, cap, latency[, capacity]) | None``
      (with ``route``): a message routed so crosses ``link`` as a routed push
      does; one routed None takes ``message_delay``.
    link_bandwidth: bytes/s of every shared link (with ``route``).
    equal_caps: every routed transfer has the same cap (every worker's link the
      same bandwidth): the links are ``links.EqualShareLinks``, whose events
      cost ``O(log n)`` instead of ``O(n)`` in the transfers in progress.
    network: routes name paths of several links (a topology's: ``((link, bytes/s | None),
      ...)``), shared over the whole network (``links.NetworkLinks``).
    update_time: seconds a server spends on one update (``cluster.server_update_time``):
      see :meth:`_updates`. 0: every update is instantaneous.
    compress_time: seconds between the end of a worker's compute and its push's departure
      (``compress.compute_time``: its compressor's work).
  """

  def __init__(self, protocol: Protocol, compute_time: Callable[[int, int], float], *,
               push_delay: Callable[[int, int], float] = lambda w, k: 0.0,
               pull_delay: Callable[[int], float] = lambda w: 0.0,
               message_delay: Callable[[Message], float] = lambda m: 0.0,
               record: bool = True, route: Callable | None = None,
               message_route: Callable | None = None,
               link_bandwidth: float = 1.25e9, equal_caps: bool = False,
               network: bool = False, update_time: float = 0.0, compress_time: float = 0.0):
    self.protocol = protocol
    self.update_time, self.compress_time = float(update_time), float(compress_time)
    self.route, self.message_route = route, message_route
    links = (links_lib.NetworkLinks if network else
             links_lib.EqualShareLinks if equal_caps else links_lib.SharedLinks)
    self.links = links(link_bandwidth) if route is not None else None
    self.compute_time, self.push_delay = compute_time, push_delay
    self.pull_delay, self.message_delay = pull_delay, message_delay
    self.record = record
    W = protocol.num_workers
    self.queue: list = []
    self.seq = 0
    self.iteration = np.zeros([W], np.int64)
    self.pushed_at = np.zeros([W])
    self.blocked_time = np.zeros([W])
    self.num_pushes = 0
    self.now = 0.0
    self.compute_sum = np.zeros([W])     # compute seconds per worker since the last reset
    self.compute_count = np.zeros([W], np.int64)
    # [R] when each replica's server has done the updates queued at it (``_updates``).
    self.server_busy = np.zeros([protocol.num_replicas])
    self.starts, self.pushes, self.events = [], [], []
    for w in range(W):
      self._schedule(0.0, "start", w)

  def _schedule(self, time, kind, payload):
    heapq.heappush(self.queue, (float(time), self.seq, kind, payload))
    self.seq += 1

  def _react(self, reaction, time):
    leave, done = self._updates(reaction, time)
    for w in reaction.release:
      self.blocked_time[w] += time - self.pushed_at[w]
      self._pull(w, leave.get(w, time))
    for m in reaction.messages:
      self._send(m, time, done)
    return reaction.rounds

  def _updates(self, reaction, time) -> tuple[dict, float]:
    """Queues the updates of ``reaction``'s rounds at their servers (with ``update_time``).

    A round updates each replica whose weights it changes (``applies``, ``adopt``,
    ``average``); each replica's server applies its updates one at a time, in
    event order: one starts at ``max(time, server_busy[r])`` and lasts
    ``update_time``. A worker that pulls in a round leaves when its replica's
    server has done every update queued up to that round (the weights it takes).
    Returns ``({worker: its pull's departure}, when the reaction's updates are
    done)``: the messages the event sends leave then (``time`` without updates).
    """
    if not self.update_time:
      return {}, time
    busy, step, done, leave = self.server_busy, self.update_time, time, {}
    for rnd in reaction.rounds:
      changed = rnd.applies | (rnd.adopt >= 0) | (rnd.average >= 0)
      for r in np.flatnonzero(changed).tolist():
        busy[r] = max(time, busy.item(r)) + step
        done = max(done, busy.item(r))
      replicas = rnd.groups if busy.size > 1 else np.zeros_like(rnd.groups)
      for w in np.flatnonzero(rnd.pulls).tolist():
        leave[w] = max(time, busy.item(int(replicas[w])))
    return leave, done

  def _pull(self, w: int, leave: float) -> None:
    """Released worker ``w``'s pull leaves its server at ``leave``; then it starts."""
    if leave > self.now:   # its server is still updating: the pull (and its route) waits
      self._schedule(leave, "pull", w)
      return
    path = self.route("pull", w, self.iteration.item(w)) if self.route is not None else None
    if path is None:
      self._schedule(leave + self.pull_delay(w), "start", w)
    else:
      self._transfer(leave, path, ("start", w))

  def _send(self, m, time: float, leave: float) -> None:
    """Message ``m``, sent by an event at ``time``, leaves at ``leave`` (its updates done)."""
    path = self.message_route(m) if self.message_route is not None else None
    # Its arrival, if known now (a routed message's is known when its transfer ends).
    arrival = leave + self.message_delay(m) if path is None else float("inf")
    for w in m.carries:   # their push travels on: push time, not blocked time
      self.blocked_time[w] += time - self.pushed_at[w]
      self.pushed_at[w] = arrival
    if path is None:
      self._schedule(arrival, "message", m)
    elif leave > self.now:
      self._schedule(leave, "post", m)
    else:
      self._transfer(leave, path, ("message", m))

  def _transfer(self, time: float, path, then) -> None:
    """Starts a transfer on a shared link; ``then`` = (event kind, worker) follows its end."""
    link, num_bytes, cap, latency, *capacity = path
    version = self.links.start(link, time, (then, float(latency)), num_bytes, cap, *capacity)
    key = self.links.event_key(link)   # the link, or the whole network
    self._schedule(self.links.next_end(key), "link", (key, version))

  def _link_event(self, link, version) -> None:
    """A link's first transfer ends (the caller checked that its shares did not change since:
    else the event is stale)."""
    for (kind, w), latency in self.links.finish(link, self.now):
      self._schedule(self.now + latency, kind, w)
    end = self.links.next_end(link)
    if end is not None:
      self._schedule(end, "link", (link, self.links.version[link]))

  def busy_workers(self) -> set:
    """Workers computing, pushing or pulling (not waiting for a release, not dropped)."""
    busy = {payload for _, _, kind, payload in self.queue
            if kind in ("start", "push", "sent", "pull")}
    if self.links is not None:
      busy |= {w for (kind, w), _ in self.links.tags() if kind != "message"}
    return busy

  def drop_at(self, time: float, worker: int) -> None:
    """Schedules ``worker``'s crash at ``time``: its pending start and push vanish.

    At that event the protocol drops it (``Protocol.drop``); a wait it was in
    counts as blocked time up to the drop, its time dead does not.
    """
    self._schedule(time, "drop", int(worker))

  def rejoin_at(self, time: float, worker: int) -> None:
    """Schedules a dropped ``worker``'s return at ``time``: it pulls, then starts (``rejoin``)."""
    self._schedule(time, "rejoin", int(worker))

  def _drop(self, w: int) -> list:
    busy = w in self.busy_workers()
    reaction = self.protocol.drop(w, self.now)
    if not busy:   # it was waiting to be released (not while its push travelled)
      self.blocked_time[w] += max(self.now - self.pushed_at[w], 0.0)
    self.queue = [e for e in self.queue
                  if not (e[2] in ("start", "push", "sent", "pull") and e[3] == w)]
    heapq.heapify(self.queue)
    if self.links is not None:
      for link in self.links.cancel(self.now, lambda tag: tag[0][1] == w):
        end = self.links.next_end(link)
        if end is not None:
          self._schedule(end, "link", (link, self.links.version[link]))
    return self._react(reaction, self.now)

  def _rejoin(self, w: int) -> list:
    reaction = self.protocol.rejoin(w, self.now)
    self.pushed_at[w] = self.now   # its release is no wait
    return self._react(reaction, self.now)

  def step(self) -> list:
    """Processes the next event; returns the rounds it produced (often none)."""
    if not self.queue:
      raise RuntimeError(f"{self.protocol.name} timeline has no pending event: every worker "
                         "waits and no message is in flight (a protocol deadlock)")
    self.now, _, kind, payload = heapq.heappop(self.queue)
    if kind == "link":   # the most frequent (a shared link's transfers), and never recorded
      link, version = payload
      if version == self.links.version[link]:   # else stale: its shares changed since
        self._link_event(link, version)
      return []
    if kind == "pull":   # a released worker's pull, after its server's updates
      self._pull(payload, self.now)
      return []
    if kind == "post":   # a routed message, after its server's updates
      self._transfer(self.now, self.message_route(payload), ("message", payload))
      return []
    if self.record and kind != "sent":   # a link's own events are not recorded
      self.events.append((kind, self.now, payload))
    if kind == "start":
      w = payload
      k = self.iteration.item(w)
      if self.record:
        self.starts.append((self.now, w, k))
      compute = self.compute_time(w, k)
      self.compute_sum[w] += compute
      self.compute_count[w] += 1
      ready = self.now + compute + self.compress_time   # its push leaves: compressed
      if self.route is None:
        self._schedule(ready + self.push_delay(w, k), "push", w)
      else:
        self._schedule(ready, "sent", w)
      return []
    if kind == "sent":   # compute ended: the push leaves
      w, k = payload, self.iteration.item(payload)
      path = self.route("push", w, k)
      if path is None:
        self._schedule(self.now + self.push_delay(w, k), "push", w)
      else:
        self._transfer(self.now, path, ("push", w))
      return []
    if kind == "push":
      w = payload
      if self.record:
        self.pushes.append((self.now, w, int(self.iteration[w])))
      self.iteration[w] += 1
      self.pushed_at[w] = self.now
      self.num_pushes += 1
      return self._react(self.protocol.on_push(w, self.now), self.now)
    if kind == "drop":
      return self._drop(payload)
    if kind == "rejoin":
      return self._rejoin(payload)
    for w in payload.carries:   # their push arrives now (a routed message's: set only now)
      self.pushed_at[w] = self.now
    return self._react(self.protocol.on_message(payload, self.now), self.now)

  def next_time(self) -> float:
    """The virtual time of the next event (``inf`` when none is pending)."""
    return self.queue[0][0] if self.queue else math.inf

  def wait_until(self, time: float) -> None:
    """Moves the clock to ``time``, with no event before it (a run that ends at a budget:
    its waits count up to there)."""
    if self.next_time() < time:
      raise ValueError(f"wait_until({time}): an event is due at {self.next_time()}, before it")
    self.now = max(self.now, float(time))

  def blocked_time_so_far(self) -> np.ndarray:
    """``[W]`` blocked time up to ``now``, counting waits still in progress; changes nothing.

    ``blocked_time`` grows only when a worker is released; a worker that has
    pushed and has neither a start nor a push scheduled is still waiting, since
    its last push at ``pushed_at``. A dropped worker is not waiting.
    """
    busy = self.busy_workers()
    waiting = np.array([w not in busy for w in range(self.blocked_time.size)])
    waiting &= self.protocol.alive
    return self.blocked_time + np.where(waiting, np.maximum(self.now - self.pushed_at, 0.0), 0.0)

  def measured_times(self, reset: bool = True) -> np.ndarray:
    """``[W]`` mean compute time per iteration since the last reset (what a real server sees)."""
    times = self.compute_sum / np.maximum(self.compute_count, 1)
    if reset:
      self.compute_sum[:] = 0.0
      self.compute_count[:] = 0
    return times

  def state_dict(self) -> dict:
    return {k: getattr(self, k) for k in ("protocol", "queue", "seq", "iteration", "pushed_at",
                                         "blocked_time", "num_pushes", "now", "compute_sum",
                                         "compute_count", "links", "server_busy")}

  def load_state_dict(self, state: dict) -> None:
    """Restores :meth:`state_dict`'s values; a state saved before ``server_busy`` existed
    (no server time modelled) keeps it at zeros."""
    for k, v in state.items():
      setattr(self, k, v)


def run_timeline(protocol: Protocol, compute_time: Callable[[int, int], float], *,
                 max_pushes: int, push_delay: Callable[[int], float] = lambda w: 0.0,
                 pull_delay: Callable[[int], float] = lambda w: 0.0,
                 message_delay: Callable[[Message], float] = lambda m: 0.0) -> Timeline:
  """Runs ``protocol`` until ``max_pushes`` pushes have reached the servers.

  ``push_delay`` here takes only the worker (see :class:`TimelineEngine` for
  the per-iteration form the simulator uses).
  """
  engine = TimelineEngine(protocol, compute_time, push_delay=lambda w, k: push_delay(w),
                          pull_delay=pull_delay, message_delay=message_delay)
  rounds = []
  while engine.queue and engine.num_pushes < max_pushes:
    rounds.extend(engine.step())
  return Timeline(rounds=rounds, starts=engine.starts, pushes=engine.pushes,
                  blocked_time=engine.blocked_time, end_time=engine.now, events=engine.events)
