"""Weight decay that follows training progress: each replica decays by the gradient mass it applies.

An asynchronous server applies many small steps where BSP applies one: an
ASP/SSP/DSSP push carries one worker gradient scaled by ``1/W``, a GSSP peer
delivery ``K/W``, an InHAD aggregate ``count/W``, a CASP community ``m/W``,
BSP's round ``W x 1/W = 1``. Decay added at every optimizer step (the GSSP
authors' code) therefore decays an asynchronous server up to ``W`` times more
per epoch of data than BSP. Here a replica's decay in a round is scaled by the
**gradient mass** it applies in that round: the scale times the number of
worker gradients in its update. Summed over an epoch that is the same for
every scheme (BSP: ``1`` per round; ASP: ``W`` pushes of ``1/W``; a GSSP group
server: its own group's pushes plus every other group's forwarded sums), so
every scheme decays per epoch as BSP does.

The mass is measured exactly on the device, with no host bookkeeping:
:func:`with_gradient_mass` routes a per-worker ``1`` through the sync
transform beside the gradients, so it takes exactly their path (``route_sum``,
GSSP ``pending``/``outbox`` and deliveries, InHAD node aggregates, ``applies``
masks). The transform's output then carries ``mass[R]``. :func:`replicated_with_mass`
hands each replica's mass to its optimizer as the keyword-only extra arg
``gradient_mass``, which :func:`add_mass_decayed_weights` reads::

    inner = optax.chain(add_mass_decayed_weights(5e-4), optax.sgd(0.05, 0.9))
    tx = optax.chain(with_gradient_mass(ssp(W, 3)), replicated_with_mass(inner, 1))

Without ``gradient_mass`` (a plain, non-replicated optimizer such as the BSP
loop's) the mass is 1, which is what one BSP step applies: there the decay is
exactly ``optax.add_decayed_weights``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax.sync import transforms

MASS_ARG = "gradient_mass"


class GradientMass(NamedTuple):
  """Replica updates with the gradient mass each replica applies in the round.

  Attributes:
    updates: pytree of ``[R, ...]`` float32, the sync transform's updates.
    mass: ``[R]`` float32, scale x number of worker gradients in each
      replica's update (0 for a replica that does not apply).
  """
  updates: Any
  mass: jax.Array


def with_gradient_mass(sync_tx: optax.GradientTransformationExtraArgs
                       ) -> optax.GradientTransformationExtraArgs:
  """Runs ``sync_tx`` on ``(worker_grads, ones[W])`` and returns :class:`GradientMass`.

  The ``1`` of every worker travels the gradients' route, so whatever the
  scheme does with a gradient (scale, route, hold in a pending sum or an
  outbox, deliver to other replicas, aggregate on a node, mask) it does with
  the ``1`` as well. The state is ``sync_tx``'s own state type (its buffers
  gain a ``[G]``/``[N]`` mass leaf), so ``find_sync_state`` and the staleness
  accessors work unchanged.

  ``sync_tx`` receives the replicas' parameters as they are; the built-in
  sync transforms ignore them.
  """

  def init(params):
    return sync_tx.init((params, jnp.zeros([], jnp.float32)))

  def update(updates, state, params=None, **extra):
    num_workers = jax.tree.leaves(updates)[0].shape[0]
    ones = jnp.ones([num_workers], jnp.float32)
    (out, mass), state = sync_tx.update((updates, ones), state, params, **extra)
    return GradientMass(updates=out, mass=mass), state

  return optax.GradientTransformationExtraArgs(init, update)


def replicated_with_mass(inner: optax.GradientTransformation,
                         num_replicas: int) -> optax.GradientTransformationExtraArgs:
  """``transforms.replicated`` over :class:`GradientMass`; replica r's optimizer gets its mass.

  Replica ``r``'s ``inner.update`` receives the extra arg ``gradient_mass=mass[r]``.

  The state is ``transforms.ReplicatedState``; replicas outside ``applies``
  keep their optimizer state and get a zero update, as with ``replicated``.
  """
  inner = optax.with_extra_args_support(inner)

  def one_update(updates, state, params=None, **extra):
    del extra  # the round's masks are not one replica's business (see ``replicated``)
    return inner.update(updates.updates, state, params, **{MASS_ARG: updates.mass})

  return transforms.replicated(optax.GradientTransformationExtraArgs(inner.init, one_update),
                               num_replicas)


def add_mass_decayed_weights(weight_decay: float) -> optax.GradientTransformationExtraArgs:
  """``updates + gradient_mass * weight_decay * params``; ``gradient_mass`` defaults to 1.

  With mass 1 this is ``optax.add_decayed_weights(weight_decay)`` bit for bit.
  Put it before the optimizer for L2 decay (PyTorch's ``weight_decay``), or
  between ``scale_by_adam`` and the learning rate for decoupled decay (AdamW).

  Raises:
    ValueError: a weight decay that is not a finite number >= 0.
  """
  if (isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real)
      or not np.isfinite(float(weight_decay)) or weight_decay < 0):
    raise ValueError(f"add_mass_decayed_weights weight_decay={weight_decay!r} is invalid; "
                     "allowed: a finite number >= 0")
  weight_decay = float(weight_decay)

  def update(updates, state, params=None, **extra):
    if params is None:
      raise ValueError("add_mass_decayed_weights needs params: call update(updates, state, params)")
    mass = extra.get(MASS_ARG)
    s = weight_decay if mass is None else jnp.asarray(mass, jnp.float32) * weight_decay
    return jax.tree.map(lambda g, p: g + s * p, updates, params), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
