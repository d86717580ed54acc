"""The configuration contract: the defaults every config file starts from, and validation.

Config files under ``configs/`` call :func:`default_config` (from the leaf
:mod:`gssp_jax.defaults`, which holds every key with its meaning) and change
only what differs. :func:`validate_config` runs before any data is read or
anything is compiled, and names the offending key, its value and what is
allowed. It holds no check of its own but those of the run itself (seed,
sizes, the training loop's keys): each part is validated where it is built,
and this module calls them in order.

A config is validated once a run: where the run begins (``experiments.main`` through
``train_and_evaluate``, a sweep when it loads its trials, ``experiments.launch`` before it starts
any process). :func:`validate_config` remembers what it accepted, by content, and
:func:`ensure_valid` (``train_and_evaluate``'s entry) checks only a config it has not accepted in
this process; nothing below the entry checks again.
"""

from __future__ import annotations

import collections
import hashlib
import math
from typing import Collection

import ml_collections

from gssp_jax import checks
from gssp_jax import compress
from gssp_jax import defaults
from gssp_jax.runtime import settings as runtime_settings
from gssp_jax.sim import cluster
from gssp_jax.sync import local as local_lib
from gssp_jax.sync import registry
from gssp_jax import executors
from gssp_jax.base import optim
from gssp_jax.base import tasks

# The public names of the contract (config files and notebooks use them from here too).
default_config = defaults.default_config
parse_arg = defaults.parse_arg


def override(config: ml_collections.ConfigDict, changes: dict, *,
             check_types: bool = True) -> ml_collections.ConfigDict:
  """Sets dotted keys in place (``{"sync.scheme": "gssp"}``), as ``--config.key=value`` does.

  Raises:
    KeyError: a key that the config does not have, naming it, the keys it probably meant (in
      any section) and the keys allowed where it points (:func:`defaults.unknown_key_message`).
  """
  for key, value in changes.items():
    node = config
    *path, leaf = key.split(".")
    for part in path:
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise KeyError(defaults.unknown_key_message(config, key))
      node = node[part]
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise KeyError(defaults.unknown_key_message(config, key))
    if check_types:
      node[leaf] = value
    else:
      with node.ignore_type():
        node[leaf] = value
  return config


def validate_config(config: ml_collections.ConfigDict, *,
                    allow_unread: Collection[str] = ()) -> None:
  """Raises ValueError naming the first invalid key; runs before any compilation.

  Each part checks its own keys, in this order: the task (model, dataset,
  ``data.*``), the scheme's name, the compressor, the optimizer, the run's own
  keys, the sync scheme, the local-update keys, the real runtime's settings,
  the cluster, the executor, the clocks the executor must have.

  Args:
    config: the run's config.
    allow_unread: dotted ``sync.*`` keys that may differ from their default
      although the scheme does not read them: what a sweep's base config sets
      for its other trials (``sweep.expand``). Their range checks still run.
  """
  key = _fingerprint(config, allow_unread)
  tasks.validate(config)
  registry.check_name(config)
  compress.validate(config)
  optim.validate(config, "optimizer")
  _check_run(config)
  registry.validate(config, allow_unread=allow_unread)
  if "local" in config:   # absent from a config recorded before the local-update schemes
    optim.validate(config, "local.optimizer")
  local_lib.validate(config)
  runtime_settings.validate(config)
  cluster.validate(config)
  executors.validate(config)
  _check_budget(config)
  _check_simulated_times(config)
  _ACCEPTED[key] = None
  while len(_ACCEPTED) > _ACCEPTED_KEPT:
    _ACCEPTED.popitem(last=False)


# Fingerprints of the configs validate_config accepted in this process (the newest kept).
_ACCEPTED: collections.OrderedDict[str, None] = collections.OrderedDict()
_ACCEPTED_KEPT = 4096


def _fingerprint(config: ml_collections.ConfigDict, allow_unread: Collection[str]) -> str:
  """A config's content (every key and value, sorted) with the keys it may leave unread."""
  text = config.to_json_best_effort(sort_keys=True) + "\n" + ",".join(sorted(allow_unread))
  return hashlib.sha256(text.encode()).hexdigest()


def ensure_valid(config: ml_collections.ConfigDict, *,
                 allow_unread: Collection[str] = ()) -> bool:
  """Validates ``config`` unless this process accepted the same content before; True if it ran.

  What a run's entry calls (``train_and_evaluate``): a config its caller validated already (the
  command line, a sweep loading its trials) is not checked twice, and a config changed since is
  checked again (the fingerprint is its content, not the object).
  """
  if _fingerprint(config, allow_unread) in _ACCEPTED:
    return False
  validate_config(config, allow_unread=allow_unread)
  return True


def _check_run(config: ml_collections.ConfigDict) -> None:
  """The keys of the run itself: its seed, its size, the training loop's ``train.*``."""
  if not isinstance(config.seed, int) or isinstance(config.seed, bool):
    checks.fail("seed", config.seed, "an integer")
  for key in ("num_workers", "batch_size", "train.max_checkpoints", "train.log_every"):
    checks.positive(config, key, int)
  every = config.train.checkpoint_every
  if isinstance(every, bool) or not isinstance(every, int) or every < 0:
    checks.fail("train.checkpoint_every", every,
                "an integer >= 0 (evaluations between checkpoints; 0 = not by count)")
  for key in ("train.num_epochs", "train.eval_every"):
    checks.positive(config, key)
  for key in ("train.target_accuracy", "train.target_bleu", "train.stop_after_updates"):
    checks.non_negative(config, key)
  if not isinstance(config.train.stop_after_updates, int):
    checks.fail("train.stop_after_updates", config.train.stop_after_updates, "an integer >= 0")
  if config.train.target_accuracy > 1:
    checks.fail("train.target_accuracy", config.train.target_accuracy,
                "a fraction in [0, 1] (0 = no target)")
  for key, off in (("virtual_budget", "0 = off: the run lasts train.num_epochs"),
                   ("eval_every_seconds", "0 = off: evaluations every train.eval_every epochs")):
    _check_seconds(config, key, f"a finite number of virtual seconds >= 0 ({off})")
  _check_seconds(config, "checkpoint_every_seconds",
                 "a finite number of wall seconds >= 0 (0 = no checkpoints by time)")
  if config.data.train_size and config.data.train_size < config.num_workers:
    checks.fail("data.train_size", config.data.train_size,
                f"0 (all) or at least num_workers={config.num_workers}")


def _check_seconds(config: ml_collections.ConfigDict, key: str, allowed: str) -> None:
  """``train.{key}`` is a finite number >= 0 (0 when absent: a config recorded before it)."""
  seconds = config.train.get(key, 0.0)
  if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
      or not 0 <= seconds < math.inf):
    checks.fail(f"train.{key}", seconds, allowed)


def _check_budget(config: ml_collections.ConfigDict) -> None:
  """Seconds of a run's clock need one: ``train.virtual_budget`` the simulator's or the real
  runtime's (its wall clock), ``train.eval_every_seconds`` the simulator's. A budget also needs
  a schedule that its clock can drive: no warm-up (counted in epochs), and the local-update
  schemes' inner schedule constant (it runs over each worker's own steps, on the device)."""
  _check_virtual_clock(config, "virtual_budget", ("fused",))
  _check_virtual_clock(config, "eval_every_seconds", ("fused", "dist"))
  budget = config.train.get("virtual_budget", 0.0)
  _check_warmup_seconds(config.optimizer.get("warmup_seconds", 0.0), budget)
  if not budget:
    return
  where = f"with config.train.virtual_budget={budget!r}"
  keys = [("optimizer.warmup_epochs", 0.0, "0 (a warm-up is counted in epochs; "
             "optimizer.warmup_seconds counts virtual seconds)")]
  if "local" in config:
    keys += [("local.optimizer.schedule", "constant", "'constant' (the inner schedule runs "
              "over each worker's own steps, not virtual time)"),
             ("local.optimizer.warmup_epochs", 0.0, "0 (a warm-up is counted in epochs)")]
  if (local_lib.workers_run_optimizer(config.sync.scheme)
      and config.optimizer.get("warmup_seconds", 0.0)):
    raise ValueError(f"config.optimizer.warmup_seconds={config.optimizer.warmup_seconds!r} "
                     f"cannot go with sync.scheme={config.sync.scheme!r} (its optimizer.* is the"
                     " workers' own, over their steps; its server averages); allowed: 0")
  for key, allowed, why in keys:
    value = checks.get(config, key)
    if value != allowed:
      raise ValueError(f"config.{key}={value!r} cannot go {where}; allowed: {why}, or "
                       "virtual_budget=0")


def _check_warmup_seconds(seconds, budget: float) -> None:
  """``optimizer.warmup_seconds``: a number in ``[0, budget)``, and 0 without a budget."""
  if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
      or not 0 <= seconds < math.inf):
    checks.fail("optimizer.warmup_seconds", seconds, "a finite number of virtual seconds >= 0")
  if seconds and not budget:
    raise ValueError(f"config.optimizer.warmup_seconds={seconds!r} needs "
                     "train.virtual_budget > 0 (it is a warm-up in virtual seconds); allowed: 0, "
                     "or optimizer.warmup_epochs for a run measured in epochs")
  if seconds and seconds >= budget:
    raise ValueError(f"config.optimizer.warmup_seconds={seconds!r} is invalid with "
                     f"train.virtual_budget={budget!r}; allowed: fewer seconds than the budget")


# Seconds only the simulator's clock charges: the real runtime's servers apply and its workers
# compress in their own real time, and the fused BSP loop has no clock.
SIMULATED_TIMES = ("cluster.server_update_time", "compress.compute_time")


def _check_simulated_times(config: ml_collections.ConfigDict) -> None:
  """Each of :data:`SIMULATED_TIMES` > 0 needs the simulator (not ``fused``, not ``dist``)."""
  name = executors.executor_name(config, backend="cpu")   # the backend picks only among sims
  if name not in ("fused", "dist"):
    return
  for key in SIMULATED_TIMES:
    section, leaf = key.split(".")
    seconds = config[section].get(leaf, 0.0)
    if not seconds:
      continue
    what = ("the real runtime's servers and workers take their own real time for it"
            if name == "dist" else "BSP without a cluster trains in the fused loop, which has no "
            "virtual time")
    raise ValueError(f"config.executor={config.get('executor', 'auto')!r} (runs as {name!r}) "
                     f"cannot go with config.{key}={seconds!r}: {what}; allowed: a simulated "
                     "cluster (set cluster.profile, or executor='rounds' or 'levels'), or "
                     f"{key}=0")


def _check_virtual_clock(config: ml_collections.ConfigDict, key: str, refused) -> None:
  """``train.{key}`` > 0 counts seconds of a clock the executors ``refused`` lack or ignore."""
  seconds = config.train.get(key, 0.0)
  name = executors.executor_name(config, backend="cpu")   # the backend picks only among sims
  if seconds and name in refused:
    what = ("the real runtime evaluates at pushes, not at seconds of its clock" if name == "dist"
            else "BSP without a cluster trains in the fused loop, which has no virtual time")
    raise ValueError(f"config.executor={config.get('executor', 'auto')!r} (runs as {name!r}) "
                     f"cannot go with config.train.{key}={seconds!r}: {what}; allowed: a "
                     "simulated cluster (set cluster.profile, or executor='rounds' or "
                     f"'levels'), or {key}=0")
