"""The sync schemes' argument checks: plain Python and NumPy, no JAX.

The device transforms and the host protocols check their arguments with the same functions,
so a bad value gets the same message from either, before anything is compiled; the host half
(the real runtime's coordinator runs it without devices) imports no JAX.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np

INTER_GROUP = ("peer", "global")


def check_int(scheme: str, name: str, value: Any, minimum: int) -> int:
  """Returns ``value`` as int if it is an int >= minimum; else ValueError naming it."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{scheme} {name}={value!r} is invalid; allowed: an int >= {minimum}")
  return int(value)


def check_scale(scheme: str, scale: Any) -> float:
  if (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
      or not np.isfinite(float(scale)) or float(scale) <= 0):
    raise ValueError(f"{scheme} scale={scale!r} is invalid; allowed: a positive finite number")
  return float(scale)


def check_assignment(scheme: str, name: str, ids: Sequence[int], num_workers: int,
                     num_ids: int) -> np.ndarray:
  """Validates a static worker -> replica/group assignment of length W with ids in range."""
  arr = np.asarray(ids)
  if (arr.shape != (num_workers,) or not np.issubdtype(arr.dtype, np.integer)
      or np.any(arr < 0) or np.any(arr >= num_ids)):
    raise ValueError(f"{scheme} {name}={list(np.ravel(ids))!r} is invalid; allowed: "
                     f"{num_workers} ints in range({num_ids})")
  return arr.astype(np.int32)


def equal_groups(scheme: str, num_workers: int, num_groups: int) -> np.ndarray:
  """Contiguous equal groups ``[0]*m + [1]*m + ...``; the groups must divide the workers."""
  if num_workers % num_groups:
    raise ValueError(f"{scheme} num_groups={num_groups} does not divide num_workers="
                     f"{num_workers}; allowed: a divisor of {num_workers} for equal groups, "
                     "or pass an explicit assignment")
  return np.repeat(np.arange(num_groups, dtype=np.int32), num_workers // num_groups)


def check_staleness_range(scheme: str, staleness_range) -> tuple[int, int]:
  try:
    low, high = staleness_range
  except (TypeError, ValueError):
    raise ValueError(f"{scheme} staleness_range={staleness_range!r} is invalid; "
                     "allowed: a pair (s_L, s_U) of ints with 0 <= s_L <= s_U") from None
  low = check_int(scheme, "s_L", low, 0)
  high = check_int(scheme, "s_U", high, 0)
  if low > high:
    raise ValueError(f"{scheme} staleness_range=({low}, {high}) is invalid: s_L={low} > "
                     f"s_U={high}; allowed: 0 <= s_L <= s_U")
  return low, high
