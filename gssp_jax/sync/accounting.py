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
from gssp_jax.sync.rounds import stack_fields

# The round fields Accounting.apply_many reads.
STACKED = ("arrived", "pulls", "applies", "groups", "forward", "deliver", "adopt", "average")


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

  def apply_many(self, rounds, stacked: dict | None = None) -> None:
    """Accounts for ``rounds`` in order: what :meth:`apply` does one by one, vectorised.

    The simulator accounts for the rounds between two evaluations in one call
    (a few microseconds of host time per round instead of ~100). Stretches of
    rounds in which no replica adopts or averages are done with cumulative sums
    (versions and data grow by addition there; a read is the value at the
    worker's last pull before the round, found by a sorted search); GSSP's
    forwards and deliveries are followed event by event. A round that adopts or
    averages, and every round of an aggregating scheme, goes through
    :meth:`apply`. The result is the same, exactly (integers throughout).

    ``stacked``: the rounds' fields :data:`STACKED`, already stacked
    (``rounds.stack_fields``); else they are stacked here.
    """
    rounds = list(rounds)
    if not rounds:
      return
    if self.aggregating:
      for rnd in rounds:
        self.apply(rnd)
      return
    if stacked is None:
      stacked = stack_fields(rounds, STACKED)
    stacked = _Stacked(stacked, self.version.size)
    special = np.flatnonzero(stacked.special)
    start = 0
    for k in special.tolist() + [len(rounds)]:
      if k > start:
        self._apply_plain(stacked.part(start, k))
      if k < len(rounds):
        self.apply(rounds[k])
      start = k + 1

  def _apply_plain(self, s: "_Stacked") -> None:
    """:meth:`apply_many` on rounds in which no replica adopts or averages."""
    n, R, G = s.arrived.shape[0], self.version.size, s.forward.shape[1]
    inc = s.applies.astype(np.int64)                                   # [n, R]
    v_after = self.version + np.cumsum(inc, axis=0)
    ka, wa = np.nonzero(s.arrived)                                     # round, worker
    ra = s.replicas[ka, wa]
    iters = self.push_iterations[wa]
    taken = np.zeros([n, R], np.int64)
    np.add.at(taken, (ka, ra), iters * s.applies[ka, ra])
    if self.group_pending is None:   # GSSP's forwards (other schemes never forward)
      self.group_pending = np.zeros([G], np.int64)
      self.group_outbox = np.zeros([G], np.int64)
    if G > 1 or s.forward.any():
      self._exchanges(s, ka, np.minimum(ra, G - 1), iters, taken)
    d_after = self.data + np.cumsum(taken, axis=0)
    kp, wp = np.nonzero(s.pulls)
    rp = s.replicas[kp, wp]
    read = _last_before(kp, wp, v_after[kp, rp], ka, wa, self.read, n)
    read_data = _last_before(kp, wp, d_after[kp, rp], ka, wa, self.read_data, n)
    values = (v_after - inc)[ka, ra] - read
    data_values = (d_after - taken)[ka, ra] - read_data
    self.version = v_after[-1].copy()
    self.data = d_after[-1].copy()
    # Each worker's read after the stretch: its last pull's value (the pulls come sorted
    # by round, so the last write per worker wins).
    self.read[wp] = v_after[kp, rp]
    self.read_data[wp] = d_after[kp, rp]
    self._count(values, data_values)

  def _exchanges(self, s: "_Stacked", ka, ga, iters, taken) -> None:
    """GSSP's group bookkeeping over plain rounds: pending sums, forwards, deliveries.

    ``ka``, ``ga``, ``iters``: each arrival's round, group and data iterations.
    Adds every delivery to ``taken`` (peer: the other group servers that apply;
    global: the global server ``G``) in the round it happens.

    Vectorised per group when each forward finds its group's outbox empty (one
    forward in flight per group, as GSSP does): a forward then sends what
    arrived since the previous one, and a delivery what the last forward before
    it sent, unless a delivery came in between. Otherwise event by event
    (:meth:`_exchange_events`).
    """
    n, G = s.forward.shape
    arrivals = np.zeros([n, G], np.int64)
    np.add.at(arrivals, (ka, ga), iters)
    total = np.zeros([n + 1, G], np.int64)       # total[b] - total[a]: rounds a .. b - 1
    np.cumsum(arrivals, axis=0, out=total[1:])
    sent = np.zeros([n, G], np.int64)            # what each round delivers, per group
    pending, outbox = self.group_pending.copy(), self.group_outbox.copy()
    for g in range(G):
      f, d = np.flatnonzero(s.forward[:, g]), np.flatnonzero(s.deliver[:, g])
      if not (f.size or d.size):
        pending[g] += total[n, g]
        continue
      if f.size:
        # Each forward must find the outbox empty: delivered in (previous forward, this one]
        # (a delivery before the forward of its round), or empty at the start.
        cleared = np.searchsorted(d, f, side="right") > np.searchsorted(
            d, np.concatenate([[-1], f[:-1]]), side="right")
        if not cleared[0] and outbox[g] == 0:
          cleared[0] = True
        if not cleared.all():
          self._exchange_events(s, total, taken)
          return
        amounts = np.diff(total[f + 1, g], prepend=total[0, g])
        amounts[0] += pending[g]
      if d.size:
        before = np.searchsorted(f, d, side="left") - 1      # the last forward before each
        prev_d = np.concatenate([[-1], d[:-1]])
        if f.size:
          prev_f = np.where(before >= 0, f[np.maximum(before, 0)], -1)
          value = np.where(before >= 0, amounts[np.maximum(before, 0)], outbox[g])
        else:
          prev_f, value = np.full(d.size, -1), np.full(d.size, outbox[g])
        # Sent unless a delivery since that forward (or since the start) emptied the outbox.
        sent[d, g] = np.where(np.where(before >= 0, prev_d <= prev_f, prev_d < 0), value, 0)
      if f.size:
        pending[g] = total[n, g] - total[f[-1] + 1, g]
        outbox[g] = amounts[-1] if not d.size or f[-1] >= d[-1] else 0
      else:
        pending[g] += total[n, g]
        outbox[g] = 0
    whole = sent.sum(1)
    if taken.shape[1] == 2 * G + 1:   # GSSP global: the global server takes every delivered sum
      taken[:, G] += whole * s.applies[:, G]
    else:                             # peer: every other group server takes it
      taken[:, :G] += (whole[:, None] - sent) * s.applies[:, :G]
    self.group_pending, self.group_outbox = pending, outbox

  def _exchange_events(self, s: "_Stacked", total, taken) -> None:
    """:meth:`_exchanges`, event by event in plain Python (any order of forwards and deliveries)."""
    n, G = s.forward.shape
    R = taken.shape[1]
    # Event by event in plain Python: a handful of groups, one event every few rounds.
    pending, outbox = self.group_pending.tolist(), self.group_outbox.tolist()
    events = np.flatnonzero(s.forward.any(1) | s.deliver.any(1))
    totals = total[events + 1].tolist()
    forward, deliver = s.forward[events].tolist(), s.deliver[events].tolist()
    applies = s.applies[events].tolist()
    upto = np.zeros([G], np.int64).tolist()   # ``total`` at the last event: what pending holds
    is_global = R == 2 * G + 1
    for i, k in enumerate(events.tolist()):
      sent = [o if d else 0 for o, d in zip(outbox, deliver[i])]   # before this round's forward
      whole = sum(sent)
      if whole:
        if is_global:   # GSSP global: the global server takes every delivered sum
          taken[k, G] += whole if applies[i][G] else 0
        else:           # peer: every other group server takes it
          taken[k, :G] += [whole - x if a else 0 for x, a in zip(sent, applies[i][:G])]
      pending = [p + t - u for p, t, u in zip(pending, totals[i], upto)]
      upto = totals[i]
      outbox = [0 if d else o for o, d in zip(outbox, deliver[i])]
      outbox = [o + p if f else o for o, p, f in zip(outbox, pending, forward[i])]
      pending = [0 if f else p for p, f in zip(pending, forward[i])]
    self.group_pending = np.asarray(pending, np.int64) + total[n] - np.asarray(upto, np.int64)
    self.group_outbox = np.asarray(outbox, np.int64)

  def _count(self, values: np.ndarray, data_values: np.ndarray) -> None:
    """Adds applied gradients' staleness (updates, data) to the histograms and totals."""
    if not values.size:
      return
    self.hist += np.bincount(np.minimum(values, self.hist.size - 1),
                             minlength=self.hist.size)
    self.applied += values.size
    self.staleness_sum += int(values.sum())
    self.staleness_max = max(self.staleness_max, int(values.max()))
    self.data_hist += np.bincount(np.minimum(data_values, self.data_hist.size - 1),
                                  minlength=self.data_hist.size)
    self.data_sum += int(data_values.sum())
    self.data_max = max(self.data_max, int(data_values.max()))

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


def _last_before(kp, wp, pulled, ka, wa, initial: np.ndarray, n: int) -> np.ndarray:
  """For each arrival ``(ka, wa)``: the value its worker read at its last pull in an earlier
  round of the stretch (``pulled``, one per pull ``(kp, wp)``), else ``initial[wa]``."""
  if not ka.size:
    return np.zeros([0], np.int64)
  out = initial[wa].astype(np.int64)
  if not kp.size:
    return out
  keys = wp.astype(np.int64) * (n + 1) + kp            # pulls by worker, then round
  order = np.argsort(keys, kind="stable")
  keys, pulled = keys[order], pulled[order]
  at = np.searchsorted(keys, wa.astype(np.int64) * (n + 1) + ka, side="left") - 1
  hit = at >= 0
  hit[hit] = keys[at[hit]] // (n + 1) == wa[hit]       # the same worker, an earlier round
  out[hit] = pulled[at[hit]]
  return out


class _Stacked:
  """The fields :meth:`Accounting.apply_many` reads, stacked over rounds (leading axis)."""

  def __init__(self, fields: dict, num_replicas: int):
    self.arrived, self.pulls = fields["arrived"], fields["pulls"]
    self.applies, self.forward, self.deliver = (fields["applies"], fields["forward"],
                                                fields["deliver"])
    # ``rounds.replica_route``: with one replica every worker's is 0.
    self.replicas = (np.zeros(self.arrived.shape, np.int64) if num_replicas == 1
                     else fields["groups"].astype(np.int64))
    self.special = (fields["adopt"] >= 0).any(1) | (fields["average"] >= 0).any(1)

  def part(self, start: int, stop: int) -> "_Stacked":
    out = object.__new__(_Stacked)
    out.__dict__.update({k: v[start:stop] for k, v in vars(self).items()})
    return out
