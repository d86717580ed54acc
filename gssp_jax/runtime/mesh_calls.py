"""The meshes' calls to the control plane: ``Join``, ``Push``, ``Heartbeat``, ``Pull``.

:class:`MeshCalls` answers them with the control plane's parts: the mesh table
(``membership.Membership``), the push checks (``push_checks``), the protocol
core (``core.ProtocolCore``), shard 0 in this process and the shards' session
(``shard_links.ShardLinks``). It keeps no state of its own.

Concurrency: each call runs on a gRPC handler thread. A ``Push`` checks its
body (shard 0) without the server's lock, then takes it to check the header
against the mesh table, stage shard 0's slice, run the protocol and emit ops,
and waits for its release on the lock's condition; it reads its weights from
shard 0 without the lock. A ``Heartbeat`` takes no lock
(``Membership.heartbeat``).
"""

from __future__ import annotations

import math
import time
from typing import Callable

from absl import logging
import grpc

from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import push_checks
from gssp_jax.runtime import wire


class MeshCalls:
  """The meshes' gRPC methods (see the module docstring).

  Args:
    config: the run's config; ``config_id``: its id, as every process computes it.
    layout: the parameter layout over the shards; ``pull_bytes``: a mesh's pull.
    core0: shard 0 (``ShardCore``); ``links``: the ``ShardLinks``.
    core: the ``ProtocolCore``; ``members``: the ``Membership``.
    lock, changed: the server's lock and its condition.
    credentials: ``() -> auth.Credentials``.
    at_end: ``(iterations, pushes) -> bool``, the run's end.
    failure: ``() -> str | None``, why the run cannot go on.
  """

  def __init__(self, *, config, config_id: str, layout, pull_bytes: int, core0, links, core,
               members, lock, changed, credentials: Callable, at_end: Callable,
               failure: Callable):
    self.config, self.config_id, self.layout, self.pull_bytes = (config, config_id, layout,
                                                                 pull_bytes)
    self.W = config.num_workers
    self.core0, self.links, self.core, self.members = core0, links, core, members
    self.lock, self.changed = lock, changed
    self.credentials, self.at_end, self.failure = credentials, at_end, failure

  def on_join(self, header, body, peer):
    """A mesh's process starts (fresh run) or rejoins (after a crash, a drop, a server restart)."""
    del body
    w, instance = push_checks.mesh_of(header, self.W)
    if wire.field(header, "config", str) != self.config_id:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                         f"mesh {w}'s config differs from the server's; start every process with"
                         " the same --config and --config.* flags")
    with self.lock:
      answer = self.members.join(w, instance)
      if answer is None:
        return self.members.stop(w), None
      seq, job = answer
    logging.info("mesh %d joined from %s", w, peer)
    return self._reply_with_weights(w, seq, job)

  def _reply_with_weights(self, w: int, seq: int, job: dict):
    """A job reply, with shard 0's slice of the worker's weights at its watermark."""
    body = self.core0.pull(w, job["watermark"], float(self.config.dist.save_timeout))
    with self.lock:
      self.core.book.host["wire_pulled_per_worker"][w] += wire.body_bytes(body)
    shards = [address or "" for address in self.links.addresses()[1:]]
    return {"session": self.links.session, "seq": seq, "shards": shards,
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
        self.core.count_refused("malformed", header.get("mesh"), str(e))
      raise

  def _accept(self, header: dict, body) -> tuple[int, int, dict | None]:
    push = push_checks.parse(header, num_workers=self.W, layout=self.layout,
                             pull_bytes=self.pull_bytes)
    w, seq, core = push.mesh, push.seq, self.core
    if push.nonfinite:
      return w, seq, self._refuse_nonfinite(w, seq, push.nonfinite)
    try:
      grads, stats = self.core0.check_push(w, seq, body, push.nnz[0])
      if not math.isfinite(push.loss):
        raise layout_lib.NonFinite(f"a non-finite loss ({push.loss})")
    except layout_lib.NonFinite as e:
      return w, seq, self._refuse_nonfinite(w, seq, str(e))
    with self.lock:
      if push.session != self.links.session or not core.protocol.alive[w]:
        return w, seq, {"rejoin": True}   # from before a drop or a server restart
      if push.instance != self.members.instance[w]:
        raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"mesh {w} is held by another process; this one must rejoin")
      if core.done:
        return w, seq, self.members.stop(w)
      now = core.now()
      if core.past_budget(now):   # train.virtual_budget: not applied; the run ends before it
        core.end_at_budget()
        return w, seq, self.members.stop(w)
      if seq == core.book.host["seq"][w]:
        core.book.host["refused"]["duplicate"] += 1   # a retry: answered once released, not applied
        return w, seq, None
      push_checks.check_in_order(push, host=core.book.host, waiting=core.waiting,
                                 layout=self.layout, credentials=self.credentials(),
                                 session=self.links.session)
      self.links.stage(w, seq, grads, stats)   # appended to shard 0's link, in order
      self.members.last_seen[w] = time.monotonic()
      core.accept(w, seq, push.loss, push.nbytes, push.wire_bytes, push.digests, now=now)
      if self.at_end(core.iterations(), core.book.host["pushes"]):
        core.finish()
      if core.iterations() >= core.book.host["next_eval"] or core.done:
        self.changed.notify_all()
    return w, seq, None

  def _refuse_nonfinite(self, w: int, seq: int, why: str) -> dict:
    with self.lock:
      return self.core.refuse_nonfinite(w, seq, why, self.config.optimizer.learning_rate)

  def await_release(self, w: int, seq: int, timeout: float | None = None):
    """Waits for mesh ``w``'s release from push ``seq``; the reply with its next job and weights."""
    deadline = None if timeout is None else time.monotonic() + timeout
    core = self.core
    with self.lock:
      while not (core.releases.get(w, (0,))[0] == seq or core.done or self.failure()
                 or not core.protocol.alive[w]):
        if deadline is not None and time.monotonic() > deadline:
          raise TimeoutError(f"mesh {w} was not released from push {seq}")
        self.changed.wait(timeout=0.5)
      if core.done or self.failure():
        return self.members.stop(w), None
      if not core.protocol.alive[w]:
        return {"rejoin": True}, None
      seq, job = core.releases[w]
    return self._reply_with_weights(w, seq, job)

  def on_heartbeat(self, header, body, peer):
    del body, peer
    w, instance = push_checks.mesh_of(header, self.W)
    return self.members.heartbeat(w, instance, header, self.links.session), None

  def on_pull(self, header, body, peer):
    """Shard 0's slice of a worker's weights (the other ranks of a multi-process mesh)."""
    del body, peer
    w = wire.field(header, "mesh", int, 0, self.W - 1)
    if wire.field(header, "session", str) != self.links.session:
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, "the session changed; rejoin")
    return {}, self.core0.pull(w, wire.field(header, "watermark", int, 0),
                               float(self.config.dist.save_timeout))
