"""The scheme registry: a config's ``sync.*`` names a transform and a protocol that belong together."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection, Sequence

import numpy as np
import optax

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.sync import arguments
from gssp_jax.sync import legs as legs_lib
from gssp_jax.sync import local as local_lib
from gssp_jax.sync import transforms
from gssp_jax.sync.protocol import Protocol

# Every scheme, the built-ins first (each registered by its package under ``sync/schemes/``,
# which ``sync`` imports after this module): name -> builder(config, worker_times) -> Scheme.
_REGISTERED: dict[str, Callable[..., "Scheme"]] = {}
# The ``config.sync.*`` keys each scheme reads, as it was registered (a scheme registered without
# them may read any): a key changed from its default under a scheme that does not read it is
# rejected by :func:`validate`; the keys it reads are its builder's to check.
SYNC_KEYS: dict[str, tuple[str, ...]] = {}
# What a built-in registers besides (sync/schemes/*/__init__.py, :func:`register_built_in`):
# its keyword builder (W, **settings) -> Scheme, for :func:`build_scheme`.
_KEYWORD_BUILDERS: dict[str, Callable[..., "Scheme"]] = {}
# Name -> sync_config -> the run log's words on its settings (:func:`settings_line`).
_SETTINGS_LINES: dict[str, Callable[[Any], str]] = {}
# What only a built-in has, asked about here rather than by name elsewhere: BSP without a cluster
# trains in the fused data-parallel loop (executors.FusedBSP, BSP's own math); GDTopK's ratios are
# per GSSP group.
_FUSED_LOOP: set[str] = set()
_GROUP_RATIOS: set[str] = set()
# The built-ins' names, fixed once every built-in registered (:func:`fix_built_ins`): a
# researcher's scheme may not take them.
_FIXED: tuple[str, ...] = ()
SCHEMES: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Scheme:
  """A sync scheme ready to run.

  Attributes:
    name: the registry name.
    transform: the device half (worker gradients -> replica updates).
    make_protocol: builds a fresh host half (protocols are stateful).
    num_workers: W.
    num_replicas: R, the leading axis of the replicas' weights.
    groups: ``[W]`` the exchange group of each worker (GSSP groups, InHAD
      nodes, CASP/DS-Sync: all 0); GDTopK takes its ratios per group.
    own_optimizer: the transform applies its servers' optimizers itself
      (HALoS: a Delayed Nesterov per local server and one at the global
      server), so its updates are final and nothing is chained after it.
    legs: its legs class (``sync.legs``): the delays and the bytes per class
      of its pushes, pulls and messages; the default, ``ServerLegs``, sends
      every push and pull over the worker's own link to its server.
  """
  name: str
  transform: optax.GradientTransformationExtraArgs
  make_protocol: Callable[[], Protocol]
  num_workers: int
  num_replicas: int
  groups: np.ndarray
  own_optimizer: bool = False
  legs: type = legs_lib.ServerLegs

  def chain(self, optimizer: optax.GradientTransformation | None,
            compressor: optax.GradientTransformationExtraArgs | None = None
            ) -> optax.GradientTransformationExtraArgs:
    """``optax.chain([compressor,] transform, replicated(optimizer, R))``.

    A scheme with ``own_optimizer`` (HALoS) takes ``optimizer=None``: ``[compressor,] transform``.

    Raises:
      ValueError: an optimizer for a scheme with its own, or None for one without.
    """
    if self.own_optimizer != (optimizer is None):
      raise ValueError(f"scheme {self.name!r}: optimizer={optimizer!r} is invalid; allowed: "
                       + ("None (its transform applies its servers' own optimizers)"
                          if self.own_optimizer else "an optax optimizer for its replicas"))
    parts = ([compressor] if compressor is not None else []) + [self.transform]
    if optimizer is not None:
      parts.append(transforms.replicated(optimizer, self.num_replicas))
    return optax.chain(*parts)


def build_scheme(name: str, num_workers: int, *, staleness: int = 3,
                 staleness_range=(3, 15), num_groups: int = 4, grouping_method: str = "speed",
                 inter_group: str = "peer", forward_every: int | None = None,
                 num_nodes: int = 4, inhad_threshold: int | None = None,
                 group_size: int = 2, casp_max_communities: int = 4,
                 casp_reconfigure_every: int = 64, casp_traffic_penalty: float = 0.01,
                 worker_times=None, seed: int = 0, scale: float | None = None,
                 halos: dict | None = None) -> Scheme:
  """Builds built-in scheme ``name`` for ``num_workers`` from keyword settings; every argument
  is checked here, before any JAX (a config goes through :func:`scheme_from_config`).

  ``worker_times`` ([W] iteration times or slowdown factors) feeds the speed
  groupings; without it all workers count as equally fast. ``halos``: the
  HALoS settings (``merge_weight``, ``local_learning_rate``, ``local_momentum``,
  ``local_period``, ``global_momentum``, ``global_period``; ``halos_settings``).
  Each scheme reads the settings it has (:data:`SYNC_KEYS`) and ignores the others.

  Raises:
    ValueError: an unknown name or an invalid argument, naming the value and
      what is allowed.
  """
  if name not in _KEYWORD_BUILDERS:
    raise ValueError(f"sync scheme={name!r} is invalid; allowed: {', '.join(_KEYWORD_BUILDERS)} "
                     "(register others with register_scheme)")
  W = arguments.check_int(name, "num_workers", num_workers, 1)
  return _KEYWORD_BUILDERS[name](
      W, staleness=staleness, staleness_range=staleness_range, num_groups=num_groups,
      grouping_method=grouping_method, inter_group=inter_group, forward_every=forward_every,
      num_nodes=num_nodes, inhad_threshold=inhad_threshold, group_size=group_size,
      casp=dict(max_communities=casp_max_communities, reconfigure_every=casp_reconfigure_every,
                traffic_penalty=casp_traffic_penalty, seed=seed),
      worker_times=worker_times, seed=seed, scale=scale, halos=halos)


def zeros(W: int) -> np.ndarray:
  """``[W]`` zeros: the groups of a scheme without groups."""
  return np.zeros([W], np.int32)


def register_scheme(name: str, builder: Callable[..., Scheme],
                    sync_keys: Sequence[str] | None = None,
                    local: local_lib.LocalUpdate | None = None) -> None:
  """Adds a scheme so that ``config.sync.scheme=name`` trains with it (simulator, sweeps).

  The built-in schemes are registered through it too (:func:`register_built_in`).

  Args:
    name: a new name (not a built-in one); registering it again replaces the builder.
    builder: ``builder(config, worker_times) -> Scheme``; ``worker_times`` is
      ``[W]`` iteration times (or slowdown factors) of the cluster, or None
      when the config is only being validated. It should raise ValueError for
      bad settings, as the built-ins do: it checks the keys it reads.
    sync_keys: the ``config.sync.*`` keys it reads (e.g. ``("staleness",)``); any other
      changed from its default is then rejected at validation, naming the schemes that
      read it. None: it may read any.
    local: for a local-update scheme (its workers take ``local.steps`` inner steps per push),
      how it uses ``config.local`` (``sync.local.LocalUpdate``); None for any other.

  Raises:
    ValueError: a built-in or non-identifier name, a builder that is not callable, or a
      ``sync_keys`` entry that is no ``config.sync`` key.
  """
  if not isinstance(name, str) or not name.isidentifier() or name in _FIXED:
    raise ValueError(f"scheme name={name!r} is invalid; allowed: a new identifier, not one of "
                     f"{', '.join(_FIXED)}")
  if not callable(builder):
    raise ValueError(f"register_scheme({name!r}): builder={builder!r} is invalid; allowed: a "
                     "callable (config, worker_times) -> Scheme")
  if sync_keys is not None and name not in _KEYWORD_BUILDERS:   # a researcher's: each must exist
    known = defaults.default_config().sync
    for key in sync_keys:
      node = known
      for part in str(key).split("."):
        node = node.get(part) if hasattr(node, "get") else None
      if part == "scheme" or node is None:
        raise ValueError(f"register_scheme({name!r}): sync_keys entry {key!r} is invalid; "
                         f"allowed: keys of config.sync but scheme ({', '.join(known)})")
  if local is not None and not isinstance(local, local_lib.LocalUpdate):
    raise ValueError(f"register_scheme({name!r}): local={local!r} is invalid; allowed: None or "
                     "a sync.local.LocalUpdate")
  _REGISTERED[name] = builder
  SYNC_KEYS.pop(name, None)
  if sync_keys is not None:
    SYNC_KEYS[name] = tuple(sync_keys)
  local_lib.LOCAL.pop(name, None)
  if local is not None:
    local_lib.LOCAL[name] = local


def unregister_scheme(name: str) -> None:
  """Removes a scheme added with :func:`register_scheme` (no-op if absent; never a built-in)."""
  if name not in _FIXED:
    _REGISTERED.pop(name, None)
    SYNC_KEYS.pop(name, None)
    local_lib.LOCAL.pop(name, None)


def settings_line(name: str, sync_config) -> str:
  """The run log's words on built-in ``name``'s settings (``", staleness bound 3 clocks
  ahead"``), '' for others. The bound counts clocks ahead of the slowest worker; the progress
  lines' measured staleness counts updates of the gradient's server (docs/USAGE.md,
  "Staleness: the bound and the measured figure")."""
  line = _SETTINGS_LINES.get(name)
  return line(sync_config) if line is not None else ""


def has_fused_loop(name: str) -> bool:
  """Whether scheme ``name`` trains in the fused data-parallel loop when no cluster is set."""
  return name in _FUSED_LOOP


def scheme_names() -> tuple[str, ...]:
  """Every name ``config.sync.scheme`` accepts: the built-ins, then the registered ones."""
  return tuple(_REGISTERED)


def scheme_from_config(config, worker_times=None) -> Scheme:
  """Builds ``config.sync.scheme`` with its registered builder (the built-ins' included)."""
  builder = _REGISTERED.get(config.sync.scheme)
  if builder is None:
    raise ValueError(f"sync scheme={config.sync.scheme!r} is invalid; allowed: "
                     f"{', '.join(_REGISTERED)} (register others with register_scheme)")
  scheme = builder(config, worker_times)
  if not isinstance(scheme, Scheme) or scheme.num_workers != config.num_workers:
    raise ValueError(f"the builder of registered scheme {config.sync.scheme!r} returned "
                     f"{scheme!r}; allowed: a Scheme with num_workers={config.num_workers}")
  return scheme


def _settings_from_config(config, worker_times) -> dict[str, Any]:
  """:func:`build_scheme`'s keyword settings from ``config.sync.*`` (the built-ins' builders;
  a built-in that reads more adds its own, :func:`register_built_in`'s ``more_settings``)."""
  s = config.sync
  opt = lambda key, default: s.get(key, default)
  casp = opt("casp", None)
  return dict(
      staleness=opt("staleness", 3), staleness_range=tuple(opt("staleness_range", (3, 15))),
      num_groups=opt("num_groups", 4), grouping_method=opt("grouping", "speed"),
      inter_group=opt("inter_group", "peer"), forward_every=opt("forward_every", 0) or None,
      num_nodes=opt("num_nodes", 4), inhad_threshold=opt("inhad_threshold", 0) or None,
      group_size=opt("group_size", 2),
      casp_max_communities=casp.max_communities if casp else 4,
      casp_reconfigure_every=casp.reconfigure_every if casp else 64,
      casp_traffic_penalty=casp.traffic_penalty if casp else 0.01,
      worker_times=worker_times, seed=config.get("seed", 0))


def register_built_in(name: str, build: Callable[..., Scheme], sync_keys: Sequence[str], *,
                      local: local_lib.LocalUpdate | None = None,
                      settings_line: Callable[[Any], str] | None = None,
                      more_settings: Callable[[Any], dict] | None = None,
                      fused_loop: bool = False, group_ratios: bool = False) -> None:
  """Registers built-in scheme ``name`` (its package under ``sync/schemes/`` calls it) with
  :func:`register_scheme`, exactly as a researcher's, and what only a built-in has besides.

  Args:
    name: the scheme's name.
    build: ``(W, **settings) -> Scheme``, reading the settings it has (:func:`build_scheme`).
    sync_keys, local: :func:`register_scheme`'s.
    settings_line: ``sync_config -> str``, the run log's words (:func:`settings_line`).
    more_settings: ``config -> dict``, keyword settings it reads beyond
      :func:`_settings_from_config`'s (HALoS's ``halos``).
    fused_loop: it trains in the fused data-parallel loop when no cluster is set (BSP).
    group_ratios: its groups take GDTopK's per-group ratios (GSSP).
  """
  if _FIXED:
    raise ValueError(f"register_built_in({name!r}): the built-ins are fixed; use "
                     "register_scheme")
  _KEYWORD_BUILDERS[name] = build

  def from_config(config, worker_times):
    settings = _settings_from_config(config, worker_times)
    if more_settings is not None:
      settings.update(more_settings(config))
    return build_scheme(name, config.num_workers, **settings)
  register_scheme(name, from_config, tuple(sync_keys), local)
  if settings_line is not None:
    _SETTINGS_LINES[name] = settings_line
  if fused_loop:
    _FUSED_LOOP.add(name)
  if group_ratios:
    _GROUP_RATIOS.add(name)


def fix_built_ins() -> None:
  """Fixes the built-ins' names (``sync/schemes/__init__.py`` calls it once every built-in
  registered): a researcher's scheme may not take one."""
  global _FIXED, SCHEMES
  SCHEMES = _FIXED = tuple(_KEYWORD_BUILDERS)


def check_name(config) -> None:
  """``config.sync.scheme`` names a scheme: a built-in or a registered one."""
  checks.choice(config, "sync.scheme", scheme_names())


def validate(config, *, allow_unread: Collection[str] = ()) -> None:
  """``config.sync.*``: builds the scheme (host-only, no compilation), checks the keys it does not read.

  Args:
    config: the run's config.
    allow_unread: dotted ``sync.*`` keys that may differ from their default
      although the scheme does not read them: what a sweep's base config sets
      for its other trials (``sweep.expand``). Their range checks still run.

  Raises:
    ValueError: one line naming the ``config.sync`` key, its value and what is allowed.
  """
  check_name(config)
  reads = SYNC_KEYS.get(config.sync.scheme)
  if config.sync.regroup_every_epoch and reads is not None and "regroup_every_epoch" not in reads:
    # Not left to allow_unread: the simulator regroups whenever it is set.
    readers = " or ".join(map(repr, _readers("regroup_every_epoch")))
    checks.fail("sync.regroup_every_epoch", True,
                f"True only with sync.scheme={readers} (False otherwise)")
  check_unread_sync_keys(config, allow_unread)
  try:
    scheme = scheme_from_config(config)
  except ValueError as e:
    raise ValueError(f"config.sync (scheme {config.sync.scheme!r}): {e}") from None
  if config.compress.name == "gdtopk" and config.sync.scheme not in _GROUP_RATIOS:
    allowed = ", ".join(repr(n) for n in sorted(_GROUP_RATIOS))
    checks.fail("compress.name", "gdtopk", f"gdtopk only with sync.scheme={allowed} (its ratios "
                "are per group); use topk or dgc otherwise")
  if scheme.legs.dense_only and config.compress.name != "none":
    checks.fail("compress.name", config.compress.name,
                f"'none' with sync.scheme={config.sync.scheme!r} (its legs move dense gradients "
                "only: a ring all-reduce sums dense chunks)")
  topology = config.cluster.get("topology", "")
  if topology and not scheme.legs.supports_topology:
    checks.fail("cluster.topology", topology,
                f"'' (none) with sync.scheme={config.sync.scheme!r}: its legs "
                f"({scheme.legs.__name__}) keep transfers inside a node, a community or a ring, "
                "which a topology's regions do not model (sync.legs: supports_topology)")


def _check_staleness_range(key, value):
  ok = (isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and value[0] <= value[1])
  if not ok:
    checks.fail(key, value, "a pair (s_L, s_U) of ints with 0 <= s_L <= s_U")


# The range/type check of every sync key, run under every scheme: a scheme's builder checks
# the keys it reads (with their relations, e.g. num_groups dividing num_workers); these check
# the others, which must still hold a value that could apply.
_SYNC_CHECKS = {
    "staleness": checks.int_at_least(0),
    "staleness_range": _check_staleness_range,
    "num_groups": checks.int_at_least(1),
    "grouping": checks.one_of("speed", "kmeans", "round_robin", "contiguous"),
    "regroup_every_epoch": checks.check_bool,
    "inter_group": checks.one_of("peer", "global"),
    "forward_every": checks.int_at_least(0),
    "num_nodes": checks.int_at_least(1),
    "inhad_threshold": checks.int_at_least(0),
    "group_size": checks.int_at_least(1),
    "casp.max_communities": checks.int_at_least(1),
    "casp.reconfigure_every": checks.int_at_least(1),
    "casp.traffic_penalty": checks.check_non_negative,
}


def _sync_values(config):
  """``(key, value, default)`` of every sync key in ``_SYNC_CHECKS`` that ``config`` has.

  A config recorded before a key existed lacks it: its default applies, so it is skipped.
  """
  sync_defaults = defaults.default_config().sync
  for key in _SYNC_CHECKS:
    try:
      value = checks.get(config.sync, key)
    except (KeyError, AttributeError):
      continue
    yield key, value, checks.get(sync_defaults, key)


def check_unread_sync_keys(config, allow_unread: Collection[str] = ()) -> None:
  """Range-checks the sync keys the scheme does not read and rejects any changed from its default.

  Schemes registered without ``sync_keys`` may read any key, so only the
  range checks run for them; keys in ``allow_unread`` are only range-checked.

  Raises:
    ValueError: one line naming the key, its value, and why it cannot apply.
  """
  scheme = config.sync.scheme
  reads = SYNC_KEYS.get(scheme)
  for key, value, default in _sync_values(config):
    if reads is not None and key in reads:
      continue   # the scheme's builder checks it
    _SYNC_CHECKS[key](f"sync.{key}", value)
    if (reads is not None and f"sync.{key}" not in allow_unread
        and defaults.comparable(value) != defaults.comparable(default)):
      raise ValueError(
          f"config.sync.{key}={value!r} cannot apply: sync.scheme={scheme!r} does not read it"
          f" (read only by {', '.join(_readers(key))}); leave it at its default {default!r}")


def _readers(key: str) -> list[str]:
  """The schemes registered as reading ``config.sync.<key>``."""
  return [name for name, keys in SYNC_KEYS.items() if key in keys]


def changed_sync_keys(config) -> tuple[str, ...]:
  """The dotted ``sync.*`` keys (but ``scheme``) whose value differs from the default."""
  return tuple(f"sync.{key}" for key, value, default in _sync_values(config)
               if defaults.comparable(value) != defaults.comparable(default))

def describe(scheme: Scheme) -> dict[str, Any]:
  return dict(name=scheme.name, num_workers=scheme.num_workers, num_replicas=scheme.num_replicas,
              groups=scheme.groups.tolist())
