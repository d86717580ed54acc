"""Learning-rate ablation on the reduced ResNet-18/CIFAR-10 sweep: is GSSP's failure the rate?

  python -m experiments.sweep --sweep=configs/sweeps/cifar10_resnet18_lr.py \\
      --workdir=/tmp/cifar10_resnet18_lr --parallel=2
  python -m experiments.report /tmp/cifar10_resnet18_lr --out=results/cifar10_resnet18_lr \\
      --target=0.35   # nothing reaches the sweep's 50 % in 4 epochs

In ``paper_cifar10_resnet18.py`` (reduced) GSSP's training loss jumped during
the 1-epoch warm-up towards SGD 0.1 and it ended 27 pp below BSP (2026-11-21;
20.85 pp after the fixes of issue 11). The same
cluster, model, data and 4 epochs here, for BSP and GSSP alike, with smaller
peak learning rates (0.01 and 0.03) reached over a 2-epoch warm-up: if GSSP
then trains as well as BSP, the learning rate, not the scheme, caused it.
4 trials, seed 0; 18 min on a 2-core CPU with --parallel=2 (after the fixes;
before them 29 min one trial at a time, beside another run; docs/REPRODUCTION.md).
"""

from configs.sweeps import paper_cifar10_resnet18 as resnet_sweep
from gssp_jax.studies.sweep import product, sweep


def get_config():
  c = resnet_sweep.get_config()
  c.optimizer.warmup_epochs = 2.0
  return c


def get_sweep():
  return product(sweep("optimizer.learning_rate", [0.01, 0.03]),
                 sweep("sync.scheme", ["bsp", "gssp"]), sweep("seed", [0]))
