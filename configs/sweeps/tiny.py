"""A tiny sweep (2 schemes x 2 seeds on a 4-worker smoke cluster): checks the sweep machinery.

  python -m experiments.sweep --sweep=configs/sweeps/tiny.py --workdir=/tmp/sweep_tiny

About 1 minute on a 2-core CPU.
"""

from configs import mnist_lenet5
from gssp_jax.sweep import product, sweep


def get_config():
  c = mnist_lenet5.get_config("smoke")
  c.data.train_size, c.data.test_size = 1024, 200
  c.train.num_epochs = 1.0
  c.train.eval_every = 0.5
  c.cluster.profile = "tiers"
  c.cluster.tiers = (1.0, 2.0)
  c.sync.num_groups = 2
  return c


def get_sweep():
  return product(sweep("sync.scheme", ["bsp", "gssp"]), sweep("seed", [0, 1]))
