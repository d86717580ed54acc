"""LeNet-5 on MNIST, 16 simulated workers in four speed tiers (1, 1.5, 2, 3), GSSP with 4 groups.

  python -m experiments.main --config=configs/mnist_lenet5_hetero.py --workdir=/tmp/hetero_gssp
  python -m experiments.main --config=configs/mnist_lenet5_hetero.py --workdir=/tmp/hetero_bsp \\
      --config.sync.scheme=bsp
  python -m experiments.main --config=configs/mnist_lenet5_hetero.py --workdir=/tmp/hetero_dssync \\
      --config.sync.scheme=dssync --config.sync.group_size=4

The cluster: 4 workers each at 1x, 1.5x, 2x and 3x a base iteration time of
10 ms (batch 32), 10 Gb/s links with 0.1 ms latency; GSSP groups by speed,
s = 3, peer exchange every 4 pushes (DS-Sync in groups of 4, as in
docs/REPRODUCTION.md, needs ``--config.sync.group_size=4``). This file sets GSSP's
keys (groups, staleness, peer exchange) and InHAD's ``sync.num_nodes``; a key the
chosen scheme does not read is allowed here because the file sets it for another
scheme, while one given on the command line that the scheme does not read is rejected.
Every scheme uses the same optimizer (SGD 0.05, momentum 0.9, cosine over 8 epochs, each
gradient scaled by 1/16). Full: 8 epochs, 64 s (BSP) to 212 s (HALoS) per scheme on a 2-core
CPU (the README's tour table, 2026-11-27); `--config.train.num_epochs=1` shrinks a run to a
fifth and it still learns. `:smoke`: 2,048 examples, 2 epochs, seconds: it checks that a
scheme runs, not that it learns (a local-update scheme makes one server update there).

The local-update schemes of the README's tour, each with its own optimizers (8 AdamW steps at
1e-3 on every worker, then the server's Nesterov step on the pseudo-gradient), as one arg:
`:diloco`, `:async_local` (Delayed Nesterov every 16 pushes, dynamic local steps), `:halos` (a
local server per speed group, an asynchronous global one); `:diloco,smoke` shrinks one.

  python -m experiments.main --config=configs/mnist_lenet5_hetero.py:diloco \
      --workdir=/tmp/hetero/diloco
"""

from configs import mnist_lenet5
from gssp_jax.defaults import parse_arg


# The local-update presets: each one's keys beyond the base config's.
_LOCAL = {
    "diloco": {"sync.scheme": "diloco"},
    "async_local": {"sync.scheme": "async_local_sgd", "local.dylu": True,
                    "local.delayed_nesterov": 16},
    "halos": {"sync.scheme": "halos", "local.dylu": True, "optimizer.learning_rate": 0.3,
              "optimizer.momentum": 0.5},
}
_LOCAL_COMMON = {"local.steps": 8, "local.optimizer.name": "adamw",
                 "local.optimizer.learning_rate": 1e-3, "optimizer.learning_rate": 0.7,
                 "optimizer.nesterov": True, "optimizer.weight_decay": 0.0}


def get_config(arg=None):
  args = parse_arg(arg, allowed=("smoke", *_LOCAL))
  local = [a for a in _LOCAL if a in args]
  if len(local) > 1:
    raise ValueError(f"config args {', '.join(local)} are invalid together; allowed: one "
                     f"local-update scheme of {', '.join(_LOCAL)}")
  c = mnist_lenet5.get_config("smoke" if "smoke" in args else None)
  c.num_workers = 16
  c.sync.scheme = "gssp"
  c.sync.num_groups = 4
  c.sync.staleness = 3
  c.sync.inter_group = "peer"
  c.sync.num_nodes = 4
  c.cluster.profile = "tiers"
  c.cluster.tiers = (1.0, 1.5, 2.0, 3.0)
  c.cluster.base_time = 0.01
  c.train.target_accuracy = 0.98
  c.train.eval_every = 0.5
  if "smoke" in args:
    c.train.num_epochs = 2.0
  if local:
    c.update_from_flattened_dict({**_LOCAL_COMMON, **_LOCAL[local[0]]})
  return c
