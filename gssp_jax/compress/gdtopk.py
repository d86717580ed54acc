"""GDTopK: group-dependent top-k whose ratio shrinks per epoch, densest for the slowest group.

Slow groups spend their time computing rather than communicating, so they can
afford to send more; fast groups compress harder. The ratio schedule is
host-side NumPy (it changes once per epoch) and reaches the jitted update as
the traced extra arg ``ratios``, so a new epoch does not recompile. At the end
of each of its epochs a worker flushes (the traced extra arg ``flush``): it
sends gradient plus residual densely and starts the next epoch with an empty
residual, as the authors' code does.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import optax

from gssp_jax.compress import topk as topk_lib

_FASTEST, _MIDDLE, _SLOWEST = 0, 1, 2
_WARMUP_EPOCHS = 2   # completed epochs at the initial ratio before the classes' decay starts


def gdtopk(num_workers: int, *, scope: str = "tensor", error_feedback: bool = True,
           value_bytes: int = 4, index_bytes: int = 4) -> optax.GradientTransformationExtraArgs:
  """Top-k whose per-worker ratios come from the extra arg ``ratios`` every round.

  Args:
    num_workers: W, the leading axis of every gradient leaf.
    scope: ``"tensor"`` (top-k of each leaf) or ``"global"`` (of the whole
      flattened model), as for :func:`~gssp_jax.compress.topk`.
    error_feedback: carry unsent mass to the next round.
    value_bytes: bytes per sent value.
    index_bytes: bytes per sent index.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state ``TopKState``; its
    update raises ValueError at trace time when ``ratios`` is missing and
    honours ``flush`` (epoch-end: send everything, clear the residual).
  """
  num_workers = topk_lib.check_num_workers(num_workers)
  topk_lib.check_scope(scope)
  value_bytes = topk_lib.check_positive_int("value_bytes", value_bytes)
  index_bytes = topk_lib.check_positive_int("index_bytes", index_bytes)
  selector = topk_lib.topk_selector(scope, value_bytes, index_bytes)
  return topk_lib.build_compressor(num_workers, None, selector, error_feedback=bool(error_feedback),
                                   require_ratios="gdtopk")


def _check_epoch(epoch) -> int:
  if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 1:
    raise ValueError(f"gdtopk epoch={epoch!r} is invalid; "
                     "allowed: an int >= 1 (epochs count from 1)")
  return int(epoch)


def _check_floor_power(floor_power) -> int:
  if (isinstance(floor_power, bool) or not isinstance(floor_power, numbers.Integral)
      or floor_power < 0):
    raise ValueError(f"gdtopk floor_power={floor_power!r} is invalid; allowed: an int >= 0")
  return int(floor_power)


def _check_base(name: str, value) -> float:
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not 0.0 < float(value) <= 1.0):
    raise ValueError(f"gdtopk {name}={value!r} is invalid; allowed: a number in (0, 1]")
  return float(value)


def _decayed(base: np.ndarray, epoch: int, floor_power: int) -> np.ndarray:
  """``base ** (epoch - 1)`` floored at ``base ** floor_power``, as float32."""
  base = np.asarray(base, np.float64)
  return np.maximum(base ** (epoch - 1), base ** floor_power).astype(np.float32)


def speed_class(rank: int, num_groups: int) -> int:
  """0 fastest, 1 middle, 2 slowest; one group is middle, two are fastest and slowest."""
  if num_groups == 1:
    return _MIDDLE
  if rank == 0:
    return _FASTEST
  return _SLOWEST if rank == num_groups - 1 else _MIDDLE


def gdtopk_group_ratios(epoch: int, group_speed_rank: Sequence[int], *, classes_known: bool = True,
                        bases: tuple[float, float, float] = (0.25, 0.30, 0.35),
                        initial_ratio: float = 0.35, floor_power: int = 4) -> np.ndarray:
  """The reference GDTopK schedule (the GDTopK authors' rule): one ratio per group.

  With ``c = epoch - 1`` epochs completed, every group sends ``initial_ratio``
  while ``c < 2`` (the authors wait two epochs before they trust the speed
  classes); from then on a group of class base ``b`` sends ``b ** (c - 1)``,
  floored at ``b ** floor_power``. With the defaults, epochs 1..7 give

  =========  ====  ====  ======  ======  ======  ======  ======
  class      1     2     3       4       5       6       7
  =========  ====  ====  ======  ======  ======  ======  ======
  fastest    0.35  0.35  0.25    0.25^2  0.25^3  0.25^4  0.25^4
  middle     0.35  0.35  0.30    0.30^2  0.30^3  0.30^4  0.30^4
  slowest    0.35  0.35  0.35    0.35^2  0.35^3  0.35^4  0.35^4
  =========  ====  ====  ======  ======  ======  ======  ======

  Args:
    epoch: the epoch the iteration belongs to, counting from 1 (so
      ``epoch - 1`` epochs are completed).
    group_speed_rank: for each group its speed rank, 0 the fastest; a
      permutation of ``range(G)``.
    classes_known: False keeps every group at ``initial_ratio`` whatever the
      epoch (the groups' speeds are not measured yet).
    bases: decay bases of the (fastest, middle, slowest) classes, each in (0, 1].
    initial_ratio: ratio of the first two epochs, in (0, 1].
    floor_power: the ratio never drops below ``base ** floor_power``.

  Returns:
    ``[G]`` float32 ratios; with the default bases the slowest group's is the
    largest (densest).
  """
  epoch = _check_epoch(epoch)
  floor_power = _check_floor_power(floor_power)
  ranks = [int(r) for r in group_speed_rank]
  if not ranks or sorted(ranks) != list(range(len(ranks))):
    raise ValueError(f"gdtopk group_speed_rank={list(group_speed_rank)!r} is invalid; "
                     f"allowed: a permutation of range(G) with G >= 1")
  if len(bases) != 3:
    raise ValueError(f"gdtopk bases={bases!r} is invalid; "
                     "allowed: three numbers (fastest, middle, slowest) in (0, 1]")
  bases = [_check_base("bases", b) for b in bases]
  initial_ratio = _check_base("initial_ratio", initial_ratio)
  completed = epoch - 1
  if not classes_known or completed < _WARMUP_EPOCHS:
    return np.full([len(ranks)], initial_ratio, np.float32)
  group_bases = np.array([bases[speed_class(r, len(ranks))] for r in ranks])
  # _decayed(b, e) is b ** (e - 1), so e = completed gives the authors' b ** (completed - 1).
  return _decayed(group_bases, completed, floor_power)


def gdtopk_continuous_ratios(epoch: int, group_iteration_times: Sequence[float], *,
                             base_fast: float = 0.25, base_slow: float = 0.35,
                             floor_power: int = 4) -> np.ndarray:
  """Continuous GDTopK: each group's base interpolates linearly in its iteration time.

  ``base_g = base_fast + (base_slow - base_fast) * (t_g - t_min) / (t_max - t_min)``;
  when every time is equal no group is faster, so all take the midpoint base.

  Args:
    epoch: current epoch, counting from 1.
    group_iteration_times: positive mean iteration time of each group.
    base_fast: base of the fastest group, in (0, 1].
    base_slow: base of the slowest group, in [base_fast, 1].
    floor_power: the ratio never drops below ``base_g ** floor_power``.

  Returns:
    ``[G]`` float32 ratios, non-decreasing in iteration time.
  """
  epoch = _check_epoch(epoch)
  floor_power = _check_floor_power(floor_power)
  base_fast = _check_base("base_fast", base_fast)
  base_slow = _check_base("base_slow", base_slow)
  if base_slow < base_fast:
    raise ValueError(f"gdtopk base_slow={base_slow!r} is invalid; "
                     f"allowed: a number >= base_fast={base_fast!r}")
  times = np.asarray(group_iteration_times, np.float64)
  if times.ndim != 1 or times.size == 0 or not np.all(np.isfinite(times)) or np.any(times <= 0):
    raise ValueError(f"gdtopk group_iteration_times={list(group_iteration_times)!r} is invalid; "
                     "allowed: a non-empty sequence of positive finite numbers")
  span = times.max() - times.min()
  frac = np.full_like(times, 0.5) if span == 0 else (times - times.min()) / span
  return _decayed(base_fast + (base_slow - base_fast) * frac, epoch, floor_power)


def worker_ratios(group_ratios: np.ndarray, worker_group: Sequence[int]) -> np.ndarray:
  """``[W]`` float32 ratios: each worker takes its group's ratio.

  Args:
    group_ratios: ``[G]`` ratios in (0, 1].
    worker_group: each worker's group id in ``range(G)``.
  """
  group_ratios = np.asarray(group_ratios, np.float32)
  ids = np.asarray(worker_group)
  if group_ratios.ndim != 1 or not np.all((group_ratios > 0) & (group_ratios <= 1)):
    raise ValueError(f"gdtopk group_ratios={group_ratios.tolist()!r} is invalid; "
                     "allowed: a [G] array in (0, 1]")
  if (ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer)
      or np.any(ids < 0) or np.any(ids >= group_ratios.size)):
    raise ValueError(f"gdtopk worker_group={list(worker_group)!r} is invalid; "
                     f"allowed: group ids in range({group_ratios.size})")
  return group_ratios[ids]
