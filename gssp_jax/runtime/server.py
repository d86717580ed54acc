"""``DistServer``: the real runtime's executor, the control plane of a sharded parameter server.

``train/loop.py`` drives it like the simulator (``config.executor='dist'``; the
launcher's ``server`` role sets it). It runs the scheme's **protocol** on the
meshes' pushes with wall-clock times and turns every event into ops for the
S parameter shards (``runtime/shard.py``): ``put`` a push into its worker slot,
apply a ``round``, take a ``snap``-shot, ``save``. The protocol sees only small
control messages (who pushed, its loss and bytes); the gradient and weight
bytes go straight between each mesh and each shard, in parallel. Shard 0 lives
in this process (its slice rides on the ``Push`` call itself); shards 1..S-1
are processes of their own (``--role=shard``), fed the same op stream.

What it counts (staleness, updates, bytes per link, the records) is counted by
the simulator's own functions (``sim/records.py``, ``sim/traffic.py``), and the
shards apply the simulator's jitted ``put``/``round`` functions to whole
tensors, so fed the same event sequence a real run reproduces the simulator
bit for bit, for any S.

Closed to strangers: every call carries the run's token (``runtime/auth.py``);
every push is checked before anything changes (the sender is this mesh's
joined process, its session and push number, its body's size and
finiteness against the model, its receipts from the other shards); a retried
push (same number) is answered, never applied twice.

Concurrency (what each thread owns; one lock orders the control plane):

* gRPC handler threads run ``Register``/``Ready`` (shards), ``Join``,
  ``Push``, ``Heartbeat``, ``Pull``. A ``Push`` checks its body without the
  lock, then takes ``self.lock`` to check the header against the mesh table,
  stage shard 0's slice, run the protocol and emit ops; it waits for its
  release on ``self.changed`` (the lock's condition), then, without the lock,
  reads its weights from shard 0 at its watermark.
* The loop's thread (``advance``/``evaluate``/``save``) takes the lock only to
  copy counters and emit ``snap``/``save`` ops; it fetches snapshots and waits
  for saves without it.
* The monitor thread drops meshes whose heartbeats stopped, ends a run whose
  meshes are all lost (``dist.all_lost_timeout``), and keeps the shards' op
  streams alive (a ``noop`` op when idle).
* The scheduler thread delivers server-to-server messages after their
  emulated delay.
* Shard 0's applier thread (``ShardCore``) and one sender thread per remote
  shard drain their op queues.

Lock order: ``self.lock`` may be held while taking a shard's lock (to stage a
slice or enqueue an op: both brief); a shard never takes ``self.lock``, and no
thread holds ``self.lock`` while it calls another process (``on_register``
closes a replaced shard's link after releasing it). ``self.lock`` is a plain
lock (``runtime/locks.py``): taking it again on the thread that holds it
raises, and the helpers that must run under it (``_emit``, ``_react``,
``_accept_push``, ``_finish``, ``_count_refused``) check that they do.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import math
import os
import threading
import time
from typing import Any, Callable

from absl import logging
import grpc
import jax
import ml_collections
import msgpack
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.runtime import auth
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import locks
from gssp_jax.runtime import shard as shard_lib
from gssp_jax.runtime import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import records
from gssp_jax.sim import simulate
from gssp_jax.sim import traffic as traffic_lib
from gssp_jax.sync import local as local_lib
from gssp_jax.train import checkpoint as ckpt_lib
from gssp_jax.train import interrupt
from gssp_jax.train import optim
from gssp_jax.train import run as run_lib
from gssp_jax.train import step as step_lib
from gssp_jax.train import workdir as workdir_lib

ADDRESS_FILE = "server_address.json"   # in the workdir: where the launcher finds a port-0 server
HOST_FORMAT = "sharded-1"              # the control plane's checkpointed host state


class RunFailed(RuntimeError):
  """The run cannot go on (every mesh lost, a shard lost); its checkpoint lets it resume."""


def config_id(config: ml_collections.ConfigDict) -> str:
  """A JSON of the config but ``executor`` and ``dist`` (which differ between roles)."""
  d = json.loads(config.to_json())
  d.pop("dist", None)
  d.pop("executor", None)
  return json.dumps(d, sort_keys=True)


# -- links to the shards ----------------------------------------------------------------------


class _LocalShard:
  """Shard 0, in this process."""

  def __init__(self, core: shard_lib.ShardCore):
    self.core, self.index, self.address = core, 0, "(in the server)"

  def send(self, index: int, op: dict) -> None:
    self.core.enqueue(index, [op])

  def snapshot(self, snap_id: int, timeout: float):
    return self.core.snapshot(snap_id, timeout)

  def saved(self, step: int, timeout: float) -> None:
    self.core.saved(step, timeout)

  def failure(self) -> str | None:
    return None if self.core.error is None else str(self.core.error)

  def close(self) -> None:
    self.core.stop()


class _RemoteShard:
  """Shard s in another process: a sender thread streams its ops; calls fetch what it made."""

  def __init__(self, index: int, address: str, client: wire.Client, session: str,
               layout: layout_lib.ShardLayout):
    self.index, self.address, self.client, self.session = index, address, client, session
    self.layout = layout
    self.cond = threading.Condition()
    self.outbox: list[tuple[int, dict]] = []
    self.error: str | None = None
    self.closed = False
    self.ready = False
    self._thread = threading.Thread(target=self._run, name=f"shard{index}-sender", daemon=True)
    self._thread.start()

  def send(self, index: int, op: dict) -> None:
    if op["k"] == "round":
      op = {**op, "args": shard_lib.encode_round(op["args"]), "lr": float(op["lr"])}
    with self.cond:
      self.outbox.append((index, op))
      self.cond.notify()

  def _run(self) -> None:
    while True:
      with self.cond:
        while not self.outbox and not self.closed:
          self.cond.wait()
        if self.closed and not self.outbox:
          return
        batch = self.outbox[:shard_lib.MAX_OPS_PER_CALL]
      body = np.frombuffer(msgpack.packb([op for _, op in batch], use_bin_type=True), np.uint8)
      try:
        self.client.call("Ops", {"session": self.session, "first": batch[0][0]}, body)
      except (wire.ServerGone, wire.CallError) as e:
        with self.cond:
          self.error = f"shard {self.index} at {self.address} failed: {e}"
          self.closed = True
        return
      with self.cond:
        del self.outbox[:len(batch)]

  def snapshot(self, snap_id: int, timeout: float):
    header, body = self.client.call("Snapshot", {"session": self.session, "id": snap_id},
                                    reply_limit=4 * self.layout.grad_size(self.index),
                                    timeout=timeout + 10)
    return (body.view(np.float32) if body is not None else np.zeros([0], np.float32)), header

  def saved(self, step: int, timeout: float) -> None:
    self.client.call("Saved", {"session": self.session, "step": step}, timeout=timeout + 10)

  def failure(self) -> str | None:
    return self.error

  def close(self) -> None:
    """Lets the queued ops go out, tells the shard to stop, closes the link."""
    with self.cond:
      self.closed = True
      self.cond.notify()
    self._thread.join(timeout=5)
    if self.error is None:
      try:
        self.client.call("Stop", {"session": self.session}, timeout=5, retry=False)
      except (wire.ServerGone, wire.CallError):
        pass   # it is gone already
    self.client.close()


# -- server-to-server messages ------------------------------------------------------------------


class _Scheduler:
  """Delivers messages after their delay on one thread; ``manual`` holds them for a caller."""

  def __init__(self, deliver: Callable[[Any], None], manual: bool = False):
    self.deliver, self.manual = deliver, manual
    self.cond = threading.Condition()
    self.heap: list = []
    self.count = itertools.count()
    self.closed = False
    if not manual:
      threading.Thread(target=self._run, name="messages", daemon=True).start()

  def add(self, due: float, message) -> None:
    with self.cond:
      heapq.heappush(self.heap, (due, next(self.count), message))
      self.cond.notify()

  def pending(self) -> list[tuple[float, Any]]:
    with self.cond:
      return [(due, m) for due, _, m in sorted(self.heap)]

  def take(self, message):
    """Manual mode: removes and returns the first held message equal to ``message``."""
    with self.cond:
      for i, (_, _, held) in enumerate(self.heap):
        if held == message:
          self.heap.pop(i)
          heapq.heapify(self.heap)
          return held
    raise KeyError(f"no held message {message}")

  def _run(self) -> None:
    while True:
      with self.cond:
        while not self.closed and (not self.heap or self.heap[0][0] > time.monotonic()):
          self.cond.wait(None if not self.heap else self.heap[0][0] - time.monotonic())
        if self.closed:
          return
        _, _, message = heapq.heappop(self.heap)
      self.deliver(message)

  def close(self) -> None:
    with self.cond:
      self.closed = True
      self.cond.notify()


# -- the control plane --------------------------------------------------------------------------


class DistServer:
  """The control plane of a real run: an executor of ``train/loop.py``.

  Args:
    config: the run's config (``config.dist.*`` holds the server's settings).
    task: the task (the server evaluates; it never trains).
    workdir: the run's workdir (checkpoints, ``server_address.json``).
    num_servers: S, the parameter shards (1: shard 0 only, in this process).
    credentials: the run's credentials (default: from the environment's secret).
    clock: seconds since the run's start (default: the wall clock); tests
      replay a simulated timeline with their own.
    manual_messages: hold server-to-server messages until :meth:`deliver`
      (tests); default: delivered after their emulated delay.
  """

  position_key = "pushes"

  def __init__(self, config: ml_collections.ConfigDict, task, workdir: str, *,
               num_servers: int = 1, credentials: auth.Credentials | None = None,
               clock: Callable[[], float] | None = None, manual_messages: bool = False):
    self.config, self.task, self.workdir = config, task, workdir
    self._credentials = credentials
    self.metric_name, self.target = run_lib.metric_and_target(config, task)
    self._plan_pushes()
    self._build_model(num_servers)
    self._build_host(clock, manual_messages)

  @property
  def credentials(self) -> auth.Credentials:
    """The run's (from the environment's secret when not given): needed only to serve."""
    if self._credentials is None:
      self._credentials = auth.load_credentials()
    return self._credentials

  # -- building the run -----------------------------------------------------------------------

  def _plan_pushes(self) -> None:
    self.W, self.B = self.config.num_workers, self.config.batch_size
    plan = simulate.plan_pushes(self.config, self.task.num_train)
    self.spe, self.total_pushes, self.eval_pushes, self.end_pushes = (
        plan.spe, plan.total_pushes, plan.eval_pushes, plan.end_pushes)

  def _build_model(self, num_servers: int) -> None:
    """The scheme, the layout over the shards and shard 0 (its jitted functions compiled)."""
    config, task = self.config, self.task
    self.cluster = cluster_lib.cluster_from_config(config)
    self.emulated = config_lib.cluster_is_set(config)
    self.scheme, _ = shard_lib.build_chain(config)
    # A local-update scheme's outer optimizer's learning rates (the simulator's table, computed
    # now, not under the lock while meshes wait), and each mesh's H_w (as the simulator).
    self.schedule = optim.learning_rate_table(local_lib.outer_config(config), self.spe,
                                              round(self.total_pushes / self.W))
    self.local = local_lib.is_local(config.sync.scheme)
    self.steps, _ = simulate.local_plan(config, self.cluster.mean_times, self.spe)
    # The simulator's initialisation (``run.init_model``); every shard and mesh starts from these.
    params, model_state, _ = jax.device_get(run_lib.init_model(task, config.seed))
    self.treedefs = (jax.tree.structure(params), jax.tree.structure(model_state))
    self.layout = layout_lib.ShardLayout.balanced(params, model_state, num_servers)
    self.S = self.layout.num_shards
    self.init_leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    stats = [np.asarray(x) for x in jax.tree.leaves(model_state)]
    self.dense_bytes = step_lib.tree_bytes(params)
    self.stats_bytes = step_lib.tree_bytes(model_state)
    self.pull_bytes = self.dense_bytes + self.stats_bytes
    self.core0 = shard_lib.ShardCore(
        0, self.layout, config, [self.init_leaves[i] for i in self.layout.leaves(0)], stats,
        shard_lib.checkpoint_dir(self.workdir, 0))
    self.core0.warm_up()   # nothing compiles under the lock once meshes push
    self.ratio_of = simulate.Ratios(config, self.scheme, self.cluster.speeds, self.spe)
    self.links = traffic_lib.Traffic(self.scheme.name, self.cluster, self._push_payload,
                                     self.pull_bytes, self.pull_bytes)

  def _build_host(self, clock, manual_messages: bool) -> None:
    W = self.W
    self.protocol = self.scheme.make_protocol()
    self.acct = sync.accounting.Accounting(W, self.scheme.num_replicas,
                                           aggregating=self.scheme.name == "inhad",
                                           push_iterations=self.steps)
    self.eval_replica = getattr(self.protocol, "global_replica", None)
    self.host = {**records.new_counters(W), "format": HOST_FORMAT,
                 "jobs": np.zeros([W], np.int64), "seq": np.zeros([W], np.int64),
                 "pushes": 0, "iterations": 0, "wall_time": 0.0,
                 "next_eval": self.eval_pushes, "num_evals": 0, "evaluated": 0,
                 "evaluated_iterations": 0, "started": np.zeros([W], bool),
                 "pushes_per_worker": np.zeros([W], np.int64),
                 "wire_pushed_per_worker": np.zeros([W], np.int64),
                 "wire_pulled_per_worker": np.zeros([W], np.int64),
                 "blocked_time_per_worker": np.zeros([W]), "lost": [], "rejoined": [],
                 "refused": {"nonfinite": 0, "malformed": 0, "duplicate": 0},
                 "in_flight": []}   # server-to-server messages: (seconds left, message)
    self.lock = locks.OwnedLock("server.lock")   # plain: a helper that runs under it says so
    self.changed = threading.Condition(self.lock)
    self.session = os.urandom(16).hex()
    self.instance = [""] * W                  # the joined process of each mesh
    self.releases: dict[int, tuple[int, dict]] = {}   # mesh -> (push number, its job)
    self.waiting = np.zeros([W], bool)        # a Push of this mesh waits for its release
    self.told_stop = np.zeros([W], bool)
    self.blocked_since = np.zeros([W])
    self.last_seen = np.full([W], np.inf)     # monotonic seconds of the last sign of life
    self.last_push_bytes = np.zeros([W], np.int64)
    self.ops = 0                               # ops emitted (the next op's number)
    self._op_log: list | None = [] if self.S > 1 else None   # ops before every shard was ready
    self.snaps = 0
    self.done = False                          # the run reached end_pushes: meshes stop
    self.failure: str | None = None            # why the run cannot go on (RunFailed)
    self.diverged: str | None = None           # a refused non-finite push (FloatingPointError)
    self.all_lost_since: float | None = None
    self.shards: list = [_LocalShard(self.core0)] + [None] * (self.S - 1)
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                              self.config.train.max_checkpoints)
    self.restored_step = -1
    self._grpc = None
    self._wall_base, self._session_start = 0.0, time.perf_counter()
    self._eta = workdir_lib.Eta(0)
    self._clock_started = False
    self._clock = clock
    self._messages = _Scheduler(self._deliver_due, manual=manual_messages)
    self._threads: list[threading.Thread] = []

  # -- the executor interface -----------------------------------------------------------------

  def restore(self) -> int:
    latest = self.checkpointer.latest_step()
    if latest is not None:
      saved = self.checkpointer.restore_host(latest)   # first: it refuses an older format
      if saved.get("host", {}).get("format") != HOST_FORMAT:
        raise ckpt_lib.host_state_lib.HostStateError(
            f"the checkpoint at {latest} pushes in {self.checkpointer.directory} was written by "
            "an older real runtime (one server process, no shards); start the run again in a "
            "new workdir")
      self.protocol, self.host = saved["protocol"], saved["host"]
      for key, old in (("iterations", "pushes"), ("evaluated_iterations", "evaluated")):
        self.host.setdefault(key, self.host[old])   # a checkpoint from before local updates
      self.acct.load_state_dict(saved["acct"])
      self.core0.restore(latest)
      self.restored_step = latest
      logging.info("resumed from the server checkpoint at %d pushes", latest)
      # The meshes' iterations in flight belonged to the previous server: every mesh
      # rejoins from its replica's current weights.
      with self.lock:   # before anything serves, but _react's ops and releases need it
        now = self._now()
        for w in np.flatnonzero(self.protocol.alive & self.host["started"]):
          self._react(self.protocol.drop(int(w), now), now)
    self.core0.start()
    self._wall_base = self.host["wall_time"]
    self._session_start = time.perf_counter()
    self._eta = workdir_lib.Eta(self.host["pushes"], (self.host["pushes"], self._wall_base))
    return int(self.host["pushes"])

  def restore_served(self, step: int):
    """The served weights ``(params, model_state)`` of the checkpoint at ``step``, from every
    shard's own checkpoint in this workdir (``train.load_trained``); starts nothing."""
    bodies = []
    for s in range(self.S):
      core = self.core0 if s == 0 else shard_lib.ShardCore(
          s, self.layout, self.config, [self.init_leaves[i] for i in self.layout.leaves(s)], [],
          shard_lib.checkpoint_dir(self.workdir, s))
      core.restore(step)
      bodies.append(np.asarray(core.served_fn(core.state)))
      if s:
        core.checkpointer.close()
    return self.layout.assemble(bodies, self.treedefs)

  def finished(self) -> bool:
    return self._at_end(self.host["evaluated_iterations"], self.host["evaluated"])

  def completed(self) -> bool:
    return self._iterations() >= self.total_pushes

  def _iterations(self) -> int:
    """Data iterations applied so far (``simulate.Simulation._iterations``): pushes, but a
    local-update push counts its job's ``H_w``, once a round applies it."""
    return int(self.host["iterations"] if self.local else self.host["pushes"])

  def _at_end(self, iterations: int, pushes: int) -> bool:
    """The run's end: its epochs' iterations, or ``train.stop_after_updates`` pushes."""
    stop = self.config.train.stop_after_updates
    return iterations >= self.total_pushes or bool(stop and pushes >= stop)

  @property
  def position(self) -> int:
    return int(self.host["pushes"])

  def advance(self) -> bool:
    self._serve()
    with self.changed:
      while not (self.done or self._iterations() >= self.host["next_eval"]):
        self._raise_if_stopped()
        if interrupt.requested():
          return False   # save() snapshots under the lock; close() stops the meshes
        self.changed.wait(timeout=0.5)
      self._raise_if_stopped()
      return True   # an evaluation point, or the end

  def _raise_if_stopped(self) -> None:
    if self.diverged:
      raise FloatingPointError(self.diverged)
    for link in self.shards:
      if link is not None and link.failure() and not self.failure:
        self.failure = link.failure()
    if self.failure:
      raise RunFailed(self.failure)

  def evaluate(self) -> dict[str, Any]:
    with self.lock:   # a consistent cut: the meshes go on while it is evaluated
      snap_id = self.snaps
      self.snaps += 1
      self._emit({"k": "snap", "id": snap_id})
      host = copy.deepcopy(self.host)
      acct = copy.deepcopy(self.acct)
      blocked = self._blocked_so_far()
      alive = self.protocol.alive.copy()
      wall = self._wall_time()
      done = self._iterations()
      self.host["evaluated"], self.host["evaluated_iterations"] = host["pushes"], done
      while self.host["next_eval"] <= done:
        self.host["next_eval"] += self.eval_pushes
      self.host["num_evals"] += 1
    params, model_state, sums = self._fetch_snapshot(snap_id)
    if not np.isfinite(sums["loss_sum"]):
      raise FloatingPointError(
          f"non-finite training loss before {host['pushes']} pushes; the run stopped. Lower "
          f"optimizer.learning_rate ({self.config.optimizer.learning_rate}) or set "
          "optimizer.grad_clip")
    if self.links.counts_device_pushes:   # as the simulator: pushes counted once applied
      pushed = np.asarray(sums["push_bytes"], np.int64)
      host["pushed_per_worker"] += pushed
      with self.lock:
        self.host["pushed_per_worker"] += pushed
    results = self.task.evaluate(params, model_state)
    return {
        **records.evaluation_record(
            pushes=host["pushes"], num_workers=self.W, spe=self.spe, updates=host["updates"],
            virtual_time=wall, wall_time=wall, loss_sum=sums["loss_sum"],
            loss_count=sums["loss_count"], results=results, host=host,
            pull_bytes=self.pull_bytes, blocked=blocked, acct=acct, iterations=done),
        "wire_bytes_pushed": int(host["wire_pushed_per_worker"].sum()),
        "wire_bytes_pulled": int(host["wire_pulled_per_worker"].sum()),
        "wire_bytes_pushed_per_worker": host["wire_pushed_per_worker"].tolist(),
        "wire_bytes_pulled_per_worker": host["wire_pulled_per_worker"].tolist(),
        "pushes_per_worker": host["pushes_per_worker"].tolist(),
        "meshes_alive": int(alive.sum()),
        "meshes_lost": len(host["lost"]),
        "refused_pushes": dict(host["refused"]),
    }

  def _fetch_snapshot(self, snap_id: int):
    """The served weights of snapshot ``snap_id`` from every shard, as trees; shard 0's sums."""
    timeout = float(self.config.dist.save_timeout)
    results = _parallel([lambda link=link: link.snapshot(snap_id, timeout)
                         for link in self.shards])
    params, model_state = self.layout.assemble([flat.view(np.uint8) for flat, _ in results],
                                               self.treedefs)
    return params, model_state, results[0][1]

  @property
  def evaluations(self) -> int:
    return self.host["num_evals"]

  def progress(self, record: dict[str, Any]) -> str:
    rate = self._eta.rate(record["pushes"])
    eta = max(self.end_pushes - record["pushes"], 0) / max(rate, 1e-9)
    if self.local:   # the end is in data iterations: H_w per push
      done = round(record["epoch"] * self.W * self.spe)
      eta = max(self.total_pushes - done, 0) / max(rate * float(self.steps.mean()), 1e-9)
    return (f"{self.scheme.name} (real, {self.W} meshes, {self.S} shard"
            f"{'s' if self.S > 1 else ''}) epoch {record['epoch']:.2f} | wall"
            f" {record['wall_time']:.1f} s | loss {record['train_loss']:.4f} |"
            f" {self.metric_name} {record[self.metric_name]:.4f} | {rate:.1f} pushes/s |"
            f" meshes alive {record['meshes_alive']}/{self.W} | staleness mean"
            f" {record['staleness']['mean']:.2f} | ETA {workdir_lib.format_duration(eta)}")

  def save(self) -> None:
    with self.lock:
      step = int(self.host["pushes"])
      if step == self.checkpointer.latest_step():
        return
      self.host["wall_time"] = self._wall_time()
      self.host["in_flight"] = [(max(0.0, due - time.monotonic()), m)
                                for due, m in self._messages.pending()]
      saved = copy.deepcopy({"protocol": self.protocol, "host": self.host,
                             "acct": self.acct.state_dict()})   # a snapshot; meshes go on
      self._emit({"k": "save", "step": step})
    timeout = float(self.config.dist.save_timeout)
    # Every shard's step is on disk before the control plane's: its latest step is complete.
    _parallel([lambda link=link: link.saved(step, timeout) for link in self.shards
               if link is not None])
    self.checkpointer.save_and_wait(step, {"pushes": np.int64(step)}, {"pushes": step},
                                    host=saved)

  def close(self) -> None:
    with self.lock:
      self._finish()
    saved = False
    if self._clock_started and not self.failure_of_a_shard():
      try:
        self.save()   # also after Ctrl-C, SIGTERM or a failure: what was applied stays
        saved = True
      except (wire.Refused, wire.ServerGone, wire.CallError) as e:
        logging.error("the final checkpoint could not be written: %s", e)
    # Meshes still running read their stop from their next push or heartbeat; wait a little
    # for them (never for ones the launcher already ended: it ends meshes first).
    deadline = time.monotonic() + (1.0 if interrupt.requested() else 3.0)
    while (time.monotonic() < deadline and self._grpc is not None
           and not (self.told_stop | ~self.protocol.alive | ~self.host["started"]).all()):
      time.sleep(0.05)
    self._messages.close()
    for link in self.shards[1:]:
      if link is not None:
        link.close()
    if self._grpc is not None:
      self._grpc.stop(grace=0.5).wait()
      self._grpc = None
    self.core0.stop()
    self.checkpointer.close()
    if saved:
      logging.info("the server stopped; its checkpoint is at %d pushes", self.host["pushes"])

  def failure_of_a_shard(self) -> str | None:
    return next((link.failure() for link in self.shards if link is not None and link.failure()),
                None)

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    with self.lock:
      host = copy.deepcopy(self.host)
      blocked = self._blocked_so_far()
      wall = self._wall_time()
      fields = records.summary_fields(
          history=history, reached=reached, metric=self.metric_name, target=self.target,
          scheme=self.scheme, groups=self.scheme.groups.tolist(),
          cluster={**self.cluster.describe(), "emulated": self.emulated},
          pushes=host["pushes"], batch_size=self.B, virtual_time=wall, wall_time=wall,
          host=host, pull_bytes=self.pull_bytes, blocked=blocked, acct=self.acct,
          iterations=int(host["iterations"] if self.local else host["pushes"]))
    if self.local:
      fields["scheme"]["local_steps"] = self.steps.tolist()
    fields["runtime"] = "dist"
    fields["meshes"] = {"num": self.W, "lost": host["lost"], "rejoined": host["rejoined"],
                        "alive": self.protocol.alive.tolist()}
    fields["servers"] = {"num": self.S, "shard_bytes": self.layout.shard_bytes(),
                         "addresses": [link.address if link else None for link in self.shards]}
    fields["refused_pushes"] = dict(host["refused"])
    fields["totals"].update(
        wire_bytes_pushed=int(host["wire_pushed_per_worker"].sum()),
        wire_bytes_pulled=int(host["wire_pulled_per_worker"].sum()),
        pushes_per_worker=host["pushes_per_worker"].tolist())
    if self.failure:
      fields["failure"] = self.failure
    return fields

  # -- serving ----------------------------------------------------------------------------------

  def bind(self, address: str) -> str:
    """Starts serving at ``address`` (before the loop runs, so a bad address fails at once)."""
    if self._grpc is not None:
      return self.address
    methods = [wire.Method("Register", self.on_register), wire.Method("Ready", self.on_ready),
               wire.Method("Tensors", self.on_tensors),
               wire.Method("Join", self.on_join),
               wire.Method("Push", self.on_push, self._push_limit, parts=True),
               wire.Method("Heartbeat", self.on_heartbeat), wire.Method("Pull", self.on_pull)]
    self._grpc, port = wire.make_server(methods, address, self.credentials,
                                        max_workers=2 * self.W + 2 * self.S + 8,
                                        **wire.server_settings(self.config.dist))
    host, _ = wire.check_address("--server_address", address)
    self.address = f"{host}:{port}"
    workdir_lib.write_json(os.path.join(self.workdir, ADDRESS_FILE),
                           {"address": self.address, "pid": os.getpid(),
                            "run_id": self.credentials.run_id})   # not secret: names the run
    return self.address

  def _serve(self) -> None:
    """Serves (once per session) and starts the monitor."""
    if self._threads:
      return
    dist = self.config.dist
    self.bind(dist.server_address or "127.0.0.1:0")
    logging.info("parameter server of %s (%d replicas, %d shard%s) serving %d meshes at %s",
                 self.scheme.name, self.scheme.num_replicas, self.S, "s" if self.S > 1 else "",
                 self.W, self.address)
    self._join_by = join_by = time.monotonic() + float(dist.join_timeout)
    with self.lock:
      self.last_seen[:] = join_by - float(dist.heartbeat_timeout)   # the first join's grace
      for left, message in self.host["in_flight"]:   # messages in flight at the checkpoint
        self._messages.add(time.monotonic() + left, message)
      self.host["in_flight"] = []
    monitor = threading.Thread(target=self._monitor, name="monitor", daemon=True)
    monitor.start()
    self._threads.append(monitor)

  def _heartbeat_interval(self) -> float:
    return max(0.05, float(self.config.dist.heartbeat_timeout) / 4)

  def _push_limit(self, header: dict) -> int:
    nnz = wire.field(header, "nnz", list)
    if len(nnz) != self.S:
      raise wire.BadMessage(f"nnz has {len(nnz)} entries; allowed: one per shard ({self.S})")
    return self.layout.push_limit(0, _int(nnz[0], "nnz[0]", -1, self.layout.grad_size(0)))

  # -- shards ---------------------------------------------------------------------------------

  def on_register(self, header, body, peer):
    """A shard process starts: its session, its initial tensors, the step to restore."""
    del body, peer
    s = wire.field(header, "shard", int, 1, self.S - 1)
    if wire.field(header, "num_servers", int) != self.S:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"shard {s} was started with --num_servers={header['num_servers']}, the "
                         f"server with {self.S}; start every process with the same --num_servers")
    if wire.field(header, "config", str) != config_id(self.config):
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"shard {s}'s config differs from the server's; start every process "
                         "with the same --config and --config.* flags")
    address = wire.field(header, "address", str)
    wire.check_address("shard address", address)
    with self.lock:
      old = self.shards[s]
      if self._op_log is None:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"shard {s} registers after the run started: a shard's tensors live "
                           "only in its process, so a lost shard ends the run; resume the run "
                           "from its checkpoint (rerun the same command)")
      if old is not None and old.ready and not old.failure():
        raise wire.Refused(grpc.StatusCode.ALREADY_EXISTS,
                           f"shard {s} is already registered (at {old.address}); each --shard "
                           "runs once")
      client = wire.Client(address, self.credentials,
                           retry_seconds=float(self.config.dist.retry_seconds),
                           **wire.client_settings(self.config.dist))
      self.shards[s] = _RemoteShard(s, address, client, self.session, self.layout)
      logging.info("shard %d registered at %s", s, address)
    if old is not None:   # outside the lock: closing may call the old shard (Stop), up to 5 s
      old.close()
    return {"session": self.session, "restore": int(self.restored_step),
            "layout": json.dumps(self.layout.describe())}, None

  def on_tensors(self, header, body, peer):
    """A registered shard's initial tensors (the server's initialisation, one for every shard)."""
    del body, peer
    s = wire.field(header, "shard", int, 1, self.S - 1)
    if wire.field(header, "session", str) != self.session:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, "the session changed; register")
    return {}, np.concatenate([self.init_leaves[i].reshape(-1) for i in self.layout.leaves(s)])

  def on_ready(self, header, body, peer):
    """A registered shard compiled, restored and serves: it may take ops."""
    del body, peer
    s = wire.field(header, "shard", int, 1, self.S - 1)
    with self.lock:
      link = self.shards[s]
      if link is None or wire.field(header, "session", str) != self.session:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {s} must register first")
      link.ready = True
      for index, op in self._op_log or []:   # ops emitted before it registered
        link.send(index, op)
      if self._shards_ready():
        self._op_log = None
      self.changed.notify_all()
    return {}, None

  def _shards_ready(self) -> bool:
    return all(link is not None and getattr(link, "ready", True) for link in self.shards)

  def _emit(self, op: dict) -> None:
    """Appends ``op`` to every shard's stream (under ``self.lock``: one order for all)."""
    self.lock.check("_emit")
    index = self.ops
    self.ops += 1
    if self._op_log is not None:   # kept for shards that are not ready yet
      self._op_log.append((index, op))
    for link in self.shards:
      if link is not None and getattr(link, "ready", True):
        link.send(index, op)

  # -- meshes -----------------------------------------------------------------------------------

  def _mesh_header(self, header: dict) -> tuple[int, str]:
    w = wire.field(header, "mesh", int, 0, self.W - 1)
    return w, wire.field(header, "instance", str)

  def on_join(self, header, body, peer):
    """A mesh's process starts (fresh run) or rejoins (after a crash, a drop, a server restart)."""
    del body
    w, instance = self._mesh_header(header)
    if wire.field(header, "config", str) != config_id(self.config):
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"mesh {w}'s config differs from the server's; start every process with"
                         " the same --config and --config.* flags")
    with self.lock:
      if self.done:
        return self._stop(w), None
      if self.instance[w] and self.instance[w] != instance and self.protocol.alive[w]:
        age = time.monotonic() - self.last_seen[w]
        raise wire.Refused(grpc.StatusCode.ALREADY_EXISTS,
                           f"mesh {w} is held by another process (last heard {age:.1f} s ago); "
                           "each --mesh runs once. If that process is gone, the server drops it "
                           f"after dist.heartbeat_timeout={self.config.dist.heartbeat_timeout} s"
                           " and this one may join then")
      if self.instance[w] == instance and w in self.releases and self.protocol.alive[w]:
        pass   # a retried Join of the joined process: the same answer
      elif not self.host["started"][w] and self.protocol.alive[w]:
        self._first_join(w, instance)
      else:
        self._rejoin(w, instance)
      self.last_seen[w] = time.monotonic()
      seq, job = self.releases[w]
    logging.info("mesh %d joined from %s", w, peer)
    return self._reply_with_weights(w, seq, job)

  def _first_join(self, w: int, instance: str) -> None:
    """The start barrier: a fresh run begins when every shard and mesh has joined (or at
    ``dist.join_timeout``); its clock starts then, so wall time counts training."""
    self.instance[w] = instance
    self.host["started"][w] = True
    self.changed.notify_all()
    while ((not self.host["started"].all() or not self._shards_ready())
           and time.monotonic() < self._join_by and not self.done
           and self.host["pushes"] == 0):   # only a fresh run waits
      self.last_seen[w] = time.monotonic()  # waiting here is alive
      self.changed.wait(timeout=0.2)
    if not self._shards_ready():   # not started after all: its retry is a first join again
      self.host["started"][w] = False
      raise wire.Refused(grpc.StatusCode.UNAVAILABLE, "the parameter shards did not all start "
                         f"within dist.join_timeout={self.config.dist.join_timeout} s")
    self._start_clock()
    self.releases[w] = (int(self.host["seq"][w]), self._next_job(w))
    self.changed.notify_all()

  def _rejoin(self, w: int, instance: str) -> None:
    if not self._shards_ready():
      raise wire.Refused(grpc.StatusCode.UNAVAILABLE, "the parameter shards are not all up yet")
    self._start_clock()               # a resumed session starts at its first rejoin
    now = self._now()
    if self.protocol.alive[w]:         # restarted before its heartbeat ran out
      self._lose(w, now, "restarted")
    self.instance[w] = instance
    self.host["started"][w] = True
    self.host["rejoined"].append({"mesh": w, "time": now, "pushes": int(self.host["pushes"])})
    logging.info("mesh %d rejoins at %d pushes", w, self.host["pushes"])
    self._react(self.protocol.rejoin(w, now), now)
    self.all_lost_since = None

  def _reply_with_weights(self, w: int, seq: int, job: dict):
    """A job reply, with shard 0's slice of the worker's weights at its watermark."""
    body = self.core0.pull(w, job["watermark"], float(self.config.dist.save_timeout))
    with self.lock:
      self.host["wire_pulled_per_worker"][w] += wire.body_bytes(body)
    shards = [link.address if link is not None else "" for link in self.shards[1:]]
    return {"session": self.session, "seq": seq, "shards": shards,
            "digest": self.layout.digest(), **job}, body

  def on_push(self, header, body, peer):
    """A mesh's push: checked whole, applied as the protocol says; the reply waits for its release."""
    del peer
    w, seq, immediate = self.accept_push(header, body)
    if immediate is not None:
      return immediate, None
    return self.await_release(w, seq)

  def accept_push(self, header: dict, body) -> tuple[int, int, dict | None]:
    """Checks a push and, if new, applies it (ops, protocol); never waits for its release.

    Returns:
      ``(mesh, push number, None)`` when the caller should wait for the release
      (:meth:`await_release`), or ``(mesh, push number, reply)`` to answer at
      once (stop, rejoin, refused).

    Raises:
      BadMessage: a malformed push (nothing changed).
    """
    try:
      return self._accept(header, body)
    except wire.BadMessage as e:
      with self.lock:
        self._count_refused("malformed", header.get("mesh"), str(e))
      raise

  def _accept(self, header: dict, body) -> tuple[int, int, dict | None]:
    w, instance = self._mesh_header(header)
    session = wire.field(header, "session", str)
    seq = wire.field(header, "seq", int, 1)
    if header.get("nonfinite"):
      return w, seq, self._refuse_nonfinite(w, seq, wire.field(header, "nonfinite", str))
    iteration = wire.field(header, "iteration", int, 0)
    loss = wire.field(header, "loss", float)
    nbytes = wire.field(header, "bytes", int, 0, 2 * self.pull_bytes)
    wire_bytes = wire.field(header, "wire_bytes", int, 0, 2 * self.pull_bytes + 4 * self.S)
    nnz = [_int(x, f"nnz[{s}]", -1, self.layout.grad_size(s))
           for s, x in enumerate(wire.field(header, "nnz", list))]
    if len(nnz) != self.S:
      raise wire.BadMessage(f"nnz has {len(nnz)} entries; allowed: one per shard ({self.S})")
    receipts = wire.field(header, "receipts", list)
    try:
      grads, stats = self.core0.check_push(w, seq, body, nnz[0])
      if not math.isfinite(loss):
        raise layout_lib.NonFinite(f"a non-finite loss ({loss})")
    except layout_lib.NonFinite as e:
      return w, seq, self._refuse_nonfinite(w, seq, str(e))
    with self.lock:
      if session != self.session or not self.protocol.alive[w]:
        return w, seq, {"rejoin": True}   # from before a drop or a server restart
      if instance != self.instance[w]:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"mesh {w} is held by another process; this one must rejoin")
      if self.done:
        return w, seq, self._stop(w)
      if seq == self.host["seq"][w]:
        self.host["refused"]["duplicate"] += 1   # a retry: answered once released, not applied
      else:
        self._check_push(w, seq, iteration, nnz, receipts)
        self._accept_push(w, seq, grads, stats, loss, nbytes, wire_bytes)
    return w, seq, None

  def await_release(self, w: int, seq: int, timeout: float | None = None):
    """Waits for mesh ``w``'s release from push ``seq``; the reply with its next job and weights."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self.lock:
      while not (self.releases.get(w, (0,))[0] == seq or self.done or self.failure
                 or not self.protocol.alive[w]):
        if deadline is not None and time.monotonic() > deadline:
          raise TimeoutError(f"mesh {w} was not released from push {seq}")
        self.changed.wait(timeout=0.5)
      if self.done or self.failure:
        return self._stop(w), None
      if not self.protocol.alive[w]:
        return {"rejoin": True}, None
      seq, job = self.releases[w]
    return self._reply_with_weights(w, seq, job)

  def _check_push(self, w: int, seq: int, iteration: int, nnz: list, receipts: list) -> None:
    """Everything about a new push that needs the mesh table (raises BadMessage)."""
    expected = int(self.host["seq"][w]) + 1
    if seq != expected:
      raise wire.BadMessage(f"push {seq} of mesh {w} is out of order; expected {expected}")
    if iteration != self.host["jobs"][w] - 1:
      raise wire.BadMessage(f"push {seq} of mesh {w} is of iteration {iteration}; its job is "
                            f"{self.host['jobs'][w] - 1}")
    if self.waiting[w]:
      raise wire.BadMessage(f"mesh {w} pushed again before its release")
    if len(receipts) != self.S - 1:
      raise wire.BadMessage(f"{len(receipts)} receipts; allowed: one per other shard "
                            f"({self.S - 1})")
    for s, receipt in enumerate(receipts, start=1):
      size = self.layout.push_limit(s, nnz[s])
      if not self.credentials.check_receipt(receipt, s, w, seq, self.session, size):
        raise wire.BadMessage(f"the receipt of shard {s} for push {seq} of mesh {w} is "
                              "invalid (its slice was not staged there)")

  def _accept_push(self, w, seq, grads, stats, loss, nbytes, wire_bytes) -> None:
    self.lock.check("_accept_push")
    host = self.host
    self.core0.stage(w, seq, grads, stats)
    host["seq"][w] = seq
    self.last_push_bytes[w] = nbytes
    self._emit({"k": "put", "w": w, "seq": seq, "loss": float(loss), "bytes": int(nbytes)})
    host["pushes"] += 1
    host["pushes_per_worker"][w] += 1
    host["wire_pushed_per_worker"][w] += wire_bytes
    now = self._now()
    self.blocked_since[w] = now
    self.waiting[w] = True
    self.last_seen[w] = time.monotonic()
    self._react(self.protocol.on_push(w, now), now)
    if self._at_end(self._iterations(), host["pushes"]):
      self._finish()
    if self._iterations() >= host["next_eval"] or self.done:
      self.changed.notify_all()

  def _refuse_nonfinite(self, w: int, seq: int, why: str) -> dict:
    """A non-finite gradient or loss: refused, logged; the loop stops the run as diverged."""
    with self.lock:
      self._count_refused("nonfinite", w, why)
      if not self.diverged:
        self.diverged = (f"mesh {w} pushed a non-finite gradient or loss (push {seq}, after "
                         f"{self.host['pushes']} pushes): {why}. Lower optimizer.learning_rate "
                         f"({self.config.optimizer.learning_rate}) or set optimizer.grad_clip")
      self.changed.notify_all()
      return {"stop": True, "refused": why}

  def _count_refused(self, kind: str, w: int, why: str) -> None:
    self.lock.check("_count_refused")
    self.host["refused"][kind] += 1
    if self.host["refused"][kind] <= 10:
      logging.warning("refused a push of mesh %s (%s): %s", w, kind, why)

  def on_heartbeat(self, header, body, peer):
    del body, peer
    w, instance = self._mesh_header(header)
    # No lock: a heartbeat counts even while the lock is held (a long round, a checkpoint), so
    # a busy server never drops a live mesh. Only the joined process's heartbeats count.
    if self.done:
      return self._stop(w), None
    mine = instance == self.instance[w]
    if mine:
      self.last_seen[w] = time.monotonic()
    session = wire.field(header, "session", str)
    return {"stop": False, "rejoin": bool(session != self.session or not mine
                                          or not self.protocol.alive[w])}, None

  def on_pull(self, header, body, peer):
    """Shard 0's slice of a worker's weights (the other ranks of a multi-process mesh)."""
    del body, peer
    w = wire.field(header, "mesh", int, 0, self.W - 1)
    if wire.field(header, "session", str) != self.session:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, "the session changed; rejoin")
    return {}, self.core0.pull(w, wire.field(header, "watermark", int, 0),
                               float(self.config.dist.save_timeout))

  def _monitor(self) -> None:
    """Drops silent meshes; ends a run whose meshes are all lost; keeps op streams alive."""
    dist = self.config.dist
    timeout, all_lost = float(dist.heartbeat_timeout), float(dist.all_lost_timeout)
    last_ops = self.ops
    while self._grpc is not None and not self.done:
      time.sleep(self._heartbeat_interval() / 2)
      with self.lock:
        now = time.monotonic()
        late = self.protocol.alive & (now - self.last_seen > timeout)
        for w in np.flatnonzero(late):
          self._lose(int(w), self._now(), f"no heartbeat for {timeout:g} s")
        if self._clock_started and not self.protocol.alive.any() and not self.done:
          if self.all_lost_since is None:
            self.all_lost_since = now
            logging.warning("no mesh is alive; the run ends unless one rejoins within %g s "
                            "(dist.all_lost_timeout)", all_lost)
          elif now - self.all_lost_since > all_lost and not self.failure:
            self.failure = (f"every mesh was lost and none rejoined within "
                            f"dist.all_lost_timeout={all_lost:g} s; the run stopped (its "
                            "checkpoint lets it resume)")
            logging.error(self.failure)
        if self.ops == last_ops and self.S > 1:
          self._emit({"k": "noop"})   # the shards hear from the control plane
        last_ops = self.ops
        self.changed.notify_all()

  # -- protocol events ----------------------------------------------------------------------------

  def _lose(self, w: int, now: float, why: str) -> None:
    """Drops mesh ``w`` from the protocol: nobody waits for it any more; what it applied stays."""
    self.host["lost"].append({"mesh": w, "time": now, "pushes": int(self.host["pushes"]),
                              "why": why})
    logging.warning("mesh %d lost (%s) at %d pushes; %d meshes alive", w, why,
                    self.host["pushes"], int(self.protocol.alive.sum()) - 1)
    self.waiting[w] = False
    self.releases.pop(w, None)
    self._react(self.protocol.drop(w, now), now)
    self.changed.notify_all()

  def _react(self, reaction, now: float) -> None:
    """Emits a reaction's rounds, releases its meshes, schedules its messages."""
    self.lock.check("_react")
    for rnd in reaction.rounds:
      if self.local:   # as the simulator's _apply_round: before the round's learning rate
        self.host["iterations"] += int(self.steps[np.asarray(rnd.arrived, bool)].sum())
      args = records.account_round(
          rnd, host=self.host, acct=self.acct, protocol=self.protocol, links=self.links,
          iteration=self.host["pushes_per_worker"],
          learning_rate=self.schedule(self._iterations() // self.W), pull_bytes=self.pull_bytes)
      lr = args.pop("learning_rate")
      self._emit({"k": "round", "args": args, "lr": float(lr)})
    for w in reaction.release:
      self.host["blocked_time_per_worker"][w] += max(0.0, now - self.blocked_since[w])
      self.waiting[w] = False
      self.releases[w] = (int(self.host["seq"][w]), self._next_job(w))
    for message in reaction.messages:
      delay = self._message_delay(message)
      if delay <= 0 and not self._messages.manual:
        self._react(self.protocol.on_message(message, now), now)
      else:
        self._messages.add(time.monotonic() + delay, message)
    if reaction.release:
      self.changed.notify_all()

  def _deliver_due(self, message) -> None:
    with self.lock:
      if not self.done:
        now = self._now()
        self._react(self.protocol.on_message(message, now), now)

  def deliver(self, message, now: float | None = None) -> None:
    """Delivers a held server-to-server message now (``manual_messages`` runs: tests)."""
    with self.lock:
      held = self._messages.take(message)
      now = self._now() if now is None else now
      self._react(self.protocol.on_message(held, now), now)

  def _message_delay(self, message) -> float:
    """An emulated server-to-server link's delay, as the simulator charges it (0 without a
    cluster description)."""
    if not self.emulated:
      return 0.0
    return self.links.message_delay(self.protocol, message, self.host["pushes_per_worker"])

  def _finish(self) -> None:
    """The run's pushes are all in: every mesh is told to stop."""
    self.lock.check("_finish")
    if not self.done:
      self.done = True
      self.changed.notify_all()

  def _next_job(self, w: int) -> dict:
    k = int(self.host["jobs"][w])
    self.host["jobs"][w] += 1
    # "steps": the job's inner steps H_w (1 but for the local-update schemes), its data
    # iterations k H_w .. k H_w + H_w - 1.
    return {"iteration": k, "ratio": float(self.ratio_of(w, k)),
            "flush": bool(self.ratio_of.flush(w, k)), "watermark": self.ops,
            "steps": int(self.steps[w])}

  def _stop(self, w: int) -> dict:
    self.told_stop[w] = True
    return {"stop": True}

  def _push_payload(self, w: int, k: int) -> int:
    """Bytes of mesh ``w``'s push ``k`` as its compressor counted them (InHAD's node link)."""
    del k   # only a mesh's latest push is asked for (``Traffic.count_round``)
    return int(self.last_push_bytes[w])

  # -- time -------------------------------------------------------------------------------------

  def _start_clock(self) -> None:
    if not self._clock_started:
      self._clock_started = True
      self._session_start = time.perf_counter()

  def _now(self) -> float:
    return self._clock() if self._clock is not None else self._wall_time()

  def _wall_time(self) -> float:
    return self._wall_base + time.perf_counter() - self._session_start

  def _blocked_so_far(self) -> np.ndarray:
    now = self._now()
    return self.host["blocked_time_per_worker"] + np.where(
        self.waiting, now - self.blocked_since, 0.0)


def _int(value, name: str, lo: int, hi: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise wire.BadMessage(f"{name}={value!r:.40} is invalid; allowed: an int in {lo}..{hi}")
  return value


def _parallel(calls: list[Callable[[], Any]]) -> list[Any]:
  """Runs ``calls`` at once (one thread each but the first); their results in order."""
  if len(calls) <= 1:
    return [call() for call in calls]
  results: list[Any] = [None] * len(calls)
  errors: list[BaseException] = []

  def run(i):
    try:
      results[i] = calls[i]()
    except BaseException as e:  # pylint: disable=broad-except  (re-raised below)
      errors.append(e)
  threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(calls))]
  for t in threads:
    t.start()
  run(0)
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return results
