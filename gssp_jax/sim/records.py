"""The host bookkeeping every scheme executor shares: a round's accounting, metrics, summaries.

The simulator (``sim/simulate.py``) and the real runtime's control plane
(``runtime/server.py``) both drive a scheme's protocol and apply the rounds it
emits; the only differences are where time comes from (virtual or wall) and
where gradients come from. Everything they count is counted here, by the same
functions, so a simulated and a real run of the same events report the same
staleness, updates, bytes per link and records.

``host`` is the executor's counters dict: ``rounds``, ``updates``,
``server_bytes``, ``class_bytes`` (bytes of the traffic classes that are not
pushes, pulls or between servers, by name: ``sync.legs``), and the ``[W]``
arrays ``pushed_per_worker`` and ``pulls_per_worker``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gssp_jax import sync
from gssp_jax.base import health


def new_counters(num_workers: int) -> dict[str, Any]:
  """The byte and round counters :func:`account_round` and :func:`traffic` read and write."""
  return {"rounds": 0, "updates": 0, "server_bytes": 0, "class_bytes": {},
          "pushed_per_worker": np.zeros([num_workers], np.int64),
          "pulls_per_worker": np.zeros([num_workers], np.int64)}


def upgrade_counters(host: dict, links) -> dict:
  """``host`` of a checkpoint written before the traffic classes, in today's form (in place).

  Its ``node_push_bytes`` (InHAD's aggregates) become ``node_to_server``, its
  ``local_bytes`` the class the legs count there (``legs.local_class``).
  """
  if "class_bytes" in host:
    return host
  class_bytes = host["class_bytes"] = {}
  node, local = int(host.pop("node_push_bytes", 0)), int(host.pop("local_bytes", 0))
  if node:
    class_bytes["node_to_server"] = node
  if local and links.legs.local_class:   # only legs with a local class ever counted them
    class_bytes[links.legs.local_class] = local
  return host


def account_round(rnd, *, host: dict, acct, protocol, links, iteration: np.ndarray,
                  learning_rate: float, pull_bytes: int) -> dict[str, Any]:
  """Counts round ``rnd`` (staleness, updates, bytes per link); returns its device args.

  Args:
    rnd: the round the protocol emitted.
    host: the executor's counters (see the module docstring), updated.
    acct: the run's ``sync.accounting.Accounting``, updated.
    protocol: the protocol that emitted ``rnd``.
    links: the run's ``sim.traffic.Traffic``.
    iteration: ``[W]`` pushes per worker so far (sizes a compressed push).
    learning_rate: the schedule's value at this point of the run.
    pull_bytes: bytes of one pull (a server-to-server payload is as large).
  """
  args = sync.round_args(rnd)
  args["learning_rate"] = np.float32(learning_rate)
  acct.apply(rnd)
  host["rounds"] += 1
  host["updates"] += int(rnd.applies.any())
  host["server_bytes"] += protocol.server_payloads(rnd) * pull_bytes
  links.count_round(protocol, rnd, iteration, host)
  return args


def account_rounds(rounds, *, host: dict, acct, protocol, links, pull_bytes: int) -> None:
  """:func:`account_round`'s bookkeeping of many rounds at once, but their device args.

  The simulator defers its rounds' accounting to the next evaluation (or
  checkpoint) and does it here, vectorised (``Accounting.apply_many``): a few
  microseconds per round. What depends on the protocol's state when a round
  happens (InHAD's and CASP's traffic, ``links.counts_per_round``) is counted
  then, by ``links.count_round``; the rest here gives the same counters
  (``links.count_rounds``).
  """
  rounds = list(rounds)
  if not rounds:
    return
  stacked = sync.rounds.stack_fields(rounds, sync.accounting.STACKED, protocol.round_fields)
  acct.apply_many(rounds, stacked)
  host["rounds"] += len(rounds)
  host["updates"] += int(stacked["applies"].any(1).sum())
  if type(protocol).server_payloads is not sync.Protocol.server_payloads:
    payloads = sum(protocol.server_payloads(r) for r in rounds)   # a protocol's own rule
  else:
    payloads = protocol.server_payloads_of(stacked["deliver"], stacked["adopt"])
  host["server_bytes"] += payloads * pull_bytes
  if not links.counts_per_round:
    links.count_rounds(stacked, host)


def check_finite_loss(loss_sum, *, pushes: int, learning_rate, when: str = "") -> None:
  """Raises ``FloatingPointError`` when the training loss since the last evaluation is not
  finite: the message every executor of pushes gives (``when``: more about the moment)."""
  if not np.isfinite(loss_sum):
    raise FloatingPointError(
        f"non-finite training loss before {pushes} pushes{when}; the run stopped. Lower "
        f"optimizer.learning_rate ({learning_rate}) or set optimizer.grad_clip")


def traffic(host: dict, pull_bytes: int) -> dict:
  """Bytes so far: in total, per class, and by the links the keys before the classes named
  (``sync.legs.traffic_fields``)."""
  by_class = dict(host["class_bytes"])
  for name, num_bytes in (("worker_to_server", int(host["pushed_per_worker"].sum())),
                          ("server_to_worker", int(host["pulls_per_worker"].sum()) * pull_bytes),
                          ("server_to_server", int(host["server_bytes"]))):
    by_class[name] = by_class.get(name, 0) + num_bytes
  return sync.legs.traffic_fields(by_class)


def evaluation_record(*, pushes: int, num_workers: int, spe: int, updates: int,
                      virtual_time: float, wall_time: float, loss_sum: float, loss_count: int,
                      results: dict, host: dict, pull_bytes: int, blocked: np.ndarray,
                      acct, iterations: int | None = None) -> dict[str, Any]:
  """One ``metrics.jsonl`` line (the keys docs/USAGE.md lists), from the executor's counters.

  ``iterations``: data iterations pushed (default ``pushes``; a local-update
  push carries its ``H`` inner steps' iterations); the epoch counts them.
  """
  iterations = pushes if iterations is None else iterations
  return {
      "epoch": iterations / (num_workers * spe),
      "pushes": int(pushes),
      "updates": int(updates),
      "virtual_time": float(virtual_time),
      "wall_time": float(wall_time),
      "train_loss": float(loss_sum) / max(int(loss_count), 1),
      **results,
      **traffic(host, pull_bytes),
      "bytes_pushed_per_worker": host["pushed_per_worker"].tolist(),
      "bytes_pulled_per_worker": (host["pulls_per_worker"] * pull_bytes).tolist(),
      "blocked_time": float(np.mean(blocked)),
      "blocked_time_per_worker": np.asarray(blocked).tolist(),
      "staleness": acct.summary(),
      "staleness_data": acct.data_summary(),
      "updates_per_replica": acct.version.tolist(),
  }


def summary_fields(*, history: list[dict], reached: dict | None, metric: str, target: float,
                   scheme, groups, cluster: dict, pushes: int, batch_size: int,
                   virtual_time: float, wall_time: float, host: dict, pull_bytes: int,
                   blocked: np.ndarray, acct, iterations: int | None = None) -> dict[str, Any]:
  """The executor's part of ``summary.json``: time to target, the scheme, the cluster, totals.

  ``iterations``: as in :func:`evaluation_record`; ``samples`` counts them.
  """
  iterations = pushes if iterations is None else iterations
  return {
      **health.time_to_target_fields(history, metric, target),
      "pushes_to_target": reached["pushes"] if reached else None,
      "scheme": {**sync.registry.describe(scheme), "groups": groups},
      "cluster": cluster,
      "totals": {
          "pushes": int(pushes), "updates": int(host["updates"]), "rounds": int(host["rounds"]),
          "samples": int(iterations) * batch_size, "virtual_time": float(virtual_time),
          "wall_time": float(wall_time), **traffic(host, pull_bytes),
          "blocked_time_per_worker": np.asarray(blocked).tolist(),
          "staleness": acct.summary(), "staleness_data": acct.data_summary(),
          "updates_per_replica": acct.version.tolist(),
      },
  }
