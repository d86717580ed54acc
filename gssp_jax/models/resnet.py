"""ResNet-18, CIFAR variant (as in kuangliu/pytorch-cifar)."""

from functools import partial
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from gssp_jax.models.layers import batch_norm, conv_init, scaled_channels


class BasicBlock(nn.Module):
  """Two 3x3 convs with a residual connection.

  A 1x1 conv + BN projection is used on the shortcut whenever the stride or
  the channel count changes.
  """

  features: int
  strides: int = 1
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    conv = partial(nn.Conv, use_bias=False, kernel_init=conv_init, dtype=self.dtype)
    norm = batch_norm(train, self.dtype)
    s = (self.strides, self.strides)

    y = conv(self.features, (3, 3), strides=s, padding=1)(x)
    y = nn.relu(norm()(y))
    y = conv(self.features, (3, 3), padding=1)(y)
    y = norm()(y)

    if self.strides != 1 or x.shape[-1] != self.features:
      x = conv(self.features, (1, 1), strides=s, padding=0, name="shortcut_conv")(x)
      x = norm(name="shortcut_bn")(x)
    return nn.relu(x + y)


class ResNet18(nn.Module):
  """CIFAR ResNet-18: 3x3 stem, no max pool, 4 stages of 2 BasicBlocks.

  11,173,962 parameters for 10 classes (BN running stats not counted).

  Attributes:
    num_classes: number of output logits.
    width: channel multiplier (1.0: 64-128-256-512 channels); the reduced-cost
      CPU sweeps use 0.25.
    dtype: computation dtype; parameters stay float32 and logits are float32.
  """

  num_classes: int = 10
  width: float = 1.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Computes logits for NHWC images [B, 32, 32, C] -> float32 [B, num_classes]."""
    channels = [scaled_channels(c, self.width) for c in (64, 128, 256, 512)]
    x = x.astype(self.dtype)
    x = nn.Conv(channels[0], (3, 3), padding=1, use_bias=False, kernel_init=conv_init,
                dtype=self.dtype)(x)
    x = nn.relu(batch_norm(train, self.dtype)()(x))
    for stage, (features, strides) in enumerate(zip(channels, (1, 2, 2, 2))):
      for block in range(2):
        x = BasicBlock(features, strides if block == 0 else 1, dtype=self.dtype,
                       name=f"stage{stage + 1}_block{block + 1}")(x, train)
    x = jnp.mean(x, axis=(1, 2))  # Global average pool (4x4 for 32x32 input).
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return x.astype(jnp.float32)
