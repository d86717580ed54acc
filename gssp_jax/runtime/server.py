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
every push is checked before anything changes (``runtime/push_checks.py``: the
sender is this mesh's joined process, its session and push number, its body's
size and finiteness against the model, its receipts from the other shards); a
retried push (same number) is answered, never applied twice.

The parts, each in its own module; this class is the executor that builds
them and ties them together:

* ``mesh_calls.MeshCalls``: the meshes' calls (``Join``, ``Push``,
  ``Heartbeat``, ``Pull``);
* ``shard_links.ShardLinks``: the links to the shards, their calls and the op
  stream;
* ``membership.Membership``: which process holds each mesh (joins, rejoins,
  heartbeats, silent meshes);
* ``push_checks``: a push's header and its place in the run;
* ``core.ProtocolCore``: the protocol, its accounting and counters, the
  meshes' releases, the server-to-server messages.

Concurrency (what each thread owns; one lock orders the control plane):

* gRPC handler threads run ``Register``/``Tensors``/``Ready`` (shards),
  ``Join``, ``Push``, ``Heartbeat``, ``Pull``; their pool has ``2W + 2S + 8``
  threads: a mesh's ``Push`` waiting for its release and its ``Heartbeat``,
  a shard's ``Register`` and ``Ready``, and spare ones. A ``Push`` checks its
  body without the lock, then takes ``self.lock`` to check the header against
  the mesh table, queue shard 0's slice, run the protocol and emit ops; it
  waits for its release on ``self.changed`` (the lock's condition), then,
  without the lock, reads its weights from shard 0 at its watermark.
* The loop's thread (``advance``/``evaluate``/``save``) takes the lock only to
  copy counters and emit ``snap``/``save`` ops; it fetches snapshots and waits
  for saves without it.
* The monitor thread drops meshes whose heartbeats stopped, ends a run whose
  meshes are all lost (``dist.all_lost_timeout``), and keeps the shards' op
  streams alive (a ``noop`` op when idle).
* The scheduler thread (``core.Scheduler``) delivers server-to-server messages
  after their emulated delay.
* Shard 0's feeder thread (``shard_links.LocalShard``) hands it its queued slices and ops;
  shard 0's applier thread (``ShardCore``) and one sender thread per remote
  shard drain their op queues; a pool of S - 1 threads calls the other shards
  for snapshots and checkpoints.

Lock order: ``self.lock`` may be held while taking a link's own lock (to append a slice or
an op to its outbox), never a shard's (``ShardCore.cond``: shard 0's feeder thread takes it
without ``self.lock``); a shard never takes ``self.lock``, and no
thread holds ``self.lock`` while it calls another process or copies from a
device (``ShardLinks.register`` closes a replaced shard's link after releasing
it; snapshots are fetched after it). ``self.lock`` is a plain lock
(``runtime/locks.py``): taking it again on the thread that holds it raises,
and the helpers that must run under it (``ShardLinks.emit``/``stage``,
``ProtocolCore.react``/``accept``/``finish``/``count_refused``) check that
they do. ``Membership.heartbeat`` takes no lock (a float store per beat).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
import ml_collections
import numpy as np

from gssp_jax.runtime import auth
from gssp_jax.runtime import core as core_lib
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import locks
from gssp_jax.runtime import membership as membership_lib
from gssp_jax.runtime import mesh_calls
from gssp_jax.runtime import push_checks
from gssp_jax.runtime import shard as shard_lib
from gssp_jax.runtime import shard_links
from gssp_jax.runtime import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import records
from gssp_jax.sim import simulate
from gssp_jax.sim import traffic as traffic_lib
from gssp_jax.sync import local as local_lib
from gssp_jax.base import checkpoint as ckpt_lib
from gssp_jax.base import interrupt
from gssp_jax.base import run as run_lib
from gssp_jax.base import step as step_lib
from gssp_jax.base import workdir as workdir_lib

ADDRESS_FILE = "server_address.json"   # in the workdir: where the launcher finds a port-0 server
HOST_FORMAT = core_lib.HOST_FORMAT     # the control plane's checkpointed host state


class RunFailed(RuntimeError):
  """The run cannot go on (every mesh lost, a shard lost); its checkpoint lets it resume."""


def config_id(config: ml_collections.ConfigDict) -> str:
  """A JSON of the config but ``executor`` and ``dist`` (which differ between roles)."""
  d = json.loads(config.to_json())
  d.pop("dist", None)
  d.pop("executor", None)
  return json.dumps(d, sort_keys=True)


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
    self.W, self.B = config.num_workers, config.batch_size
    plan = simulate.plan_pushes(config, task.num_train)
    self.spe, self.total_pushes, self.eval_pushes, self.end_pushes = (
        plan.spe, plan.total_pushes, plan.eval_pushes, plan.end_pushes)
    # train.virtual_budget: the run's clock (wall time since its start) ends it, as the simulator's
    self.budget = float(config.train.get("virtual_budget", 0.0))
    self._build_model(num_servers)
    self._build_parts(clock, manual_messages)

  @property
  def credentials(self) -> auth.Credentials:
    """The run's (from the environment's secret when not given): needed only to serve."""
    if self._credentials is None:
      self._credentials = auth.load_credentials()
    return self._credentials

  # -- building the run -----------------------------------------------------------------------

  def _build_model(self, num_servers: int) -> None:
    """The scheme, the layout over the shards and shard 0 (its jitted functions compiled)."""
    config, task = self.config, self.task
    self.cluster = cluster_lib.cluster_from_config(config)
    self.emulated = cluster_lib.cluster_is_set(config)
    self.scheme, _ = shard_lib.build_chain(config)
    # The outer optimizer's learning rates (the simulator's, computed now, not under the lock
    # while meshes wait), and each mesh's H_w (as the simulator).
    self.schedule = simulate.learning_rates(config, self.spe, self.total_pushes)
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
    self.links = traffic_lib.Traffic(self.scheme.legs, self.cluster,
                                     lambda w, k: self.core.push_payload(w, k),
                                     self.pull_bytes, self.pull_bytes)

  def _build_parts(self, clock, manual_messages: bool) -> None:
    """The lock, and the parts it orders: shard links, protocol core, membership."""
    self.lock = locks.OwnedLock("server.lock")   # plain: a helper that runs under it says so
    self.changed = threading.Condition(self.lock)
    cid = config_id(self.config)   # what every process of the run must present
    self.shard_links = shard_links.ShardLinks(
        config=self.config, config_id=cid, layout=self.layout,
        core0=self.core0, init_leaves=self.init_leaves, credentials=lambda: self.credentials,
        lock=self.lock, changed=self.changed)
    self.core = core_lib.ProtocolCore(
        scheme=self.scheme, steps=self.steps, local=self.local, schedule=self.schedule,
        ratio_of=self.ratio_of, links=self.links, emulated=self.emulated,
        pull_bytes=self.pull_bytes, emit=self.shard_links.emit,
        watermark=lambda: self.shard_links.ops, lock=self.lock, changed=self.changed,
        clock=clock, manual_messages=manual_messages, budget=self.budget,
        eval_pushes=self.eval_pushes)
    if self.config.dist.record_pushes:
      self.core.push_log = []
    self.membership = membership_lib.Membership(self.W, self.config.dist, self.core,
                                                self.shard_links.all_ready, self.changed)
    self.failure: str | None = None            # why the run cannot go on (RunFailed)
    self.calls = mesh_calls.MeshCalls(
        config=self.config, config_id=cid, layout=self.layout,
        pull_bytes=self.pull_bytes, core0=self.core0, links=self.shard_links, core=self.core,
        members=self.membership, lock=self.lock, changed=self.changed,
        credentials=lambda: self.credentials, at_end=self._at_end, failure=lambda: self.failure)
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                              self.config.train.max_checkpoints)
    self._grpc = None
    self._eta = workdir_lib.Eta(0)
    self._threads: list[threading.Thread] = []

  def _emit(self, op: dict) -> None:
    self.shard_links.emit(op)

  def deliver(self, message, now: float | None = None) -> None:
    """Delivers a held server-to-server message now (``manual_messages`` runs: tests)."""
    self.core.deliver(message, now)

  # -- the executor interface -----------------------------------------------------------------

  def restore(self) -> int:
    core = self.core
    latest = self.checkpointer.latest_step()
    if latest is not None:
      saved = self.checkpointer.restore_host(latest)   # first: it refuses an older format
      if saved.get("host", {}).get("format") != HOST_FORMAT:
        raise ckpt_lib.host_state_lib.HostStateError(
            f"the checkpoint at {latest} pushes in {self.checkpointer.directory} was written by "
            "an older real runtime (one server process, no shards); start the run again in a "
            "new workdir")
      core.load(saved)
      seqs = core.book.host["seq"].tolist()   # each mesh's last push: what the shards take next
      self.core0.restore(latest, seqs)
      self.shard_links.restored_step, self.shard_links.restored_seqs = latest, seqs
      logging.info("resumed from the server checkpoint at %d pushes", latest)
      # The meshes' iterations in flight belonged to the previous server: every mesh
      # rejoins from its replica's current weights.
      with self.lock:   # before anything serves, but the reaction's ops and releases need it
        now = core.now()
        for w in np.flatnonzero(core.protocol.alive & core.book.host["started"]):
          core.react(core.protocol.drop(int(w), now), now)
    self.core0.start()
    wall = core.book.host["wall_time"]
    core.resume_clock(wall)
    self._eta = workdir_lib.Eta(core.book.host["pushes"], (core.book.host["pushes"], wall))
    return int(core.book.host["pushes"])

  def restore_served(self, step: int):
    """The served weights ``(params, model_state)`` of the checkpoint at ``step``, from every
    shard's own checkpoint in this workdir (``train.load_trained``); starts nothing."""
    bodies = []
    for s in range(self.S):
      core = self.core0 if s == 0 else shard_lib.ShardCore(
          s, self.layout, self.config, [self.init_leaves[i] for i in self.layout.leaves(s)], [],
          shard_lib.checkpoint_dir(self.workdir, s))
      core.restore(step, np.zeros([self.W], np.int64))   # (served weights only: no pushes)
      bodies.append(np.asarray(core.served_fn(core.state)))
      if s:
        core.checkpointer.close()
    return self.layout.assemble(bodies, self.treedefs)

  def finished(self) -> bool:
    host = self.core.book.host
    return (self._at_end(host["evaluated_iterations"], host["evaluated"])
            or host.get("evaluated_budget", False))

  def completed(self) -> bool:
    return (self.core.iterations() >= self.total_pushes
            or self.core.book.host.get("budget_reached", False))

  def _at_end(self, iterations: int, pushes: int) -> bool:
    """The run's end, as the simulator's (``simulate.at_end``)."""
    return simulate.at_end(iterations, pushes, self.total_pushes,
                           self.config.train.stop_after_updates)

  @property
  def position(self) -> int:
    return int(self.core.book.host["pushes"])

  def advance(self) -> bool:
    self._serve()
    core = self.core
    with self.changed:
      while not (core.done or core.iterations() >= core.book.host["next_eval"]):
        self._raise_if_stopped()
        if interrupt.requested():
          return False   # save() snapshots under the lock; close() stops the meshes
        if core.clock_started and core.past_budget(core.now()):   # no event came after it
          core.end_at_budget()
          break
        self.changed.wait(timeout=0.5)
      self._raise_if_stopped()
      return True   # an evaluation point, or the end

  def _raise_if_stopped(self) -> None:
    if self.core.diverged:
      raise FloatingPointError(self.core.diverged)
    if not self.failure:
      self.failure = self.shard_links.failure()
    if self.failure:
      raise RunFailed(self.failure)

  def evaluate(self) -> dict[str, Any]:
    core = self.core
    with self.lock:   # a consistent cut: the meshes go on while it is evaluated
      snap_id = self.shard_links.snap()
      host = copy.deepcopy(core.book.host)
      acct = copy.deepcopy(core.book.acct)
      blocked = core.blocked_so_far()
      alive = core.protocol.alive.copy()
      wall = core.wall_time()
      done = core.iterations()
      core.book.host["evaluated"], core.book.host["evaluated_iterations"] = host["pushes"], done
      core.book.host["evaluated_budget"] = host.get("budget_reached", False)
      core.book.evaluated(done)
    params, model_state, sums = self.shard_links.fetch_snapshot(snap_id, self.treedefs)
    records.check_finite_loss(sums["loss_sum"], pushes=host["pushes"],
                              learning_rate=self.config.optimizer.learning_rate)
    if self.links.counts_device_pushes:   # as the simulator: pushes counted once applied
      pushed = np.asarray(sums["push_bytes"], np.int64)
      host["pushed_per_worker"] += pushed
      with self.lock:
        core.book.host["pushed_per_worker"] += pushed
    results = self.task.evaluate(params, model_state)
    return {
        **records.evaluation_record(
            pushes=host["pushes"], num_workers=self.W, spe=self.spe, updates=host["updates"],
            virtual_time=self._ended_at(host, wall), wall_time=wall, loss_sum=sums["loss_sum"],
            loss_count=sums["loss_count"], results=results, host=host,
            pull_bytes=self.pull_bytes, blocked=blocked, acct=acct, iterations=done),
        **_wire_fields(host),
        "meshes_alive": int(alive.sum()),
        "meshes_lost": len(host["lost"]),
        "refused_pushes": dict(host["refused"]),
    }

  def _ended_at(self, host: dict, wall: float) -> float:
    """The run's clock at a cut: the budget once reached (everything before it applied, nothing
    after, as the simulator stamps it), else the wall time."""
    return self.budget if host.get("budget_reached") else wall

  @property
  def evaluations(self) -> int:
    return self.core.book.host["num_evals"]

  def progress(self, record: dict[str, Any]) -> str:
    rate = self._eta.rate(record["pushes"])
    eta = max(self.end_pushes - record["pushes"], 0) / max(rate, 1e-9)
    if self.local:   # the end is in data iterations: H_w per push
      done = round(record["epoch"] * self.W * self.spe)
      eta = max(self.total_pushes - done, 0) / max(rate * float(self.steps.mean()), 1e-9)
    if self.budget:   # its clock is the wall clock: the budget's end comes first, or the epochs'
      eta = min(eta, max(self.budget - record["virtual_time"], 0.0))
    return (f"{self.scheme.name} (real, {self.W} meshes, {self.S} shard"
            f"{'s' if self.S > 1 else ''}) epoch {record['epoch']:.2f} | wall"
            f" {record['wall_time']:.1f} s | loss {record['train_loss']:.4f} |"
            f" {run_lib.metrics_text(record, self.metric_name)} | {rate:.1f} pushes/s |"
            f" meshes alive {record['meshes_alive']}/{self.W} | staleness mean"
            f" {record['staleness']['mean']:.2f} updates | ETA {workdir_lib.format_duration(eta)}")

  def save(self) -> None:
    core = self.core
    with self.lock:
      step = int(core.book.host["pushes"])
      if step == self.checkpointer.latest_step():
        return
      core.book.host["wall_time"] = core.wall_time()
      core.book.host["in_flight"] = [(max(0.0, due - time.monotonic()), m)
                                for due, m in core.messages.pending()]
      saved = copy.deepcopy({"protocol": core.protocol, "host": core.book.host,
                             "acct": core.book.acct.state_dict()})   # a snapshot; meshes go on
      self.shard_links.emit({"k": "save", "step": step})
    # Every shard's step is on disk before the control plane's: its latest step is complete.
    self.shard_links.wait_saved(step)
    self.checkpointer.save_and_wait(step, {"pushes": np.int64(step)}, {"pushes": step},
                                    host=saved)

  def close(self) -> None:
    with self.lock:
      self.core.finish()
    saved = False
    if self.core.clock_started and not self.failure_of_a_shard():
      try:
        self.save()   # also after Ctrl-C, SIGTERM or a failure: what was applied stays
        saved = True
      except (wire.Refused, wire.ServerGone, wire.CallError) as e:
        logging.error("the final checkpoint could not be written: %s", e)
    # Meshes still running read their stop from their next push or heartbeat; wait a little
    # for them (never for ones the launcher already ended: it ends meshes first).
    deadline = time.monotonic() + (1.0 if interrupt.requested() else 3.0)
    while (time.monotonic() < deadline and self._grpc is not None
           and not self.membership.all_stopped()):
      time.sleep(0.05)
    self.core.messages.close()
    self.shard_links.close_remote()
    if self._grpc is not None:
      self._grpc.stop(grace=0.5).wait()
      self._grpc = None
    self.shard_links.close_local()   # what is queued for shard 0 first, then the shard stops
    self.checkpointer.close()
    if saved:
      logging.info("the server stopped; its checkpoint is at %d pushes",
                   self.core.book.host["pushes"])

  def failure_of_a_shard(self) -> str | None:
    return self.shard_links.failure()

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    core = self.core
    with self.lock:
      host = copy.deepcopy(core.book.host)
      wall = core.wall_time()
      fields = records.summary_fields(
          history=history, reached=reached, metric=self.metric_name, target=self.target,
          scheme=self.scheme, groups=self.scheme.groups.tolist(),
          cluster={**self.cluster.describe(), "emulated": self.emulated},
          pushes=host["pushes"], batch_size=self.B, virtual_time=self._ended_at(host, wall),
          wall_time=wall,
          host=host, pull_bytes=self.pull_bytes, blocked=core.blocked_so_far(), acct=core.book.acct,
          iterations=core.iterations())
    core.book.scheme_fields(fields["scheme"])
    fields["runtime"] = "dist"
    fields["meshes"] = {"num": self.W, "lost": host["lost"], "rejoined": host["rejoined"],
                        "alive": core.protocol.alive.tolist()}
    fields["servers"] = {"num": self.S, "shard_bytes": self.layout.shard_bytes(),
                         "addresses": self.shard_links.addresses()}
    fields["refused_pushes"] = dict(host["refused"])
    fields["virtual_budget"] = ({"seconds": self.budget, "ended_at": self._ended_at(host, wall),
                                 "reached": bool(host.get("budget_reached"))}
                                if self.budget else None)
    wire_fields = _wire_fields(host)
    fields["totals"].update(wire_bytes_pushed=wire_fields["wire_bytes_pushed"],
                            wire_bytes_pulled=wire_fields["wire_bytes_pulled"],
                            pushes_per_worker=wire_fields["pushes_per_worker"])
    if core.push_log is not None:   # dist.record_pushes (this session's pushes)
      fields["push_log"] = list(core.push_log)
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
               wire.Method("Join", self.calls.on_join),
               wire.Method("Push", self.calls.on_push,
                           lambda header: push_checks.body_limit(header, self.layout),
                           parts=True),
               wire.Method("Heartbeat", self.calls.on_heartbeat),
               wire.Method("Pull", self.calls.on_pull)]
    self._grpc, port = endpoints.make_server(methods, address, self.credentials,
                                             max_workers=2 * self.W + 2 * self.S + 8,
                                             **endpoints.server_settings(self.config.dist,
                                                                      self.credentials))
    host, _ = wire.check_address("config.dist.server_address", address)
    self.address = f"{host}:{port}"
    workdir_lib.write_json(os.path.join(self.workdir, ADDRESS_FILE),
                           {"address": self.address, "pid": os.getpid(),
                            "run_id": self.credentials.run_id})   # not secret: names the run
    return self.address

  def _serve(self) -> None:
    """Serves (once per session) and starts the monitor."""
    if self._threads:
      return
    self.bind(self.config.dist.server_address or "127.0.0.1:0")
    logging.info("parameter server of %s (%d replicas, %d shard%s) serving %d meshes at %s",
                 self.scheme.name, self.scheme.num_replicas, self.S, "s" if self.S > 1 else "",
                 self.W, self.address)
    core = self.core
    with self.lock:
      self.membership.open()
      for left, message in core.book.host["in_flight"]:   # messages in flight at the checkpoint
        core.messages.add(time.monotonic() + left, message)
      core.book.host["in_flight"] = []
    monitor = threading.Thread(target=self._monitor, name="monitor", daemon=True)
    monitor.start()
    self._threads.append(monitor)

  def _monitor(self) -> None:
    """Drops silent meshes; ends a run whose meshes are all lost; keeps op streams alive."""
    interval = max(0.05, float(self.config.dist.heartbeat_timeout) / 4)
    last_ops = self.shard_links.ops
    while self._grpc is not None and not self.core.done:
      time.sleep(interval / 2)
      with self.lock:
        why = self.membership.check_silent()
        if why and not self.failure:
          self.failure = why
          logging.error(why)
        if self.shard_links.ops == last_ops and self.S > 1:
          self.shard_links.emit({"k": "noop"})   # the shards hear from the control plane
        last_ops = self.shard_links.ops
        self.changed.notify_all()

  # -- the shards' calls ------------------------------------------------------------------------

  def on_register(self, header, body, peer):
    del body, peer
    return self.shard_links.register(header), None

  def on_tensors(self, header, body, peer):
    del body, peer
    return {}, self.shard_links.tensors(header)

  def on_ready(self, header, body, peer):
    del body, peer
    self.shard_links.ready(header)
    return {}, None

def _wire_fields(host: dict) -> dict:
  """The records' counts of bytes on the wire and pushes per mesh."""
  return {"wire_bytes_pushed": int(host["wire_pushed_per_worker"].sum()),
          "wire_bytes_pulled": int(host["wire_pulled_per_worker"].sum()),
          "wire_bytes_pushed_per_worker": host["wire_pushed_per_worker"].tolist(),
          "wire_bytes_pulled_per_worker": host["wire_pulled_per_worker"].tolist(),
          "pushes_per_worker": host["pushes_per_worker"].tolist()}
