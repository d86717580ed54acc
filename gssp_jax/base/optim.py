"""The server-side optimizer, built from ``config.optimizer``, and the workers' gradient clip."""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import numbers
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import optax

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.sync import decay as decay_lib
from gssp_jax.sync import local as local_lib
from gssp_jax.sync import transforms

# How weight decay is counted where a server applies many small steps (see gssp_jax.sync.decay):
# "progress": by the gradient mass each application carries, so every scheme decays per epoch as
# BSP does; "per_step": once per server optimizer step (the GSSP authors' code).
WEIGHT_DECAY_MODES = defaults.WEIGHT_DECAY_MODES


def learning_rate_schedule(cfg: ml_collections.ConfigDict, steps_per_epoch: int,
                           total_steps: int) -> optax.Schedule:
  """Constant or cosine decay, after an optional linear warm-up (in epochs)."""
  warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
  peak = cfg.learning_rate
  if cfg.schedule == "constant":
    main = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, decay_steps=max(1, total_steps - warmup))
  else:
    raise ValueError(f"optimizer.schedule={cfg.schedule!r}; allowed: constant, cosine")
  if warmup == 0:
    return main
  return optax.join_schedules(
      [optax.linear_schedule(0.0, peak, warmup), main], boundaries=[warmup])


class LearningRateTable:
  """:func:`learning_rate_schedule`'s values at steps ``0 .. total_steps``, looked up on the host.

  ``table(step)`` is the rate at ``step`` (``values[-1]`` past the end: every
  schedule here is constant from ``total_steps`` on). The simulator and the
  real runtime's server read each round's learning rate from one, so no
  schedule runs eagerly once per round (it did: a third of the simulator's
  host time per round).
  """

  def __init__(self, values: np.ndarray):
    self.values = np.asarray(values, np.float32)
    self._last = self.values.size - 1

  def __call__(self, step: int) -> np.float32:
    return self.values[min(int(step), self._last)]


def learning_rate_table(cfg: ml_collections.ConfigDict, steps_per_epoch: int,
                        total_steps: int) -> LearningRateTable:
  """:func:`learning_rate_schedule` at steps ``0 .. total_steps``, float32, from one jitted call."""
  schedule = learning_rate_schedule(cfg, steps_per_epoch, total_steps)
  steps = np.arange(max(int(total_steps), 0) + 1, dtype=np.int32)
  return LearningRateTable(np.asarray(jax.jit(jax.vmap(schedule))(steps), np.float32))


class VirtualTimeSchedule:
  """``cfg.schedule`` over virtual time: the rate at ``t`` is the schedule at progress ``t / B``.

  ``B`` is ``train.virtual_budget`` (> 0): a run with one reads each round's
  learning rate from this, at the round's time, in place of
  :class:`LearningRateTable`'s epochs of data (the simulator and the real
  runtime alike). After a linear warm-up from 0 over ``cfg.warmup_seconds``
  (``w``; 0: none), ``constant`` is ``cfg.learning_rate`` and ``cosine`` is
  optax's cosine decay over the rest, ``peak (1 + cos(pi p)) / 2`` with
  ``p = (t - w) / (B - w)``, float32: the epochs' schedule with seconds for
  steps. Past the budget the rate stays at its end value.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, budget: float):
    if cfg.schedule not in defaults.SCHEDULES:
      raise ValueError(f"optimizer.schedule={cfg.schedule!r}; allowed: "
                       f"{', '.join(defaults.SCHEDULES)}")
    self.peak, self.kind, self.budget = float(cfg.learning_rate), cfg.schedule, float(budget)
    self.warmup = float(cfg.get("warmup_seconds", 0.0))

  def __call__(self, time: float) -> np.float32:
    t = float(time)
    if t < self.warmup:
      return np.float32(self.peak * t / self.warmup)
    if self.kind == "constant":
      return np.float32(self.peak)
    progress = min(max((t - self.warmup) / (self.budget - self.warmup), 0.0), 1.0)
    return np.float32(self.peak * 0.5 * (1.0 + math.cos(math.pi * progress)))


def check_grad_clip(value) -> float:
  """``optimizer.grad_clip`` as a float, checked: a finite number >= 0 (0 = off).

  Raises:
    ValueError: ``value`` is not such a number.
  """
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not math.isfinite(value) or value < 0):
    raise ValueError(f"grad_clip={value!r} is invalid; allowed: a finite number >= 0 (0 = off)")
  return float(value)


def clip_gradient(grads, max_norm: float):
  """One worker's gradient scaled to global norm at most ``max_norm`` (0: returned as is).

  ``optax.clip_by_global_norm``'s rule, pure. What ``optimizer.grad_clip``
  means in every executor: each worker clips its own gradient, before the 1/W
  scale of an asynchronous push and before its compressor, so the clip bounds
  the same quantity for every scheme. BSP's step is then the mean of the
  clipped worker gradients, not the clip of their mean. With ``max_norm`` 0
  nothing is traced (no norm is computed).
  """
  if max_norm == 0:
    return grads
  clipped, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
  return clipped


BUILTIN = defaults.OPTIMIZERS   # sgd, adam, adamw: built in below
# Arguments a constructor may not take from ``optimizer.args``: the run sets them (the learning
# rate follows the schedule, weight decay follows progress through ``optimizer.weight_decay``).
RESERVED_ARGS = ("learning_rate", "weight_decay")


def parse_args(text: str, where: str = "optimizer.args") -> dict[str, Any]:
  """``"b1=0.95,b2=0.98"`` -> ``{"b1": 0.95, "b2": 0.98}`` (values are Python literals)."""
  if not isinstance(text, str):
    raise ValueError(f"{where}={text!r} is invalid; allowed: a string 'key=value,...' of the "
                     "optimizer's keyword arguments (values as Python literals), or ''")
  out = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    key, sep, value = item.partition("=")
    key = key.strip()
    try:
      if not sep or not key.isidentifier():
        raise ValueError
      out[key] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      raise ValueError(f"{where}={text!r} is invalid at {item!r}; allowed: key=value pairs "
                       "separated by commas, each value a Python literal (e.g. "
                       "'b1=0.95,eps=1e-8')") from None
  return out


def optimizer_constructor(name: str, args: str = "", where: str = "optimizer"
                          ) -> tuple[Callable[..., Any], dict[str, Any]]:
  """The constructor named by ``{where}.name`` and its checked keyword arguments.

  ``name``: an optax optimizer taking ``learning_rate`` (``"lion"``, ``"rmsprop"``,
  ``"adafactor"``, ...), or a user function ``"package.module:function"`` that takes
  ``learning_rate`` and returns an optax ``GradientTransformation``. ``args``: its other
  keyword arguments (:func:`parse_args`); ``learning_rate`` and ``weight_decay`` are the
  run's own (``{where}.learning_rate`` with its schedule, ``{where}.weight_decay``).

  Raises:
    ValueError: an unknown name, a function without ``learning_rate``, an argument it does
      not take or a reserved one, naming the value and what is allowed.
  """
  if name in BUILTIN:
    raise ValueError(f"{where}.name={name!r} is built in: it takes no {where}.args (got "
                     f"{args!r}; its settings are {where}.momentum, .nesterov and "
                     f".weight_decay); allowed: '' with it, or another optax optimizer by name "
                     "(e.g. 'nadam', 'lion') with its arguments")
  if not isinstance(name, str) or not name:
    raise ValueError(f"{where}.name={name!r} is invalid; allowed: {', '.join(BUILTIN)}, an optax "
                     "optimizer's name (e.g. 'lion') or 'module:function'")
  if ":" in name:
    module_name, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"{where}.name={name!r}: cannot import it ({e}); allowed: "
                       "'package.module:function' importable here") from None
  else:
    fn = getattr(optax, name, None)
    if fn is None or not callable(fn):
      raise ValueError(f"{where}.name={name!r} is not an optax optimizer; allowed: "
                       f"{', '.join(BUILTIN)}, an optax function taking learning_rate (e.g. "
                       "'lion', 'rmsprop', 'adafactor', 'nadam') or 'module:function'")
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    params = {}
  if "learning_rate" not in params:
    raise ValueError(f"{where}.name={name!r} takes no learning_rate argument; allowed: an "
                     "optimizer constructor whose learning rate the run's schedule sets")
  kwargs = parse_args(args, f"{where}.args")
  for key in kwargs:
    if key in RESERVED_ARGS:
      raise ValueError(f"{where}.args sets {key!r}; allowed: not {' or '.join(RESERVED_ARGS)} "
                       f"(set {where}.{key}: the run schedules it for every scheme alike)")
    if key not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
      allowed = [p for p in params if p not in RESERVED_ARGS]
      raise ValueError(f"{where}.args sets {key!r}, which {name} does not take; allowed: "
                       f"{', '.join(allowed) or 'none'}")
  return fn, kwargs


def validate(config: ml_collections.ConfigDict, where: str = "optimizer") -> None:
  """The optimizer at ``config.{where}`` (``optimizer`` or ``local.optimizer``): every key it has.

  ``name`` built in (no ``args``), or an optax/user optimizer whose ``args`` it
  takes; the schedule; a positive rate; momentum in [0, 1); weight decay,
  warm-up and gradient clip >= 0; ``nesterov`` a bool.

  Raises:
    ValueError: one line naming the key, its value and what is allowed.
  """
  cfg = checks.get(config, where)
  if not (cfg.name in BUILTIN and cfg.get("args", "") == ""):
    optimizer_constructor(cfg.name, cfg.get("args", ""), f"config.{where}")
  checks.choice(config, f"{where}.schedule", defaults.SCHEDULES)
  if "weight_decay_mode" in cfg:
    checks.choice(config, f"{where}.weight_decay_mode", WEIGHT_DECAY_MODES)
  checks.positive(config, f"{where}.learning_rate")
  for key in ("momentum", "weight_decay", "warmup_epochs", "grad_clip"):
    if key in cfg:
      checks.non_negative(config, f"{where}.{key}")
  checks.below_one(config, f"{where}.momentum")
  if "nesterov" in cfg:
    checks.check_bool(f"{where}.nesterov", cfg.nesterov)


def make_optimizer(cfg: ml_collections.ConfigDict, steps_per_epoch: int,
                   total_steps: int, *, unit_learning_rate: bool = False
                   ) -> optax.GradientTransformation:
  """SGD with momentum and PyTorch-style L2 weight decay, Adam / AdamW, or any optax optimizer.

  ``cfg.name`` other than the built-ins is an optax constructor or a user
  function (:func:`optimizer_constructor`) called with the schedule's learning
  rate and ``cfg.args``; ``cfg.weight_decay`` is added to its gradient as L2.

  It does not clip: ``cfg.grad_clip`` is applied to each worker's gradient
  before the server sees it (:func:`clip_gradient`, called by
  ``sim.executor.make_worker_gradient`` and ``train.step.make_bsp_step``), so a
  loop built on this optimizer must clip its workers' gradients itself.

  With ``unit_learning_rate`` the learning rate is 1 and the caller scales the
  updates by the schedule itself (the simulator does, from training progress,
  because an asynchronous server's step count is not the run's progress).

  ``cfg.weight_decay_mode`` ``"progress"`` (default) scales the decay by the
  keyword-only extra arg ``gradient_mass`` (see :func:`make_sync_chain`); a
  plain optimizer such as the BSP loop's gets none, and one BSP step has mass
  1, so there both modes are the same optimizer, bit for bit.
  """
  lr = 1.0 if unit_learning_rate else learning_rate_schedule(cfg, steps_per_epoch, total_steps)
  progress = weight_decay_mode(cfg) == "progress"
  # Progress mode scales the decay by the extra arg ``gradient_mass`` (1 when absent, as in
  # the BSP loop, where it equals optax.add_decayed_weights bit for bit).
  decay = (decay_lib.add_mass_decayed_weights if progress else optax.add_decayed_weights)(
      cfg.weight_decay)
  parts = []
  if cfg.name == "sgd":
    # PyTorch-style weight decay: added to the gradient before momentum.
    if cfg.weight_decay > 0:
      parts.append(decay)
    parts.append(optax.sgd(lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov))
  elif cfg.name == "adam":
    if cfg.weight_decay > 0:
      parts.append(decay)
    parts.append(optax.adam(lr))
  elif cfg.name == "adamw":
    # optax.adamw's own chain, with the decoupled decay in the middle.
    parts.append(optax.chain(optax.scale_by_adam(), decay, optax.scale_by_learning_rate(lr))
                 if progress else optax.adamw(lr, weight_decay=cfg.weight_decay))
  else:
    # Any optax optimizer (or a user's): weight decay as L2 added to the gradient, scaled by
    # progress like sgd's and adam's, the learning rate from the schedule, no clipping here.
    fn, kwargs = optimizer_constructor(cfg.name, cfg.get("args", ""))
    if cfg.weight_decay > 0:
      parts.append(decay)
    parts.append(fn(learning_rate=lr, **kwargs))
  return optax.chain(*parts)


def scale_by_learning_rate_arg() -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by the keyword-only extra arg ``learning_rate`` (default 1)."""
  def update(updates, state, params=None, *, learning_rate=None, **extra):
    del params, extra
    if learning_rate is None:
      return updates, state
    return optax.tree.scale(learning_rate, updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def weight_decay_mode(cfg: ml_collections.ConfigDict) -> str:
  """``cfg.weight_decay_mode`` (``"progress"`` when the key is absent), checked."""
  mode = cfg.get("weight_decay_mode", "progress")
  if mode not in WEIGHT_DECAY_MODES:
    raise ValueError(f"optimizer.weight_decay_mode={mode!r} is invalid; allowed: "
                     f"{', '.join(WEIGHT_DECAY_MODES)}")
  return mode


def make_sync_chain(cfg: ml_collections.ConfigDict,
                    sync_transform: optax.GradientTransformationExtraArgs,
                    num_replicas: int, *, inner_view: Callable | None = None
                    ) -> optax.GradientTransformationExtraArgs:
  """The simulator's chain: sync transform, one optimizer per replica, the ``learning_rate`` arg.

  Worker gradients ``[W, ...]`` in, replica updates ``[R, ...]`` out. The
  replicas' optimizers run at learning rate 1; the round's extra arg
  ``learning_rate`` scales their updates (``scale_by_learning_rate_arg``).
  No replica clips: the workers clipped their gradients (``cfg.grad_clip``,
  :func:`clip_gradient`) before they were scaled and pushed.

  Weight decay (``cfg.weight_decay_mode``):

  * ``"progress"``: every replica decays in proportion to the gradient mass it
    applies (``gssp_jax.sync.decay``): BSP's round has mass 1, an ASP push
    ``1/W``, a GSSP delivery of K pushes ``K/W``. Per epoch of data every
    scheme then decays as BSP does, as the learning-rate schedule follows
    epochs rather than server steps. L2 for ``sgd``/``adam`` (added to the
    gradient), decoupled for ``adamw``.
  * ``"per_step"``: the full decay at every optimizer step of every replica,
    as the GSSP authors' servers do; an asynchronous server then decays up to
    W times more per epoch than BSP.

  ``inner_view`` wraps the one-replica optimizer (``sim.flat.on_tree``: the
  level executor's flat weights seen as the model's pytree).
  """
  inner = make_optimizer(cfg, 1, 1, unit_learning_rate=True)
  if inner_view is not None:   # the level executor's flat weights, for a per-tensor rule
    inner = inner_view(inner)
  if weight_decay_mode(cfg) == "per_step" or not cfg.weight_decay > 0:
    return optax.chain(sync_transform, transforms.replicated(inner, num_replicas),
                       scale_by_learning_rate_arg())
  return optax.chain(decay_lib.with_gradient_mass(sync_transform),
                     decay_lib.replicated_with_mass(inner, num_replicas),
                     scale_by_learning_rate_arg())


# -- the local-update schemes' optimizers (their keys: ``sync.local``) ------------------------


def inner_optimizer(config: ml_collections.ConfigDict, steps_per_epoch: int,
                    total_steps: int) -> optax.GradientTransformation:
  """A local-update scheme's workers' inner optimizer: ``local.optimizer.*``, its schedule over
  the worker's own steps."""
  return make_optimizer(local_lib.inner_config(config), steps_per_epoch, total_steps)


def server_chain(config: ml_collections.ConfigDict, scheme, *, inner_view=None):
  """``scheme``'s (a ``sync.Scheme``) sync chain: :func:`make_sync_chain` of
  ``sync.local.outer_config`` (the server's optimizer), or Delayed Nesterov's.

  A scheme that declares ``own_optimizer`` (HALoS: its transform applies both its servers'
  optimizers) is its own chain. ``inner_view``: see :func:`make_sync_chain` (Delayed Nesterov
  and HALoS are elementwise: they need none).
  """
  transform, num_replicas = scheme.transform, scheme.num_replicas
  if scheme.own_optimizer:
    return transform
  n = config.local.delayed_nesterov
  if not n:
    return make_sync_chain(local_lib.outer_config(config), transform, num_replicas,
                           inner_view=inner_view)
  outer = local_lib.delayed_nesterov(config.optimizer.momentum, n, num_workers=config.num_workers)
  return optax.chain(transform, transforms.replicated(outer, num_replicas),
                     scale_by_learning_rate_arg())
