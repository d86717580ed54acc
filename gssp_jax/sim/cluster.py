"""The heterogeneous-cluster model: per-worker iteration times and link delays, seeded and pure.

``compute_time(w, k)`` is a pure function of (seed, worker, iteration), so a
resumed simulation sees the same cluster as an uninterrupted one:

    base_time * speed[w] * exp(jitter * z[w, k]) * (straggler_slowdown if straggling)

where ``z`` is standard normal and a worker straggles for
``straggler_duration`` iterations after a start drawn with
``straggler_prob`` per iteration. Communication is ``latency + bytes /
bandwidth`` per push and pull, with bytes from the real payload.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.sim import topology as topology_lib
from gssp_jax.sim import traces

PROFILES = ("none", "homogeneous", "tiers", "lognormal", "trace")
# Keys of the compute-time model; a trace gives every iteration's time, so none applies to it
# (but base_time and calibrate, which set the pace of a trace in relative units).
_MODEL_KEYS = ("speeds", "tiers", "sigma", "base_time", "calibrate", "jitter", "straggler_prob",
               "straggler_slowdown", "straggler_duration")
_PACE_KEYS = ("base_time", "calibrate")
_BLOCK = 1024   # iterations drawn at once per worker


def _fail(key, value, allowed):
  checks.fail(f"cluster.{key}", value, allowed)


def _positive(key, value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value > 0):
    _fail(key, value, "a positive finite number")
  return float(value)


def _non_negative(key, value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      math.isfinite(value) and value >= 0):
    _fail(key, value, "a finite number >= 0")
  return float(value)


@dataclasses.dataclass
class Cluster:
  """Seeded per-worker compute times and link delays.

  Attributes:
    speeds: ``[W]`` slowdown factors (1 = base, 2 = twice as slow).
    base_time: seconds per iteration at speed 1.
    jitter: sigma of the per-iteration log-normal noise.
    straggler_prob, straggler_slowdown, straggler_duration: transient stragglers.
    bandwidth, latency: ``[W]`` each worker's link (bytes/s, s) for pushes and pulls.
    server_bandwidth, server_latency: links between servers (GSSP forwards) and
      into the server from nodes (InHAD's aggregates).
    node_bandwidth, node_latency: the link inside a machine (PCIe/NVLink class)
      from a worker to its node's aggregator (InHAD).
    trace: ``[T, W]`` iteration times in seconds replacing the model (cycled), or None
      (``sim/traces.py``: read, mapped to the workers and scaled).
    trace_scale: the factor the trace's recorded times were multiplied by (1: seconds).
    topology: the network's regions and the links between them (``sim/topology.py``), or None:
      every transfer crosses its worker's link and its server's interface alone.
    seed: the draws' seed.
    server_update_time: seconds a server spends applying one update (a round that
      changes its weights); its updates queue (``sync.TimelineEngine``).
  """
  speeds: np.ndarray
  base_time: float = 0.05
  jitter: float = 0.0
  straggler_prob: float = 0.0
  straggler_slowdown: float = 5.0
  straggler_duration: int = 10
  bandwidth: np.ndarray | None = None
  latency: np.ndarray | None = None
  server_bandwidth: float = 1.25e9
  server_latency: float = 1e-4
  node_bandwidth: float = 2.5e10
  node_latency: float = 5e-6
  trace: np.ndarray | None = None
  trace_scale: float = 1.0
  topology: topology_lib.Topology | None = None
  seed: int = 0
  server_update_time: float = 0.0

  def __post_init__(self):
    self.speeds = np.asarray(self.speeds, np.float64)
    W = self.speeds.size
    self.bandwidth = np.broadcast_to(np.asarray(
        1.25e9 if self.bandwidth is None else self.bandwidth, np.float64), (W,)).copy()
    self.latency = np.broadcast_to(np.asarray(
        1e-4 if self.latency is None else self.latency, np.float64), (W,)).copy()

  @property
  def num_workers(self) -> int:
    return self.speeds.size

  @property
  def mean_times(self) -> np.ndarray:
    """``[W]`` each worker's mean slowdown: its speed factor, or its trace's mean iteration time
    (what grouping by speed, DyLU and the compression ratios read)."""
    return self.trace.mean(0) if self.trace is not None else self.speeds

  @functools.lru_cache(maxsize=4096)
  def _block(self, worker: int, block: int) -> np.ndarray:
    """Multiplicative noise of iterations ``[block*B, (block+1)*B)`` of ``worker``."""
    n = _BLOCK
    z = np.random.default_rng([self.seed, 1, worker, block]).standard_normal(n)
    factor = np.exp(self.jitter * z) if self.jitter else np.ones(n)
    if self.straggler_prob > 0:
      d = self.straggler_duration
      # Uniform draws of iterations [block*n - (d-1), (block+1)*n): a straggling
      # episode starts where a draw is below straggler_prob and covers d iterations.
      prev = (np.random.default_rng([self.seed, 2, worker, block - 1]).random(n)[n - d + 1:]
              if block > 0 else np.ones(d - 1))
      u = np.concatenate([prev[:d - 1], np.random.default_rng([self.seed, 2, worker, block]).random(n)])
      window = np.convolve((u < self.straggler_prob).astype(np.int64), np.ones(d, np.int64),
                           "valid")
      factor = np.where(window > 0, factor * self.straggler_slowdown, factor)
    return factor

  def compute_time(self, worker: int, iteration: int) -> float:
    if self.trace is not None:
      return float(self.trace[iteration % self.trace.shape[0], worker])
    block, offset = divmod(int(iteration), _BLOCK)
    return self._block_times(int(worker), block)[offset]

  def compute_span(self, worker: int, first: int, count: int) -> list:
    """:meth:`compute_time` of iterations ``first .. first + count - 1`` of ``worker``, a list."""
    if self.trace is not None:
      return [self.compute_time(worker, first + j) for j in range(count)]
    out, k, end = [], int(first), int(first) + int(count)
    while k < end:   # a block at a time: usually one slice
      block, offset = divmod(k, _BLOCK)
      take = min(end - k, _BLOCK - offset)
      out += self._block_times(int(worker), block)[offset:offset + take]
      k += take
    return out

  def _block_times(self, worker: int, block: int) -> list:
    """Seconds of iterations ``[block*B, (block+1)*B)`` of ``worker``, as Python floats.

    The worker's current block is kept (a timeline asks for every iteration in
    turn); the product is the one :meth:`_block`'s factors always gave.
    """
    cache = self.__dict__.setdefault("_times", {})
    hit = cache.get(worker)
    if hit is None or hit[0] != block or hit[1] != self.base_time:
      times = (self.base_time * self.speeds[worker] * self._block(worker, block)).tolist()
      hit = cache[worker] = (block, self.base_time, times)
    return hit[2]

  def link_time(self, worker: int, num_bytes: int) -> float:
    return float(self.latency[worker] + num_bytes / self.bandwidth[worker])

  def server_time(self, num_bytes: int) -> float:
    return float(self.server_latency + num_bytes / self.server_bandwidth)

  def node_time(self, num_bytes: int) -> float:
    """Seconds to move ``num_bytes`` inside a machine (worker -> node aggregator)."""
    return float(self.node_latency + num_bytes / self.node_bandwidth)

  def describe(self) -> dict:
    """The cluster as ``summary.json`` reports it: a trace's mean times, else the model's factors;
    ``server_update_time`` where it is not 0."""
    if self.trace is not None:
      out = {"profile": "trace", "trace_iterations": int(self.trace.shape[0]),
             "trace_mean_iteration_time": self.trace.mean(0).tolist(),
             "trace_scale": self.trace_scale}
    else:
      out = {"speeds": self.speeds.tolist(), "base_time": self.base_time}
    if self.server_update_time:
      out["server_update_time"] = self.server_update_time
    if self.topology is not None:
      out["topology"] = self.topology.describe()
    return out

  def __hash__(self):   # lru_cache on a method needs a hashable self
    return id(self)


def cluster_speeds(cfg, num_workers: int, seed: int) -> np.ndarray:
  """``[W]`` slowdown factors of ``config.cluster``'s profile (``speeds`` overrides)."""
  if len(cfg.speeds):
    speeds = np.asarray(cfg.speeds, np.float64)
    if speeds.shape != (num_workers,) or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
      _fail("speeds", tuple(cfg.speeds), f"{num_workers} positive finite slowdown factors "
            f"(one per worker, num_workers={num_workers})")
    return speeds
  if cfg.profile in ("none", "homogeneous", "trace"):
    return np.ones([num_workers])
  if cfg.profile == "tiers":
    tiers = np.asarray(cfg.tiers, np.float64)
    if tiers.ndim != 1 or tiers.size == 0 or np.any(~np.isfinite(tiers)) or np.any(tiers <= 0):
      _fail("tiers", tuple(cfg.tiers), "a non-empty tuple of positive slowdown factors")
    if num_workers % tiers.size:
      _fail("tiers", tuple(cfg.tiers), f"as many tiers as divide num_workers={num_workers}")
    return np.repeat(tiers, num_workers // tiers.size)
  sigma = _non_negative("sigma", cfg.sigma)
  return np.exp(sigma * np.random.default_rng([seed, 3]).standard_normal(num_workers))


def trace_units(cfg) -> str:
  """``cluster.trace_units``; a config recorded before the key read its trace in seconds."""
  return cfg.get("trace_units", "seconds")


def check_trace_keys(cfg) -> None:
  """Rejects a compute-time model key set beside ``profile='trace'`` (the trace gives the times;
  ``base_time`` and ``calibrate`` set its pace, in ``trace_units='relative'`` only)."""
  cluster_defaults = defaults.default_config().cluster
  relative = trace_units(cfg) == "relative"
  for key in _MODEL_KEYS:
    value, default = cfg[key], cluster_defaults[key]
    if relative and key in _PACE_KEYS:
      continue
    if defaults.comparable(value) != defaults.comparable(default):
      why = ("in seconds (cluster.trace_units='seconds')" if key in _PACE_KEYS
             else "every iteration's time")
      raise ValueError(f"config.cluster.{key}={value!r} cannot apply with cluster.profile='trace':"
                       f" the trace gives {why}; leave it at {default!r}")


# Keys only one profile reads (and, for tiers and sigma, only while cluster.speeds is empty).
PROFILE_KEYS = {"tiers": "tiers", "sigma": "lognormal", "trace_file": "trace",
                "trace_units": "trace", "trace_map": "trace"}


def check_profile_keys(cfg) -> None:
  """Rejects a key changed from its default that ``cfg.profile`` does not read.

  ``tiers`` is read only by ``profile='tiers'``, ``sigma`` only by
  ``'lognormal'``, ``trace_file`` only by ``'trace'``; non-empty ``speeds``
  replace the tiers' and log-normal factors, so those keys cannot apply beside them.
  """
  cluster_defaults = defaults.default_config().cluster
  for key, profile in PROFILE_KEYS.items():
    if key not in cfg:   # a config recorded before the key
      continue
    value, default = cfg[key], cluster_defaults[key]
    if defaults.comparable(value) == defaults.comparable(default):
      continue
    if cfg.profile != profile:
      raise ValueError(f"config.cluster.{key}={value!r} cannot apply with cluster.profile="
                       f"{cfg.profile!r}: only profile {profile!r} reads it; set cluster.profile="
                       f"{profile!r} or leave it at {default!r}")
    if key in ("tiers", "sigma") and len(cfg.speeds):
      raise ValueError(f"config.cluster.{key}={value!r} cannot apply beside cluster.speeds="
                       f"{tuple(cfg.speeds)!r}, which replace the profile's factors; set one of"
                       " them")


def validate(config) -> None:
  """``config.cluster.*``: builds the cluster (calibrated runs with a stand-in base time).

  Raises:
    ValueError: one line naming the ``config.cluster`` key, its value and what is allowed.
  """
  cluster_from_config(config, base_time=1.0 if config.cluster.calibrate else None)


def cluster_is_set(config) -> bool:
  """True when ``config.cluster`` describes a cluster: a profile, or any key off its default."""
  if config.cluster.profile != "none":
    return True
  cluster_defaults = defaults.default_config().cluster
  return any(defaults.comparable(config.cluster[key])
             != defaults.comparable(cluster_defaults[key])
             for key in cluster_defaults if key in config.cluster)


SERVER_CAPACITIES = ("each", "split")   # cluster.server_capacity


def cluster_from_config(config, base_time: float | None = None) -> Cluster:
  """Builds and validates ``config.cluster`` (``base_time`` overrides, e.g. from calibration)."""
  cfg = config.cluster
  if cfg.profile not in PROFILES:
    _fail("profile", cfg.profile, ", ".join(PROFILES))
  if cfg.profile == "trace":
    check_trace_keys(cfg)
  check_profile_keys(cfg)
  W = config.num_workers
  speeds = cluster_speeds(cfg, W, config.seed)
  bandwidth = np.asarray(cfg.bandwidth if np.ndim(cfg.bandwidth) == 0 or len(cfg.bandwidth)
                         else 1.25e9, np.float64)
  for key, arr in (("bandwidth", bandwidth), ("latency", np.asarray(cfg.latency, np.float64))):
    if arr.ndim > 1 or (arr.ndim == 1 and arr.size != W):
      _fail(key, cfg[key], f"a number or {W} numbers (one per worker)")
    if key == "bandwidth" and (np.any(~np.isfinite(arr)) or np.any(arr <= 0)):
      _fail(key, cfg[key], "positive finite bytes per second (0 would never deliver)")
    if key == "latency" and (np.any(~np.isfinite(arr)) or np.any(arr < 0)):
      _fail(key, cfg[key], "finite seconds >= 0")
  duration = cfg.straggler_duration
  if isinstance(duration, bool) or not isinstance(duration, int) or duration < 1:
    _fail("straggler_duration", duration, "an int >= 1 (iterations)")
  if not isinstance(cfg.get("shared_server_links", True), bool):
    _fail("shared_server_links", cfg.shared_server_links, "True or False")
  capacity = cfg.get("server_capacity", "each")
  if capacity not in SERVER_CAPACITIES:
    _fail("server_capacity", capacity, ", ".join(map(repr, SERVER_CAPACITIES)))
  if capacity == "split" and not cfg.get("shared_server_links", True):
    _fail("server_capacity", capacity, "'each' with shared_server_links=False (the split "
          "divides the shared interfaces' bandwidth, which a run without them does not use)")
  prob = _non_negative("straggler_prob", cfg.straggler_prob)
  if prob > 1:
    _fail("straggler_prob", prob, "a probability in [0, 1]")
  base_time = _positive("base_time", base_time if base_time is not None else cfg.base_time)
  trace, scale = None, 1.0
  if cfg.profile == "trace":
    trace, scale = traces.load(cfg.trace_file, W, units=trace_units(cfg),
                               trace_map=cfg.get("trace_map", "replica"), base_time=base_time,
                               data_dir=config.get("data_dir", ""))
  topology = topology_lib.from_config(cfg, W, np.broadcast_to(bandwidth, [W]))
  return Cluster(
      speeds=speeds, base_time=base_time, topology=topology,
      jitter=_non_negative("jitter", cfg.jitter), straggler_prob=prob,
      straggler_slowdown=_positive("straggler_slowdown", cfg.straggler_slowdown),
      straggler_duration=duration, bandwidth=bandwidth, latency=np.asarray(cfg.latency),
      server_bandwidth=_positive("server_bandwidth", cfg.server_bandwidth),
      server_latency=_non_negative("server_latency", cfg.server_latency),
      node_bandwidth=_positive("node_bandwidth", cfg.get("node_bandwidth", 2.5e10)),
      node_latency=_non_negative("node_latency", cfg.get("node_latency", 5e-6)),
      trace=trace, trace_scale=scale, seed=config.seed,
      server_update_time=_non_negative("server_update_time", cfg.get("server_update_time", 0.0)))
