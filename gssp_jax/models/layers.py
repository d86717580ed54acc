"""Layers shared by the CNNs, including workarounds for slow XLA:CPU kernels."""

from functools import partial
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
from jax import lax


def scaled_channels(channels: int, width: float) -> int:
  """``channels`` scaled by the width multiplier ``width`` (> 0), at least 1.

  Raises:
    ValueError: a non-positive or non-numeric ``width``, naming it.
  """
  if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
    raise ValueError(f"model width={width!r} is invalid; allowed: a number > 0 (1.0 = the "
                     "paper's channel counts)")
  return max(1, int(round(channels * width)))


# Kaiming-normal (fan_out, ReLU gain) for the ResNet-18 and VGG-19 convs, as
# torchvision initialises them. Under BatchNorm the scale barely matters, but
# it is the well-tested choice for SGD-with-momentum training.
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def batch_norm(train: bool, dtype: Any) -> Callable[..., nn.BatchNorm]:
  """BatchNorm constructor matching PyTorch defaults (torch momentum 0.1 == flax 0.9)."""
  return partial(
      nn.BatchNorm,
      use_running_average=not train,
      momentum=0.9,
      epsilon=1e-5,
      dtype=dtype,
  )


# XLA:CPU (jax 0.10) runs 3x3 convolutions on 2x2 feature maps through a very
# slow path: batch 32, 512->512 channels takes 1.25 s forward+backward, versus
# 36 ms as nine shifted matmuls (4x4 maps and larger: no difference). VGG-19's
# last stage has four such convs, which otherwise dominate the step time.
_SMALL_MAP = 2


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                         rhs_dilation=None, dimension_numbers=None,
                         feature_group_count=1, precision=None):
  """`lax.conv_general_dilated` with a fast path for tiny NHWC feature maps.

  Plugged into `nn.Conv(conv_general_dilated=...)`, so parameters and results
  are unchanged. Stride-1, undilated, ungrouped convs with explicit padding on
  maps of at most `_SMALL_MAP` pixels per side are computed as a sum over
  kernel taps of shifted [N*H*W, Cin] x [Cin, Cout] matmuls.
  """
  nhwc = lax.conv_dimension_numbers(lhs.shape, rhs.shape, ("NHWC", "HWIO", "NHWC"))
  fast = (lhs.ndim == 4 and max(lhs.shape[1:3]) <= _SMALL_MAP
          and dimension_numbers == nhwc and feature_group_count == 1
          and not isinstance(padding, str)
          and all(s == 1 for s in window_strides)
          and all(d == 1 for d in (lhs_dilation or ()) + (rhs_dilation or ())))
  if not fast:
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count, precision=precision)
  x = jnp.pad(lhs, ((0, 0), *padding, (0, 0)))
  kh, kw = rhs.shape[:2]
  oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
  # Accumulate in float32 (as the convolution would) also for bf16 compute.
  y = sum(jnp.einsum("nhwc,cd->nhwd", x[:, i:i + oh, j:j + ow], rhs[i, j],
                     precision=precision, preferred_element_type=jnp.float32)
          for i in range(kh) for j in range(kw))
  return y.astype(lhs.dtype)


def max_pool_2x2(x):
  """2x2/stride-2 max pool as reshape + max.

  Same values as `nn.max_pool`, but its gradient avoids XLA:CPU's slow
  select-and-scatter (about 10x faster backward at 32x32x64). Gradients differ
  only for exactly tied maxima, which after ReLU are zeros with zero gradient.
  H and W must be even.
  """
  b, h, w, c = x.shape
  return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))
