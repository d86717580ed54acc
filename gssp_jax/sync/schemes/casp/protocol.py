"""CASP (after Petrel): synchronous communities, asynchronous between them; an agent picks them.

Honest naming: the agent is a one-step **advantage actor-critic** (synchronous,
single learner, linear policy and value in NumPy), not the asynchronous A3C of
the paper. Its action is a partition of the speed-sorted workers into ``k``
contiguous communities of near-equal size, ``k`` from ``1..max_communities``;
its state is the workers' measured speeds and the recent progress; its reward
is progress per unit virtual time minus a traffic penalty.
"""

from __future__ import annotations

import numpy as np

from gssp_jax import host_state
from gssp_jax.sync import arguments
from gssp_jax.sync.protocol import Message
from gssp_jax.sync.protocol import Protocol
from gssp_jax.sync.protocol import Reaction


def contiguous_partition(order: np.ndarray, num_communities: int) -> np.ndarray:
  """``[W]`` community ids cutting the workers, taken in ``order``, into near-equal blocks."""
  num_workers = order.size
  ids = np.empty([num_workers], np.int32)
  ids[order] = (np.arange(num_workers) * num_communities) // num_workers
  return ids


class ActorCritic:
  """One-step advantage actor-critic over ``num_actions`` discrete actions, seeded, NumPy only.

  ``act(features)`` samples from ``softmax(theta @ features)``; ``learn(reward)``
  moves the critic ``v = w @ features`` toward the reward and the actor along
  ``advantage * grad log pi``.
  """

  def __init__(self, num_actions: int, num_features: int, *, seed: int = 0,
               actor_lr: float = 0.1, critic_lr: float = 0.1):
    self.theta = np.zeros([num_actions, num_features])
    self.w = np.zeros([num_features])
    self.actor_lr, self.critic_lr = float(actor_lr), float(critic_lr)
    self.rng = np.random.default_rng(seed)
    self.last = None   # (features, action)

  def probabilities(self, features: np.ndarray) -> np.ndarray:
    logits = self.theta @ features
    e = np.exp(logits - logits.max())
    return e / e.sum()

  def act(self, features: np.ndarray) -> int:
    action = int(self.rng.choice(len(self.theta), p=self.probabilities(features)))
    self.last = (features, action)
    return action

  def learn(self, reward: float) -> float:
    """Updates from the reward of the last action; returns the advantage."""
    if self.last is None:
      return 0.0
    features, action = self.last
    advantage = float(reward) - float(self.w @ features)
    self.w += self.critic_lr * advantage * features
    grad = -self.probabilities(features)[:, None] * features[None, :]
    grad[action] += features
    self.theta += self.actor_lr * advantage * grad
    return advantage


class CASPProtocol(Protocol):
  """Communities push as one (synchronous inside); the server applies each push at once.

  Members of a community start every iteration together from the weights they
  pulled together. A community of one pushes straight to the server (its push
  is applied on arrival). In a larger one every member's push goes to the
  community's leader (its lowest-index member), which reduces them; when the
  last has arrived the leader sends ONE payload to the server, a
  ``Message("community", c)`` whose delay is that transfer, applied on arrival
  as one round; the members then pull (the server's reply goes to the leader,
  which broadcasts it inside the community). Communities never wait for each
  other. Every ``reconfigure_every`` community pushes the protocol drains (each
  community finishes its iteration, then everyone waits) and the agent picks
  the next partition from the measured speeds; the reward of its previous
  choice is the progress per unit virtual time minus ``traffic_penalty`` times
  the pushes per unit time. Progress is what the caller reports through
  :meth:`report_progress` (e.g. the loss drop), else the applied gradients
  weighted by ``1 / (1 + staleness)``.

  Args:
    num_workers: W.
    max_communities: the agent chooses ``k`` in ``1..max_communities``.
    reconfigure_every: community pushes between reconfigurations.
    traffic_penalty: weight of pushes per unit time in the reward.
    seed: the agent's seed.
    initial_communities: k of the first partition (workers in index order,
      since no speed is known yet).
  """

  name = "casp"
  round_fields = ()
  membership_unsupported = (
      "a community pushes through its leader once every member has pushed, and the drain "
      "and the agent's partitions cover all workers: dropping a member (or the leader, "
      "with the community's push in flight) needs a leader re-elected and communities "
      "re-formed mid-iteration, which this protocol does not model")

  def __init__(self, num_workers: int, *, max_communities: int = 4, reconfigure_every: int = 64,
               traffic_penalty: float = 0.01, seed: int = 0, initial_communities: int = 1):
    num_workers = arguments.check_int("casp", "num_workers", num_workers, 1)
    super().__init__(num_workers)
    self.max_communities = arguments.check_int("casp", "max_communities", max_communities, 1)
    if self.max_communities > num_workers:
      raise ValueError(f"casp max_communities={max_communities} is invalid; allowed: 1.."
                       f"{num_workers} (num_workers)")
    self.reconfigure_every = arguments.check_int("casp", "reconfigure_every",
                                                  reconfigure_every, 1)
    k0 = arguments.check_int("casp", "initial_communities", initial_communities, 1)
    if k0 > self.max_communities:
      raise ValueError(f"casp initial_communities={k0} is invalid; allowed: 1.."
                       f"{self.max_communities} (max_communities)")
    self.traffic_penalty = float(traffic_penalty)
    self.agent = ActorCritic(self.max_communities, 4, seed=seed)
    self.communities = contiguous_partition(np.arange(num_workers), k0)
    self.started = np.zeros([num_workers])            # start time of the current iteration
    self.iteration_time = np.full([num_workers], np.nan)
    self.version = 0
    self.read = np.zeros([num_workers], np.int64)
    self.pushes_since = 0
    self.period_start = 0.0
    self.progress = 0.0
    self.reported = None
    self.draining = False
    self.in_flight = np.zeros([num_workers], bool)    # community id c: its push travels
    self.history: list[tuple[float, int]] = [(0.0, k0)]   # (time, k) of every configuration

  def report_progress(self, progress: float) -> None:
    """Progress since the last reconfiguration, measured by the caller (e.g. loss drop)."""
    self.reported = float(progress)

  def _features(self) -> np.ndarray:
    times = self.iteration_time[np.isfinite(self.iteration_time)]
    spread = float(times.max() / times.min()) if times.size else 1.0
    cv = float(times.std() / times.mean()) if times.size else 0.0
    return np.array([1.0, np.log(spread), cv, np.tanh(self.progress)])

  def _reconfigure(self, time: float, rnd, reaction) -> None:
    elapsed = max(time - self.period_start, 1e-12)
    progress = self.reported if self.reported is not None else self.progress
    reward = progress / elapsed - self.traffic_penalty * self.pushes_since / elapsed
    self.agent.learn(reward)
    k = self.agent.act(self._features()) + 1
    times = np.where(np.isfinite(self.iteration_time), self.iteration_time, 0.0)
    self.communities = contiguous_partition(np.argsort(times, kind="stable"), k)
    self.history.append((float(time), k))
    self.pushes_since, self.progress, self.reported = 0, 0.0, None
    self.period_start = float(time)
    self.draining = False
    rnd.pulls[:] = True
    self.blocked[:] = False
    self.read[:] = self.version
    self.started[:] = time
    reaction.release.extend(range(self.num_workers))

  def members(self, worker: int) -> np.ndarray:
    """The workers of ``worker``'s community, in index order (the first is its leader)."""
    return np.flatnonzero(self.communities == self.communities[worker])

  def leader(self, worker: int) -> int:
    """The member that reduces the community's pushes and talks to the server."""
    return int(self.members(worker)[0])

  def on_push(self, worker, time):
    worker = self.check_worker(worker)
    self.clock[worker] += 1
    self.blocked[worker] = True
    self.iteration_time[worker] = time - self.started[worker]
    members = self.members(worker)
    if not self.blocked[members].all():
      return Reaction()
    if members.size > 1:   # the leader has every member's gradient: one push to the server
      c = int(self.communities[worker])
      self.in_flight[c] = True
      return Reaction(messages=[Message("community", c, tuple(int(m) for m in members))])
    return self._apply(members, time)

  def on_message(self, message, time):
    c = int(message.group)
    if message.kind != "community" or not 0 <= c < self.num_workers or not self.in_flight[c]:
      return super().on_message(message, time)
    self.in_flight[c] = False
    return self._apply(np.flatnonzero(self.communities == c), time)

  def _apply(self, members: np.ndarray, time: float) -> Reaction:
    """The server applies a community's push; its members pull unless the protocol drains."""
    rnd = self.new_round(time)
    rnd.arrived[members] = True
    rnd.applies[0] = True
    reaction = Reaction(rounds=[rnd])
    staleness = self.version - self.read[members]
    self.progress += float(np.sum(1.0 / (1.0 + staleness)))
    self.version += 1
    self.pushes_since += 1
    if self.pushes_since >= self.reconfigure_every:
      self.draining = True
    if not self.draining:
      self.blocked[members] = False
      rnd.pulls[members] = True
      self.read[members] = self.version
      self.started[members] = time
      reaction.release.extend(int(m) for m in members)
    elif self.blocked.all() and not self.in_flight.any():
      self._reconfigure(time, rnd, reaction)
    return reaction


host_state.allow(ActorCritic)
