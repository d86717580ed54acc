"""Model zoo: LeNet-5, ResNet-18, VGG-19 (CIFAR variants) and an attention Seq2Seq.

Classification models share one call convention::

  variables = model.init(rng, x, train=False)
  logits = model.apply(variables, x, train=False)
  logits, new_state = model.apply(variables, x, train=True, mutable=["batch_stats"])

`new_state` is empty for LeNet-5, which has no BatchNorm. See `Seq2Seq` for the
sequence model's conventions.
"""

import math

import flax.linen as nn
import jax

from gssp_jax.models.lenet import LeNet5
from gssp_jax.models.resnet import ResNet18
from gssp_jax.models.seq2seq import Seq2Seq
from gssp_jax.models.vgg import VGG19

MODELS = ("lenet5", "resnet18", "vgg19", "seq2seq")

_REGISTRY = {
    "lenet5": LeNet5,
    "resnet18": ResNet18,
    "vgg19": VGG19,
    "seq2seq": Seq2Seq,
}

__all__ = [
    "MODELS", "LeNet5", "ResNet18", "VGG19", "Seq2Seq",
    "create_model", "param_count", "has_batch_stats",
]


def create_model(name: str, **kwargs) -> nn.Module:
  """Builds a model by name.

  Args:
    name: one of `MODELS`.
    **kwargs: constructor arguments, e.g. `num_classes`, `dtype` for the
      classifiers; `src_vocab_size`, `tgt_vocab_size`, `emb_dim`,
      `hidden_dim`, `dropout` for "seq2seq".

  Raises:
    ValueError: for an unknown name.
  """
  if name not in _REGISTRY:
    raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
  return _REGISTRY[name](**kwargs)


def param_count(params) -> int:
  """Number of scalars in a pytree (pass `variables["params"]`).

  Works on arrays and on `jax.ShapeDtypeStruct`s from `jax.eval_shape`.
  """
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def has_batch_stats(variables) -> bool:
  """Whether `variables` hold a non-empty "batch_stats" collection."""
  return bool(jax.tree_util.tree_leaves(variables.get("batch_stats", {})))
