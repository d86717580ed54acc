"""A tiny tuned sweep (2 schemes x 2 rates x 2 seeds, 512 examples): checks ``experiments.reproduce``.

  python -m experiments.reproduce --only=tiny --out=/tmp/reproduce_tiny

Seconds per trial on a 2-core CPU (2 epochs of 512 examples on a 4-worker smoke cluster); the
target, 30 % test accuracy, is one these runs reach, so the claims table has speedups in it.
"""

from configs import mnist_lenet5
from gssp_jax.sweep import product, sweep, tune

TARGET = 0.3


def get_config():
  c = mnist_lenet5.get_config("smoke")
  c.data.train_size, c.data.test_size = 512, 200
  c.train.num_epochs = 2.0
  c.train.eval_every = 0.25
  c.train.target_accuracy = TARGET
  c.cluster.profile = "tiers"
  c.cluster.tiers = (1.0, 2.0)
  c.sync.num_groups = 2
  return c


def get_sweep():
  return product(sweep("sync.scheme", ["bsp", "gssp"]),
                 tune("optimizer.learning_rate", [0.1, 0.2]), sweep("seed", [0, 1]))
