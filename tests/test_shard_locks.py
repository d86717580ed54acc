"""A shard's lock is held for bookkeeping only (``runtime/shard.py``'s concurrency notes).

A pull whose copy to the host is slow (a large row, a busy host) must not hold another mesh's
push: its slice is staged, its ``put`` applied and its own pull answered meanwhile. Before, the
shard's lock was held across a pull's device-to-host read, and every other call waited on it.
"""

import threading
import time

import jax
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import shard as shard_lib

import helpers

TIMEOUT = 30.0   # seconds any step may take before the test fails instead of hanging


class _SlowRow:
  """A row whose copy to the host waits for ``release`` (and says it started)."""

  def __init__(self, row, started: threading.Event, release: threading.Event):
    self.row, self.started, self.release = row, started, release

  def block_until_ready(self):
    self.row.block_until_ready()
    return self

  def __array__(self, dtype=None, copy=None):
    self.started.set()
    assert self.release.wait(TIMEOUT), "the slow pull was never released"
    return np.asarray(self.row, dtype=dtype)


def _core(tmp_path) -> shard_lib.ShardCore:
  config = config_lib.override(helpers.cluster_config("asp", None, num_workers=2),
                               {"executor": "dist"})
  params = {"b": np.zeros([3], np.float32), "w": np.ones([4, 3], np.float32)}
  layout = layout_lib.ShardLayout.balanced(params, {}, 1)
  core = shard_lib.ShardCore(0, layout, config, jax.tree.leaves(params), [], str(tmp_path))
  core.warm_up()
  return core


def test_a_slow_pull_does_not_hold_another_meshs_push(tmp_path):
  core = _core(tmp_path)
  started, release = threading.Event(), threading.Event()
  real_row = core.row_fn
  core.row_fn = lambda state, w: (_SlowRow(real_row(state, w), started, release) if int(w) == 0
                                  else real_row(state, w))
  core.start()
  slow, other = {}, {}

  def slow_pull():
    slow["row"] = core.pull(0, 0, timeout=TIMEOUT)

  def other_mesh():   # mesh 1 pushes (stage, then its put op) and pulls the result
    grads = [np.full([3], 2.0, np.float32), np.full([4, 3], 2.0, np.float32)]
    core.stage(1, 1, grads, [], b"")
    core.enqueue(0, [{"k": "put", "w": 1, "seq": 1, "loss": 0.5, "bytes": 60, "d": [b""]}])
    other["row"] = core.pull(1, 1, timeout=TIMEOUT)

  a = threading.Thread(target=slow_pull, daemon=True)
  b = threading.Thread(target=other_mesh, daemon=True)
  try:
    a.start()
    assert started.wait(TIMEOUT), "the slow pull never reached its copy to the host"
    b.start()
    b.join(TIMEOUT)
    assert not b.is_alive(), "mesh 1's push and pull waited behind mesh 0's slow pull"
    assert a.is_alive() and "row" not in slow   # mesh 0's copy is still under way
    assert core.applied == 1 and int(core.consumed[1]) == 1
  finally:
    release.set()
    a.join(TIMEOUT)
    core.stop()
  assert not a.is_alive() and "row" in slow
  # Mesh 0 read the weights at op 0: the initial ones (no later op leaked into its row).
  np.testing.assert_array_equal(np.concatenate([np.ravel(x) for x in slow["row"]]),
                                np.concatenate([np.zeros(3), np.ones(12)]).astype(np.float32))


def test_the_servers_lock_never_waits_for_shard_0s_lock(tmp_path):
  """What the server sends shard 0 under ``server.lock`` (a push's slice, then its ops) only
  joins the link's outbox: it returns while another thread holds the shard's lock, and the
  shard applies it, in order, once that lock is free. A slice the shard refuses ends the link
  (its failure names it), as a failed remote shard does."""
  from gssp_jax.runtime import shard_links  # pylint: disable=g-import-not-at-top
  core = _core(tmp_path)
  core.start()
  link = shard_links.LocalShard(core)
  grads = [np.full([3], 2.0, np.float32), np.full([4, 3], 2.0, np.float32)]
  sent = threading.Event()

  def server_side():   # what a Push does under server.lock
    link.stage(1, 1, grads, [])
    link.send(0, {"k": "put", "w": 1, "seq": 1, "loss": 0.5, "bytes": 60, "d": [b""]})
    sent.set()

  try:
    with core.cond:   # the shard busy in its own bookkeeping
      thread = threading.Thread(target=server_side, daemon=True)
      thread.start()
      assert sent.wait(TIMEOUT), "the server's side waited for the shard's lock"
      assert core.enqueued == 0 and 1 not in core.staged   # nothing handed over yet
    core.pull(1, 1, timeout=TIMEOUT)   # answered once the slice and the put reach the shard
    assert core.applied == 1 and int(core.consumed[1]) == 1 and link.failure() is None
    link.stage(1, 5, grads, [])   # out of order: the shard refuses it
    deadline = time.monotonic() + TIMEOUT
    while link.failure() is None and time.monotonic() < deadline:
      time.sleep(0.01)
    assert "shard 0 refused a stage from the server" in (link.failure() or ""), link.failure()
  finally:
    link.close()
  assert not link._thread.is_alive()   # pylint: disable=protected-access
