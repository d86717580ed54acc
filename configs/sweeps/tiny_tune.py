"""A tiny tuned sweep (2 schemes x 2 rates x 2 seeds, 512 examples): checks ``experiments.reproduce``.

  python -m experiments.reproduce --only=tiny --out=/tmp/reproduce_tiny

Seconds per trial on a 2-core CPU (2 epochs of 512 examples on a 4-worker smoke cluster); the
target, 30 % test accuracy, is one these runs reach, so the claims table has speedups in it.
"""

from configs.sweeps import tiny
from gssp_jax.studies.sweep import product, sweep, tune

TARGET = 0.3


def get_config():
  c = tiny.get_config()   # its smoke cluster: 4 workers in 2 tiers, 2 epochs
  c.data.train_size = 512
  c.train.target_accuracy = TARGET
  return c


def get_sweep():
  return product(sweep("sync.scheme", ["bsp", "gssp"]),
                 tune("optimizer.learning_rate", [0.1, 0.2]), sweep("seed", [0, 1]))
