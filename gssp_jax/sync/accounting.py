"""Gradient-free accounting of a stream of rounds: versions, staleness, bytes, updates.

It mirrors the transforms' staleness bookkeeping on the host, so the simulator
knows the staleness of every applied gradient without reading device state
(and the tests check that both agree for every gradient).

Staleness in two units, each gradient measured at its own server (the replica
its worker pulls from) between the worker's read and the gradient's
application:

* **updates** (``summary()``): the server's optimizer steps in between. A GSSP
  delivery of another group's sum, an InHAD aggregate, a BSP round or a
  DS-Sync average each count 1, however many gradients they carry.
* **data** (``data_summary()``): the worker iterations of data (gradients)
  the server incorporated in between. A BSP round adds W, an ASP push 1, a
  GSSP delivery the K pushes of the forwarded sum, an InHAD aggregate every
  gradient waiting in the node aggregates, an adoption (GSSP global) the
  count of the copied replica. DS-Sync's averaging of a group of replicas
  counts, for each member, the gradients it took since its last averaging,
  once, plus the largest count the members shared at their last averagings
  (members last averaged in different groups may share more; that overlap is
  counted twice, an upper bound).

A local-update push counts its job's ``H_w`` iterations (``push_iterations``).
HALoS's exchanges are counted as GSSP global's (a delivery adds the forwarded
pushes' iterations, a merge copies the slot's count): its merge is weighted and
its progress during an exchange is not forwarded, so there the data figure is
an approximation.

ASP's two figures are equal (one-step jobs); BSP's are 0 in both. GSSP's 6.0 updates and
ASP's 15.0 updates are not comparable; their data staleness is.
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
               max_staleness_bin: int = 64, push_iterations=None):
    self.version = np.zeros([num_replicas], np.int64)
    self.read = np.zeros([num_workers], np.int64)
    self.pending = [[] for _ in range(num_workers)]   # aggregating: staleness of waiting gradients
    self.aggregating = aggregating
    self.hist = np.zeros([max_staleness_bin + 1], np.int64)  # last bin: >= max_staleness_bin
    self.applied = 0
    self.staleness_sum = 0
    self.staleness_max = 0
    self._data_defaults(num_workers, num_replicas, max_staleness_bin)
    # Data iterations in one push of each worker: a local-update job's H_w (else 1).
    self.push_iterations = (np.ones([num_workers], np.int64) if push_iterations is None
                            else np.asarray(push_iterations, np.int64).copy())

  def _data_defaults(self, num_workers: int, num_replicas: int, max_bin: int = 64) -> None:
    """The staleness in data's counters (added with issue 22; absent from older checkpoints)."""
    self.data = np.zeros([num_replicas], np.int64)        # gradients each replica incorporated
    self.read_data = np.zeros([num_workers], np.int64)    # ``data`` of the replica each read
    self.data_base = np.zeros([num_replicas], np.int64)   # ``data`` at each replica's last average
    self.group_pending = None   # GSSP: [G] gradients since each group's last forward
    self.group_outbox = None    # GSSP: [G] gradients of each forward in flight
    self.pending_data = [[] for _ in range(num_workers)]  # aggregating: waiting gradients' values
    self.data_hist = np.zeros([max_bin + 1], np.int64)
    self.data_sum = 0
    self.data_max = 0

  def apply(self, rnd: Round) -> tuple[np.ndarray, np.ndarray]:
    """Accounts for ``rnd``; returns (the worker of each applied gradient, its staleness).

    A worker appears once per gradient applied (InHAD: as often as it pushed
    since the last update, in push order).
    """
    route = rnd.groups
    if self.aggregating:
      for w in np.flatnonzero(rnd.arrived):
        self.pending[w].append(int(self.version[0] - self.read[w]))
        self.pending_data[w].append(int(self.data[0] - self.read_data[w]))
      workers = np.zeros([0], np.int64)
      values = data_values = np.zeros([0], np.int64)
      if rnd.applies[0]:
        workers = np.array([w for w, p in enumerate(self.pending) for _ in p], np.int64)
        values = np.array([v for p in self.pending for v in p], np.int64)
        data_values = np.array([v for p in self.pending_data for v in p], np.int64)
        self.pending = [[] for _ in self.pending]
        self.pending_data = [[] for _ in self.pending_data]
        self.data[0] += workers.size
    else:
      workers = np.flatnonzero(rnd.arrived)
      replicas = _replica_route(route, self.version.size)
      values = (self.version[replicas] - self.read)[workers]
      data_values = (self.data[replicas] - self.read_data)[workers]
      self._count_data(rnd, replicas)
    self.version += rnd.applies.astype(np.int64) + (rnd.adopt >= 0)
    reads = self.version[0] if self.aggregating else self.version[route]
    self.read = np.where(rnd.pulls, reads, self.read)
    data_reads = self.data[0] if self.aggregating else self.data[
        _replica_route(route, self.version.size)]
    self.read_data = np.where(rnd.pulls, data_reads, self.read_data)
    if workers.size:
      np.add.at(self.hist, np.minimum(values, self.hist.size - 1), 1)
      self.applied += workers.size
      self.staleness_sum += int(values.sum())
      self.staleness_max = max(self.staleness_max, int(values.max()))
      np.add.at(self.data_hist, np.minimum(data_values, self.data_hist.size - 1), 1)
      self.data_sum += int(data_values.sum())
      self.data_max = max(self.data_max, int(data_values.max()))
    return workers, values

  def _count_data(self, rnd: Round, replicas: np.ndarray) -> None:
    """Adds the round's gradients to each replica's ``data``, in ``apply_round``'s order."""
    R, G = self.version.size, rnd.forward.size
    arrived = np.flatnonzero(rnd.arrived)
    iters = self.push_iterations[arrived]
    taken = np.bincount(replicas[arrived], weights=iters, minlength=R).astype(np.int64) * rnd.applies
    if self.group_pending is None:   # GSSP's forwards (other schemes never forward)
      self.group_pending = np.zeros([G], np.int64)
      self.group_outbox = np.zeros([G], np.int64)
    sent = np.where(rnd.deliver, self.group_outbox, 0)
    if sent.any():
      if R == 2 * G + 1:   # GSSP global: the global server takes every delivered sum
        taken[G] += sent.sum() if rnd.applies[G] else 0
      else:                # peer: every other group server takes it
        taken[:G] += np.where(rnd.applies[:G], sent.sum() - sent, 0)
    if G > 1 or rnd.forward.any():
      self.group_pending += np.bincount(np.minimum(replicas[arrived], G - 1), weights=iters,
                                        minlength=G)[:G].astype(np.int64)
      self.group_outbox = np.where(rnd.deliver, 0, self.group_outbox)
      self.group_outbox = np.where(rnd.forward, self.group_outbox + self.group_pending,
                                   self.group_outbox)
      self.group_pending = np.where(rnd.forward, 0, self.group_pending)
    self.data += taken
    for group in np.unique(rnd.average[rnd.average >= 0]):
      members = np.flatnonzero(rnd.average == group)
      merged = int((self.data[members] - self.data_base[members]).sum()
                   + self.data_base[members].max())
      self.data[members] = merged
      self.data_base[members] = merged
    adopt = rnd.adopt >= 0
    self.data = np.where(adopt, self.data[np.maximum(rnd.adopt, 0)], self.data)

  def data_summary(self) -> dict:
    """Staleness in worker iterations of data: ``mean``, ``max``, ``hist`` (see the module)."""
    last = int(np.max(np.flatnonzero(self.data_hist), initial=0))
    return {"mean": self.data_sum / max(self.applied, 1), "max": self.data_max,
            "hist": self.data_hist[:last + 1].tolist(), "applied": self.applied,
            "unit": "worker iterations of data incorporated by its server"}

  def summary(self) -> dict:
    """``mean``, ``max`` and ``hist`` (counts of staleness 0, 1, …; last bin is >=) so far."""
    last = int(np.max(np.flatnonzero(self.hist), initial=0))
    return {"mean": self.staleness_sum / max(self.applied, 1), "max": self.staleness_max,
            "hist": self.hist[:last + 1].tolist(), "applied": self.applied,
            "unit": "updates of its server"}

  def state_dict(self) -> dict:
    return dict(vars(self))

  def load_state_dict(self, state: dict) -> None:
    if "data" not in state:   # a checkpoint from before the data counters: they start now
      self._data_defaults(self.read.size, state["version"].size, state["hist"].size - 1)
    vars(self).update(state)


def _replica_route(groups: np.ndarray, num_replicas: int) -> np.ndarray:
  """``rounds.replica_route`` on the host: one replica means every worker's is 0."""
  return np.zeros_like(groups) if num_replicas == 1 else groups
