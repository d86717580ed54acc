"""The server-side optimizer, built from ``config.optimizer``."""

from __future__ import annotations

import ml_collections
import optax


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


def make_optimizer(cfg: ml_collections.ConfigDict, steps_per_epoch: int,
                   total_steps: int, *, unit_learning_rate: bool = False
                   ) -> optax.GradientTransformation:
  """SGD with momentum and PyTorch-style L2 weight decay, or Adam / AdamW.

  With ``unit_learning_rate`` the learning rate is 1 and the caller scales the
  updates by the schedule itself (the simulator does, from training progress,
  because an asynchronous server's step count is not the run's progress).
  """
  lr = 1.0 if unit_learning_rate else learning_rate_schedule(cfg, steps_per_epoch, total_steps)
  parts = []
  if cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(cfg.grad_clip))
  if cfg.name == "sgd":
    # PyTorch-style weight decay: added to the gradient before momentum.
    if cfg.weight_decay > 0:
      parts.append(optax.add_decayed_weights(cfg.weight_decay))
    parts.append(optax.sgd(lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov))
  elif cfg.name == "adam":
    if cfg.weight_decay > 0:
      parts.append(optax.add_decayed_weights(cfg.weight_decay))
    parts.append(optax.adam(lr))
  elif cfg.name == "adamw":
    parts.append(optax.adamw(lr, weight_decay=cfg.weight_decay))
  else:
    raise ValueError(f"optimizer.name={cfg.name!r}; allowed: sgd, adam, adamw")
  return optax.chain(*parts)


def scale_by_learning_rate_arg() -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by the keyword-only extra arg ``learning_rate`` (default 1)."""
  def update(updates, state, params=None, *, learning_rate=None, **extra):
    del params, extra
    if learning_rate is None:
      return updates, state
    return optax.tree.scale(learning_rate, updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
