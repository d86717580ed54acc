"""Sharded parameter servers: S shards reproduce the simulator bit for bit, for every S.

The simulator runs a config with its timeline recorded; the same events then
drive the real runtime's control plane, S parameter shards (the shard role's
own code, served over gRPC on loopback with the run's token) and the meshes'
own gradient, compressor and packing code (``dist_replay``). After the last
event every shard's tensors of every replica, worker and optimizer state, and
shard 0's statistics and loss sums, must equal the simulator's bit for bit,
for S = 1, 2 and 4; and the staleness, updates and bytes per link counted by
the control plane must equal the simulator's exactly.
"""

import numpy as np
import pytest

import dist_replay
from configs import mnist_lenet5_hetero
from gssp_jax import config as config_lib

CASES = {
    "bsp": {"sync.scheme": "bsp"},
    "asp": {"sync.scheme": "asp"},
    "ssp": {"sync.scheme": "ssp"},
    "dssp": {"sync.scheme": "dssp"},
    "gssp-peer": {"sync.scheme": "gssp", "sync.num_groups": 2},
    "gssp-global": {"sync.scheme": "gssp", "sync.num_groups": 2, "sync.inter_group": "global"},
    "inhad": {"sync.scheme": "inhad", "sync.num_nodes": 2},
    "gssp-gdtopk": {"sync.scheme": "gssp", "sync.num_groups": 2, "compress.name": "gdtopk"},
    "asp-dgc": {"sync.scheme": "asp", "compress.name": "dgc", "compress.ratio": 0.05},
    # BatchNorm (a ResNet-18 at 1/16 width: 42 tensors) with the global server's statistics
    # mean and adoption, and a top-k compressor; Adam at the replicas.
    "bn-gssp-global-topk": {"sync.scheme": "gssp", "sync.num_groups": 2,
                            "sync.inter_group": "global", "model": "resnet18",
                            "model_args": {"width": 0.0625}, "compress.name": "topk",
                            "compress.ratio": 0.1, "optimizer.name": "adam",
                            "optimizer.learning_rate": 1e-3, "optimizer.weight_decay": 0.0},
}


def _config(data_dir, changes):
  config = mnist_lenet5_hetero.get_config("smoke")
  config.data_dir = data_dir
  base = {"num_workers": 4, "cluster.tiers": (1.0, 3.0), "data.train_size": 256,
          "data.test_size": 50, "train.num_epochs": 3.0, "train.eval_every": 3.0}
  return config_lib.override(config, {**base, **changes})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_shards_reproduce_the_simulator_bit_for_bit(case, data_dir, tmp_path):
  config = _config(data_dir, CASES[case])
  sim = dist_replay.simulate_events(config, str(tmp_path / "sim"))
  assert sim.engine.num_pushes == sim.end_pushes >= 16
  meshes = dist_replay.make_meshes(config)
  for num_servers in (1, 2, 4):
    run = dist_replay.RealRun(config, str(tmp_path / f"real{num_servers}"), num_servers, meshes)
    try:
      run.replay(sim.engine.events)
      srv = run.srv
      assert srv.S == num_servers
      bad = []
      for s, core in enumerate(run.cores()):
        want = dist_replay.expected_shard_state(sim.state, srv.treedefs[0], srv.treedefs[1],
                                                srv.layout, s)
        bad += [f"shard {s}/{num_servers}: {d}" for d in dist_replay.differences(core.state, want)]
      assert not bad, bad[:10]
      # The control plane counts what the simulator counts, exactly.
      assert srv.acct.summary() == sim.acct.summary()
      assert srv.acct.version.tolist() == sim.acct.version.tolist()
      for key in ("rounds", "updates", "server_bytes", "local_bytes", "node_push_bytes"):
        assert srv.host[key] == sim.host[key], key
      np.testing.assert_array_equal(srv.host["pulls_per_worker"], sim.host["pulls_per_worker"])
      if not srv.links.counts_device_pushes:   # InHAD: counted per round, as the simulator does
        np.testing.assert_array_equal(srv.host["pushed_per_worker"], sim.host["pushed_per_worker"])
    finally:
      run.close()
