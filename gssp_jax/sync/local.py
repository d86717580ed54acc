"""The local-update schemes' parts: local steps per worker (DyLU), the inner optimizer, Delayed Nesterov.

A local-update scheme's worker job is ``H`` inner optimizer steps from the
weights it pulled (``sim.executor.make_local_update``); it pushes the
pseudo-gradient ``pulled - local``, which the server treats as a gradient:

* ``local_sgd``: each worker runs ``optimizer.*`` locally (Local SGD / FedAvg);
  BSP's round (the mean of the W pseudo-gradients) is applied with SGD at
  learning rate 1, so the server's weights become the workers' mean (model
  averaging). With ``local.steps=1`` and no momentum it is BSP.
* ``diloco``: the same round, the workers running ``local.optimizer.*`` and the
  server an outer optimizer, ``optimizer.*`` (DiLoCo: inner AdamW; outer SGD
  with Nesterov momentum 0.9 at learning rate 0.7; Douillard et al. 2023).
* ``async_local_sgd``: ASP's server, each pseudo-gradient applied as it
  arrives (Liu et al. 2024), with Delayed Nesterov (:func:`delayed_nesterov`)
  and dynamic local updates (:func:`local_steps`, DyLU) as options.

Each worker keeps its inner optimizer state across its jobs (DiLoCo's workers
keep their AdamW moments between outer rounds; so does the HALoS authors'
code for every method, ``utnslab/halos``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from gssp_jax import checks
from gssp_jax import defaults

# The optional parts of ``config.local`` a local-update scheme may read (``steps`` and the
# workers' optimizer it always reads).
LOCAL_PARTS = ("dylu", "delayed_nesterov", "halos")
WORKER_OPTIMIZERS = ("local.optimizer", "optimizer")


@dataclasses.dataclass(frozen=True)
class LocalUpdate:
  """How a local-update scheme uses ``config.local``, declared when it is registered
  (``sync.register_scheme(..., local=LocalUpdate(...))``, the built-ins' too) and read here, by
  the config's validation, the optimizers and both executors instead of the scheme's name.

  Attributes:
    workers: whose keys the workers' inner optimizer takes: ``"local.optimizer"`` (the server
      steps ``optimizer.*``: DiLoCo), or ``"optimizer"`` (the server averages the workers'
      models, ``AVERAGING``: Local SGD).
    reads: the optional parts of ``config.local`` it reads (:data:`LOCAL_PARTS`); any other
      changed from its default is refused, naming the schemes that read it.
    delayed_nesterov_server: its server always steps Delayed Nesterov (HALoS), so
      ``optimizer.*`` must be a Nesterov SGD without weight decay.
  """
  workers: str = "local.optimizer"
  reads: tuple[str, ...] = ()
  delayed_nesterov_server: bool = False

  def __post_init__(self):
    if self.workers not in WORKER_OPTIMIZERS:
      raise ValueError(f"LocalUpdate workers={self.workers!r} is invalid; allowed: "
                       f"{', '.join(WORKER_OPTIMIZERS)}")
    bad = [p for p in self.reads if p not in LOCAL_PARTS]
    if bad or isinstance(self.reads, str):
      raise ValueError(f"LocalUpdate reads={self.reads!r} is invalid; allowed: a tuple of "
                       f"{', '.join(LOCAL_PARTS)}")
    if self.delayed_nesterov_server and self.workers != "local.optimizer":
      raise ValueError("LocalUpdate delayed_nesterov_server=True is invalid with workers="
                       "'optimizer' (optimizer.* would be both the workers' and the server's)")


# Name -> declaration of every registered local-update scheme (sync.registry writes it).
LOCAL: dict[str, LocalUpdate] = {}


def is_local(scheme: str) -> bool:
  """True for the local-update schemes (their jobs take ``local.steps`` inner steps)."""
  return scheme in LOCAL


def declaration(scheme: str) -> LocalUpdate:
  """``scheme``'s :class:`LocalUpdate`; a scheme that is not a local-update one has none."""
  if scheme not in LOCAL:
    raise ValueError(f"sync.scheme={scheme!r} is not a local-update scheme; those registered: "
                     f"{', '.join(LOCAL)}")
  return LOCAL[scheme]


def workers_run_optimizer(scheme: str) -> bool:
  """Whether ``scheme``'s workers run ``optimizer.*`` (its server averages: Local SGD)."""
  return is_local(scheme) and LOCAL[scheme].workers == "optimizer"


def _readers(part: str) -> list[str]:
  return [name for name, d in LOCAL.items() if part in d.reads]


def local_steps(steps: int, times, dylu: bool) -> np.ndarray:
  """``[W]`` inner steps of each worker's job: ``steps``, or with DyLU by its speed.

  DyLU (Liu et al. 2024, Eq. 6): ``H_w = floor(H * v_w / v_max)`` with ``v``
  a worker's iterations per second, so the fastest worker takes ``H`` steps
  and every job takes about as long as the fastest worker's. The authors'
  toy notebook keeps at least 5 steps; here a job keeps at least 1 (the
  formula's own floor), so a worker more than ``H`` times slower than the
  fastest still pushes.

  Args:
    steps: H >= 1.
    times: ``[W]`` mean iteration times (or slowdown factors) of the workers.
    dylu: scale by speed.
  """
  times = np.asarray(times, np.float64)
  if not dylu:
    return np.full(times.shape, int(steps), np.int64)
  return np.maximum(1, np.floor(steps * times.min() / times + 1e-9)).astype(np.int64)


# The server of a scheme whose workers run optimizer.* (Local SGD): the mean of their models.
AVERAGING = {"name": "sgd", "learning_rate": 1.0, "momentum": 0.0, "nesterov": False,
             "weight_decay": 0.0, "weight_decay_mode": "progress", "schedule": "constant",
             "warmup_epochs": 0.0, "grad_clip": 0.0}


def inner_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The workers' optimizer as an ``optimizer``-style config (decay per inner step).

  A scheme declared with ``workers="optimizer"`` (Local SGD) has its workers run
  ``config.optimizer``; the others' run ``config.local.optimizer`` (``config.optimizer`` is
  their server's).
  """
  source = (config.optimizer if workers_run_optimizer(config.sync.scheme)
            else config.local.optimizer)
  cfg = ml_collections.ConfigDict({k: source[k] for k in default_inner_keys()})
  cfg.weight_decay_mode = "per_step"   # a worker's own steps: plain optax, decay every step
  cfg.grad_clip = 0.0                  # optimizer.grad_clip clips each inner gradient (executor)
  return cfg


def default_inner_keys() -> tuple[str, ...]:
  """The keys of ``config.local.optimizer`` (an inner optimizer reads these)."""
  return ("name", "args", "learning_rate", "momentum", "nesterov", "weight_decay", "schedule",
          "warmup_epochs")


class DelayedNesterovState(NamedTuple):
  """``momentum``: the outer momentum; ``window``: the sum of ``g / N`` since its last step; ``count``."""
  momentum: Any
  window: Any
  count: jax.Array


def delayed_nesterov(momentum: float, period: int, *, num_workers: int
                     ) -> optax.GradientTransformation:
  """Delayed Nesterov (Liu et al. 2024, the ``DelayedNesterovOptimizer`` of ``utnslab/halos``).

  On each push ``g`` (a pseudo-gradient) the server moves ``-lr * g / N``; the
  momentum ``m`` changes only every ``N`` pushes, to ``beta * m + (sum of the
  window's g) / N``, and that push also moves ``-lr * beta * m``. A window of
  ``N`` pushes is then one Nesterov step on their mean, its plain part applied
  as each push arrives. (The reference's momentum-activation ``c`` is 0, its
  default.)

  In this framework a push reaches the server scaled by ``1/W`` (the sync
  transform's scale), so ``u = g / W`` arrives here and ``g / N = u * W / N``.
  Outputs are descent updates at learning rate 1 (the chain's
  ``learning_rate`` arg scales them), one replica's: ``transforms.replicated``
  steps it only at replicas that apply.

  Args:
    momentum: beta in [0, 1).
    period: N >= 1, pushes per momentum step.
    num_workers: W (undoes the sync transform's scale).
  """
  if not 0 <= momentum < 1:
    raise ValueError(f"delayed_nesterov momentum={momentum!r} is invalid; allowed: [0, 1)")
  if isinstance(period, bool) or not isinstance(period, int) or period < 1:
    raise ValueError(f"delayed_nesterov period={period!r} is invalid; allowed: an int >= 1")
  factor = num_workers / period

  def init(params):
    zeros = lambda: jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return DelayedNesterovState(zeros(), zeros(), jnp.zeros([], jnp.int32))

  def update(updates, state, params=None):
    del params
    count = state.count + 1
    step = count % period == 0
    # The window holds the sum of g / N, so the new momentum is beta m + (sum g) / N.
    window = jax.tree.map(lambda s, u: s + u * factor, state.window, updates)
    new_m = jax.tree.map(lambda m, s: jnp.where(step, momentum * m + s, m), state.momentum,
                         window)
    out = jax.tree.map(lambda u, m: -(u * factor + jnp.where(step, momentum * m, 0.0)),
                       updates, new_m)
    window = jax.tree.map(lambda s: jnp.where(step, 0.0, s), window)
    return out, DelayedNesterovState(new_m, window, count)

  return optax.GradientTransformation(init, update)


def outer_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The server's optimizer config (its schedule too): ``optimizer.*``, or the averaging of a
  scheme whose workers run ``optimizer.*`` (Local SGD)."""
  if workers_run_optimizer(config.sync.scheme):
    return ml_collections.ConfigDict(AVERAGING)
  return config.optimizer


def _check_halos(h) -> None:
  """``config.local.halos.*`` in range."""
  rules = {"merge_weight": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
           "local_learning_rate": (lambda v: v > 0, "a positive number"),
           "local_momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
           "local_period": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
           "global_period": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1")}
  for key, (ok, allowed) in rules.items():
    value = h[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
      checks.fail(f"local.halos.{key}", value, allowed)


def validate(config: ml_collections.ConfigDict) -> None:
  """``config.local.*`` but its optimizer (``base/optim.py`` checks that one).

  In range under a local-update scheme; left at its defaults under any other.

  Raises:
    ValueError: naming the key, its value and what is allowed.
  """
  if "local" not in config:   # a config recorded before the local-update schemes
    return
  if is_local(config.sync.scheme):
    check_local_config(config)
    return
  local_defaults = defaults.default_config().local
  for key in ("steps", "dylu", "delayed_nesterov",
              *(f"optimizer.{k}" for k in local_defaults.optimizer),
              *(f"halos.{k}" for k in local_defaults.get("halos", {}))):
    value, default = checks.get(config.local, key), checks.get(local_defaults, key)
    if defaults.comparable(value) != defaults.comparable(default):
      raise ValueError(
          f"config.local.{key}={value!r} cannot apply: sync.scheme={config.sync.scheme!r} is not"
          f" a local-update scheme ({', '.join(LOCAL)}); leave it at its"
          f" default {default!r}")


def check_local_config(config: ml_collections.ConfigDict) -> None:
  """The ``local.*`` keys of a local-update scheme, and the outer optimizer ``local_sgd`` fixes.

  Raises:
    ValueError: naming the key, its value and what is allowed.
  """
  scheme, local = config.sync.scheme, config.local
  declared = declaration(scheme)
  checks.int_at_least(1)("local.steps", local.steps)
  n = local.delayed_nesterov
  if isinstance(n, bool) or not isinstance(n, int) or n < 0:
    checks.fail("local.delayed_nesterov", n, "an integer >= 0 (0 = off)")
  opt = config.optimizer
  if declared.workers == "optimizer":
    inner_defaults = defaults.default_config().local.optimizer
    for key in default_inner_keys():
      if (defaults.comparable(local.optimizer[key])
          != defaults.comparable(inner_defaults[key])):
        raise ValueError(
            f"config.local.optimizer.{key}={local.optimizer[key]!r} cannot apply to "
            f"sync.scheme={scheme!r}: its workers run optimizer.* and its server averages their"
            " models; set optimizer.* instead, or use sync.scheme='diloco' (workers: "
            "local.optimizer.*, server: optimizer.*)")
  if "halos" in declared.reads:
    _check_halos(local.halos)
  uses_dn = f"local.delayed_nesterov={n}" if n else (
      f"sync.scheme={scheme!r}" if declared.delayed_nesterov_server else None)
  if uses_dn and opt.name != "sgd":
    raise ValueError(f"config.optimizer.name={opt.name!r} cannot apply with {uses_dn}: Delayed "
                     "Nesterov is the server's optimizer (its momentum is optimizer.momentum); "
                     "set optimizer.name='sgd'")
  if uses_dn and (opt.weight_decay or opt.nesterov is not True):
    key, value = (("weight_decay", opt.weight_decay) if opt.weight_decay
                  else ("nesterov", opt.nesterov))
    raise ValueError(f"config.optimizer.{key}={value!r} cannot apply with {uses_dn}: Delayed "
                     "Nesterov is a Nesterov step without weight decay; set "
                     "optimizer.nesterov=True and optimizer.weight_decay=0")
  checks.check_bool("local.dylu", local.dylu)
  for key, value in (("dylu", local.dylu), ("delayed_nesterov", n)):
    if value and key not in declared.reads:
      raise ValueError(f"config.local.{key}={value!r} cannot apply: sync.scheme={scheme!r} "
                       f"does not read it (read only by {', '.join(_readers(key))})")
  if "halos" not in declared.reads:
    halos_defaults = defaults.default_config().local.halos
    for key in halos_defaults:
      if defaults.comparable(local.halos[key]) != defaults.comparable(halos_defaults[key]):
        raise ValueError(f"config.local.halos.{key}={local.halos[key]!r} cannot apply: "
                         f"sync.scheme={scheme!r} does not read it (read only by "
                         f"{', '.join(_readers('halos'))})")
  if not math.isfinite(float(local.optimizer.learning_rate)) \
      or local.optimizer.learning_rate <= 0:
    raise ValueError(f"config.local.optimizer.learning_rate={local.optimizer.learning_rate!r} is "
                     "invalid; allowed: a positive number")
