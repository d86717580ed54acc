"""Model zoo: LeNet-5, ResNet-18, VGG-19 (CIFAR variants) and an attention Seq2Seq.

Classification models share one call convention::

  variables = model.init(rng, x, train=False)
  logits = model.apply(variables, x, train=False)
  logits, new_state = model.apply(variables, x, train=True, mutable=["batch_stats"])

`new_state` is empty for LeNet-5, which has no BatchNorm. See `Seq2Seq` for the
sequence model's conventions.

Your own classifier: any Flax module with that call convention (``train`` as a keyword,
BatchNorm statistics, if any, in a collection updated under ``mutable``). Name it in the
config as ``model="package.module:Name"`` or ``"path/to/file.py:Name"`` (every process of a
run can import it: sweeps, the real runtime, ``load_trained``), or, in one process (a
notebook), ``register_model("name", Name)`` and ``model="name"``. It is called with
``num_classes`` (from the dataset) and ``config.model_args`` as keyword arguments.
"""

import math
from typing import Any, Callable

import flax.linen as nn
import jax

from gssp_jax import plugins

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
_USER: dict[str, Callable[..., nn.Module]] = {}   # register_model, this process only

__all__ = [
    "MODELS", "LeNet5", "ResNet18", "VGG19", "Seq2Seq",
    "create_model", "param_count", "has_batch_stats", "register_model", "is_user_model",
    "resolve_user_model", "check_user_model_args",
]

def register_model(name: str, factory: Callable[..., nn.Module]) -> None:
  """Makes ``config.model=name`` build ``factory(num_classes=..., **config.model_args)``.

  In this process only: a run of several processes (``sweep --parallel``, the real runtime)
  needs the spec form, ``"package.module:Name"`` or ``"path/file.py:Name"``. Registering a
  name again replaces it.

  Raises:
    ValueError: a name that is not lower-case letters, digits and ``_``, or a built-in's, or a
      factory that is not callable.
  """
  plugins.check_registered_name("register_model", name, MODELS)
  if not callable(factory):
    raise ValueError(f"register_model({name!r}): {factory!r} is not callable; allowed: a Flax "
                     "module class or a function returning a module")
  _USER[name] = factory


def is_user_model(name: Any) -> bool:
  """Whether ``name`` is a registered name or a spec (not one of the built-in models)."""
  return name in _USER or plugins.is_spec(name)


def resolve_user_model(name: str) -> Callable[..., nn.Module]:
  """The factory of a registered name or a spec.

  Raises:
    ValueError: an unknown name or a spec that does not resolve to something callable.
  """
  if name in _USER:
    return _USER[name]
  if not plugins.is_spec(name):
    raise ValueError(f"model={name!r} is unknown; allowed: {', '.join(MODELS)}, a name given to "
                     f"register_model ({', '.join(sorted(_USER)) or 'none yet'}) or "
                     f"{plugins.SPEC_HELP}")
  factory = plugins.resolve(name, "model")
  if not callable(factory):
    raise ValueError(f"model={name!r} is {type(factory).__name__}, not callable; allowed: a Flax "
                     "module class or a function returning a module")
  return factory


def check_user_model_args(name: str, model_args: dict) -> None:
  """Raises ValueError if the user model ``name`` cannot take ``num_classes`` and ``model_args``.

  Reads the factory's signature (a Flax module's fields); a factory taking ``**kwargs``, or
  one whose signature cannot be read, is left to fail when it is built.
  """
  import inspect  # pylint: disable=g-import-not-at-top
  factory = resolve_user_model(name)
  try:
    params = inspect.signature(factory).parameters
  except (TypeError, ValueError):
    return
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  missing = [k for k in ("num_classes", *model_args) if k not in params]
  if missing:
    allowed = sorted(k for k in params if k not in ("num_classes", "parent", "name"))
    raise ValueError(f"model={name!r} takes no {', '.join(missing)}; allowed: a model with a "
                     f"num_classes argument, and model_args among {allowed or 'none'}")


def create_model(name: str, **kwargs) -> nn.Module:
  """Builds a model by name.

  Args:
    name: one of `MODELS`, a name given to `register_model`, or a spec
      ("package.module:Name", "path/file.py:Name").
    **kwargs: constructor arguments, e.g. `num_classes`, `dtype` for the
      classifiers; `src_vocab_size`, `tgt_vocab_size`, `emb_dim`,
      `hidden_dim`, `dropout` for "seq2seq".

  Raises:
    ValueError: for an unknown name, or a user factory that rejects the arguments or
      returns something other than a Flax module.
  """
  if name in _REGISTRY:
    return _REGISTRY[name](**kwargs)
  factory = resolve_user_model(name)
  try:
    model = factory(**kwargs)
  except TypeError as e:
    raise ValueError(f"model={name!r} cannot be built with {sorted(kwargs)} ({e}); a user model "
                     "takes num_classes and the keys of config.model_args") from None
  if not isinstance(model, nn.Module):
    raise ValueError(f"model={name!r} returned {type(model).__name__}; allowed: a flax.linen "
                     "Module")
  return model


def param_count(params) -> int:
  """Number of scalars in a pytree (pass `variables["params"]`).

  Works on arrays and on `jax.ShapeDtypeStruct`s from `jax.eval_shape`.
  """
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def has_batch_stats(variables) -> bool:
  """Whether `variables` hold a non-empty "batch_stats" collection."""
  return bool(jax.tree_util.tree_leaves(variables.get("batch_stats", {})))
