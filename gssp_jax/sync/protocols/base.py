"""What every protocol shares: reactions, messages and the blocking bookkeeping.

A protocol is the host half of a scheme: plain Python and NumPy, no JAX. It is
told about events (a worker's push reached its server, a message between
servers arrived) and answers with a :class:`Reaction`: the rounds the device
must apply now, the workers released to pull and start their next iteration,
and the messages to deliver later (their delay is the cluster's business, not
the protocol's). The same objects drive the simulator's timeline and the real
multi-process runtime.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from gssp_jax.sync import rounds as rounds_lib


class Message(NamedTuple):
  """A server-to-server message: ``kind`` (e.g. "deliver", "adopt") about ``group``."""
  kind: str
  group: int


@dataclasses.dataclass
class Reaction:
  """What follows from one event.

  Attributes:
    rounds: rounds to apply now, in order.
    release: workers that pull now (their ``pulls`` is set in the last round)
      and start their next iteration.
    messages: messages to deliver after a delay chosen by the caller.
  """
  rounds: list = dataclasses.field(default_factory=list)
  release: list = dataclasses.field(default_factory=list)
  messages: list = dataclasses.field(default_factory=list)


class Protocol:
  """Base class: W workers, R replicas, G exchange groups, a worker -> replica route.

  Subclasses implement :meth:`on_push` and may implement :meth:`on_message`.
  Every worker starts its first iteration at time 0 with the initial weights.
  """

  name = "protocol"

  def __init__(self, num_workers: int, num_replicas: int = 1, num_groups: int = 1,
               route=None):
    self.num_workers = int(num_workers)
    self.num_replicas = int(num_replicas)
    self.num_groups = int(num_groups)
    self.route = (np.zeros([self.num_workers], np.int32) if route is None
                  else np.asarray(route, np.int32).copy())
    self.clock = np.zeros([self.num_workers], np.int64)   # pushes per worker
    self.blocked = np.zeros([self.num_workers], bool)     # pushed, waiting to be released

  def new_round(self, time: float) -> rounds_lib.Round:
    return rounds_lib.empty_round(time, self.num_workers, self.num_replicas, self.num_groups,
                                  self.route)

  def on_push(self, worker: int, time: float) -> Reaction:
    raise NotImplementedError

  def on_message(self, message: Message, time: float) -> Reaction:
    raise ValueError(f"{self.name} protocol got unexpected message {message!r}")

  def server_payloads(self, rnd: rounds_lib.Round) -> int:
    """Payloads sent between servers in ``rnd`` (the simulator counts their bytes)."""
    return int(rnd.deliver.sum() + (rnd.adopt >= 0).sum())

  def check_worker(self, worker: int) -> int:
    if not 0 <= int(worker) < self.num_workers:
      raise ValueError(f"{self.name} worker={worker!r} is invalid; allowed: "
                       f"0..{self.num_workers - 1}")
    if self.blocked[worker]:
      raise ValueError(f"{self.name} worker {worker} pushed while blocked: it must be "
                       "released before its next iteration")
    return int(worker)


def release_where(protocol: Protocol, rnd: rounds_lib.Round, ok: np.ndarray,
                  reaction: Reaction) -> None:
  """Releases every blocked worker with ``ok[w]``: it pulls in ``rnd``."""
  free = np.flatnonzero(protocol.blocked & ok)
  protocol.blocked[free] = False
  rnd.pulls[free] = True
  reaction.release.extend(int(w) for w in free)
