"""VGG-19 (BatchNorm) on CIFAR-10 across schemes on a heterogeneous cluster: reduced or full size.

  # reduced (default): 36 min on a 2-core CPU, sharing it (docs/REPRODUCTION.md)
  python -m experiments.sweep --sweep=configs/sweeps/paper_cifar10_vgg19.py \\
      --workdir=/tmp/paper_vgg19 --parallel=2
  # full size, for GPUs
  python -m experiments.sweep --sweep=configs/sweeps/paper_cifar10_vgg19.py:full \\
      --workdir=/tmp/paper_vgg19_full

The cluster, GSSP settings and schedule are those of paper_cifar10_resnet18.py
(four speed tiers 1x-3x a 100 ms base iteration, 4 speed groups, s = 3), with
SGD 0.05 as in configs/cifar10_vgg19.py.

Reduced: VGG-19-BN at a quarter of the width (1,256,922 parameters,
``model_args.width=0.25``), 8 workers x 32, 8,192 / 2,000 images, 4 epochs,
BSP, SSP, GSSP and GSSP + GDTopK, seed 0, target 50 %.
Full (``:full``): the paper-size VGG-19-BN (20,040,522 parameters), 16 workers,
all images, 30 epochs, target 90 %, every scheme, seeds 0-2, evaluated every
quarter epoch (27 trials; an estimate of the cost is that of the ResNet-18 file).
"""

from configs import cifar10_vgg19
from configs.sweeps import paper_cifar10_resnet18 as resnet_sweep


def get_config(arg=None):
  return resnet_sweep.cifar_config(cifar10_vgg19.get_config(), arg)


def get_sweep(arg=None):
  return resnet_sweep.get_sweep(arg)
