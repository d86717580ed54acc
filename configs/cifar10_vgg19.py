"""VGG-19 with BatchNorm on CIFAR-10: the ResNet-18 setting with the other model and lr 0.05.

  python -m experiments.main --config=configs/cifar10_vgg19.py --workdir=/tmp/c10_vgg19

Full: 30 epochs with cosine decay; a GPU job (on a 2-core CPU one epoch takes about
33 min, see docs/RESULTS.md). `configs/cifar10_vgg19.py:smoke`: 256 examples, ~30 s.
"""

from configs import cifar10_resnet18
from gssp_jax.defaults import parse_arg


def get_config(arg=None):
  c = cifar10_resnet18.get_config(arg)
  c.model = "vgg19"
  if "smoke" not in parse_arg(arg):   # the smoke run keeps the ResNet smoke's 0.01
    c.optimizer.learning_rate = 0.05
  return c
