"""Gradient-free accounting of a stream of rounds: versions, staleness, bytes, updates.

It mirrors the transforms' staleness bookkeeping on the host, so the simulator
knows the staleness of every applied gradient without reading device state
(and the tests check that both agree for every gradient).
"""

from __future__ import annotations

import numpy as np

from gssp_jax.sync.rounds import Round


class Accounting:
  """Versions per replica and what every worker read; ``apply`` returns the round's staleness.

  Args:
    num_workers: W.
    num_replicas: R.
    aggregating: InHAD semantics (gradients wait in node aggregates and are
      applied when the round's ``aggregate`` is set). Every push is one
      gradient: a worker that pushes k times before an update contributes k
      applied gradients, each with its own staleness (fixed on arrival, since
      the version cannot change while gradients wait).
  """

  def __init__(self, num_workers: int, num_replicas: int, aggregating: bool = False,
               max_staleness_bin: int = 64):
    self.version = np.zeros([num_replicas], np.int64)
    self.read = np.zeros([num_workers], np.int64)
    self.pending = [[] for _ in range(num_workers)]   # aggregating: staleness of waiting gradients
    self.aggregating = aggregating
    self.hist = np.zeros([max_staleness_bin + 1], np.int64)  # last bin: >= max_staleness_bin
    self.applied = 0
    self.staleness_sum = 0
    self.staleness_max = 0

  def apply(self, rnd: Round) -> tuple[np.ndarray, np.ndarray]:
    """Accounts for ``rnd``; returns (the worker of each applied gradient, its staleness).

    A worker appears once per gradient applied (InHAD: as often as it pushed
    since the last update, in push order).
    """
    route = rnd.groups
    if self.aggregating:
      for w in np.flatnonzero(rnd.arrived):
        self.pending[w].append(int(self.version[0] - self.read[w]))
      workers = np.zeros([0], np.int64)
      values = np.zeros([0], np.int64)
      if rnd.applies[0]:
        workers = np.array([w for w, p in enumerate(self.pending) for _ in p], np.int64)
        values = np.array([v for p in self.pending for v in p], np.int64)
        self.pending = [[] for _ in self.pending]
    else:
      workers = np.flatnonzero(rnd.arrived)
      values = (self.version[route] - self.read)[workers]
    self.version += rnd.applies.astype(np.int64) + (rnd.adopt >= 0)
    reads = self.version[0] if self.aggregating else self.version[route]
    self.read = np.where(rnd.pulls, reads, self.read)
    if workers.size:
      np.add.at(self.hist, np.minimum(values, self.hist.size - 1), 1)
      self.applied += workers.size
      self.staleness_sum += int(values.sum())
      self.staleness_max = max(self.staleness_max, int(values.max()))
    return workers, values

  def summary(self) -> dict:
    """``mean``, ``max`` and ``hist`` (counts of staleness 0, 1, …; last bin is >=) so far."""
    last = int(np.max(np.flatnonzero(self.hist), initial=0))
    return {"mean": self.staleness_sum / max(self.applied, 1), "max": self.staleness_max,
            "hist": self.hist[:last + 1].tolist(), "applied": self.applied}

  def state_dict(self) -> dict:
    return dict(vars(self))

  def load_state_dict(self, state: dict) -> None:
    vars(self).update(state)
