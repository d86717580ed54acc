"""A network topology: workers and servers in regions (or racks), links between regions.

``cluster.topology`` (empty: none, every transfer crosses its worker's link and its server's
interface alone, as before topologies existed):

* ``'regions'``: from the keys. ``cluster.regions``, each worker's region (W ints, 0..R-1);
  ``cluster.region_bandwidth``, an R × R matrix of bytes/s; ``cluster.region_latency``, an R × R
  matrix of seconds (empty: none); ``cluster.uplink_bandwidth``, R bytes/s, each region's uplink
  (empty, or 0 for a region: not limited).
* ``'halos'``: the HALoS paper's setting (utnslab/halos ``examples/env.yaml``, ICML 2025): 4
  regions, the workers split evenly over them in order (region ``w // (W / 4)``), Gb/s between
  regions ``[[100, 0.537, 0.935, 0.202], [0.537, 100, 0.386, 0.117], [0.935, 0.386, 100, 0.127],
  [0.202, 0.117, 0.127, 100]]`` (100 inside one), no latency between regions (their simulator
  charges bytes / bandwidth alone), no uplink limit.
* ``'oversubscribed'``: 4 racks, the workers split evenly in order, each rack's uplink a quarter
  of what its workers' links add up to (4:1 oversubscription, the usual leaf-spine ratio), the
  spine between racks 100 Gb/s each way, no latency between racks.

``cluster.server_region`` places the one server (BSP, ASP, SSP, ...) or the global server (GSSP
``global``, HALoS); a group server sits in the region that holds most of its group's workers at
the start (ties: the lowest region), and stays there when groups change.

**What a transfer crosses** (``path``): from region a to region b ≠ a, region a's uplink
(``("up", a)``), the pipe from a to b (``("wan", a, b)``, ``region_bandwidth[a][b]``, one pipe each
way, shared by the transfers on it) and region b's downlink (``("down", b)``, the uplink's
bandwidth the other way); inside one region nothing more (``region_bandwidth[a][a]`` caps each
transfer: the fabric inside a region is not contended). Add the server's interface and the
worker's own link cap, as without a topology, and every link a transfer crosses is shared
max-min fairly with the others on it (``sync.links.NetworkLinks``); its latency is its
worker's plus ``region_latency[a][b]``. Without ``cluster.shared_server_links`` a transfer takes
its path's uncontended time (:meth:`Topology.transfer_time`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gssp_jax import checks

GBPS = 1.25e8   # bytes/s in one Gb/s
TOPOLOGIES = ("", "regions", "halos", "oversubscribed")
# Keys only cluster.topology='regions' reads (the presets set their own).
REGION_KEYS = ("regions", "region_bandwidth", "region_latency", "uplink_bandwidth")
HALOS_GBPS = ((100, 0.537, 0.935, 0.202), (0.537, 100, 0.386, 0.117),
              (0.935, 0.386, 100, 0.127), (0.202, 0.117, 0.127, 100))
OVERSUBSCRIPTION = 4.0
SPINE_GBPS = 100.0


@dataclasses.dataclass(frozen=True)
class Topology:
  """Regions and the links between them (module doc).

  Attributes:
    regions: ``[W]`` each worker's region.
    bandwidth: ``[R, R]`` bytes/s between regions (the diagonal: a transfer's cap inside one).
    latency: ``[R, R]`` seconds between regions.
    uplink: ``[R]`` bytes/s of each region's uplink and downlink (``inf``: not limited).
    server_region: the region of the one server, or of the global server.
    name: the preset, or ``'regions'``.
  """
  regions: np.ndarray
  bandwidth: np.ndarray
  latency: np.ndarray
  uplink: np.ndarray
  server_region: int = 0
  name: str = "regions"

  @property
  def num_regions(self) -> int:
    return int(self.bandwidth.shape[0])

  def hops(self, a: int, b: int) -> tuple:
    """``((link, bytes/s), ...)``: the shared links between regions a and b (none inside one)."""
    if a == b:
      return ()
    out = []
    if np.isfinite(self.uplink[a]):
      out.append((("up", a), float(self.uplink[a])))
    out.append((("wan", a, b), float(self.bandwidth[a, b])))
    if np.isfinite(self.uplink[b]):
      out.append((("down", b), float(self.uplink[b])))
    return tuple(out)

  def own_cap(self, a: int, b: int) -> float:
    """A transfer's own bytes/s limit from a to b, besides its hops: inside one region the
    diagonal's bandwidth (the fabric inside is not contended); across regions none (the pipe
    between them is a shared hop)."""
    return float(self.bandwidth[a, a]) if a == b else math.inf

  def transfer_time(self, num_bytes: float, cap: float, latency: float, a: int, b: int) -> float:
    """A transfer's uncontended seconds: ``latency + latency[a][b] + bytes`` over the least of
    ``cap``, :meth:`own_cap` and its hops' bandwidths."""
    limit = min([cap, self.own_cap(a, b)] + [c for _, c in self.hops(a, b)])
    return latency + float(self.latency[a, b]) + num_bytes / limit

  def server_regions(self, route: np.ndarray, num_servers: int) -> np.ndarray:
    """``[num_servers]`` each server's region. ``route``: each worker's server at the start (a
    fresh protocol's). A group server sits in the region holding most of the workers routed to
    it (ties: the lowest); the one server, or a server no worker is routed to (the global
    one), in ``server_region``."""
    route = np.asarray(route)
    out = np.full([num_servers], self.server_region, np.int64)
    if num_servers > 1:
      for s in range(num_servers):
        members = self.regions[route == s]
        if members.size:
          out[s] = int(np.argmax(np.bincount(members, minlength=self.num_regions)))
    return out

  def describe(self) -> dict:
    """What ``summary.json``'s ``cluster.topology`` states."""
    return {"name": self.name, "regions": self.regions.tolist(),
            "region_bandwidth": self.bandwidth.tolist(), "region_latency": self.latency.tolist(),
            "uplink_bandwidth": [None if not np.isfinite(u) else float(u) for u in self.uplink],
            "server_region": self.server_region}


def _fail(key, value, allowed):
  checks.fail(f"cluster.{key}", value, allowed)


def _even_regions(num_workers: int, num_regions: int, name: str) -> np.ndarray:
  if num_workers % num_regions:
    _fail("topology", name, f"a topology whose {num_regions} regions divide num_workers="
          f"{num_workers} evenly (the preset's workers are split in order), or 'regions' with "
          "cluster.regions")
  return np.arange(num_workers) // (num_workers // num_regions)


def _matrix(key, value, R: int, *, positive: bool) -> np.ndarray:
  if not positive and not len(value):
    return np.zeros([R, R])
  arr = np.asarray(value, np.float64)
  if arr.shape != (R, R):
    _fail(key, value, f"a {R} x {R} matrix (one row and column per region; R = {R} from "
          "cluster.regions)" + ("" if positive else ", or () for none"))
  bad = ~np.isfinite(arr) | ((arr <= 0) if positive else (arr < 0))
  if bad.any():
    i, j = np.argwhere(bad)[0]
    _fail(key, value, ("positive finite bytes/s" if positive else "finite seconds >= 0")
          + f" (entry [{i}][{j}] is {float(arr[i, j])!r})")
  return arr


def _uplinks(value, R: int) -> np.ndarray:
  arr = np.asarray(value, np.float64) if len(value) else np.zeros([R])
  if arr.shape != (R,) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
    _fail("uplink_bandwidth", value, f"{R} numbers (one per region), bytes/s >= 0 (0: not "
          "limited), or () for none")
  return np.where(arr > 0, arr, np.inf)


def _regions_of(cfg, num_workers: int) -> np.ndarray:
  regions = cfg.regions
  arr = np.asarray(regions)
  if (arr.shape != (num_workers,) or arr.dtype.kind not in "iu" or np.any(arr < 0)):
    _fail("regions", tuple(regions), f"{num_workers} region ids (one per worker, num_workers="
          f"{num_workers}), ints >= 0")
  missing = sorted(set(range(int(arr.max()) + 1)) - set(arr.tolist()))
  if missing:
    _fail("regions", tuple(regions), f"regions numbered 0..R-1 with a worker in each (region "
          f"{missing[0]} has none)")
  return arr.astype(np.int64)


def from_config(cfg, num_workers: int, worker_bandwidth: np.ndarray) -> Topology | None:
  """``config.cluster``'s topology (None without one), checked: one line naming the bad key."""
  name = cfg.get("topology", "")
  if name not in TOPOLOGIES:
    _fail("topology", name, ", ".join(map(repr, TOPOLOGIES)))
  for key in REGION_KEYS:
    if key in cfg and name != "regions" and len(cfg[key]):
      raise ValueError(f"config.cluster.{key}={cfg[key]!r} cannot apply with cluster.topology="
                       f"{name!r}: only topology 'regions' reads it; set cluster.topology="
                       "'regions' or leave it unset")
  server = cfg.get("server_region", 0)
  if not name:
    if server:
      raise ValueError(f"config.cluster.server_region={server!r} cannot apply without "
                       "cluster.topology; set one or leave it at 0")
    return None
  if name == "halos":
    regions = _even_regions(num_workers, 4, name)
    bandwidth, latency = np.asarray(HALOS_GBPS) * GBPS, np.zeros([4, 4])
    uplink = np.full([4], np.inf)
  elif name == "oversubscribed":
    regions = _even_regions(num_workers, 4, name)
    bandwidth, latency = np.full([4, 4], SPINE_GBPS * GBPS), np.zeros([4, 4])
    uplink = np.array([worker_bandwidth[regions == r].sum() / OVERSUBSCRIPTION
                       for r in range(4)])
  else:
    regions = _regions_of(cfg, num_workers)
    R = int(regions.max()) + 1
    bandwidth = _matrix("region_bandwidth", cfg.region_bandwidth, R, positive=True)
    latency = _matrix("region_latency", cfg.region_latency, R, positive=False)
    uplink = _uplinks(cfg.uplink_bandwidth, R)
  R = bandwidth.shape[0]
  if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < R:
    _fail("server_region", server, f"a region id in 0..{R - 1}")
  return Topology(regions=regions, bandwidth=bandwidth, latency=latency, uplink=uplink,
                  server_region=server, name=name)
