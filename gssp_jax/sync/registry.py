"""The scheme registry: a config's ``sync.*`` names a transform and a protocol that belong together."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import optax

from gssp_jax.sync import grouping
from gssp_jax.sync import halos as halos_lib
from gssp_jax.sync import transforms
from gssp_jax.sync.protocols.base import Protocol
from gssp_jax.sync.protocols.casp import CASPProtocol
from gssp_jax.sync.protocols.dssync import DSSyncProtocol
from gssp_jax.sync.protocols.gssp import GSSPProtocol
from gssp_jax.sync.protocols.halos import HALoSProtocol
from gssp_jax.sync.protocols.inhad import InHADProtocol
from gssp_jax.sync.protocols.ssp import ASPProtocol
from gssp_jax.sync.protocols.ssp import BSPProtocol
from gssp_jax.sync.protocols.ssp import DSSPProtocol
from gssp_jax.sync.protocols.ssp import SSPProtocol

SCHEMES = ("bsp", "asp", "ssp", "dssp", "gssp", "inhad", "dssync", "casp", "local_sgd", "diloco",
           "async_local_sgd", "halos")
# The ``config.sync.*`` keys each built-in scheme reads (besides ``scheme``); a key changed from
# its default under a scheme that does not read it is rejected by ``config.validate_config``.
SYNC_KEYS = {
    "bsp": (),
    "asp": (),
    "ssp": ("staleness",),
    "dssp": ("staleness_range",),
    "gssp": ("staleness", "num_groups", "grouping", "regroup_every_epoch", "inter_group",
             "forward_every"),
    "inhad": ("num_nodes", "inhad_threshold", "grouping"),
    "dssync": ("group_size",),
    "casp": ("casp.max_communities", "casp.reconfigure_every", "casp.traffic_penalty"),
    # The local-update schemes read config.local.* (gssp_jax/sync/local.py), no sync key.
    "local_sgd": (),
    "diloco": (),
    "async_local_sgd": (),
    "halos": ("num_groups", "grouping", "forward_every"),
}
# Schemes added with register_scheme: name -> builder(config, worker_times) -> Scheme.
_REGISTERED: dict[str, Callable[..., "Scheme"]] = {}


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
  """
  name: str
  transform: optax.GradientTransformationExtraArgs
  make_protocol: Callable[[], Protocol]
  num_workers: int
  num_replicas: int
  groups: np.ndarray
  own_optimizer: bool = False

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
  """Builds scheme ``name`` for ``num_workers``; every argument is checked here, before any JAX.

  ``worker_times`` ([W] iteration times or slowdown factors) feeds the speed
  groupings; without it all workers count as equally fast. ``halos``: the
  HALoS settings (``merge_weight``, ``local_learning_rate``, ``local_momentum``,
  ``local_period``, ``global_momentum``, ``global_period``; ``halos_settings``).

  Raises:
    ValueError: an unknown name or an invalid argument, naming the value and
      what is allowed.
  """
  if name not in SCHEMES:
    raise ValueError(f"sync scheme={name!r} is invalid; allowed: {', '.join(SCHEMES)} "
                     "(register others with register_scheme)")
  W = transforms.check_int(name, "num_workers", num_workers, 1)
  zeros = np.zeros([W], np.int32)
  if name in ("bsp", "local_sgd", "diloco"):   # the local-update ones push pseudo-gradients
    return Scheme(name, transforms.bsp(W, scale=scale), lambda: BSPProtocol(W), W, 1, zeros)
  if name == "async_local_sgd":
    return Scheme(name, transforms.asp(W, scale=scale), lambda: ASPProtocol(W), W, 1, zeros)
  if name == "asp":
    return Scheme(name, transforms.asp(W, scale=scale), lambda: ASPProtocol(W), W, 1, zeros)
  if name == "ssp":
    s = transforms.check_int("ssp", "staleness", staleness, 0)
    return Scheme(name, transforms.ssp(W, s, scale=scale), lambda: SSPProtocol(W, s), W, 1,
                  zeros)
  if name == "dssp":
    rng = transforms.check_staleness_range("dssp", staleness_range)
    return Scheme(name, transforms.dssp(W, rng, scale=scale), lambda: DSSPProtocol(W, rng), W, 1,
                  zeros)
  if name == "gssp":
    groups = grouping.make_groups(grouping_method, W, num_groups, worker_times)
    s = transforms.check_int("gssp", "staleness", staleness, 0)
    tx = transforms.gssp(W, num_groups, inter_group=inter_group, assignment=groups, scale=scale)
    probe = GSSPProtocol(W, groups, s, inter_group=inter_group, forward_every=forward_every)
    return Scheme(name, tx, lambda: GSSPProtocol(W, groups, s, inter_group=inter_group,
                                                 forward_every=forward_every),
                  W, probe.num_replicas, groups)
  if name == "halos":
    groups = grouping.make_groups(grouping_method, W, num_groups, worker_times)
    settings = dict(halos or {})
    merge = settings.pop("merge_weight", 0.25)
    make = lambda: HALoSProtocol(W, groups, forward_every=forward_every, merge_weight=merge)
    probe = make()   # validates
    tx = halos_lib.halos(W, num_groups, assignment=groups, **{**halos_lib.DEFAULTS, **settings})
    return Scheme(name, tx, make, W, probe.num_replicas, groups, own_optimizer=True)
  if name == "inhad":
    nodes = grouping.make_groups(grouping_method, W, num_nodes, worker_times)
    tx = transforms.inhad(W, num_nodes, assignment=nodes, scale=scale)
    InHADProtocol(W, nodes, inhad_threshold)   # validates
    return Scheme(name, tx, lambda: InHADProtocol(W, nodes, inhad_threshold), W, 1, nodes)
  if name == "dssync":
    DSSyncProtocol(W, group_size, seed)      # validates
    return Scheme(name, transforms.dssync(W), lambda: DSSyncProtocol(W, group_size, seed), W, W,
                  zeros)
  kwargs = dict(max_communities=casp_max_communities, reconfigure_every=casp_reconfigure_every,
                traffic_penalty=casp_traffic_penalty, seed=seed)
  CASPProtocol(W, **kwargs)                  # validates
  return Scheme(name, transforms.casp(W, scale=scale), lambda: CASPProtocol(W, **kwargs), W, 1,
                zeros)


def register_scheme(name: str, builder: Callable[..., Scheme]) -> None:
  """Adds a scheme so that ``config.sync.scheme=name`` trains with it (simulator, sweeps).

  Args:
    name: a new name (not a built-in one); registering it again replaces the builder.
    builder: ``builder(config, worker_times) -> Scheme``; ``worker_times`` is
      ``[W]`` iteration times (or slowdown factors) of the cluster, or None
      when the config is only being validated. It should raise ValueError for
      bad settings, as the built-ins do.

  Raises:
    ValueError: a built-in or non-identifier name, or a builder that is not callable.
  """
  if not isinstance(name, str) or not name.isidentifier() or name in SCHEMES:
    raise ValueError(f"scheme name={name!r} is invalid; allowed: a new identifier, not one of "
                     f"{', '.join(SCHEMES)}")
  if not callable(builder):
    raise ValueError(f"register_scheme({name!r}): builder={builder!r} is invalid; allowed: a "
                     "callable (config, worker_times) -> Scheme")
  _REGISTERED[name] = builder


def unregister_scheme(name: str) -> None:
  """Removes a scheme added with :func:`register_scheme` (no-op if absent)."""
  _REGISTERED.pop(name, None)


def scheme_names() -> tuple[str, ...]:
  """Every name ``config.sync.scheme`` accepts: the built-ins, then the registered ones."""
  return SCHEMES + tuple(_REGISTERED)


def scheme_from_config(config, worker_times=None) -> Scheme:
  """Builds ``config.sync.scheme`` with the ``config.sync.*`` settings."""
  if config.sync.scheme in _REGISTERED:
    scheme = _REGISTERED[config.sync.scheme](config, worker_times)
    if not isinstance(scheme, Scheme) or scheme.num_workers != config.num_workers:
      raise ValueError(f"the builder of registered scheme {config.sync.scheme!r} returned "
                       f"{scheme!r}; allowed: a Scheme with num_workers={config.num_workers}")
    return scheme
  s = config.sync
  opt = lambda key, default: s.get(key, default)
  forward_every = opt("forward_every", 0)
  threshold = opt("inhad_threshold", 0)
  casp = opt("casp", None)
  return build_scheme(
      s.scheme, config.num_workers, staleness=opt("staleness", 3),
      staleness_range=tuple(opt("staleness_range", (3, 15))), num_groups=opt("num_groups", 4),
      grouping_method=opt("grouping", "speed"), inter_group=opt("inter_group", "peer"),
      forward_every=forward_every or None, num_nodes=opt("num_nodes", 4),
      inhad_threshold=threshold or None, group_size=opt("group_size", 2),
      casp_max_communities=casp.max_communities if casp else 4,
      casp_reconfigure_every=casp.reconfigure_every if casp else 64,
      casp_traffic_penalty=casp.traffic_penalty if casp else 0.01,
      worker_times=worker_times, seed=config.get("seed", 0),
      halos=halos_lib.settings_from_config(config) if s.scheme == "halos" else None)


def describe(scheme: Scheme) -> dict[str, Any]:
  return dict(name=scheme.name, num_workers=scheme.num_workers, num_replicas=scheme.num_replicas,
              groups=scheme.groups.tolist())
