"""VGG-19 with BatchNorm, CIFAR variant (as in kuangliu/pytorch-cifar)."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from gssp_jax.models.layers import (batch_norm, conv_general_dilated, conv_init, max_pool_2x2,
                                    scaled_channels)

# Conv output channels; "M" is a 2x2 max pool. Five pools take 32x32 to 1x1.
VGG19_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
             512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


class VGG19(nn.Module):
  """VGG-19-BN: 16 conv3x3(+bias)+BN+ReLU layers, then one dense classifier.

  20,040,522 parameters for 10 classes (BN running stats not counted).
  Convs use Kaiming-normal (fan_out) init with zero bias, like torchvision.

  Attributes:
    num_classes: number of output logits.
    width: channel multiplier (1.0: the channels of ``VGG19_CFG``); the
      reduced-cost CPU sweeps use 0.25.
    dtype: computation dtype; parameters stay float32 and logits are float32.
  """

  num_classes: int = 10
  width: float = 1.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    """Computes logits for NHWC images [B, 32, 32, C] -> float32 [B, num_classes]."""
    x = x.astype(self.dtype)
    for v in VGG19_CFG:
      if v == "M":
        x = max_pool_2x2(x)
      else:
        x = nn.Conv(scaled_channels(v, self.width), (3, 3), padding=1, kernel_init=conv_init, dtype=self.dtype,
                    conv_general_dilated=conv_general_dilated)(x)
        x = nn.relu(batch_norm(train, self.dtype)()(x))
    x = x.reshape((x.shape[0], -1))  # [B, 512] for 32x32 input.
    x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
    return x.astype(jnp.float32)
