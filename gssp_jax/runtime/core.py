"""The control plane's protocol core: the scheme's protocol on the meshes' pushes, with wall time.

:class:`ProtocolCore` owns what the protocol decides and what it counts: the
protocol object, the run's host books (``sim.book.HostBook``, the simulator's
own: the staleness accounting, the counters, job numbers, a round's learning
rate), the counters only a real run has (wire bytes, blocked time, lost and
refused meshes), each mesh's release (its next job), and the server-to-server
messages in flight (:class:`Scheduler`). Each event (a push, a drop, a rejoin, a
message) becomes rounds, which it accounts with the simulator's functions
(``sim/records.py``) and emits to the shards as ops.

Concurrency: every method but :meth:`now`, :meth:`wall_time` and the
scheduler's thread runs under the server's lock (``server.lock``, passed in);
the helpers that must, check it (``react``, ``accept``, ``finish``,
``count_refused``). ``Scheduler``'s thread delivers a due message through
:meth:`deliver_due`, which takes the lock; its own condition is never held
while the lock is taken.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable

from absl import logging
import numpy as np

from gssp_jax.sim import book as book_lib
from gssp_jax.sim import records

HOST_FORMAT = "sharded-1"              # the control plane's checkpointed host state


class Scheduler:
  """Delivers messages after their delay on one thread; ``manual`` holds them for a caller."""

  def __init__(self, deliver: Callable[[Any], None], manual: bool = False):
    self.deliver, self.manual = deliver, manual
    self.cond = threading.Condition()
    self.heap: list = []
    self.count = itertools.count()
    self.closed = False
    if not manual:
      threading.Thread(target=self._run, name="messages", daemon=True).start()

  def add(self, due: float, message) -> None:
    with self.cond:
      heapq.heappush(self.heap, (due, next(self.count), message))
      self.cond.notify()

  def pending(self) -> list[tuple[float, Any]]:
    with self.cond:
      return [(due, m) for due, _, m in sorted(self.heap)]

  def take(self, message):
    """Manual mode: removes and returns the first held message equal to ``message``."""
    with self.cond:
      for i, (_, _, held) in enumerate(self.heap):
        if held == message:
          self.heap.pop(i)
          heapq.heapify(self.heap)
          return held
    raise KeyError(f"no held message {message}")

  def _run(self) -> None:
    while True:
      with self.cond:
        while not self.closed and (not self.heap or self.heap[0][0] > time.monotonic()):
          self.cond.wait(None if not self.heap else self.heap[0][0] - time.monotonic())
        if self.closed:
          return
        _, _, message = heapq.heappop(self.heap)
      self.deliver(message)

  def close(self) -> None:
    with self.cond:
      self.closed = True
      self.cond.notify()


class ProtocolCore:
  """The protocol, its accounting and counters, the meshes' releases (module docstring).

  Args:
    scheme: the run's ``sync`` scheme.
    steps: ``[W]`` each mesh's inner steps per job (``simulate.local_plan``).
    local: a local-update scheme (its pushes count ``H_w`` iterations).
    schedule: the outer learning rates (``simulate.learning_rates``).
    eval_pushes: data iterations between evaluations.
    budget: ``train.virtual_budget`` (0: none): no event at or past it is applied; the first
      one ends the run (``end_at_budget``), as the simulator's timeline does.
    ratio_of: the compression ratios (``simulate.Ratios``).
    links: the scheme's ``traffic.Traffic`` (bytes per link, emulated delays).
    emulated: the cluster's link delays are emulated (else messages land at once).
    pull_bytes: bytes of the weights a mesh pulls.
    emit: ``op -> None``, appends an op to every shard's stream (under the lock).
    watermark: ``() -> int``, the op number a released mesh's weights are read at.
    lock, changed: the server's lock and its condition.
    clock: seconds since the run's start (default: the wall clock).
    manual_messages: hold server-to-server messages until :meth:`deliver` (tests).
  """

  def __init__(self, *, scheme, steps: np.ndarray, local: bool, schedule, ratio_of, links,
               emulated: bool, pull_bytes: int, emit: Callable[[dict], None],
               watermark: Callable[[], int], lock, changed,
               clock: Callable[[], float] | None = None, manual_messages: bool = False,
               budget: float = 0.0, eval_pushes: int = 0):
    W = scheme.num_workers
    self.W, self.scheme = W, scheme
    self.ratio_of, self.links = ratio_of, links
    self.emulated, self.pull_bytes = emulated, pull_bytes
    self._emit, self._watermark = emit, watermark
    self.lock, self.changed = lock, changed
    self.protocol = scheme.make_protocol()
    self.book = book_lib.HostBook(
        num_workers=W, num_replicas=scheme.num_replicas, aggregating=self.protocol.aggregating,
        steps=steps, local=local, schedule=schedule, budget=budget, eval_pushes=eval_pushes,
        format=HOST_FORMAT, seq=np.zeros([W], np.int64), pushes=0, evaluated=0,
        evaluated_iterations=0, started=np.zeros([W], bool),
        pushes_per_worker=np.zeros([W], np.int64),
        wire_pushed_per_worker=np.zeros([W], np.int64),
        wire_pulled_per_worker=np.zeros([W], np.int64),
        blocked_time_per_worker=np.zeros([W]), lost=[], rejoined=[],
        refused={"nonfinite": 0, "malformed": 0, "duplicate": 0},
        in_flight=[])   # server-to-server messages: (seconds left, message)
    self.releases: dict[int, tuple[int, dict]] = {}   # mesh -> (push number, its job)
    self.waiting = np.zeros([W], bool)        # a Push of this mesh waits for its release
    self.blocked_since = np.zeros([W])
    self.last_push_bytes = np.zeros([W], np.int64)
    self.done = False                          # the run reached its end: meshes stop
    self.diverged: str | None = None           # a refused non-finite push (FloatingPointError)
    self._wall_base, self._session_start = 0.0, time.perf_counter()
    self.clock_started = False
    self._clock = clock
    self.messages = Scheduler(self.deliver_due, manual=manual_messages)
    self.push_log: list | None = None   # [seconds, mesh] of each accepted push, when recorded

  # -- counting -------------------------------------------------------------------------------

  def iterations(self) -> int:
    """Data iterations applied so far, counted as the simulator counts them."""
    return self.book.iterations(self.book.host["pushes"])

  def load(self, saved: dict) -> None:
    """The protocol, counters and accounting of a checkpoint's host state."""
    self.protocol = saved["protocol"]
    host = records.upgrade_counters(saved["host"], self.links)
    for key, old in (("iterations", "pushes"), ("evaluated_iterations", "evaluated")):
      host.setdefault(key, host[old])   # a checkpoint from before local updates
    self.book.load(host, saved["acct"])

  # -- events (under the lock) ------------------------------------------------------------------

  def accept(self, w: int, seq: int, loss: float, nbytes: int, wire_bytes: int,
             digests: tuple = (), now: float | None = None) -> None:
    """Mesh ``w``'s new push ``seq`` (checked, its slices staged): counted, ``put``, the
    protocol's reaction. ``digests``: its slices' on shards 1..S-1, which the ``put`` names
    (shard 0's, staged here, under ``b""``). ``now``: its time, if the caller read it (the
    budget's check did), else the clock's."""
    self.lock.check("ProtocolCore.accept")
    host = self.book.host
    host["seq"][w] = seq
    self.last_push_bytes[w] = nbytes
    self._emit({"k": "put", "w": w, "seq": seq, "loss": float(loss), "bytes": int(nbytes),
                "d": [b"", *digests]})
    host["pushes"] += 1
    host["pushes_per_worker"][w] += 1
    host["wire_pushed_per_worker"][w] += wire_bytes
    now = self.now() if now is None else now
    if self.push_log is not None:
      self.push_log.append([float(now), int(w)])
    self.blocked_since[w] = now
    self.waiting[w] = True
    self.react(self.protocol.on_push(w, now), now)

  def lose(self, w: int, now: float, why: str) -> None:
    """Drops mesh ``w`` from the protocol: nobody waits for it any more; what it applied stays."""
    self.lock.check("ProtocolCore.lose")
    if self.past_budget(now):   # the run ended before it: nothing changes
      self.end_at_budget()
      return
    host = self.book.host
    host["lost"].append({"mesh": w, "time": now, "pushes": int(host["pushes"]), "why": why})
    logging.warning("mesh %d lost (%s) at %d pushes; %d meshes alive", w, why, host["pushes"],
                    int(self.protocol.alive.sum()) - 1)
    self.waiting[w] = False
    self.releases.pop(w, None)
    self.react(self.protocol.drop(w, now), now)
    self.changed.notify_all()

  def react(self, reaction, now: float) -> None:
    """Emits a reaction's rounds, releases its meshes, schedules its messages."""
    self.lock.check("ProtocolCore.react")
    if self.past_budget(now):   # a rejoin past the budget (the other events check before)
      self.end_at_budget()
      return
    for rnd in reaction.rounds:
      rate = self.book.round_rate(rnd, self.book.host["pushes"])
      args = records.account_round(
          rnd, host=self.book.host, acct=self.book.acct, protocol=self.protocol, links=self.links,
          iteration=self.book.host["pushes_per_worker"], learning_rate=rate,
          pull_bytes=self.pull_bytes)
      lr = args.pop("learning_rate")
      self._emit({"k": "round", "args": args, "lr": float(lr)})
    for w in reaction.release:
      self.book.host["blocked_time_per_worker"][w] += max(0.0, now - self.blocked_since[w])
      self.waiting[w] = False
      self.releases[w] = (int(self.book.host["seq"][w]), self.next_job(w))
    for message in reaction.messages:
      delay = self._message_delay(message)
      if delay <= 0 and not self.messages.manual:
        self.react(self.protocol.on_message(message, now), now)
      else:
        self.messages.add(time.monotonic() + delay, message)
    if reaction.release:
      self.changed.notify_all()

  def deliver_due(self, message) -> None:
    """The scheduler's thread: a message whose delay passed (takes the lock)."""
    with self.lock:
      if not self.done:
        now = self.now()
        if self.past_budget(now):
          self.end_at_budget()
        else:
          self.react(self.protocol.on_message(message, now), now)

  def deliver(self, message, now: float | None = None) -> None:
    """Delivers a held server-to-server message now (``manual_messages`` runs: tests)."""
    with self.lock:
      held = self.messages.take(message)
      now = self.now() if now is None else now
      if self.past_budget(now):
        self.end_at_budget()
      else:
        self.react(self.protocol.on_message(held, now), now)

  def _message_delay(self, message) -> float:
    """An emulated server-to-server link's delay, as the simulator charges it (0 without a
    cluster description)."""
    if not self.emulated:
      return 0.0
    return self.links.message_delay(self.protocol, message, self.book.host["pushes_per_worker"])

  def finish(self) -> None:
    """The run's pushes are all in: every mesh is told to stop."""
    self.lock.check("ProtocolCore.finish")
    if not self.done:
      self.done = True
      self.changed.notify_all()

  def past_budget(self, now: float) -> bool:
    """Whether an event at ``now`` is at or past ``train.virtual_budget`` (never without one)."""
    budget = self.book.budget
    return bool(budget) and now >= budget

  def end_at_budget(self) -> None:
    """The run reached its budget: every event before it applied, none after; meshes stop."""
    self.lock.check("ProtocolCore.end_at_budget")
    self.book.host["budget_reached"] = True
    self.finish()

  def next_job(self, w: int) -> dict:
    """Mesh ``w``'s next job (counted as dispatched)."""
    k = int(self.book.take_jobs([w])[0])
    # "steps": the job's inner steps H_w (1 but for the local-update schemes), its data
    # iterations k H_w .. k H_w + H_w - 1.
    return {"iteration": k, "ratio": float(self.ratio_of(w, k)),
            "flush": bool(self.ratio_of.flush(w, k)), "watermark": self._watermark(),
            "steps": int(self.book.steps[w])}

  def refuse_nonfinite(self, w: int, seq: int, why: str, learning_rate: float) -> dict:
    """A non-finite gradient or loss: refused, logged; the loop stops the run as diverged."""
    self.count_refused("nonfinite", w, why)
    if not self.diverged:
      self.diverged = (f"mesh {w} pushed a non-finite gradient or loss (push {seq}, after "
                       f"{self.book.host['pushes']} pushes): {why}. Lower optimizer.learning_rate "
                       f"({learning_rate}) or set optimizer.grad_clip")
    self.changed.notify_all()
    return {"stop": True, "refused": why}

  def count_refused(self, kind: str, w, why: str) -> None:
    self.lock.check("ProtocolCore.count_refused")
    self.book.host["refused"][kind] += 1
    if self.book.host["refused"][kind] <= 10:
      logging.warning("refused a push of mesh %s (%s): %s", w, kind, why)

  def push_payload(self, w: int, k: int) -> int:
    """Bytes of mesh ``w``'s push ``k`` as its compressor counted them (InHAD's node link)."""
    del k   # only a mesh's latest push is asked for (``Traffic.count_round``)
    return int(self.last_push_bytes[w])

  # -- time -------------------------------------------------------------------------------------

  def start_clock(self) -> None:
    if not self.clock_started:
      self.clock_started = True
      self._session_start = time.perf_counter()

  def resume_clock(self, wall_base: float) -> None:
    """A session's wall time starts from ``wall_base`` (a checkpoint's)."""
    self._wall_base, self._session_start = wall_base, time.perf_counter()

  def now(self) -> float:
    return self._clock() if self._clock is not None else self.wall_time()

  def wall_time(self) -> float:
    return self._wall_base + time.perf_counter() - self._session_start

  def blocked_so_far(self) -> np.ndarray:
    now = self.now()
    return self.book.host["blocked_time_per_worker"] + np.where(
        self.waiting, now - self.blocked_since, 0.0)
