"""``DistServer``: the real runtime's executor, a parameter server process driving real meshes.

``train/loop.py`` drives it like the simulator (``config.executor='dist'``; the
launcher's ``server`` role sets it). It hosts the scheme's replicas (group
servers, global server or the single parameter server) as the simulator's
device state (``sim/executor.SimState``), runs the scheme's protocol object on
the meshes' real pushes with wall-clock times, and applies every round the
protocol emits with the same jitted ``round_body`` as the simulator. What
differs from the simulator is only where gradients come from (a mesh's push,
not a job on this device) and where time comes from (the wall clock).

Threads: gRPC serves each call on its own thread (a ``Push`` waits there until
its mesh is released); one lock orders every protocol event and device update;
a monitor drops meshes whose heartbeat stopped; the loop's thread waits for
the next evaluation point, then evaluates a copy of the served weights while
the meshes go on.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
import uuid
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.dist import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import executor
from gssp_jax.sim import simulate
from gssp_jax.train import checkpoint as ckpt_lib
from gssp_jax.train import health
from gssp_jax.train import interrupt
from gssp_jax.train import optim
from gssp_jax.train import run as run_lib
from gssp_jax.train import step as step_lib
from gssp_jax.train import workdir as workdir_lib

ADDRESS_FILE = "server_address.json"   # in the workdir: where the launcher finds a port-0 server


def make_put_fn():
  """``(state, worker, grad, model_state, loss, nbytes) -> state``: a push into its slot."""

  def put(state: executor.SimState, w, grad, model_state, loss, nbytes):
    set_row = lambda buf, value: jax.tree.map(lambda b, v: b.at[w].set(v.astype(b.dtype)),
                                              buf, value)
    return state.replace(grad_buf=set_row(state.grad_buf, grad),
                         worker_model_state=set_row(state.worker_model_state, model_state),
                         job_loss=state.job_loss.at[w].set(loss),
                         job_bytes=state.job_bytes.at[w].set(nbytes))
  return jax.jit(put, donate_argnums=(0,))


class DistServer:
  """The parameter server of a real run: an executor of ``train/loop.py``.

  Args:
    config: the run's config (``config.dist.*`` holds the server's settings).
    task: the task (the server evaluates; it never trains).
    workdir: the run's workdir (checkpoints, ``server_address.json``).
  """

  position_key = "pushes"

  def __init__(self, config: ml_collections.ConfigDict, task, workdir: str):
    self.config, self.task, self.workdir = config, task, workdir
    self.metric_name, self.target = run_lib.metric_and_target(config, task)
    self._plan_pushes()
    self._build_replicas()
    self._build_host()

  # -- building the run -----------------------------------------------------------------------

  def _plan_pushes(self) -> None:
    """Iterations per epoch, and the run's end and evaluation points in pushes (as simulated)."""
    self.W, self.B = self.config.num_workers, self.config.batch_size
    plan = simulate.plan_pushes(self.config, self.task.num_train)
    self.spe, self.total_pushes, self.eval_pushes, self.end_pushes = (
        plan.spe, plan.total_pushes, plan.eval_pushes, plan.end_pushes)

  def _build_replicas(self) -> None:
    """The scheme, its chain, the replicas' device state and the jitted round and push."""
    config, task = self.config, self.task
    self.cluster = cluster_lib.cluster_from_config(config)
    self.emulated = config_lib.cluster_is_set(config)
    self.scheme = scheme = sync.scheme_from_config(config, worker_times=self.cluster.speeds)
    self.schedule = optim.learning_rate_schedule(config.optimizer, self.spe,
                                                 round(self.total_pushes / self.W))
    tx = optim.make_sync_chain(config.optimizer, scheme.transform, scheme.num_replicas)
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    # One compiled init (eager init compiles each initializer: ~7 s for LeNet-5 here).
    params, model_state = jax.jit(task.init)(init_rng)
    self.treedefs = (jax.tree.structure(params), jax.tree.structure(model_state))
    self.dense_bytes = step_lib.tree_bytes(params)
    self.stats_bytes = step_lib.tree_bytes(model_state)
    self.pull_bytes = self.dense_bytes + self.stats_bytes
    self.state = executor.init_state(params, model_state, tx, None, self.W,
                                     scheme.num_replicas, train_rng)
    self.round_fn = executor.make_round_fn(tx)
    self.put_fn = make_put_fn()
    self.take_fn = jax.jit(lambda tree, w: jax.tree.map(lambda x: x[w], tree))   # a pull
    self._compile(params, model_state)
    self.ratio_of = simulate.Ratios(config, scheme, self.cluster.speeds, self.spe)

  def _compile(self, params, model_state) -> None:
    """Runs the round and the push once on a copy, so no compilation happens under the lock."""
    copy_state = lambda: jax.tree.map(jnp.copy, self.state)
    self.put_fn(copy_state(), np.int32(0), params, model_state, np.float32(0), np.int32(0))
    args = sync.round_args(self.scheme.make_protocol().new_round(0.0))
    args["learning_rate"] = np.float32(0.0)
    jax.block_until_ready(self.round_fn(copy_state(), args))
    # What runs under the lock after the clock started compiles here too: the pull, the
    # schedule, the evaluated weights (their first calls compiled ~30 programs, seconds on a
    # loaded CPU, while every mesh waited). The schedule stays eager, as the simulator's: a
    # jitted one rounds differently.
    jax.block_until_ready((self.take_fn((self.state.worker_params, self.state.worker_model_state),
                                        np.int32(0)), self.schedule(0)))
    executor.served_weights(self.state, getattr(self.scheme.make_protocol(), "global_replica",
                                                None))

  def _build_host(self) -> None:
    W = self.W
    self.protocol = self.scheme.make_protocol()
    self.acct = sync.accounting.Accounting(W, self.scheme.num_replicas,
                                           aggregating=self.scheme.name == "inhad")
    self.eval_replica = getattr(self.protocol, "global_replica", None)
    self.host = {"jobs": np.zeros([W], np.int64), "pushes": 0, "updates": 0, "rounds": 0,
                 "wall_time": 0.0, "next_eval": self.eval_pushes, "num_evals": 0,
                 "pushed_per_worker": np.zeros([W], np.int64),
                 "wire_pushed_per_worker": np.zeros([W], np.int64),
                 "wire_pulled_per_worker": np.zeros([W], np.int64),
                 "pulls_per_worker": np.zeros([W], np.int64),
                 "pushes_per_worker": np.zeros([W], np.int64),
                 "blocked_time_per_worker": np.zeros([W]), "server_bytes": 0,
                 "lost": [], "rejoined": [], "started": np.zeros([W], bool), "evaluated": 0,
                 "in_flight": []}   # server-to-server messages: (due time, message)
    self.lock = threading.RLock()
    self.changed = threading.Condition(self.lock)
    self.session = uuid.uuid4().hex
    self.replies: dict[int, dict] = {}
    self.waiting = np.zeros([W], bool)        # a Push of this mesh waits for its release
    self.told_stop = np.zeros([W], bool)      # the mesh got a reply saying the run is over
    self.blocked_since = np.zeros([W])
    self.last_seen = np.full([W], np.inf)     # monotonic seconds of the last call (inf: never)
    self.done = False                         # the run reached end_pushes: meshes stop
    self.checkpointer = ckpt_lib.Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                              self.config.train.max_checkpoints)
    self._grpc = None
    self._wall_base, self._session_start = 0.0, time.perf_counter()
    self._session_pushes = 0
    self._clock_started = False

  # -- the executor interface -----------------------------------------------------------------

  def restore(self) -> int:
    latest = self.checkpointer.latest_step()
    if latest is not None:
      saved = self.checkpointer.restore_host(latest)   # first: it refuses an older format
      state, _ = self.checkpointer.restore(latest, self.state)
      self.state = jax.device_put(state)
      self.protocol, self.host = saved["protocol"], saved["host"]
      self.acct.load_state_dict(saved["acct"])
      logging.info("resumed from the server checkpoint at %d pushes", latest)
      # The meshes' iterations in flight belonged to the previous server: every mesh
      # rejoins from its replica's current weights.
      now = self._now()
      for w in np.flatnonzero(self.protocol.alive & self.host["started"]):
        self._react(self.protocol.drop(int(w), now), now)
    self._wall_base = self.host["wall_time"]
    self._session_start, self._session_pushes = time.perf_counter(), self.host["pushes"]
    return int(self.host["pushes"])

  def finished(self) -> bool:
    # Pushes go on while an evaluation runs, so the end is reached once it is evaluated.
    return self.host["evaluated"] >= self.end_pushes

  def completed(self) -> bool:
    return self.host["pushes"] >= self.total_pushes

  @property
  def position(self) -> int:
    return int(self.host["pushes"])

  def advance(self) -> bool:
    self._serve()
    with self.changed:
      while not (self.done or self.host["pushes"] >= self.host["next_eval"]):
        if interrupt.requested():
          return False   # save() snapshots under the lock; close() stops the meshes
        self.changed.wait(timeout=0.5)
      return True   # an evaluation point, or the end

  def evaluate(self) -> dict[str, Any]:
    with self.lock:   # a consistent snapshot; the meshes go on while it is evaluated
      host = copy.deepcopy(self.host)
      loss_sum, loss_count = jax.device_get((self.state.loss_sum, self.state.loss_count))
      self.state = self.state.replace(loss_sum=jnp.zeros([], jnp.float32),
                                      loss_count=jnp.zeros([], jnp.int32))
      params, model_state = executor.served_weights(self.state, self.eval_replica)
      params, model_state = jax.device_get((params, model_state))
      staleness, versions = self.acct.summary(), self.acct.version.tolist()
      blocked = self._blocked_so_far()
      alive = self.protocol.alive.copy()
      wall = self._wall_time()
      self.host["evaluated"] = host["pushes"]
      while self.host["next_eval"] <= host["pushes"]:
        self.host["next_eval"] += self.eval_pushes
      self.host["num_evals"] += 1
    if not np.isfinite(loss_sum):
      raise FloatingPointError(
          f"non-finite training loss before {host['pushes']} pushes; the run stopped. Lower "
          f"optimizer.learning_rate ({self.config.optimizer.learning_rate}) or set "
          "optimizer.grad_clip")
    results = self.task.evaluate(params, model_state)
    return {
        "epoch": host["pushes"] / (self.W * self.spe),
        "pushes": int(host["pushes"]),
        "updates": int(host["updates"]),
        "virtual_time": wall,   # a real run: wall seconds stand where virtual time stands
        "wall_time": wall,
        "train_loss": float(loss_sum) / max(int(loss_count), 1),
        **results,
        **self._traffic(host),
        "bytes_pushed_per_worker": host["pushed_per_worker"].tolist(),
        "bytes_pulled_per_worker": (host["pulls_per_worker"] * self.pull_bytes).tolist(),
        "wire_bytes_pushed_per_worker": host["wire_pushed_per_worker"].tolist(),
        "wire_bytes_pulled_per_worker": host["wire_pulled_per_worker"].tolist(),
        "pushes_per_worker": host["pushes_per_worker"].tolist(),
        "blocked_time": float(blocked.mean()),
        "blocked_time_per_worker": blocked.tolist(),
        "staleness": staleness,
        "updates_per_replica": versions,
        "meshes_alive": int(alive.sum()),
        "meshes_lost": len(host["lost"]),
    }

  @property
  def evaluations(self) -> int:
    return self.host["num_evals"]

  def progress(self, record: dict[str, Any]) -> str:
    elapsed = time.perf_counter() - self._session_start
    rate = (record["pushes"] - self._session_pushes) / max(elapsed, 1e-9)
    eta = (self.end_pushes - record["pushes"]) / max(rate, 1e-9)
    return (f"{self.scheme.name} (real, {self.W} meshes) epoch {record['epoch']:.2f} | wall"
            f" {record['wall_time']:.1f} s | loss {record['train_loss']:.4f} |"
            f" {self.metric_name} {record[self.metric_name]:.4f} | {rate:.1f} pushes/s |"
            f" meshes alive {record['meshes_alive']}/{self.W} | staleness mean"
            f" {record['staleness']['mean']:.2f} | ETA {workdir_lib.format_duration(eta)}")

  def save(self) -> None:
    with self.lock:
      step = int(self.host["pushes"])
      self.host["wall_time"] = self._wall_time()
      state = jax.device_get(self.state)
      saved = copy.deepcopy({"protocol": self.protocol, "host": self.host,
                             "acct": self.acct.state_dict()})   # a snapshot; meshes go on
    if step == self.checkpointer.latest_step():
      return
    self.checkpointer.save(step, state, {"pushes": step}, host=saved)
    self.checkpointer.wait()

  def close(self) -> None:
    with self.lock:
      self._finish()
    if self._clock_started:
      self.save()   # also after Ctrl-C, SIGTERM or a failure: what was applied stays
    # Serve until every live mesh has read its stop (a push reply or a heartbeat), so none is
    # left retrying a server that is gone; a mesh that does not call within the heartbeat
    # timeout is not waited for.
    deadline = time.monotonic() + float(self.config.dist.heartbeat_timeout)
    while (time.monotonic() < deadline and self._grpc is not None
           and not (self.told_stop | ~self.protocol.alive).all()):
      time.sleep(0.05)
    if self._grpc is not None:
      self._grpc.stop(grace=1.0).wait()
      self._grpc = None
    self.checkpointer.close()

  def summary_fields(self, history: list[dict], reached: dict | None) -> dict[str, Any]:
    with self.lock:
      host = copy.deepcopy(self.host)
      blocked = self._blocked_so_far()
      staleness = self.acct.summary()
      versions = self.acct.version.tolist()
    return {
        **health.time_to_target_fields(history, self.metric_name, self.target),
        "pushes_to_target": reached["pushes"] if reached else None,
        "runtime": "dist",
        "scheme": {**sync.registry.describe(self.scheme), "groups": self.scheme.groups.tolist()},
        "cluster": {**self.cluster.describe(), "emulated": self.emulated},
        "meshes": {"num": self.W, "lost": host["lost"], "rejoined": host["rejoined"],
                   "alive": self.protocol.alive.tolist()},
        "totals": {
            "pushes": int(host["pushes"]), "updates": int(host["updates"]),
            "rounds": int(host["rounds"]), "samples": int(host["pushes"]) * self.B,
            "virtual_time": self._wall_time(), "wall_time": self._wall_time(),
            **self._traffic(host),
            "pushes_per_worker": host["pushes_per_worker"].tolist(),
            "blocked_time_per_worker": blocked.tolist(),
            "staleness": staleness, "updates_per_replica": versions,
        },
    }

  # -- serving ----------------------------------------------------------------------------------

  def _serve(self) -> None:
    """Starts the gRPC server and the heartbeat monitor (once per session)."""
    if self._grpc is not None:
      return
    dist = self.config.dist
    address = dist.server_address or "127.0.0.1:0"
    handlers = {"Join": self.on_join, "Push": self.on_push, "Heartbeat": self.on_heartbeat}
    self._grpc, port = wire.make_server(handlers, address, max_workers=2 * self.W + 8)
    host, _ = wire.check_address("dist.server_address", address)
    self.address = f"{host}:{port}"
    workdir_lib.write_json(os.path.join(self.workdir, ADDRESS_FILE),
                           {"address": self.address, "session": self.session, "pid": os.getpid()})
    logging.info("parameter server of %s (%d replicas) serving %d meshes at %s", self.scheme.name,
                 self.scheme.num_replicas, self.W, self.address)
    self._join_by = join_by = time.monotonic() + float(dist.join_timeout)
    with self.lock:
      self.last_seen[:] = join_by - float(dist.heartbeat_timeout)   # the first join's grace
      for due, message in self.host["in_flight"]:   # messages in flight at the checkpoint
        self._deliver_later(message, max(0.0, due - self._now()))
      self.host["in_flight"] = []
    monitor = threading.Thread(target=self._monitor, name="heartbeat-monitor", daemon=True)
    monitor.start()

  def _heartbeat_interval(self) -> float:
    return max(0.05, float(self.config.dist.heartbeat_timeout) / 4)

  def _check_call(self, request: dict) -> int:
    w = int(request["mesh"])
    if not 0 <= w < self.W:
      raise ValueError(f"mesh={w} is invalid; allowed: 0..{self.W - 1}")
    self.last_seen[w] = time.monotonic()
    return w

  def on_join(self, request: dict) -> dict:
    """A mesh starts (fresh run) or rejoins (after a crash, a drop, or a server restart)."""
    with self.lock:
      w = self._check_call(request)
      if request.get("config") != self._config_id():
        return {"error": f"mesh {w}'s config differs from the server's; start every process"
                         " with the same --config and --config.* flags"}
      if self.done:
        return self._stop(w)
      if not self.host["started"][w] and self.protocol.alive[w]:
        self.host["started"][w] = True   # the first start: the initial weights, iteration 0
        self._await_start(w)
        reply = self._pull_reply(w, self._next_job(w))
        self.host["pulls_per_worker"][w] += 1
        return self._sent(w, reply)
      self._start_clock()               # a resumed session starts at its first rejoin
      now = self._now()
      if self.protocol.alive[w]:         # restarted before its heartbeat ran out
        self._lose(w, now, "restarted")
      self.host["rejoined"].append({"mesh": w, "time": now, "pushes": int(self.host["pushes"])})
      logging.info("mesh %d rejoins at %d pushes", w, self.host["pushes"])
      self._react(self.protocol.rejoin(w, now), now)
      return self._sent(w, self.replies.pop(w))

  def _await_start(self, w: int) -> None:
    """The start barrier: a fresh run begins when every mesh has joined (or at join_timeout).

    As on a real cluster, where jobs start together; the run's clock starts
    then, so wall time counts training, not the meshes' staggered start-up.
    """
    self.changed.notify_all()
    while (not self.host["started"].all() and time.monotonic() < self._join_by
           and not self.done and self.host["pushes"] == 0):   # only a fresh run waits
      self.last_seen[w] = time.monotonic()   # waiting here is alive
      self.changed.wait(timeout=0.2)
    self._start_clock()
    self.changed.notify_all()

  def _start_clock(self) -> None:
    if not self._clock_started:
      self._clock_started = True
      self._session_start = time.perf_counter()

  def on_push(self, request: dict) -> dict:
    """A mesh's gradient: applied as the protocol says; the reply waits for the mesh's release."""
    with self.lock:
      w = self._check_call(request)
      if self.done:
        return self._stop(w)
      if (request.get("session") != self.session or not self.protocol.alive[w]
          or int(request["iteration"]) != self.host["jobs"][w] - 1):
        return {"rejoin": True}   # from before a drop or a server restart
      self._put(w, request)
      now = self._now()
      self.blocked_since[w] = now
      self.waiting[w] = True
      self._react(self.protocol.on_push(w, now), now)
      self._after_push()
      while w not in self.replies and not self.done:
        self.changed.wait(timeout=0.5)
        if not self.protocol.alive[w]:
          self.waiting[w] = False
          return {"rejoin": True}
      self.waiting[w] = False
      if self.done:   # the run ended while this mesh waited: no further iteration
        return self._stop(w)
      return self._sent(w, self.replies.pop(w))

  def on_heartbeat(self, request: dict) -> dict:
    # No lock: a heartbeat counts even while the lock is held (a long round, a checkpoint),
    # so a busy server never drops a live mesh.
    w = self._check_call(request)
    if self.done:
      return self._stop(w)
    return {"stop": False, "rejoin": (request.get("session") != self.session
                                      or not self.protocol.alive[w])}

  def _monitor(self) -> None:
    """Drops every mesh whose heartbeat stopped for ``dist.heartbeat_timeout`` seconds."""
    timeout = float(self.config.dist.heartbeat_timeout)
    while self._grpc is not None and not self.done:
      time.sleep(self._heartbeat_interval() / 2)
      with self.lock:
        late = (self.protocol.alive & (time.monotonic() - self.last_seen > timeout))
        for w in np.flatnonzero(late):
          self._lose(int(w), self._now(), f"no heartbeat for {timeout:g} s")
        if not self.protocol.alive.any() and not self.done:
          logging.warning("no mesh is alive; waiting for meshes to rejoin")
          self.last_seen[:] = np.inf   # one warning; a rejoin restarts the clocks
        self.changed.notify_all()

  # -- protocol events ----------------------------------------------------------------------------

  def _lose(self, w: int, now: float, why: str) -> None:
    """Drops mesh ``w`` from the protocol: nobody waits for it any more; what it applied stays."""
    self.host["lost"].append({"mesh": w, "time": now, "pushes": int(self.host["pushes"]),
                              "why": why})
    logging.warning("mesh %d lost (%s) at %d pushes; %d meshes alive", w, why,
                    self.host["pushes"], int(self.protocol.alive.sum()) - 1)
    self.waiting[w] = False
    self.replies.pop(w, None)
    self._react(self.protocol.drop(w, now), now)
    self.changed.notify_all()

  def _react(self, reaction, now: float) -> None:
    """Applies a reaction's rounds, answers the released meshes, schedules its messages."""
    for rnd in reaction.rounds:
      self._apply_round(rnd)
    for w in reaction.release:
      self.host["blocked_time_per_worker"][w] += max(0.0, now - self.blocked_since[w])
      self.replies[w] = self._pull_reply(w, self._next_job(w))
      self.host["pulls_per_worker"][w] += 1
    for message in reaction.messages:
      delay = self._message_delay(message)
      if delay <= 0:
        self._react(self.protocol.on_message(message, now), now)
      else:
        self._deliver_later(message, delay)
    if reaction.release:
      self.changed.notify_all()

  def _apply_round(self, rnd) -> None:
    args = sync.round_args(rnd)
    args["learning_rate"] = np.float32(self.schedule(self.host["pushes"] // self.W))
    self.acct.apply(rnd)
    self.host["rounds"] += 1
    self.host["updates"] += int(rnd.applies.any())
    self.host["server_bytes"] += self.protocol.server_payloads(rnd) * self.pull_bytes
    self.state = self.round_fn(self.state, args)

  def _deliver_later(self, message, delay: float) -> None:
    entry = (self._now() + delay, message)
    self.host["in_flight"].append(entry)

    def deliver():
      with self.lock:
        if entry in self.host["in_flight"]:
          self.host["in_flight"].remove(entry)
        if not self.done:
          now = self._now()
          self._react(self.protocol.on_message(message, now), now)
    timer = threading.Timer(delay, deliver)
    timer.daemon = True
    timer.start()

  def _message_delay(self, message) -> float:
    """An emulated server-to-server link's delay (0 without a cluster description)."""
    return self.cluster.server_time(self.pull_bytes) if self.emulated else 0.0

  def _put(self, w: int, request: dict) -> None:
    grad = jax.tree.unflatten(self.treedefs[0], wire.unpack_leaves(request["grad"]))
    stats = jax.tree.unflatten(self.treedefs[1], wire.unpack_leaves(request["model_state"]))
    self.state = self.put_fn(self.state, np.int32(w), grad, stats,
                             np.float32(request["loss"]), np.int32(request["bytes"]))
    host = self.host
    host["pushes"] += 1
    host["pushes_per_worker"][w] += 1
    host["pushed_per_worker"][w] += int(request["bytes"])
    host["wire_pushed_per_worker"][w] += int(request.get("wire_bytes", 0))

  def _after_push(self) -> None:
    if self.host["pushes"] >= self.end_pushes:
      self._finish()
    if self.host["pushes"] >= self.host["next_eval"] or self.done:
      self.changed.notify_all()

  def _finish(self) -> None:
    """The run's pushes are all in: every mesh is told to stop."""
    if not self.done:
      self.done = True
      self.changed.notify_all()

  def _next_job(self, w: int) -> dict:
    k = int(self.host["jobs"][w])
    self.host["jobs"][w] += 1
    return {"iteration": k, "ratio": float(self.ratio_of(w, k)),
            "flush": bool(self.ratio_of.flush(w, k))}

  def _pull_reply(self, w: int, job: dict) -> dict:
    params, stats = jax.device_get(self.take_fn(
        (self.state.worker_params, self.state.worker_model_state), np.int32(w)))
    return {"params": wire.pack_leaves(jax.tree.leaves(params)),
            "model_state": wire.pack_leaves(jax.tree.leaves(stats)),
            "session": self.session, **job}

  def _stop(self, w: int) -> dict:
    self.told_stop[w] = True
    return {"stop": True}

  def _sent(self, w: int, reply: dict) -> dict:
    if "params" in reply:
      self.host["wire_pulled_per_worker"][w] += sum(
          np.asarray(x["v"]).nbytes for x in reply["params"] + reply["model_state"])
    return reply

  # -- time and totals ----------------------------------------------------------------------------

  def _now(self) -> float:
    return self._wall_time()

  def _wall_time(self) -> float:
    return self._wall_base + time.perf_counter() - self._session_start

  def _blocked_so_far(self) -> np.ndarray:
    now = self._now()
    return self.host["blocked_time_per_worker"] + np.where(
        self.waiting, now - self.blocked_since, 0.0)

  def _traffic(self, host: dict) -> dict[str, int]:
    return {"bytes_pushed": int(host["pushed_per_worker"].sum()),
            "bytes_pulled": int(host["pulls_per_worker"].sum()) * self.pull_bytes,
            "bytes_between_servers": int(host["server_bytes"]),
            "wire_bytes_pushed": int(host["wire_pushed_per_worker"].sum()),
            "wire_bytes_pulled": int(host["wire_pulled_per_worker"].sum())}

  def _config_id(self) -> str:
    """What a mesh's config must equal: the config without the per-process ``dist`` settings."""
    return config_id(self.config)


def config_id(config: ml_collections.ConfigDict) -> str:
  """A JSON of the config but ``executor`` and ``dist`` (which differ between roles)."""
  d = json.loads(config.to_json())
  d.pop("dist", None)
  d.pop("executor", None)
  return json.dumps(d, sort_keys=True)
