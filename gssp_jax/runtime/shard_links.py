"""The control plane's links to the parameter shards, and the one op stream they all apply.

:class:`ShardLinks` owns the links (shard 0 in this process, shards 1..S-1 in
their own: ``--role=shard``), the run's session, and the op stream: every op
(``put``, ``round``, ``snap``, ``save``, ``noop``) gets the next number and
goes to every ready shard in that order. A shard that registers late gets the
ops it missed from the log kept until every shard is ready. It answers the
shards' calls (``Register``, ``Tensors``, ``Ready``), fetches snapshots and
waits for checkpoints across the shards at once.

Concurrency: ``emit``, ``next_snap_id`` and the registration's table changes
run under the server's lock (``server.lock``, passed in); a link's own lock
(``RemoteShard.cond``, ``LocalShard.cond``) is taken under it only to append to the link's
outbox, never a shard's (``ShardCore.cond``: shard 0's feeder thread takes it).
No call to another process is made under the server's lock: a replaced shard is
closed after it is released; snapshots and checkpoint waits run without it.
Snapshots and checkpoint waits call the shards at once, on a pool of S - 1 threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
from typing import Any, Callable

from absl import logging
import grpc
import msgpack
import numpy as np

from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import shard as shard_lib
from gssp_jax.runtime import wire


class _Outbox:
  """A link's outbox and the one thread that drains it (``_run``). ``self.cond`` is the link's
  own lock: held to append or take items, never across a call to the shard."""

  def __init__(self, thread_name: str, outbox):
    self.cond = threading.Condition()
    self.outbox = outbox
    self.error: str | None = None
    self.closed = False
    self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
    self._thread.start()

  def _put(self, item) -> None:
    with self.cond:
      self.outbox.append(item)
      self.cond.notify()

  def _has_items(self) -> bool:
    """Waits (under ``self.cond``) for an item or the close; False once closed and drained."""
    while not self.outbox and not self.closed:
      self.cond.wait()
    return bool(self.outbox)

  def _end_thread(self) -> None:
    """Lets the thread hand over what is queued, then stops it (up to 5 s)."""
    with self.cond:
      self.closed = True
      self.cond.notify()
    self._thread.join(timeout=5)

  def _run(self) -> None:
    raise NotImplementedError


class LocalShard(_Outbox):
  """Shard 0, in this process: a feeder thread hands it the staged slices and ops in order.

  Under the server's lock a push's slice (:meth:`stage`) and the ops (:meth:`send`) are only
  appended to this link's outbox (its own lock, list appends): ``server.lock`` never waits
  for the shard's lock (``ShardCore.cond``), which the feeder takes, without the server's, to
  stage and enqueue them in the order they came. A stage or an enqueue the shard refuses ends
  the link (:meth:`failure`), as a remote shard's failed call does.
  """

  def __init__(self, core: shard_lib.ShardCore):
    self.core, self.index, self.address = core, 0, "(in the server)"
    super().__init__("shard0-feeder", collections.deque())   # ("stage" | "ops", args)

  def stage(self, w: int, seq: int, grads: list, stats: list) -> None:
    """Mesh ``w``'s checked push ``seq``, staged before the ops sent after it."""
    self._put(("stage", (w, seq, grads, stats)))

  def send(self, index: int, op: dict) -> None:
    self._put(("ops", (index, [op])))

  def _run(self) -> None:
    while True:
      with self.cond:
        if not self._has_items():
          return   # closed, everything handed over
        kind, args = self.outbox.popleft()
      try:   # without this link's lock (and never under the server's)
        if kind == "stage":
          self.core.stage(*args)
        else:
          self.core.enqueue(*args)
      except Exception as e:  # pylint: disable=broad-except  (the run ends on a failed shard)
        logging.error("shard 0 refused a %s from the server: %s", kind, e)
        with self.cond:
          self.error = f"shard 0 refused a {kind} from the server: {e}"
          self.closed = True
        return

  def snapshot(self, snap_id: int, timeout: float):
    return self.core.snapshot(snap_id, timeout)

  def saved(self, step: int, timeout: float) -> None:
    self.core.saved(step, timeout)

  def failure(self) -> str | None:
    if self.error is not None:
      return self.error
    return None if self.core.error is None else str(self.core.error)

  def close(self) -> None:
    """Hands over what is queued, stops the feeder, then the shard."""
    self._end_thread()
    self.core.stop()


class RemoteShard(_Outbox):
  """Shard s in another process: a sender thread streams its ops; calls fetch what it made."""

  def __init__(self, index: int, address: str, client: endpoints.Client, session: str,
               layout: layout_lib.ShardLayout):
    self.index, self.address, self.client, self.session = index, address, client, session
    self.layout = layout
    self.ready = False
    super().__init__(f"shard{index}-sender", [])   # (index, op), kept until sent

  def send(self, index: int, op: dict) -> None:
    if op["k"] == "round":
      op = {**op, "args": shard_lib.encode_round(op["args"]), "lr": float(op["lr"])}
    self._put((index, op))

  def _run(self) -> None:
    while True:
      with self.cond:
        if not self._has_items():
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
    self._end_thread()
    if self.error is None:
      try:
        self.client.call("Stop", {"session": self.session}, timeout=5, retry=False)
      except (wire.ServerGone, wire.CallError):
        pass   # it is gone already
    self.client.close()


class ShardLinks:
  """The links to the S shards and their op stream (see the module docstring).

  Args:
    config: the run's config (``dist.*`` settings; its id is checked at registration).
    config_id: the config's id, as every process computes it.
    layout: the parameter layout over the shards.
    core0: shard 0 (``ShardCore``), in this process.
    init_leaves: the initial parameter leaves (a registering shard's tensors).
    credentials: ``() -> auth.Credentials`` (read when a shard registers).
    lock: the server's lock (``locks.OwnedLock``); ``changed``: its condition.
  """

  def __init__(self, *, config, config_id: str, layout: layout_lib.ShardLayout, core0,
               init_leaves: list, credentials: Callable[[], Any], lock, changed):
    self.config, self.config_id, self.layout = config, config_id, layout
    self.S = layout.num_shards
    self.init_leaves, self._credentials = init_leaves, credentials
    self.lock, self.changed = lock, changed
    self.session = os.urandom(16).hex()
    self.links: list = [LocalShard(core0)] + [None] * (self.S - 1)
    self.ops = 0                               # ops emitted (the next op's number)
    self._op_log: list | None = [] if self.S > 1 else None   # ops before every shard was ready
    self.snaps = 0
    self.restored_step = -1                    # the step a registering shard restores
    self.restored_seqs: list[int] = [0] * config.num_workers   # each mesh's last push there
    self._calls = CallPool(self.S - 1, "shard-call")   # snapshots' and checkpoints' calls

  # -- the shards' calls (gRPC handler threads) ----------------------------------------------

  def register(self, header: dict) -> dict:
    """A shard process starts: its session, the step to restore, the layout."""
    s = wire.field(header, "shard", int, 1, self.S - 1)
    if wire.field(header, "num_servers", int) != self.S:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"shard {s} was started with config.dist.num_servers="
                         f"{header['num_servers']}, the server with {self.S}; start every process "
                         "with the same config")
    if wire.field(header, "config", str) != self.config_id:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"shard {s}'s config differs from the server's; start every process "
                         "with the same --config and --config.* flags")
    address = wire.field(header, "address", str)
    wire.check_address("shard address", address)
    with self.lock:
      old = self.links[s]
      if self._op_log is None:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"shard {s} registers after the run started: a shard's tensors live "
                           "only in its process, so a lost shard ends the run; resume the run "
                           "from its checkpoint (rerun the same command)")
      if old is not None and old.ready and not old.failure():
        raise wire.Refused(grpc.StatusCode.ALREADY_EXISTS,
                           f"shard {s} is already registered (at {old.address}); each --shard "
                           "runs once")
      dist = self.config.dist
      credentials = self._credentials()
      client = endpoints.Client(address, credentials, retry_seconds=float(dist.retry_seconds),
                                **endpoints.client_settings(dist, credentials))
      self.links[s] = RemoteShard(s, address, client, self.session, self.layout)
      logging.info("shard %d registered at %s", s, address)
    if old is not None:   # outside the lock: closing may call the old shard (Stop), up to 5 s
      old.close()
    return {"session": self.session, "restore": int(self.restored_step),
            "seqs": [int(x) for x in self.restored_seqs],
            "layout": json.dumps(self.layout.describe())}

  def tensors(self, header: dict) -> np.ndarray:
    """A registered shard's initial tensors (the server's initialisation, one for every shard)."""
    s = wire.field(header, "shard", int, 1, self.S - 1)
    if wire.field(header, "session", str) != self.session:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, "the session changed; register")
    return np.concatenate([self.init_leaves[i].reshape(-1) for i in self.layout.leaves(s)])

  def ready(self, header: dict) -> None:
    """A registered shard compiled, restored and serves: it may take ops."""
    s = wire.field(header, "shard", int, 1, self.S - 1)
    with self.lock:
      link = self.links[s]
      if link is None or wire.field(header, "session", str) != self.session:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {s} must register first")
      link.ready = True
      for index, op in self._op_log or []:   # ops emitted before it registered
        link.send(index, op)
      if self.all_ready():
        self._op_log = None
      self.changed.notify_all()

  # -- the op stream (under the server's lock) --------------------------------------------------

  def all_ready(self) -> bool:
    return all(link is not None and getattr(link, "ready", True) for link in self.links)

  def emit(self, op: dict) -> None:
    """Appends ``op`` to every shard's stream (under the server's lock: one order for all)."""
    self.lock.check("ShardLinks.emit")
    index = self.ops
    self.ops += 1
    if self._op_log is not None:   # kept for shards that are not ready yet
      self._op_log.append((index, op))
    for link in self.links:
      if link is not None and getattr(link, "ready", True):
        link.send(index, op)

  def stage(self, w: int, seq: int, grads: list, stats: list) -> None:
    """Shard 0's slice of mesh ``w``'s accepted push ``seq``, ahead of the ops emitted after it
    (under the server's lock; handed to the shard by its link's feeder)."""
    self.lock.check("ShardLinks.stage")
    self.links[0].stage(w, seq, grads, stats)

  def close_local(self) -> None:
    """Hands shard 0 what is queued for it, then stops it."""
    self.links[0].close()

  def snap(self) -> int:
    """Emits a ``snap`` op (under the server's lock); returns its id (:meth:`fetch_snapshot`)."""
    self.lock.check("ShardLinks.snap")
    snap_id = self.snaps
    self.snaps += 1
    self.emit({"k": "snap", "id": snap_id})
    return snap_id

  # -- without the lock --------------------------------------------------------------------------

  def fetch_snapshot(self, snap_id: int, treedefs):
    """The served weights of snapshot ``snap_id`` from every shard, as trees; shard 0's sums."""
    timeout = float(self.config.dist.save_timeout)
    results = self._calls.run([lambda link=link: link.snapshot(snap_id, timeout)
                              for link in self.links])
    params, model_state = self.layout.assemble([flat.view(np.uint8) for flat, _ in results],
                                               treedefs)
    return params, model_state, results[0][1]

  def wait_saved(self, step: int) -> None:
    """Waits until every shard's checkpoint at ``step`` is on disk."""
    timeout = float(self.config.dist.save_timeout)
    self._calls.run([lambda link=link: link.saved(step, timeout) for link in self.links
                    if link is not None])

  def failure(self) -> str | None:
    """Why a shard's link failed (the first), or None."""
    return next((link.failure() for link in self.links if link is not None and link.failure()),
                None)

  def addresses(self) -> list:
    return [link.address if link else None for link in self.links]

  def close_remote(self) -> None:
    """Lets the remote shards' queued ops go out, stops them and closes their links."""
    for link in self.links[1:]:
      if link is not None:
        link.close()
    self._calls.close()


class CallPool:
  """Runs a few calls at once: the first on the caller's thread, the others on ``size``
  threads made once (not one thread per call: a mesh calls the other shards at every push)."""

  def __init__(self, size: int, name: str):
    self._pool = (concurrent.futures.ThreadPoolExecutor(size, name) if size > 0 else None)

  def run(self, calls: list[Callable[[], Any]]) -> list[Any]:
    """The results of ``calls``, in order; the first error is raised once all of them ended."""
    futures = [self._pool.submit(call) for call in calls[1:]] if self._pool else []
    if len(futures) != len(calls[1:]):
      raise ValueError(f"{len(calls)} calls on a pool of none; allowed: 1")
    results, errors = [None] * len(calls), []
    for i, run in enumerate(calls[:1] + [future.result for future in futures]):
      try:
        results[i] = run()
      except BaseException as e:  # pylint: disable=broad-except  (raised after the others)
        errors.append(e)
    if errors:
      raise errors[0]
    return results

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False)
