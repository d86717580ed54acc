"""A researcher's own model whose gradient costs next to nothing, named by file in a config.

``benchmarks/tiny_model.py:Linear`` (``config.model``): one dense layer from the flattened
input to the logits (MNIST: 1,024 x 10 weights). The simulator's benchmarks use it to
measure what a simulated gradient costs beyond the model's own work.
"""

import flax.linen as nn


class Linear(nn.Module):
  """Logistic regression: ``__call__(x, train=...)`` -> logits, as every classifier here."""
  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))
