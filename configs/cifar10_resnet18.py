"""ResNet-18 (CIFAR variant) on CIFAR-10, 4 synchronous (BSP) workers x batch 32, augmented.

  python -m experiments.main --config=configs/cifar10_resnet18.py --workdir=/tmp/c10_resnet18

Full: 30 epochs with cosine decay; a GPU job (on a 2-core CPU one epoch takes about
81 min, see docs/RESULTS.md). `configs/cifar10_resnet18.py:smoke`: 256 examples, lr 0.01, ~1 min (with compilation).
"""

from gssp_jax.defaults import default_config, parse_arg


def get_config(arg=None):
  args = parse_arg(arg)
  c = default_config()
  c.model = "resnet18"
  c.dataset = "cifar10"
  c.num_workers = 4
  c.batch_size = 32
  c.data.augment = True
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.1
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.optimizer.schedule = "cosine"
  c.train.num_epochs = 30.0
  c.train.eval_every = 1.0
  c.train.target_accuracy = 0.9
  if "smoke" in args:
    c.num_workers = 2
    c.batch_size = 16
    c.data.train_size = 256
    c.data.test_size = 128
    c.data.eval_batch_size = 64
    c.optimizer.learning_rate = 0.01  # 16 updates on 10 classes: gentle enough to learn visibly
    c.train.num_epochs = 2.0
  return c
