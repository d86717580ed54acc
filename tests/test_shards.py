"""Sharded parameter servers: S shards reproduce the simulator bit for bit, for every S.

The simulator runs a config with its timeline recorded; the same events then
drive the real runtime's control plane, S parameter shards (the shard role's
own code, served over gRPC on loopback with the run's token) and the meshes'
own gradient, compressor and packing code (``dist_replay``). After the last
event every shard's tensors of every replica, worker and optimizer state, and
shard 0's statistics and loss sums, must equal the simulator's bit for bit,
for S = 1 and 4 (GSSP with GDTopK also 2; BatchNorm with top-k and Adam 2 and 4; the
local-update schemes S = 2); and the staleness, updates and bytes per link counted by
the control plane must equal the simulator's exactly. Shard bodies go over Arrow
Flight (``dist.data_plane``' default) in most cases, gRPC streams in ``GRPC_CASES``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_replay
from configs import mnist_lenet5_hetero
from gssp_jax import config as config_lib
from gssp_jax import models
from gssp_jax.runtime import flight
from gssp_jax.runtime import wire

# Every scheme the runtime runs, each once; compression (GDTopK, DGC, top-k) and BatchNorm on
# some of them; S = 1 and 4 shards each, and 2 where noted in the test.
CASES = {
    "bsp": {"sync.scheme": "bsp"},
    "ssp": {"sync.scheme": "ssp"},
    "dssp": {"sync.scheme": "dssp"},
    "inhad": {"sync.scheme": "inhad", "sync.num_nodes": 2},
    "gssp-global": {"sync.scheme": "gssp", "sync.num_groups": 2, "sync.inter_group": "global"},
    "gssp-peer-gdtopk": {"sync.scheme": "gssp", "sync.num_groups": 2, "compress.name": "gdtopk"},
    "asp-dgc": {"sync.scheme": "asp", "compress.name": "dgc", "compress.ratio": 0.05},
    # BatchNorm (the model below: 8 tensors, 2 of statistics) with the global server's
    # statistics mean and adoption, a top-k compressor, and Adam at the replicas.
    "bn-gssp-global-topk-adam": {"sync.scheme": "gssp", "sync.num_groups": 2,
                                 "sync.inter_group": "global", "model": "tiny_bn",
                                 "compress.name": "topk", "compress.ratio": 0.1,
                                 "optimizer.name": "adam", "optimizer.learning_rate": 1e-3,
                                 "optimizer.weight_decay": 0.0},
    # Local-update schemes: each mesh's H_w inner steps with its own inner optimizer state.
    "diloco": {"sync.scheme": "diloco", "local.steps": 3, "local.optimizer.name": "adamw",
               "local.optimizer.learning_rate": 1e-3, "optimizer.learning_rate": 0.7,
               "optimizer.nesterov": True, "optimizer.weight_decay": 0.0,
               "train.num_epochs": 6.0},
    "async-local-dylu-dn-gdtopk": {"sync.scheme": "async_local_sgd", "local.steps": 4,
                                   "local.dylu": True, "local.delayed_nesterov": 4,
                                   "local.optimizer.momentum": 0.9,
                                   "optimizer.nesterov": True, "optimizer.weight_decay": 0.0,
                                   "compress.name": "gdtopk", "train.num_epochs": 6.0},
    # HALoS: 2 local servers with their Delayed Nesterov, the global server's exchanges and the
    # weighted merge (adopt_weight), DyLU.
    "halos": {"sync.scheme": "halos", "sync.num_groups": 2, "sync.forward_every": 2,
              "local.steps": 2, "local.dylu": True, "local.halos.local_period": 2,
              "optimizer.nesterov": True, "optimizer.weight_decay": 0.0,
              "optimizer.learning_rate": 0.3, "optimizer.momentum": 0.5,
              "train.num_epochs": 8.0},
}


LOCAL_CASES = ("diloco", "async-local-dylu-dn-gdtopk", "halos")
GRPC_CASES = ("bsp", "bn-gssp-global-topk-adam")   # dist.data_plane='grpc'; Flight for the rest


class TinyBN(nn.Module):
  """conv3x3(4) -> BatchNorm -> ReLU -> pool -> dense: a BatchNorm model that compiles fast."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(4, (3, 3), strides=(2, 2))(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.avg_pool(x, (4, 4), strides=(4, 4)).reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes)(nn.relu(nn.Dense(16)(x))).astype(jnp.float32)


class _Inner:
  """A one-worker state's inner optimizer state (a ``[1, ...]`` row) as a field to compare."""

  def __init__(self, tree):
    self.state = jax.tree.map(lambda x: x[0], tree)


@pytest.fixture(autouse=True)
def flight_calls(monkeypatch):
  """Bodies over 256 bytes (not 4 MiB) take the large-body path: Flight (``dist.data_plane``,
  the default), or gRPC streams for the cases in GRPC_CASES; smaller ones (a shard holding a
  bias) stay unary. Returns the list of the Flight calls' method names."""
  monkeypatch.setattr(wire, "CHUNK_BYTES", 256)
  calls, call = [], flight.Link.call

  def counted(self, name, *args, **kwargs):
    calls.append(name)
    return call(self, name, *args, **kwargs)
  monkeypatch.setattr(flight.Link, "call", counted)
  return calls


@pytest.fixture(autouse=True)
def _tiny_bn_model(monkeypatch):
  """The model above under the name ``tiny_bn`` for this file's runs (all in this process)."""
  monkeypatch.setitem(models._REGISTRY, "tiny_bn", TinyBN)   # pylint: disable=protected-access


def _config(data_dir, changes):
  config = mnist_lenet5_hetero.get_config("smoke")
  config.data_dir = data_dir
  # A tiny CNN (helpers.TinyCNN, 4 tensors): bit-equality does not depend on the model, and
  # LeNet-5's compilations were most of this file's time.
  base = {"num_workers": 4, "model": "helpers:TinyCNN", "cluster.tiers": (1.0, 3.0),
          "data.train_size": 256,
          "data.test_size": 50, "train.num_epochs": 3.0, "train.eval_every": 3.0}
  return config_lib.override(config, {**base, **changes})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_shards_reproduce_the_simulator_bit_for_bit(case, data_dir, tmp_path, flight_calls):
  config = _config(data_dir, CASES[case])
  plane = "grpc" if case in GRPC_CASES else "flight"
  config = config_lib.override(config, {"dist.data_plane": plane})
  sim = dist_replay.simulate_events(config, str(tmp_path / "sim"))
  assert sim.completed() and sim.engine.num_pushes >= 16
  meshes = dist_replay.make_meshes(config)
  # S = 2 as well where a shard holds statistics and compressed slices of several tensors; one
  # and four shards for the rest (each S is a whole real run: the replay is a third of a case).
  # The local-update cases add only what is theirs (the jobs, the inner state, the outer chain,
  # HALoS's merge weight on the wire): one run with a local and a remote shard (S = 2). The
  # BatchNorm case adds the statistics' shard and Adam's state: S = 2 and 4 (all on the
  # control plane, S = 1, is the same path for it as for the seven other cases that run it).
  if case == "gssp-peer-gdtopk":
    servers = (1, 2, 4)
  elif case == "bn-gssp-global-topk-adam":
    servers = (2, 4)
  else:
    servers = (2,) if case in LOCAL_CASES else (1, 4)
  for num_servers in servers:
    run = dist_replay.RealRun(config, str(tmp_path / f"real{num_servers}"), num_servers, meshes)
    try:
      run.replay(sim.engine.events)
      # The meshes' shard links carried their bodies over the configured data plane.
      if num_servers > 1:
        assert {"PutGrad", "Pull"} <= set(flight_calls) if plane == "flight" else not flight_calls
      srv = run.srv
      assert srv.S == num_servers
      bad = []
      for s, core in enumerate(run.cores()):
        want = dist_replay.expected_shard_state(sim.state, srv.treedefs[0], srv.treedefs[1],
                                                srv.layout, s)
        bad += [f"shard {s}/{num_servers}: {d}" for d in dist_replay.differences(core.state, want)]
      # Each mesh's inner optimizer state (local-update schemes) is the simulator's row, after
      # the same jobs.
      run.compute_dispatched(sim.book.host["jobs"])
      for w, mesh in enumerate(run.meshes):
        want = jax.tree.map(lambda x, w=w: x[w], sim.state.inner_state)
        bad += [f"mesh {w}: {d}" for d in dist_replay.differences(
            _Inner(mesh._inner()), {"state": want})]   # pylint: disable=protected-access
      assert not bad, bad[:10]
      # The control plane counts what the simulator counts, exactly.
      assert srv.core.book.acct.summary() == sim.book.acct.summary()
      assert srv.core.book.acct.version.tolist() == sim.book.acct.version.tolist()
      for key in ("rounds", "updates", "server_bytes", "class_bytes"):
        assert srv.core.book.host[key] == sim.book.host[key], key
      np.testing.assert_array_equal(srv.core.book.host["pulls_per_worker"], sim.book.host["pulls_per_worker"])
      if not srv.links.counts_device_pushes:   # InHAD: counted per round, as the simulator does
        np.testing.assert_array_equal(srv.core.book.host["pushed_per_worker"], sim.book.host["pushed_per_worker"])
    finally:
      run.close()
