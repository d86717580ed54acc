"""HALoS's host half: local servers per group, an asynchronous global server, nobody waits."""

from __future__ import annotations

import numpy as np

from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction
from gssp_jax.sync.protocol import release_where


class HALoSProtocol(Protocol):
  """Hierarchical asynchronous local SGD (Kim et al., ICML 2025), as the authors' simulator runs it.

  Replicas: ``G`` local servers (one per group: a region), the global server
  ``G``, and one reply slot per group (``G + 1 + g``: the global weights as
  sent back to ``g``; never applied to, never pulled from), as GSSP's global
  layout.

  * A worker's push (a pseudo-gradient) is applied at once by its local
    server, and the worker pulls the local server's weights at once: nobody
    ever waits.
  * ``forward_every`` = K local updates after its last merge, a local server
    sends its progress since that merge (``forward``; the device keeps it,
    ``halos`` transform) and goes on applying its workers' pushes. It sends
    nothing more until the global weights come back.
  * The global server applies the progress when it arrives (``deliver``) and
    sends its new weights back to that group only (kept in the group's reply
    slot: ``adopt``); its BatchNorm statistics become the mean of the local
    servers' (``stats_mean``), as GSSP's global server's.
  * When they land, the local server merges them, ``(1 - alpha) local +
    alpha global`` (``adopt`` with ``adopt_weight`` = alpha), and counts its
    next K updates from there. The progress it made while the exchange was in
    flight stays only in its own weights (weight ``1 - alpha``), as in the
    reference (``utnslab/halos``, ``exec_halos.py``).

  Args:
    num_workers: W.
    groups: ``[W]`` group (local server) of each worker, ids ``0..G-1`` each used.
    forward_every: K >= 1, or None for each group's size.
    merge_weight: alpha in (0, 1].
  """

  name = "halos"
  round_fields = ("forward", "deliver", "adopt", "stats_mean", "adopt_weight")
  # Nobody waits on anybody: a worker that leaves holds no one back, and a local server's count
  # towards its next exchange is of its own updates, whoever sent them. A group whose workers
  # are all lost stops updating; the global server goes on with the other groups' progress.
  supports_membership = True

  def __init__(self, num_workers: int, groups, *, forward_every: int | None = None,
               merge_weight: float = 0.25):
    num_workers = arguments.check_int("halos", "num_workers", num_workers, 1)
    ids = np.asarray(groups)
    num_groups = int(ids.max()) + 1 if ids.size else 0
    route = arguments.check_assignment("halos", "groups", groups, num_workers,
                                        max(num_groups, 1))
    if sorted(set(route.tolist())) != list(range(num_groups)):
      raise ValueError(f"halos groups={route.tolist()!r} is invalid; allowed: every id in "
                       f"0..{num_groups - 1} used by at least one worker")
    if (isinstance(merge_weight, bool) or not isinstance(merge_weight, (int, float))
        or not 0 < merge_weight <= 1):
      raise ValueError(f"halos merge_weight={merge_weight!r} is invalid; allowed: a number in "
                       "(0, 1]")
    super().__init__(num_workers, 2 * num_groups + 1, num_groups, route)
    sizes = np.bincount(route, minlength=num_groups)
    self.forward_every = (sizes.astype(np.int64) if forward_every is None else np.full(
        [num_groups], arguments.check_int("halos", "forward_every", forward_every, 1), np.int64))
    self.merge_weight = float(merge_weight)
    self.since_merge = np.zeros([num_groups], np.int64)   # local updates since the last merge
    self.in_flight = np.zeros([num_groups], bool)

  @property
  def global_replica(self) -> int:
    """The global server's replica index (``G``): what evaluation serves."""
    return self.num_groups

  def reply_slot(self, group: int) -> int:
    return self.num_groups + 1 + int(group)

  def round_bounds(self):
    """One push per round; a delivery touches the global server and the group's reply slot."""
    return 1, 2

  def server_payloads_of(self, deliver, adopt) -> int:
    """One progress sum per delivery, one set of weights per reply."""
    return int(deliver.sum() + (adopt[:, :self.num_groups] >= 0).sum())

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    g = int(self.route[worker])
    self.blocked[worker] = True
    self.clock[worker] += 1
    self.since_merge[g] += 1
    rnd = self.new_round(time)
    rnd.arrived[worker] = True
    rnd.applies[g] = True
    reaction = Reaction(rounds=[rnd])
    mine = np.zeros([self.num_workers], bool)
    mine[worker] = True
    release_where(self, rnd, mine, reaction)
    if self.since_merge[g] >= self.forward_every[g] and not self.in_flight[g]:
      rnd.forward[g] = True   # after this push's update: the progress includes it
      self.in_flight[g] = True
      reaction.messages.append(Message("deliver", g))
    return reaction

  def _after_drop(self, worker: int, time: float, was_blocked: bool) -> Reaction:
    del worker, time, was_blocked   # a push is applied and released at once: nothing pending
    return Reaction()

  def _rejoin_peers(self, worker: int) -> np.ndarray:
    """No bound to keep: a rejoining worker keeps its own push count."""
    return np.zeros([self.num_workers], bool)

  def on_message(self, message, time):
    g = int(message.group)
    rnd = self.new_round(time)
    reaction = Reaction(rounds=[rnd])
    if message.kind == "deliver":
      rnd.deliver[g] = True
      rnd.applies[self.num_groups] = True
      rnd.stats_mean[self.num_groups] = self.num_groups
      rnd.adopt[self.reply_slot(g)] = self.num_groups   # after the update: the weights sent
      reaction.messages.append(Message("adopt", g))
    elif message.kind == "adopt":
      rnd.adopt[g] = self.reply_slot(g)
      rnd.adopt_weight[g] = self.merge_weight
      self.in_flight[g] = False
      self.since_merge[g] = 0
    else:
      return super().on_message(message, time)
    return reaction
