"""Assigning workers to groups (GSSP groups, InHAD nodes): by speed, round-robin, contiguous."""

from __future__ import annotations

import numpy as np

GROUPINGS = ("speed", "kmeans", "round_robin", "contiguous")


def _check(num_workers: int, num_groups: int, equal: bool) -> None:
  if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or not (
      1 <= num_groups <= num_workers):
    raise ValueError(f"num_groups={num_groups!r} is invalid; allowed: an int in 1..{num_workers}"
                     " (num_workers)")
  if equal and num_workers % num_groups:
    raise ValueError(f"num_groups={num_groups} does not divide num_workers={num_workers}; "
                     f"allowed for equal groups: a divisor of {num_workers} "
                     "(or grouping='kmeans', whose groups may differ in size)")


def check_times(num_workers: int, times) -> np.ndarray:
  """``[W]`` positive finite iteration times (or slowdown factors)."""
  arr = np.asarray(times, np.float64)
  if arr.shape != (num_workers,) or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
    raise ValueError(f"worker times={list(np.ravel(times))!r} are invalid; allowed: "
                     f"{num_workers} positive finite numbers")
  return arr


def group_by_speed(times, num_groups: int) -> np.ndarray:
  """Sort workers by iteration time and cut into equal groups; group 0 is the fastest."""
  times = check_times(len(times), times)
  _check(times.size, num_groups, equal=True)
  order = np.argsort(times, kind="stable")
  ids = np.empty([times.size], np.int32)
  ids[order] = np.arange(times.size) // (times.size // num_groups)
  return ids


def group_kmeans(times, num_groups: int, iterations: int = 50) -> np.ndarray:
  """1-D k-means on iteration times (exact DP-free Lloyd from quantile seeds); 0 is the fastest.

  Groups may differ in size; every group is non-empty (an emptied cluster is
  reseeded at the worker farthest from its centre).
  """
  times = check_times(len(times), times)
  _check(times.size, num_groups, equal=False)
  x = np.sort(times)
  centres = x[((np.arange(num_groups) + 0.5) * x.size / num_groups).astype(int)]
  for _ in range(iterations):
    ids = np.argmin(np.abs(times[:, None] - centres[None, :]), axis=1)
    for g in range(num_groups):
      if not np.any(ids == g):
        far = int(np.argmax(np.abs(times - centres[ids])))
        ids[far] = g
    new = np.array([times[ids == g].mean() for g in range(num_groups)])
    if np.allclose(new, centres):
      break
    centres = new
  rank = np.argsort(np.argsort(centres, kind="stable"), kind="stable")
  return rank[ids].astype(np.int32)


def group_round_robin(num_workers: int, num_groups: int) -> np.ndarray:
  _check(num_workers, num_groups, equal=True)
  return (np.arange(num_workers) % num_groups).astype(np.int32)


def group_contiguous(num_workers: int, num_groups: int) -> np.ndarray:
  _check(num_workers, num_groups, equal=True)
  return (np.arange(num_workers) // (num_workers // num_groups)).astype(np.int32)


def make_groups(method: str, num_workers: int, num_groups: int, times=None) -> np.ndarray:
  """``[W]`` group ids by ``method``; ``times`` (iteration times or slowdowns) for speed methods."""
  if method not in GROUPINGS:
    raise ValueError(f"grouping={method!r} is invalid; allowed: {', '.join(GROUPINGS)}")
  if method in ("speed", "kmeans"):
    times = np.ones([num_workers]) if times is None else times
    return (group_by_speed if method == "speed" else group_kmeans)(times, num_groups)
  if method == "round_robin":
    return group_round_robin(num_workers, num_groups)
  return group_contiguous(num_workers, num_groups)


def group_speed_rank(groups: np.ndarray, times) -> np.ndarray:
  """``[G]`` rank of each group by mean iteration time, 0 the fastest (for GDTopK)."""
  groups = np.asarray(groups)
  times = check_times(groups.size, times)
  num_groups = int(groups.max()) + 1
  means = np.array([times[groups == g].mean() for g in range(num_groups)])
  return np.argsort(np.argsort(means, kind="stable"), kind="stable").astype(np.int32)
