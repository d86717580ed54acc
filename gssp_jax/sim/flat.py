"""Flat parameter buffers for the level-batched executor: one ``[N, P]`` array per buffer.

The per-round executor keeps every per-worker and per-replica buffer as a
pytree (one ``[W, ...]`` leaf per tensor of the model). The level-batched
executor (``sim/levels.py``) keeps the weights and the BatchNorm statistics
of the workers, the replicas and the outstanding gradients as single
``[W, P]`` / ``[R, P]`` arrays, the model's tensors laid end to end in
``jax.flatten_util.ravel_pytree``'s order. A round then gathers, sums, steps
and scatters one array instead of one per tensor: a handful of fused kernels
on an accelerator, where a LeNet-5 round was ~217 (10 tensors) and a
ResNet-18's ~1,300 (62 with the statistics).

The model itself still sees pytrees: a job unravels the rows it gathered
(``Layout.params``: slices and reshapes, which XLA fuses into their readers)
and ravels the gradient it returns. The sync transforms are pytree-generic, so
a single ``[W, P]`` leaf is just one more pytree to them; the replicas'
optimizer sees one ``[P]`` vector, which is the same arithmetic element by
element for the built-in optimizers (``ELEMENTWISE_OPTIMIZERS``). Any other
optimizer (a per-tensor rule: Adafactor's factored moments, LAMB's trust
ratio) is run on the unravelled tree (:func:`on_tree`), so its semantics never
depend on the layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Optimizer names (``optimizer.name``) whose update is the same function of each element
# whatever the shapes around it: they may step a flat [P] vector directly.
ELEMENTWISE_OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one replica's weights and statistics lie in a ``[P]`` and an ``[S]`` vector.

  The leaves in ``jax.tree.leaves`` order, each flattened, end to end (as
  ``jax.flatten_util.ravel_pytree`` lays them out); built from shapes alone,
  so making one runs nothing on the device.

  Attributes:
    params: the weights' ``_Part``.
    stats: the model state's (BatchNorm statistics; no leaves without).
  """
  params_part: "_Part"
  stats_part: "_Part"

  @property
  def num_params(self) -> int:
    return self.params_part.size

  @property
  def num_stats(self) -> int:
    return self.stats_part.size

  @property
  def dtype(self):
    return self.params_part.dtype

  def unravel_params(self, flat: jax.Array):
    """``[P]`` -> the params pytree."""
    return self.params_part.unravel(flat)

  def unravel_stats(self, flat: jax.Array):
    """``[S]`` -> the model state pytree."""
    return self.stats_part.unravel(flat)

  def ravel_params(self, tree) -> jax.Array:
    """One replica's params pytree as ``[P]``."""
    return ravel(tree, self.params_part.dtype)

  def ravel_stats(self, tree) -> jax.Array:
    """One replica's model state as ``[S]``."""
    return ravel(tree, self.stats_part.dtype)


@dataclasses.dataclass(frozen=True)
class _Part:
  """One pytree's layout in a flat vector: its structure, leaf shapes and their offsets."""
  treedef: Any
  shapes: tuple
  dtypes: tuple
  dtype: Any

  @property
  def size(self) -> int:
    return int(sum(int(np.prod(s)) for s in self.shapes))

  def unravel(self, flat: jax.Array):
    leaves, start = [], 0
    for shape, dtype in zip(self.shapes, self.dtypes):
      n = int(np.prod(shape))
      leaves.append(flat[start:start + n].reshape(shape).astype(dtype))
      start += n
    return jax.tree.unflatten(self.treedef, leaves)


def ravel(tree, dtype) -> jax.Array:
  """``tree``'s leaves flattened and laid end to end (``ravel_pytree``'s order), as ``dtype``."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros([0], dtype)
  return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])


def _part(tree, what: str) -> _Part:
  """The :class:`_Part` of ``tree`` (arrays or shapes), whose leaves must share one dtype."""
  leaves, treedef = jax.tree.flatten(tree)
  dtypes = {jnp.dtype(x.dtype) for x in leaves}
  if len(dtypes) > 1:
    raise ValueError(f"the level-batched executor keeps the {what} in one flat array, which "
                     f"needs one dtype; got {sorted(map(str, dtypes))}; allowed: a model whose "
                     f"{what} share a dtype, or config.executor='rounds'")
  return _Part(treedef, tuple(tuple(np.shape(x)) for x in leaves),
               tuple(jnp.dtype(x.dtype) for x in leaves),
               dtypes.pop() if dtypes else jnp.dtype(jnp.float32))


def make_layout(params, model_state) -> Layout:
  """The :class:`Layout` of one replica's ``params`` and ``model_state`` (arrays or shapes).

  Raises:
    ValueError: the weights (or the statistics) have more than one dtype: a
      flat buffer would round one of them.
  """
  return Layout(_part(params, "weights"), _part(model_state, "model state (BatchNorm statistics)"))


def on_tree(inner: optax.GradientTransformation, layout: Layout
            ) -> optax.GradientTransformationExtraArgs:
  """``inner`` stepping one replica's flat ``[P]`` vector through its pytree.

  The level-batched executor's replicas are flat vectors; an optimizer whose
  rule depends on the tensors' shapes (``ELEMENTWISE_OPTIMIZERS`` lists those
  that do not) sees the model's pytree, exactly as in the per-round executor.
  Its state is the state it keeps for that pytree.
  """
  inner = optax.with_extra_args_support(inner)

  def init(flat):
    return inner.init(layout.unravel_params(flat))

  def update(updates, state, params=None, **extra):
    tree_params = None if params is None else layout.unravel_params(params)
    out, state = inner.update(layout.unravel_params(updates), state, tree_params, **extra)
    return layout.ravel_params(out), state

  return optax.GradientTransformationExtraArgs(init, update)
