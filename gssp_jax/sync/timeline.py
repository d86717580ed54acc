"""A discrete-event run of a protocol over given compute and communication times.

This is the gradient-free half of a simulation: it produces the rounds, in
order, that an executor replays with real gradients (``rounds.apply_round``).
The cluster model (speeds, jitter, stragglers, bandwidth) only supplies the
callables; protocols never see times other than event timestamps.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

from gssp_jax.sync.protocols.base import Message
from gssp_jax.sync.protocols.base import Protocol


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
      processing order (kinds "start", "push", "message").
  """
  rounds: list
  starts: list
  pushes: list
  blocked_time: np.ndarray
  end_time: float
  events: list


def run_timeline(protocol: Protocol, compute_time: Callable[[int, int], float], *,
                 max_pushes: int, push_delay: Callable[[int], float] = lambda w: 0.0,
                 pull_delay: Callable[[int], float] = lambda w: 0.0,
                 message_delay: Callable[[Message], float] = lambda m: 0.0) -> Timeline:
  """Runs ``protocol`` until ``max_pushes`` pushes have reached the servers.

  Args:
    protocol: a fresh protocol.
    compute_time: ``(worker, iteration) -> seconds`` of one local iteration.
    max_pushes: total pushes (over all workers) to simulate.
    push_delay: ``worker -> seconds`` from the end of compute to arrival.
    pull_delay: ``worker -> seconds`` from release to the start of the next
      iteration (the weights' transfer).
    message_delay: ``message -> seconds`` for server-to-server messages.

  Events at the same time are processed in the order they were scheduled, so
  the run is deterministic.
  """
  queue: list = []
  seq = 0

  def schedule(time, kind, payload):
    nonlocal seq
    heapq.heappush(queue, (float(time), seq, kind, payload))
    seq += 1

  W = protocol.num_workers
  iteration = np.zeros([W], np.int64)
  pushed_at = np.zeros([W])
  blocked_time = np.zeros([W])
  rounds, starts, pushes, events = [], [], [], []
  for w in range(W):
    schedule(0.0, "start", w)
  num_pushes, now = 0, 0.0

  def react(reaction, time):
    rounds.extend(reaction.rounds)
    for w in reaction.release:
      blocked_time[w] += time - pushed_at[w]
      schedule(time + pull_delay(w), "start", w)
    for m in reaction.messages:
      schedule(time + message_delay(m), "message", m)

  while queue and num_pushes < max_pushes:
    now, _, kind, payload = heapq.heappop(queue)
    events.append((kind, now, payload))
    if kind == "start":
      w = payload
      starts.append((now, w, int(iteration[w])))
      schedule(now + compute_time(w, int(iteration[w])) + push_delay(w), "push", w)
    elif kind == "push":
      w = payload
      pushes.append((now, w, int(iteration[w])))
      iteration[w] += 1
      pushed_at[w] = now
      num_pushes += 1
      react(protocol.on_push(w, now), now)
    else:
      react(protocol.on_message(payload, now), now)
  return Timeline(rounds=rounds, starts=starts, pushes=pushes, blocked_time=blocked_time,
                  end_time=now, events=events)
