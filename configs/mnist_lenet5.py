"""LeNet-5 on MNIST, 4 synchronous (BSP) workers x batch 32.

  python -m experiments.main --config=configs/mnist_lenet5.py --workdir=/tmp/mnist_lenet5

Full: 8 epochs, 97-117 s on an idle 2-core CPU, 99.11 % test accuracy (2026-11-26; 99.07 % with
the code of 2026-11-23; docs/RESULTS.md).
`configs/mnist_lenet5.py:smoke`: 2,048 examples, ~10 s.
"""

from gssp_jax.defaults import default_config, parse_arg


def get_config(arg=None):
  args = parse_arg(arg)
  c = default_config()
  c.model = "lenet5"
  c.dataset = "mnist"
  c.num_workers = 4
  c.batch_size = 32
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.05
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.optimizer.schedule = "cosine"
  c.train.num_epochs = 8.0
  c.train.eval_every = 1.0
  c.train.target_accuracy = 0.985
  if "smoke" in args:
    c.data.train_size = 2048
    c.data.test_size = 500
    c.train.num_epochs = 3.0
  return c
