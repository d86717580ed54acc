"""``benchmarks/dist_transport.py`` runs on tiny payloads, so it cannot rot unnoticed."""

import jax
import numpy as np
import pytest

from benchmarks import dist_transport as bench
from gssp_jax.runtime import wire

TINY = ([jax.ShapeDtypeStruct((300, 100), np.float32), jax.ShapeDtypeStruct((10,), np.float32)],
        [jax.ShapeDtypeStruct((4,), np.float32)])   # 120 KB: streamed in 32 KiB chunks below


def test_every_exchange_moves_the_payload_and_the_chunk_size_is_restored():
  before = (wire.CHUNK_BYTES, wire.MAX_MESSAGE_BYTES, list(wire.CHANNEL_OPTIONS))
  r = bench.measure_exchanges("lenet5", rounds=1, reps=2, chunk_bytes=32 << 10, shapes=TINY)
  assert r["n"] == 2 and all(r[v] > 0 and r["cpu"][v] >= 0
                            for v in ("raw unary", "raw unary + header", "raw stream", "wire",
                                      "wire flight"))
  assert r["payload"].push_bytes == 4 * (300 * 100 + 10 + 4) == r["payload"].pull_bytes
  assert (wire.CHUNK_BYTES, wire.MAX_MESSAGE_BYTES, list(wire.CHANNEL_OPTIONS)) == before
  steps = bench.local_steps_ms(r["payload"], reps=1)
  assert all(ms >= 0 for ms in steps.values())


@pytest.mark.slow
def test_a_control_plane_a_shard_and_a_mesh_push_through_the_runtime():
  r = bench.measure_run("lenet5", num_servers=2, num_meshes=1, seconds=0.5, warmup=0.2)
  assert r["pushes"] > 0 and r["rate"] > 0
  assert set(r["cpu_per_push"]) == {"control plane + shard 0", "shards 1..S-1", "meshes"}
