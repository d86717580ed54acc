"""A tiny sweep (2 schemes x 2 seeds on a 4-worker smoke cluster): checks the sweep machinery.

  python -m experiments.sweep --sweep=configs/sweeps/tiny.py --workdir=/tmp/sweep_tiny

15 s on an idle 2-core CPU, its report 3 s more (2026-11-27). 2 epochs of 1,024 examples; the
target, 40 % test accuracy, is one every trial reaches, so the tour's report has times to
target and speedups.
"""

from configs import mnist_lenet5
from gssp_jax.studies.sweep import product, sweep

TARGET = 0.4


def get_config():
  c = mnist_lenet5.get_config("smoke")
  c.data.train_size, c.data.test_size = 1024, 200
  c.train.num_epochs = 2.0
  c.train.eval_every = 0.25
  # The tour's target: one these runs reach (the main job's 0.985 is for 8 full epochs), so
  # the report has a time to target and a speedup. Choose it below where the slowest scheme
  # ends, or recompute any report with `python -m experiments.report DIR --target=X`.
  c.train.target_accuracy = TARGET
  c.cluster.profile = "tiers"
  c.cluster.tiers = (1.0, 2.0)
  c.sync.num_groups = 2
  return c


def get_sweep():
  return product(sweep("sync.scheme", ["bsp", "gssp"]), sweep("seed", [0, 1]))
