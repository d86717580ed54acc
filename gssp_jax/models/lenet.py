"""LeNet-5 for 32x32 inputs (MNIST padded to 32x32)."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from gssp_jax.models.layers import max_pool_2x2


class LeNet5(nn.Module):
  """Classic LeNet-5 with ReLU and max pooling.

  conv5x5(6) -> pool -> conv5x5(16) -> pool -> 120 -> 84 -> num_classes.
  With a 32x32x1 input and 10 classes it has exactly 61,706 parameters.
  Initialisation: flax defaults (LeCun normal kernels, zero biases).

  Attributes:
    num_classes: number of output logits.
    dtype: computation dtype; parameters stay float32 and logits are float32.
  """

  num_classes: int = 10
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Computes logits.

    Args:
      x: float images [B, 32, 32, C] (NHWC).
      train: accepted for a uniform call convention with the BatchNorm models;
        LeNet-5 behaves identically in both modes.

    Returns:
      float32 logits [B, num_classes].
    """
    del train  # No dropout or BatchNorm.
    x = x.astype(self.dtype)
    x = nn.Conv(6, (5, 5), padding="VALID", dtype=self.dtype)(x)
    x = max_pool_2x2(nn.relu(x))
    x = nn.Conv(16, (5, 5), padding="VALID", dtype=self.dtype)(x)
    x = max_pool_2x2(nn.relu(x))
    x = x.reshape((x.shape[0], -1))  # 5*5*16 = 400 features for 32x32 input.
    x = nn.relu(nn.Dense(120, dtype=self.dtype)(x))
    x = nn.relu(nn.Dense(84, dtype=self.dtype)(x))
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return x.astype(jnp.float32)
