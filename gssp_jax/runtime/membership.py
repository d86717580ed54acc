"""Which process holds each mesh: joins, rejoins, heartbeats, and the meshes that go silent.

:class:`Membership` owns the mesh table: the process (``instance``) that holds
each mesh, when it was last heard from, and whether it was told to stop. A
fresh run starts at a barrier (every shard and mesh joined, or
``dist.join_timeout``); a mesh whose process restarted, or that was dropped,
rejoins from its replica's current weights; a mesh silent for
``dist.heartbeat_timeout`` is lost (``ProtocolCore.lose``); a run whose meshes
are all lost for ``dist.all_lost_timeout`` fails.

Concurrency: :meth:`join` and :meth:`check_silent` run under the server's lock
(``server.lock``); :meth:`join` waits on its condition at the start barrier.
:meth:`heartbeat` takes no lock: a heartbeat counts even while the lock is
held (a long round, a checkpoint), so a busy server never drops a live mesh;
it only writes ``last_seen[w]`` of the joined process (a float store).
"""

from __future__ import annotations

import time

from absl import logging
import grpc
import numpy as np

from gssp_jax.runtime import wire


class Membership:
  """The mesh table (see the module docstring).

  Args:
    num_workers: W, the meshes.
    dist: the run's ``config.dist``.
    core: the ``ProtocolCore`` (its protocol, counters, releases).
    shards_ready: ``() -> bool``, every shard serves (the start barrier waits for it).
    changed: the server's lock's condition.
  """

  def __init__(self, num_workers: int, dist, core, shards_ready, changed):
    self.W, self.dist, self.core = num_workers, dist, core
    self.shards_ready, self.changed = shards_ready, changed
    self.instance = [""] * num_workers         # the joined process of each mesh
    self.last_seen = np.full([num_workers], np.inf)   # monotonic seconds of the last sign of life
    self.told_stop = np.zeros([num_workers], bool)
    self.all_lost_since: float | None = None
    self.join_by = np.inf

  def open(self) -> None:
    """Starts the join window (under the lock): a fresh run's barrier ends by ``join_by``."""
    self.join_by = time.monotonic() + float(self.dist.join_timeout)
    self.last_seen[:] = self.join_by - float(self.dist.heartbeat_timeout)   # the first grace

  def stop(self, w: int) -> dict:
    self.told_stop[w] = True
    return {"stop": True}

  def all_stopped(self) -> bool:
    """Every mesh was told to stop, was lost, or never started."""
    core = self.core
    return bool((self.told_stop | ~core.protocol.alive | ~core.book.host["started"]).all())

  def join(self, w: int, instance: str) -> tuple[int, dict] | None:
    """Mesh ``w``'s process joins (under the lock): its ``(push number, job)``, or None when
    the run is done (the caller answers stop)."""
    core = self.core
    if core.done:
      return None
    alive = core.protocol.alive[w]
    if self.instance[w] and self.instance[w] != instance and alive:
      age = time.monotonic() - self.last_seen[w]
      raise wire.Refused(grpc.StatusCode.ALREADY_EXISTS,
                         f"mesh {w} is held by another process (last heard {age:.1f} s ago); "
                         "each --mesh runs once. If that process is gone, the server drops it "
                         f"after dist.heartbeat_timeout={self.dist.heartbeat_timeout} s"
                         " and this one may join then")
    if self.instance[w] == instance and w in core.releases and alive:
      pass   # a retried Join of the joined process: the same answer
    elif not core.book.host["started"][w] and alive:
      self._first_join(w, instance)
    else:
      self._rejoin(w, instance)
    self.last_seen[w] = time.monotonic()
    return core.releases[w]

  def _first_join(self, w: int, instance: str) -> None:
    """The start barrier: a fresh run begins when every shard and mesh has joined (or at
    ``dist.join_timeout``); its clock starts then, so wall time counts training."""
    core, host = self.core, self.core.book.host
    self.instance[w] = instance
    host["started"][w] = True
    self.changed.notify_all()
    while ((not host["started"].all() or not self.shards_ready())
           and time.monotonic() < self.join_by and not core.done
           and host["pushes"] == 0):   # only a fresh run waits
      self.last_seen[w] = time.monotonic()  # waiting here is alive
      self.changed.wait(timeout=0.2)
    if not self.shards_ready():   # not started after all: its retry is a first join again
      host["started"][w] = False
      raise wire.Refused(grpc.StatusCode.UNAVAILABLE, "the parameter shards did not all start "
                         f"within dist.join_timeout={self.dist.join_timeout} s")
    core.start_clock()
    core.releases[w] = (int(host["seq"][w]), core.next_job(w))
    self.changed.notify_all()

  def _rejoin(self, w: int, instance: str) -> None:
    core = self.core
    if not self.shards_ready():
      raise wire.Refused(grpc.StatusCode.UNAVAILABLE, "the parameter shards are not all up yet")
    core.start_clock()               # a resumed session starts at its first rejoin
    now = core.now()
    if core.protocol.alive[w]:         # restarted before its heartbeat ran out
      core.lose(w, now, "restarted")
    self.instance[w] = instance
    core.book.host["started"][w] = True
    host = core.book.host
    host["rejoined"].append({"mesh": w, "time": now, "pushes": int(host["pushes"])})
    logging.info("mesh %d rejoins at %d pushes", w, core.book.host["pushes"])
    core.react(core.protocol.rejoin(w, now), now)
    self.all_lost_since = None

  def heartbeat(self, w: int, instance: str, header: dict, current_session: str) -> dict:
    """A mesh's heartbeat (no lock; see the module docstring): stop, rejoin, or go on."""
    if self.core.done:
      return self.stop(w)
    mine = instance == self.instance[w]
    if mine:
      self.last_seen[w] = time.monotonic()
    session = wire.field(header, "session", str)
    return {"stop": False, "rejoin": bool(session != current_session or not mine
                                          or not self.core.protocol.alive[w])}

  def check_silent(self) -> str | None:
    """Loses the meshes silent for ``dist.heartbeat_timeout`` (under the lock); returns why
    the run must fail when every mesh was lost for ``dist.all_lost_timeout``, else None."""
    core = self.core
    timeout, all_lost = float(self.dist.heartbeat_timeout), float(self.dist.all_lost_timeout)
    now = time.monotonic()
    late = core.protocol.alive & (now - self.last_seen > timeout)
    for w in np.flatnonzero(late):
      core.lose(int(w), core.now(), f"no heartbeat for {timeout:g} s")
    if not core.clock_started or core.protocol.alive.any() or core.done:
      return None
    if self.all_lost_since is None:
      self.all_lost_since = now
      logging.warning("no mesh is alive; the run ends unless one rejoins within %g s "
                      "(dist.all_lost_timeout)", all_lost)
    elif now - self.all_lost_since > all_lost:
      return (f"every mesh was lost and none rejoined within dist.all_lost_timeout="
              f"{all_lost:g} s; the run stopped (its checkpoint lets it resume)")
    return None
