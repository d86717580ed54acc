"""A run's host bookkeeping, written once for the simulator and the real runtime.

What the host counts while a scheme runs: the staleness accounting
(``sync.accounting.Accounting``), the counters (``records.new_counters``: pushes, bytes, updates
and the rest), each worker's next job number, the data iterations of a local-update scheme, a
round's learning rate and the next evaluation point. The simulator (``sim/simulate.py``) takes
its time from the cluster model and computes the gradients itself; the real runtime's control
plane (``runtime/core.py``) takes the clock's and the meshes' pushes. Both keep one
:class:`HostBook` and call it for the same events in the same order, so a real run fed its
simulation's events counts what the simulation counts (``tests/test_dist.py``,
``tests/test_shards.py``).

Not here: blocked time. The simulator's timeline measures it in virtual time as it runs its
events (``sync.timeline``); the runtime from when a mesh's push starts to wait and when it is
released.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gssp_jax import sync
from gssp_jax.sim import records


def iterations_done(local: bool, pushes: int, local_iterations: int) -> int:
  """Data iterations that reached a server so far: pushes, but for a local-update scheme
  the iterations of the pushes its rounds applied (``local_iterations``: each push its job's
  ``H_w``, counted when a round applies it, so an evaluation never falls inside a round)."""
  return int(local_iterations if local else pushes)


def round_learning_rate(schedule, budget: float, rnd, iterations: int, num_workers: int):
  """A round's learning rate: the schedule at the round's virtual time over the budget
  (``train.virtual_budget``), else at the data iterations done, in steps of W."""
  return schedule(rnd.time) if budget else schedule(iterations // num_workers)


class HostBook:
  """The host's books of one run (module docstring).

  Args:
    num_workers, num_replicas: W and R of the scheme.
    aggregating: the protocol's ``aggregating`` (``Accounting``'s).
    steps: ``[W]`` each worker's data iterations per push (``H_w``; 1 but for local updates).
    local: a local-update scheme (its pushes count ``H_w`` iterations when applied).
    schedule: the outer learning rates (``simulate.learning_rates``).
    budget: ``train.virtual_budget`` (0: none; then a round's rate follows the iterations).
    eval_pushes: data iterations between evaluations.
    counters: the executor's own host counters, beside the shared ones (saved with them).

  Attributes:
    host: the counters, saved in a checkpoint's host state as they are.
    acct: the staleness accounting.
  """

  def __init__(self, *, num_workers: int, num_replicas: int, aggregating: bool, steps,
               local: bool, schedule, budget: float, eval_pushes: int, **counters: Any):
    self.num_workers = int(num_workers)
    self.steps = np.asarray(steps)
    self.local, self.schedule, self.budget = bool(local), schedule, float(budget)
    self.eval_pushes = int(eval_pushes)
    self.acct = sync.accounting.Accounting(num_workers, num_replicas, aggregating=aggregating,
                                           push_iterations=self.steps)
    self.host = {**records.new_counters(num_workers),
                 "jobs": np.zeros([num_workers], np.int64), "iterations": 0,
                 "wall_time": 0.0, "next_eval": self.eval_pushes, "num_evals": 0, **counters}

  def load(self, host: dict, acct_state: dict) -> None:
    """A checkpoint's counters (already upgraded by the caller) and accounting."""
    self.host = host
    self.acct.load_state_dict(acct_state)

  def iterations(self, pushes: int) -> int:
    """Data iterations that reached a server after ``pushes`` pushes (:func:`iterations_done`)."""
    return iterations_done(self.local, pushes, self.host["iterations"])

  def round_rate(self, rnd, pushes: int):
    """Round ``rnd``'s learning rate, its arrived pushes' data iterations counted first (a
    local-update scheme's: ``H_w`` each); ``pushes``: the pushes made so far."""
    if self.local:
      self.host["iterations"] += int(self.steps[np.asarray(rnd.arrived, bool)].sum())
    return round_learning_rate(self.schedule, self.budget, rnd, self.iterations(pushes),
                               self.num_workers)

  def take_jobs(self, workers) -> np.ndarray:
    """The numbers of the next jobs of ``workers`` (distinct), counted as dispatched."""
    workers = np.asarray(workers, np.int64)
    jobs = self.host["jobs"]
    ks = jobs[workers]
    jobs[workers] = ks + 1   # distinct workers: a set, not a gather-add-scatter
    return ks

  def evaluated(self, iterations: int) -> None:
    """An evaluation at ``iterations`` data iterations: the next one is past them (a
    local-update push spans H iterations, so the point may move more than once)."""
    while self.host["next_eval"] <= iterations:
      self.host["next_eval"] += self.eval_pushes
    self.host["num_evals"] += 1

  def scheme_fields(self, scheme_fields: dict) -> None:
    """``summary.json``'s scheme entry: a local-update scheme's ``local_steps`` (``H_w``)."""
    if self.local:
      scheme_fields["local_steps"] = self.steps.tolist()
