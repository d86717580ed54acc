"""A parameter-server shard: its tensors of every replica, the gradients staged for it, its ops.

A real run's server state is the simulator's device state (``sim/executor.
SimState``) split by tensor over S shards (``layout.ShardLayout``): shard s
holds its tensors of every replica, of every worker's pulled weights and of
the per-replica optimizer and sync-transform state; shard 0 also holds the
BatchNorm statistics and the loss sums. Every shard applies the **same
ordered stream of ops** with the simulator's own jitted functions:

* ``put``: a mesh's push into its worker slot (the gradient slice staged by
  :meth:`ShardCore.stage` under the digest the op names, its loss and bytes) -- the job's
  outputs;
* ``round``: one round (``executor.round_body``, with the round's args and
  learning rate);
* ``snap``: a copy of the served weights (and, on shard 0, the loss sums,
  then cleared) for an evaluation;
* ``save``: an Orbax checkpoint of the shard's state at a push count.

The control plane (``runtime/server.py``) decides the ops and numbers them; the
shard applies them in that order and nothing else changes its state. A
mesh's pull names the op count (the *watermark*) at its release; the shard
answers once it has applied that many ops. So S shards, each applying the
stream in its own process, hold exactly the state one server would.

Threads: gRPC handlers stage gradients, enqueue ops and read pulls; one
applier thread applies ops. ``self.cond`` (one lock) orders the staged
gradients, the op queue, the applied count, the reference to the device state
and two counts of who is using that state: ``_readers`` (pulls reading a row of
it) and ``_busy`` (the applier dispatching an op that donates it). Under the
lock only bookkeeping runs: no dispatch, no device-to-host read, no call.

* A pull takes the state's reference and counts itself a reader under the
  lock, once ``applied`` reaches its watermark and no donating op is being
  dispatched; without the lock it computes its row (a buffer of its own) from
  that state, uncounts once the row is computed, and copies the row to the host.
* The applier starts a ``put`` or a ``round`` only when no pull is reading
  (a read dispatched from one thread raced with a donation from another on the
  CPU backend, jax 0.10.2, and returned updated rows), marks itself busy,
  dispatches without the lock, then stores the new state and unmarks.
* A ``snap``'s or a ``save``'s host copy is taken by the applier without the
  lock too: it is the only thread that donates the state, and pulls only read.

So a pull holds back a donating op only while its row is computed on the
device (not while it is copied to the host or sent), never another mesh's
staging; the control plane's slices and ops for shard 0 reach ``stage`` and ``enqueue``
through its link's feeder thread (``shard_links.LocalShard``), so ``server.lock`` never waits
for this lock. Nothing here calls the
control plane, so no lock is held across processes.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import grpc
import msgpack
import numpy as np

from gssp_jax import sync
from gssp_jax.runtime import auth
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import wire
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import executor
from gssp_jax.base import checkpoint as ckpt_lib
from gssp_jax.base import optim

ROUND_FIELDS = {"arrived": bool, "pulls": bool, "groups": np.int32, "applies": bool,
                "forward": bool, "deliver": bool, "aggregate": bool, "adopt": np.int32,
                "average": np.int32, "stats_mean": np.int32, "adopt_weight": np.float32}
MAX_OPS_PER_CALL = 4096
# Slices staged for one mesh's next push, each under its digest: the mesh's own, and room for
# a restarted mesh's and for one sent by another caller, none of which can displace another.
MAX_CANDIDATES = 3
PARTS_METHODS = ("PutGrad",)   # methods whose handler takes a body as the messages it came in


def param_key(i: int) -> str:
  return f"p{i:05d}"


def stats_key(i: int) -> str:
  return f"s{i:05d}"


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


def _flat_row(tree, w):
  """Worker ``w``'s row of every leaf, raveled and concatenated (one float32 body)."""
  leaves = [x[w].reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  return jnp.concatenate(leaves) if leaves else jnp.zeros([0], jnp.float32)


def _flat(tree):
  leaves = [x.reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(tree)]
  return jnp.concatenate(leaves) if leaves else jnp.zeros([0], jnp.float32)


class ShardError(RuntimeError):
  """A shard cannot go on (an op it cannot apply); the run stops."""


def build_chain(config):
  """The scheme and the sync chain every shard and the control plane build the same way (the
  simulator's: ``base.optim.server_chain``, a local-update scheme's outer optimizer included)."""
  cluster = cluster_lib.cluster_from_config(config)
  scheme = sync.scheme_from_config(config, worker_times=cluster.mean_times)
  return scheme, optim.server_chain(config, scheme)


class ShardCore:
  """Shard ``index``'s state and the ops that change it (thread-safe).

  Args:
    index: s, in ``0..S-1``.
    layout: the run's ``ShardLayout``.
    config: the run's config (the scheme, the optimizer, checkpoints).
    params: this shard's initial tensors, in layout order.
    model_state: shard 0: every statistics leaf, in layout order ([] elsewhere).
    checkpoint_dir: where this shard's Orbax checkpoints go.
  """

  def __init__(self, index: int, layout: layout_lib.ShardLayout, config, params, model_state,
               checkpoint_dir: str):
    self.index, self.layout = index, layout
    self.scheme, tx = build_chain(config)
    self.W, self.R = self.scheme.num_workers, self.scheme.num_replicas
    self.G = self.scheme.make_protocol().num_groups
    self.eval_replica = getattr(self.scheme.make_protocol(), "global_replica", None)
    tree = {param_key(i): jnp.asarray(x) for i, x in zip(layout.leaves(index), params)}
    stats = {stats_key(i): jnp.asarray(x) for i, x in enumerate(model_state)}
    self.state = executor.init_state(tree, stats, tx, None, self.W, self.R,
                                     jax.random.PRNGKey(0))
    self.round_fn = executor.make_round_fn(tx)
    self.put_fn = make_put_fn()
    self.row_fn = jax.jit(lambda state, w: jnp.concatenate(
        [_flat_row(state.worker_params, w), _flat_row(state.worker_model_state, w)]))
    self.served_fn = jax.jit(lambda state: _flat(executor.served_weights(
        state, self.eval_replica)))
    self.checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, config.train.max_checkpoints)
    self.cond = threading.Condition()
    self.ops: collections.deque = collections.deque()
    self.enqueued = 0           # ops received (applied + queued)
    self.applied = 0            # ops applied
    # mesh -> {digest: (grad leaves, stats)}: candidates for its next push, consumed + 1
    self.staged: dict[int, dict[bytes, tuple[list, list]]] = {}
    self.consumed = np.zeros([self.W], np.int64)            # the last push applied per mesh
    self.consumed_digest: dict[int, bytes] = {}             # mesh -> that push's digest
    self.snapshots: dict[int, Any] = {}
    self.saved_steps: set[int] = set()                       # checkpoints on disk
    self._to_save: collections.deque = collections.deque()   # (step, host copy of the state)
    self.error: Exception | None = None
    self.stopped = False
    self._readers = 0           # pulls reading a row of self.state (without the lock)
    self._busy = False          # the applier dispatching an op that donates self.state
    self._thread: threading.Thread | None = None
    self._saver: threading.Thread | None = None

  # -- the state's lifecycle ------------------------------------------------------------------

  def warm_up(self) -> None:
    """Compiles the put, a round, a pull and the served weights on a copy of the state."""
    copy = jax.tree.map(jnp.copy, self.state)
    grads = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), copy.grad_buf)
    stats = jax.tree.map(lambda x: np.zeros(x.shape[1:], x.dtype), copy.worker_model_state)
    copy = self.put_fn(copy, np.int32(0), grads, stats, np.float32(0), np.int32(0))
    args = sync.round_args(self.scheme.make_protocol().new_round(0.0))
    args["learning_rate"] = np.float32(0.0)
    copy = self.round_fn(copy, args)
    jax.block_until_ready((self.row_fn(copy, np.int32(0)), self.served_fn(copy)))

  def restore(self, step: int, seqs) -> None:
    """Loads this shard's checkpoint at ``step`` (the control plane's latest), where the last
    push applied of each mesh was ``seqs[w]``."""
    state, _ = self.checkpointer.restore(step, self.state)
    self.state = jax.device_put(state)
    with self.cond:
      self.consumed = np.asarray(seqs, np.int64).reshape([self.W])
    logging.info("shard %d: restored its tensors at %d pushes", self.index, step)

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name=f"shard{self.index}-ops", daemon=True)
    self._thread.start()
    self._saver = threading.Thread(target=self._save_loop, name=f"shard{self.index}-saver",
                                   daemon=True)
    self._saver.start()

  def stop(self) -> None:
    """Stops applying ops; checkpoints already asked for are still written."""
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
    for thread in (self._thread, self._saver):
      if thread is not None:
        thread.join(timeout=120)
    self.checkpointer.close()

  def _save_loop(self) -> None:
    """The only thread that touches Orbax after the start: writes the state copies, in order."""
    while True:
      with self.cond:
        while not self._to_save and not self.stopped:
          self.cond.wait()
        if not self._to_save:
          return
        step, state = self._to_save.popleft()
      self.checkpointer.save_and_wait(step, state, {"pushes": step, "shard": self.index})
      with self.cond:
        self.saved_steps.add(step)
        self.cond.notify_all()

  # -- gradients in ----------------------------------------------------------------------------

  def check_push(self, w: int, seq: int, body, nnz: int):
    """Checks a push's body for this shard (raises BadMessage); returns its leaves."""
    if not 0 <= w < self.W:
      raise wire.BadMessage(f"mesh={w} is invalid; allowed: 0..{self.W - 1}")
    return self.layout.unpack_push(self.index, body, nnz)

  def stage(self, w: int, seq: int, grads: list, stats: list, digest: bytes = b"") -> None:
    """Keeps mesh ``w``'s checked push ``seq`` under its ``digest`` until the ``put`` op that
    names it; a retry is a no-op.

    Only the mesh's next push is taken (``consumed + 1``; or the last applied, again, with the
    same digest: a retry); another number is refused, and so is a further candidate past
    :data:`MAX_CANDIDATES`, without touching what is staged (``wire.BadMessage``,
    ``wire.Refused``).
    """
    with self.cond:
      if seq == self.consumed[w] and digest == self.consumed_digest.get(w):
        return   # a retry of the push last applied
      expected = int(self.consumed[w]) + 1
      if seq != expected:
        raise wire.BadMessage(f"shard {self.index}: push {seq} of mesh {w} is out of order; "
                              f"expected {expected}")
      held = self.staged.setdefault(w, {})
      if digest in held:
        return   # a retry of a staged slice
      if len(held) >= MAX_CANDIDATES:
        raise wire.Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"shard {self.index}: {len(held)} different slices are staged for "
                           f"push {seq} of mesh {w} already; allowed: {MAX_CANDIDATES}")
      held[digest] = (grads, stats)

  # -- ops ------------------------------------------------------------------------------------

  def enqueue(self, first: int, ops: list[dict]) -> int:
    """Queues ops numbered ``first, first + 1, ...``; those already received are skipped."""
    with self.cond:
      if first > self.enqueued:
        raise wire.BadMessage(f"ops from {first} leave a gap after {self.enqueued}")
      fresh = ops[self.enqueued - first:]
      self.ops.extend(fresh)
      self.enqueued += len(fresh)
      if fresh:
        self.cond.notify_all()
      return self.enqueued

  def _run(self) -> None:
    while True:
      with self.cond:
        # A donating op waits for the pulls reading the state; a copy does not.
        while not self.stopped and (not self.ops or (
            self.ops[0]["k"] not in _COPIES and self._readers)):
          self.cond.wait()
        if self.stopped:
          return
        op = self.ops.popleft()
        state = self.state
        donates, taken = op["k"] not in _COPIES, None
        if donates:
          try:
            taken = self._consume(op)   # a put's staged slice, under the lock
          except Exception as e:  # pylint: disable=broad-except  (reported to every waiter)
            self._applied(op, e)
            return
          self._busy = True
      # Outside the lock: a put's or a round's dispatch (no pull reads the state it donates:
      # they wait for _busy), or a snapshot's or a checkpoint's host copy (pulls read it too,
      # stages and enqueues go on).
      try:
        result, error = (self._dispatch(op, state, taken) if donates
                         else self._copy(op, state)), None
      except Exception as e:  # pylint: disable=broad-except  (reported to every waiter)
        result, error = None, e
      with self.cond:
        if donates:
          self._busy = False
          if error is None:
            self.state = result
        elif error is None:
          error = _error_of(lambda: self._keep(op, state, result))
        if not self._applied(op, error):
          return

  def _applied(self, op: dict, error: Exception | None) -> bool:
    """Counts ``op`` as applied (under ``self.cond``); False if it failed with ``error`` (the
    shard stops, and every waiter is told)."""
    if error is not None:
      logging.error("shard %d cannot apply op %d (%s)", self.index, self.applied, op.get("k"),
                    exc_info=error)
      self.error = error if isinstance(error, ShardError) else ShardError(
          f"shard {self.index} failed at op {self.applied}: {error}")
      self.stopped = True
      self.cond.notify_all()
      return False
    self.applied += 1
    self.cond.notify_all()
    return True

  def _copy(self, op: dict, state):
    """The host copy a ``snap`` or ``save`` op takes of ``state`` (without the lock)."""
    if op["k"] == "snap":
      return jax.device_get((self.served_fn(state), state.loss_sum, state.loss_count,
                             state.push_bytes))
    return jax.tree.map(np.array, state)

  def _keep(self, op: dict, state, copy) -> None:
    """Keeps a ``snap``'s or ``save``'s host copy (under the lock); a snap restarts the sums."""
    if op["k"] == "snap":
      self.snapshots[op["id"]] = copy
      self.state = state.replace(loss_sum=jnp.zeros([], jnp.float32),
                                 loss_count=jnp.zeros([], jnp.int32),
                                 push_bytes=executor.zero_push_bytes(self.W))
    else:   # the saver thread writes it
      self._to_save.append((op["step"], copy))

  def _consume(self, op: dict):
    """Checks ``op`` (a ``put``, a ``round`` or a ``noop``); a ``put``'s staged slice
    ``(grads, stats)`` is taken and returned (under ``self.cond``; raises ShardError). The op
    itself is not changed: the control plane's other shards' links send the same dict."""
    kind = op["k"]
    if kind == "put":
      w, seq, digest = op["w"], op["seq"], op["d"][self.index]
      held = self.staged.get(w, {})
      if seq != self.consumed[w] + 1 or digest not in held:
        raise ShardError(f"shard {self.index}: push {seq} of mesh {w} was never staged here "
                         "with the digest the mesh sent")
      del self.staged[w]   # the other candidates (a stranger's, a restarted mesh's) go too
      self.consumed[w], self.consumed_digest[w] = seq, digest
      return held[digest]
    if kind not in ("round", "noop"):
      raise ShardError(f"unknown op {kind!r}")
    return None

  def _dispatch(self, op: dict, state, taken):
    """The state after ``op`` (``taken``: what :meth:`_consume` returned), dispatched, not
    waited for; ``state`` is donated (no lock: only the applier runs it, while no pull reads
    ``state``)."""
    kind = op["k"]
    if kind == "put":
      grads, stats = taken
      tree = {param_key(i): g for i, g in zip(self.layout.leaves(self.index), grads)}
      stats_tree = {stats_key(i): x for i, x in enumerate(stats)}
      return self.put_fn(state, np.int32(op["w"]), tree, stats_tree,
                         np.float32(op["loss"]), np.int32(op["bytes"]))
    if kind == "round":
      args = dict(op["args"])
      args["learning_rate"] = np.float32(op["lr"])
      return self.round_fn(state, args)
    return state

  def _wait(self, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
      if self.error is not None:
        raise wire.Refused(grpc.StatusCode.INTERNAL, str(self.error))
      left = deadline - time.monotonic()
      if left <= 0 or self.stopped:
        raise wire.Refused(grpc.StatusCode.UNAVAILABLE,
                           f"shard {self.index}: {what} not reached within {timeout:g} s")
      self.cond.wait(timeout=min(left, 1.0))

  # -- weights out ----------------------------------------------------------------------------

  def pull(self, w: int, watermark: int, timeout: float) -> list[np.ndarray]:
    """Worker ``w``'s weights (and statistics on shard 0) once ``watermark`` ops are applied.

    Returns:
      the row as a pull body: one float32 view per tensor (``layout.segments``).
    """
    if not 0 <= w < self.W:
      raise wire.BadMessage(f"mesh={w} is invalid; allowed: 0..{self.W - 1}")
    with self.cond:
      self._wait(lambda: self.applied >= watermark and not self._busy, timeout, f"op {watermark}")
      state = self.state
      self._readers += 1   # the applier donates no state while a pull reads it (module doc)
    try:   # without the lock: the row, a buffer of its own, computed from the state
      row = self.row_fn(state, np.int32(w))
      row.block_until_ready()
    finally:
      with self.cond:
        self._readers -= 1
        self.cond.notify_all()
    # Its copy to the host reads the row alone: ops and other pulls go on meanwhile.
    return self.layout.segments(self.index, np.asarray(row))

  def snapshot(self, snap_id: int, timeout: float) -> tuple[np.ndarray, dict]:
    """The served weights of snapshot ``snap_id`` (flat) and, on shard 0, its loss sums."""
    with self.cond:
      self._wait(lambda: snap_id in self.snapshots, timeout, f"snapshot {snap_id}")
      served, loss_sum, loss_count, pushed = self.snapshots.pop(snap_id)
    return np.asarray(served), {"loss_sum": float(loss_sum), "loss_count": int(loss_count),
                                "push_bytes": executor.push_bytes_total(pushed).tolist()}

  def saved(self, step: int, timeout: float) -> None:
    """Returns once the checkpoint at ``step`` is on disk."""
    with self.cond:
      self._wait(lambda: step in self.saved_steps, timeout, f"the save at {step}")

  # -- ops from the network -------------------------------------------------------------------

  def decode_ops(self, data: np.ndarray | None) -> list[dict]:
    """Ops from an ``Ops`` call's body, every field checked (raises BadMessage)."""
    if data is None:
      return []
    try:
      raw = msgpack.unpackb(data.tobytes(), raw=False, strict_map_key=True)
    except Exception as e:  # pylint: disable=broad-except
      raise wire.BadMessage(f"ops are not valid msgpack ({type(e).__name__})") from None
    if not isinstance(raw, list) or len(raw) > MAX_OPS_PER_CALL:
      raise wire.BadMessage(f"ops must be a list of at most {MAX_OPS_PER_CALL}")
    return [self._check_op(op) for op in raw]

  def _check_op(self, op) -> dict:
    if not isinstance(op, dict):
      raise wire.BadMessage("an op must be a map")
    kind = wire.field(op, "k", str)
    if kind == "put":
      digests = wire.field(op, "d", list)
      if len(digests) != self.layout.num_shards or not all(
          isinstance(d, bytes) and len(d) in (0, wire.DIGEST_BYTES) for d in digests):
        raise wire.BadMessage(f"a put op's digests are invalid; allowed: one per shard "
                              f"({self.layout.num_shards}), each empty or "
                              f"{wire.DIGEST_BYTES} bytes")
      return {"k": kind, "w": wire.field(op, "w", int, 0, self.W - 1),
              "seq": wire.field(op, "seq", int, 1), "loss": wire.field(op, "loss", float),
              "bytes": wire.field(op, "bytes", int, 0, 2**31 - 1), "d": digests}
    if kind == "round":
      return {"k": kind, "args": decode_round(wire.field(op, "args", dict), self.W, self.R,
                                              self.G),
              "lr": wire.field(op, "lr", float)}
    if kind in ("snap", "save"):
      name = "id" if kind == "snap" else "step"
      return {"k": kind, name: wire.field(op, name, int, 0)}
    if kind == "noop":
      return {"k": kind}
    raise wire.BadMessage(f"op kind {kind!r} is invalid; allowed: put, round, snap, save, noop")


def encode_round(args: dict) -> dict:
  """A round's args as plain lists (the ``round`` op's wire form)."""
  return {k: np.asarray(args[k]).tolist() for k in ROUND_FIELDS}


def decode_round(args: dict, W: int, R: int, G: int) -> dict:
  """Round args from their wire form, each field's dtype and length checked."""
  sizes = {"arrived": W, "pulls": W, "groups": W, "applies": R, "forward": G, "deliver": G,
           "aggregate": None, "adopt": R, "average": R, "stats_mean": R, "adopt_weight": R}
  out = {}
  for name, dtype in ROUND_FIELDS.items():
    value = args.get(name)
    size = sizes[name]
    try:
      array = np.asarray(value)
    except Exception:  # pylint: disable=broad-except
      raise wire.BadMessage(f"round field {name} is invalid") from None
    if (array.shape != (() if size is None else (size,))
        or (dtype is bool and array.dtype != bool)
        or (dtype is np.float32 and (array.dtype.kind != "f" or array.size and not (
            np.all(np.isfinite(array)) and array.min() >= 0 and array.max() <= 1)))
        or (dtype is np.int32 and (array.dtype.kind != "i" or array.size and (
            array.min() < -1 or array.max() > 1 << 20)))):
      allowed = " in [0, 1]" if dtype is np.float32 else ""
      raise wire.BadMessage(f"round field {name} has shape {array.shape} and dtype "
                            f"{array.dtype}; allowed: {dtype.__name__}{allowed} of shape "
                            f"{() if size is None else (size,)}")
    out[name] = array.astype(dtype)
  return out


# -- a remote shard's service ------------------------------------------------------------------


class ShardService:
  """The gRPC methods of a shard process (shards 1..S-1; shard 0 lives in the control plane).

  ``PutGrad`` (a mesh stages its slice; the reply is a receipt), ``Pull`` (a
  mesh's weights at a watermark), ``Ops`` (the control plane's op stream),
  ``Snapshot`` and ``Saved`` (the control plane's evaluations and
  checkpoints).
  """

  def __init__(self, core: ShardCore, credentials: auth.Credentials, session: str,
               wait_timeout: float):
    self.core, self.credentials, self.session = core, credentials, session
    self.wait_timeout = wait_timeout
    self.last_call = time.monotonic()
    self.stop = threading.Event()   # set by the server's Stop (after its final checkpoint)

  def _session(self, header: dict) -> None:
    self.last_call = time.monotonic()
    if wire.field(header, "session", str) != self.session:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         "the run's session changed (the server restarted); rejoin")

  def methods(self) -> list[wire.Method]:
    layout, s = self.core.layout, self.core.index
    push_limit = lambda h: layout.push_limit(s, wire.field(h, "nnz", int, -1,
                                                           layout.grad_size(s)))
    return [
        wire.Method("PutGrad", self.put_grad, push_limit, parts="PutGrad" in PARTS_METHODS),
        wire.Method("Pull", self.pull),
        wire.Method("Ops", self.ops, lambda h: wire.MAX_MESSAGE_BYTES),
        wire.Method("Snapshot", self.snapshot),
        wire.Method("Saved", self.saved),
        wire.Method("Stop", self.stop_call),
    ]

  def put_grad(self, header, body, peer):
    del peer
    self._session(header)
    w = wire.field(header, "mesh", int, 0, self.core.W - 1)
    seq = wire.field(header, "seq", int, 1)
    nnz = wire.field(header, "nnz", int, -1)
    grads, stats = self.core.check_push(w, seq, body, nnz)
    digest = wire.digest(body)
    self.core.stage(w, seq, grads, stats, digest)
    size = wire.body_bytes(body)
    return {"receipt": self.credentials.receipt(self.core.index, w, seq, self.session, size,
                                                digest)}, None

  def pull(self, header, body, peer):
    del body, peer
    self._session(header)
    w = wire.field(header, "mesh", int, 0, self.core.W - 1)
    watermark = wire.field(header, "watermark", int, 0)
    return {}, self.core.pull(w, watermark, self.wait_timeout)

  def ops(self, header, body, peer):
    del peer
    self._session(header)
    first = wire.field(header, "first", int, 0)
    return {"enqueued": self.core.enqueue(first, self.core.decode_ops(body))}, None

  def snapshot(self, header, body, peer):
    del body, peer
    self._session(header)
    served, sums = self.core.snapshot(wire.field(header, "id", int, 0), self.wait_timeout)
    return sums, served

  def saved(self, header, body, peer):
    del body, peer
    self._session(header)
    self.core.saved(wire.field(header, "step", int, 0), self.wait_timeout)
    return {}, None


  def stop_call(self, header, body, peer):
    del body, peer
    self._session(header)
    self.stop.set()
    return {}, None


def checkpoint_dir(workdir: str, index: int) -> str:
  """Shard ``index``'s Orbax checkpoints (the control plane's are in ``workdir/checkpoints``)."""
  return os.path.join(workdir, "shards", f"shard{index}")


# Ops whose work is a host copy of the state, taken outside ``ShardCore.cond``.
_COPIES = ("snap", "save")


def _error_of(call) -> Exception | None:
  """Runs ``call``; the exception it raised, or None."""
  try:
    call()
  except Exception as e:  # pylint: disable=broad-except  (reported to every waiter)
    return e
  return None
