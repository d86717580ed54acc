"""Executors: what advances a run's state between evaluations; the loop drives any of them.

``train/loop.py`` builds one executor from the config (:func:`make_executor`, the one place
an executor name becomes an object; ``auto`` resolves by :func:`executor_name`) and then only
calls the methods of :class:`Executor`. Three classes implement it:

* ``fused``: BSP data-parallel training with no cluster, one jitted chunk of
  updates per call (:class:`FusedBSP`); no virtual time.
* ``rounds`` and ``levels``: any scheme on the simulated cluster
  (``gssp_jax.sim.simulate.Simulation``), with one device call per round and
  its jobs, or one compiled call per chunk of dependency pieces (``sim/levels.py``).
* ``dist``: the real runtime's control plane (``gssp_jax.runtime.server.DistServer``), the
  meshes and shards running in processes of their own (``docs/REAL_RUNS.md``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from absl import logging
import jax
import ml_collections
import numpy as np

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.data import sharding
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import devices as devices_lib
from gssp_jax.sync import legs
from gssp_jax.sync import local
from gssp_jax.sync import registry
from gssp_jax.base import checkpoint as ckpt_lib
from gssp_jax.base import interrupt
from gssp_jax.base import optim
from gssp_jax.base import run as run_lib
from gssp_jax.base import step as step_lib
from gssp_jax.base import workdir as workdir_lib


class Executor(Protocol):
  """What the loop needs of an executor (host side; state stays inside it).

  Attributes:
    position_key: the metrics key that orders a run (``updates`` or
      ``pushes``); resuming keeps the metric lines up to the checkpoint's.
    metric_name: ``test_accuracy`` or ``bleu``.
    target: the config's target for it (0 = none).
  """
  position_key: str
  metric_name: str
  target: float

  def restore(self) -> int:
    """Loads the latest checkpoint if there is one; returns the position (0 when fresh)."""

  @property
  def position(self) -> int:
    """Where the run is, in ``position_key`` units."""

  def finished(self) -> bool:
    """True once the run reached its end (or ``train.stop_after_updates``)."""

  def completed(self) -> bool:
    """True once the run trained its whole budget (not only up to ``stop_after_updates``)."""

  def advance(self) -> bool:
    """Trains up to the next evaluation point or the end; True at an evaluation point.

    Returns False early, at a point it can checkpoint and resume from exactly,
    once ``interrupt.requested()``.

    Raises:
      FloatingPointError: a non-finite training loss.
    """

  def evaluate(self) -> dict[str, Any]:
    """Evaluates at the current position; returns the ``metrics.jsonl`` record."""

  @property
  def evaluations(self) -> int:
    """Evaluations so far (checkpointed), for ``train.checkpoint_every`` (the loop's cadence)."""

  def progress(self, record: dict[str, Any]) -> str:
    """The progress line logged after ``record``."""

  def save(self) -> None:
    """Checkpoints everything needed to resume exactly at the current position."""

  def close(self) -> None:
    """Waits for pending checkpoints and releases them."""

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    """The summary's executor-specific keys: time to target, totals, scheme, cluster."""


def uses_simulator(config: ml_collections.ConfigDict) -> bool:
  """BSP without a cluster description trains in the fused loop; everything else is simulated."""
  return not registry.has_fused_loop(config.sync.scheme) or cluster_lib.cluster_is_set(config)


def validate(config: ml_collections.ConfigDict) -> None:
  """``config.executor`` is known and can run this config (fused: BSP without a cluster).

  Raises:
    ValueError: one line naming the key, its value and what is allowed.
  """
  name = config.get("executor", "auto")
  if name not in defaults.EXECUTORS:
    checks.fail("executor", name, ", ".join(defaults.EXECUTORS))
  if name == "fused" and uses_simulator(config):
    why = (f"sync.scheme={config.sync.scheme!r}"
           if not registry.has_fused_loop(config.sync.scheme)
           else "config.cluster describes a cluster")
    raise ValueError(f"config.executor='fused' cannot apply: {why}, and the fused executor"
                     " trains only BSP without a cluster (no virtual time); use 'rounds' or"
                     " 'auto'")
  validate_levels_per_call(config)


def validate_levels_per_call(config: ml_collections.ConfigDict, backend: str | None = None) -> None:
  """``levels_per_call`` (0 or a power of two up to 64), ``level_job_slots`` and
  ``level_job_batch`` (each 0..W), ``devices`` (0 = all local devices, or 1..their count;
  across processes, ``sim/hosts.py``, 0 or every process's count: all of them).

  Any of them set (not 0; ``devices`` not 1) is an error unless the run uses the ``levels``
  executor.

  Args:
    config: the run's config.
    backend: the JAX backend ``executor='auto'`` resolves against (``jax.default_backend()``
      if None; only read when a key is set under ``auto``).
  """
  value = config.get("levels_per_call", 0)
  if (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64
      or value & (value - 1)):
    checks.fail("levels_per_call", value, "0 (chosen by the run) or a power of two from 1 to 64")
  counts = {}
  for key, default in (("level_job_slots", "chosen by the run, at most min(num_workers, 64)"),
                       ("level_job_batch", "chosen by the run")):
    counts[key] = count = config.get(key, 0)
    if (isinstance(count, bool) or not isinstance(count, int)
        or not 0 <= count <= config.num_workers):
      checks.fail(key, count, f"0 ({default}) or 1..num_workers ({config.num_workers})")
  devices = config.get("devices", 1)
  # An int in range (every process's devices, across processes), else ValueError.
  devices_lib.count(devices, devices_lib.available(), jax.process_count())
  for key, set_value in (("levels_per_call", value), *counts.items(), ("devices", devices)):
    if set_value == _LEVEL_KEYS_UNSET[key]:
      continue
    name = executor_name(config, backend)
    if name != "levels":
      raise ValueError(f"config.{key}={set_value} cannot apply: it sets the levels executor, and"
                       f" this run uses {name!r} (config.executor="
                       f"{config.get('executor', 'auto')!r}); set config.executor='levels' or "
                       f"leave {key}=0")


def executor_name(config: ml_collections.ConfigDict, backend: str | None = None) -> str:
  """The executor ``config.executor`` names.

  ``auto``: ``fused`` for BSP without a cluster; otherwise the simulator, with ``levels``,
  except on a CPU for a scheme whose protocol is a ``barrier`` (every round waits for every
  worker: BSP, Local SGD, DiLoCo, a researcher's scheme built on their protocol) or whose
  jobs are local updates (``local.steps`` inner steps each: every registered local-update
  scheme), which run ``rounds`` there. Measured on a 2-core CPU (``docs/PERFORMANCE.md``):
  ``levels`` simulates GSSP at 1.22-1.29 of a batched step against ``rounds``' 0.69-0.80 and
  beats it beside the serial loop for every asynchronous scheme of single gradients, while
  BSP, whose every round is already one dependency level, runs at 1.86 with ``rounds`` and
  1.39 with ``levels``; and a local-update scheme's level chunk (H inner steps in each job
  slot) compiles for minutes on a CPU: the README's shrunk asynchronous Local-SGD and HALoS
  take 121-283 s and 270 s with ``levels``, 31 s and 44 s with ``rounds``, at a steady rate
  within 10 % of each other. (On a CPU ``auto`` picked ``rounds`` for every scheme before
  2026-12-07; a resumed ``auto`` run keeps the executor its checkpoint was written by,
  :func:`resolved_for`.)

  Args:
    config: the run's config.
    backend: ``jax.default_backend()`` if None.
  """
  name = config.get("executor", "auto")
  if name != "auto":
    return name
  if not uses_simulator(config):
    return "fused"
  backend = jax.default_backend() if backend is None else backend
  if backend == "cpu" and (_barrier_scheme(config) or local.is_local(config.sync.scheme)):
    return "rounds"
  return "levels"


def _barrier_scheme(config: ml_collections.ConfigDict) -> bool:
  """Whether ``config``'s scheme's protocol is a barrier (``Protocol.barrier``); False for a
  config whose scheme cannot be built (its validation says why, elsewhere)."""
  try:
    scheme = registry.scheme_from_config(config)
  except (ValueError, KeyError, TypeError):
    return False
  return bool(scheme.make_protocol().barrier)


# The keys only the ``levels`` executor reads, each with its value when unset.
_LEVEL_KEYS_UNSET = {"levels_per_call": 0, "level_job_slots": 0, "level_job_batch": 0,
                     "devices": 1}


def _level_keys_set(config: ml_collections.ConfigDict) -> list[str]:
  """The keys only the ``levels`` executor reads that ``config`` sets."""
  return [k for k, unset in _LEVEL_KEYS_UNSET.items() if config.get(k, unset) != unset]


def resolved_for(config: ml_collections.ConfigDict, workdir: str) -> str:
  """:func:`executor_name`, except that an ``auto`` run resuming a checkpoint the ``rounds``
  executor wrote (``auto``'s choice on a CPU before it picked ``levels``) goes on with it, so
  that it resumes instead of stopping on the other layout; not where a ``levels``-only key is
  set (the restore's error then names the executor to resume with), nor across processes."""
  name = executor_name(config)
  if (config.get("executor", "auto") != "auto" or name != "levels"
      or jax.process_count() > 1 or _level_keys_set(config)):
    return name
  from gssp_jax.sim import simulate  # pylint: disable=g-import-not-at-top
  written = simulate.written_executor(workdir)
  if written is not None and written != name:
    logging.info("executor: %s, as the checkpoint in %s was written by it (config.executor="
                 "'auto' picks %r for a new run)", written, workdir, name)
    return written
  return name


def make_executor(config: ml_collections.ConfigDict, task, workdir: str) -> Executor:
  """Builds the executor the config picks (``defaults.EXECUTORS``, checked by :func:`validate`).

  The one place an executor name becomes an executor; the simulator's two
  variants differ only in the device runner they name.
  """
  name = resolved_for(config, workdir)
  logging.info("executor: %s (config.executor=%r, sync.scheme=%r, cluster.profile=%r)", name,
               config.get("executor", "auto"), config.sync.scheme, config.cluster.profile)
  if name == "fused":
    return FusedBSP(config, task, workdir)
  if name == "dist":
    from gssp_jax.runtime import server  # pylint: disable=g-import-not-at-top
    return server.DistServer(config, task, workdir,
                             num_servers=int(config.dist.get("num_servers", 1)))
  from gssp_jax.sim import simulate  # pylint: disable=g-import-not-at-top
  return simulate.Simulation(config, task, workdir, runner=name)


class _Plan:
  """The update schedule: epochs, evaluation points and chunk boundaries, all in updates."""

  def __init__(self, config, num_train: int):
    self.num_workers = config.num_workers
    self.batch_size = config.batch_size
    self.shards = sharding.worker_shards(num_train, config.num_workers, config.seed)
    self.steps_per_epoch = self.shards.shape[1] // config.batch_size
    self.total = max(1, round(config.train.num_epochs * self.steps_per_epoch))
    self.eval_interval = max(1, round(config.train.eval_every * self.steps_per_epoch))
    self.log_every = config.train.log_every
    stop = config.train.stop_after_updates
    self.end = min(self.total, stop) if stop else self.total

  def next_boundary(self, u: int) -> int:
    epoch_end = (u // self.steps_per_epoch + 1) * self.steps_per_epoch
    next_eval = (u // self.eval_interval + 1) * self.eval_interval
    next_log = (u // self.log_every + 1) * self.log_every
    return min(epoch_end, next_eval, next_log, self.end)

  def is_eval_point(self, u: int) -> bool:
    return u % self.eval_interval == 0 or u == self.total


class FusedBSP:
  """BSP data-parallel training in one jitted chunk runner: the fast path, no virtual time.

  Every worker computes its gradient on the same weights each update, so the
  run is ``step.make_bsp_step`` scanned over chunks that end at epoch ends,
  evaluations and progress lines.
  """

  position_key = "updates"

  def __init__(self, config: ml_collections.ConfigDict, task, workdir: str):
    self.config, self.task = config, task
    self.plan = plan = _Plan(config, task.num_train)
    tx = optim.make_optimizer(config.optimizer, plan.steps_per_epoch, plan.total)
    compressor = run_lib.make_compressor(config)
    self.state = step_lib.init_train_state(task, tx, config.seed, compressor)
    # Every round each worker pulls the parameters and the BatchNorm statistics.
    self.pull_payload = (step_lib.tree_bytes(self.state.params)
                         + step_lib.tree_bytes(self.state.model_state))
    logging.info("%s on %s: %d params, %d workers x batch %d, %d updates/epoch, %d updates",
                 config.model, config.dataset,
                 sum(x.size for x in jax.tree.leaves(self.state.params)),
                 plan.num_workers, plan.batch_size, plan.steps_per_epoch, plan.total)
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                              config.train.max_checkpoints)
    self.meta = {"wall_time": 0.0, "loss_sum": 0.0, "loss_steps": 0, "num_evals": 0,
                 "bytes_pushed": 0}
    # optimizer.grad_clip clips each worker's gradient before the mean, as the simulator's BSP
    # does (tx does not clip).
    self.run_chunk = step_lib.make_chunk_runner(
        step_lib.make_bsp_step(task.loss, tx, plan.num_workers, compressor,
                               grad_clip=config.optimizer.grad_clip), plan.batch_size)
    self.arrays = jax.device_put(task.train)
    self.metric_name, self.target = run_lib.metric_and_target(config, task)
    self.updates = 0
    self._order_epoch, self._order = -1, None
    self._session_start = time.perf_counter()
    self._eta = workdir_lib.Eta(0)
    self._wall_base = 0.0
    self._line = ""

  def restore(self) -> int:
    latest = self.checkpointer.latest_step()
    if latest is not None:
      state, self.meta = self.checkpointer.restore(latest, self.state)
      self.state = jax.device_put(state)
      logging.info("resumed from the checkpoint at update %d", latest)
    self.updates = int(self.state.step)
    self._session_start, self._wall_base = time.perf_counter(), self.meta["wall_time"]
    self._eta = workdir_lib.Eta(self.updates, (self.updates, self._wall_base))
    return self.updates

  def finished(self) -> bool:
    return self.updates >= self.plan.end

  def completed(self) -> bool:
    return self.updates == self.plan.total

  @property
  def position(self) -> int:
    return self.updates

  def advance(self) -> bool:
    while self.updates < self.plan.end:
      self._line = self._run_chunk()
      if self.plan.is_eval_point(self.updates):
        return True
      logging.info(self._line)
      if interrupt.requested():
        return False   # between chunks: the state and meta are consistent
    return False

  def _run_chunk(self) -> str:
    """One jitted chunk up to the next boundary; returns its progress line."""
    plan, updates = self.plan, self.updates
    epoch = updates // plan.steps_per_epoch
    if epoch != self._order_epoch:
      self._order = jax.device_put(sharding.epoch_order(plan.shards, self.config.seed, epoch))
      self._order_epoch = epoch
    n = plan.next_boundary(updates) - updates
    self.state, metrics = self.run_chunk(self.state, self.arrays, self._order,
                                         updates - epoch * plan.steps_per_epoch, n)
    losses = np.asarray(metrics["loss"], np.float64)
    if not np.all(np.isfinite(losses)):
      raise FloatingPointError(
          f"non-finite training loss in updates {updates + 1}..{updates + n} (epoch"
          f" {epoch}); the run stopped. Lower optimizer.learning_rate"
          f" ({self.config.optimizer.learning_rate}) or set optimizer.grad_clip")
    self.updates += n
    for value in losses:  # one at a time, so the sum does not depend on chunking
      self.meta["loss_sum"] += float(value)
    self.meta["loss_steps"] += n
    self.meta["bytes_pushed"] += int(np.asarray(metrics["push_bytes"], np.int64).sum())
    rate = self._eta.rate(self.updates)
    eta = max(plan.end - self.updates, 0) / max(rate, 1e-9)
    return (f"update {self.updates}/{plan.total} (epoch {self.updates / plan.steps_per_epoch:.2f})"
            f" loss {float(losses.mean()):.4f}"
            f" | {rate * plan.num_workers * plan.batch_size:.0f} samples/s"
            f" | ETA {workdir_lib.format_duration(eta)}")

  def _wall_time(self) -> float:
    return self._wall_base + time.perf_counter() - self._session_start

  def _traffic(self) -> dict:
    """Exact bytes so far (``sync.legs.traffic_fields``): pushes as the workers sent them;
    every worker pulls every round."""
    return legs.traffic_fields({
        "worker_to_server": self.meta["bytes_pushed"],
        "server_to_worker": self.updates * self.plan.num_workers * self.pull_payload})

  def evaluate(self) -> dict[str, Any]:
    results = self.task.evaluate(self.state.params, self.state.model_state)
    record = {
        "epoch": self.updates / self.plan.steps_per_epoch,
        "updates": self.updates,
        "virtual_time": None,  # no cluster: the simulator's executors time a cluster
        "wall_time": self._wall_time(),
        "train_loss": self.meta["loss_sum"] / self.meta["loss_steps"],
        **results,
        **self._traffic(),
        "blocked_time": None,
        "staleness": {"mean": 0.0, "max": 0},  # BSP applies only fresh gradients
    }
    self.meta["loss_sum"], self.meta["loss_steps"] = 0.0, 0
    self.meta["num_evals"] += 1
    return record

  @property
  def evaluations(self) -> int:
    return self.meta["num_evals"]

  def progress(self, record: dict[str, Any]) -> str:
    return f"{self._line} | {run_lib.metrics_text(record, self.metric_name)}"

  def save(self) -> None:
    self.meta["wall_time"] = self._wall_time()
    self.checkpointer.save(self.updates, self.state, self.meta)

  def close(self) -> None:
    self.checkpointer.close()

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    del history
    plan = self.plan
    return {
        "time_to_target": None,  # virtual seconds: only a simulated cluster has them
        "updates_to_target": reached["updates"] if reached else None,
        "totals": {
            "updates": self.updates,
            "samples": self.updates * plan.num_workers * plan.batch_size,
            "wall_time": self._wall_time(),
            **self._traffic(),
        },
    }
