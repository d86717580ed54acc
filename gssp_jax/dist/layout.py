"""How a real run splits the model over its parameter-server shards, and how a shard's bytes look.

``--num_servers=S`` splits the parameters over S shard processes, balanced by
bytes. A shard holds **whole tensors** (a contiguous range of the parameter
leaves, in ``jax.tree.leaves`` order), not an arbitrary slice of the
flattened vector. That is a deliberate choice: a shard then runs, tensor by
tensor, exactly the arithmetic the simulator runs on the same shapes, so the
replicas' weights are bit-identical for every S and equal the simulator's.
Slicing the flat vector instead is not: XLA's CPU fusion emitter partitions a
loop by its length, and the partitioned loops round differently (measured:
GSSP global with Adam, S = 2, about 30 % of the first moments one ulp off
after one round, while S = 1 and 4 were exact). The price is balance: a shard
cannot be smaller than the largest tensor (LeNet-5: one tensor holds 78 % of
the weights; ResNet-18: 21 %, so S = 4 balances well and S > 4 hardly
improves).

BatchNorm statistics (the model state) live on shard 0, whole, as in the
simulator. Every body is float32 (the runtime refuses other dtypes before it
starts).

Bodies (one contiguous buffer per shard and message):

* a **push** to shard s: its tensors' gradients, raveled and concatenated
  (dense), or ``nnz`` int32 flat indices followed by ``nnz`` float32 values
  (sparse, when a compressor left fewer than a third non-zero); then, on
  shard 0, the worker's BatchNorm statistics;
* a **pull** from shard s: its tensors of the worker's weights, then (shard 0)
  the statistics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import jax
import numpy as np

from gssp_jax.dist import wire

F32 = np.dtype(np.float32)


class NonFinite(wire.BadMessage):
  """A push with a NaN or an infinity: refused; the run stops as diverged."""


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """Which tensors each shard holds (``bounds[s] = (first, end)`` leaf indices).

  Attributes:
    shapes: every parameter leaf's shape, in ``jax.tree.leaves`` order.
    stats_shapes: every model-state leaf's shape (BatchNorm statistics).
    bounds: ``S`` contiguous, non-empty leaf ranges covering every leaf.
  """
  shapes: tuple
  stats_shapes: tuple
  bounds: tuple

  def __post_init__(self):
    # Sizes asked for on every push and pull: computed once (not fields: equality is the above).
    object.__setattr__(self, "_sizes", tuple(math.prod(x) for x in self.shapes))
    object.__setattr__(self, "_stats_sizes", tuple(math.prod(x) for x in self.stats_shapes))
    object.__setattr__(self, "_grad_sizes", tuple(sum(self._sizes[a:b]) for a, b in self.bounds))

  @classmethod
  def balanced(cls, params, model_state, num_shards: int) -> "ShardLayout":
    """Contiguous leaf ranges that minimise the largest shard's bytes (statistics on shard 0)."""
    for name, tree in (("parameter", params), ("model-state", model_state)):
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if np.dtype(leaf.dtype) != F32:
          raise ValueError(f"the real runtime moves float32 tensors; {name} "
                           f"{jax.tree_util.keystr(path)} has dtype {leaf.dtype}")
    shapes = tuple(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(params))
    stats = tuple(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(model_state))
    if not 1 <= num_shards <= len(shapes):
      raise ValueError(f"--num_servers={num_shards} is invalid for a model of {len(shapes)} "
                       f"tensors; allowed: 1..{len(shapes)} (a shard holds whole tensors)")
    sizes = [math.prod(s) for s in shapes]
    stats_size = sum(math.prod(s) for s in stats)
    return cls(shapes, stats, _partition(sizes, stats_size, num_shards))

  @classmethod
  def from_description(cls, d: dict) -> "ShardLayout":
    """The layout :meth:`describe` wrote (checked: raises BadMessage)."""
    try:
      shapes = tuple(tuple(int(x) for x in shape) for shape in d["shapes"])
      stats = tuple(tuple(int(x) for x in shape) for shape in d["stats_shapes"])
      bounds = tuple((int(a), int(b)) for a, b in d["bounds"])
    except (KeyError, TypeError, ValueError):
      raise wire.BadMessage("a layout description is malformed") from None
    if (not bounds or bounds[0][0] != 0 or bounds[-1][1] != len(shapes)
        or any(a >= b for a, b in bounds) or any(bounds[i][1] != bounds[i + 1][0]
                                                 for i in range(len(bounds) - 1))):
      raise wire.BadMessage(f"layout bounds {bounds} do not cover {len(shapes)} tensors")
    return cls(shapes, stats, bounds)

  @property
  def num_shards(self) -> int:
    return len(self.bounds)

  def leaves(self, s: int) -> range:
    return range(*self.bounds[s])

  def grad_size(self, s: int) -> int:
    """Float32 entries of shard ``s``'s tensors."""
    return self._grad_sizes[s]

  def stats_size(self, s: int) -> int:
    return sum(self._stats_sizes) if s == 0 else 0

  def push_limit(self, s: int, nnz: int) -> int:
    """The exact body bytes of a push to shard ``s`` (``nnz`` < 0: dense)."""
    entries = self.grad_size(s) if nnz < 0 else 2 * nnz
    return 4 * (entries + self.stats_size(s))

  def pull_bytes(self, s: int) -> int:
    return 4 * (self.grad_size(s) + self.stats_size(s))

  def describe(self) -> dict:
    return {"shapes": [list(x) for x in self.shapes],
            "stats_shapes": [list(x) for x in self.stats_shapes],
            "bounds": [list(b) for b in self.bounds]}

  def digest(self) -> str:
    """A fingerprint two processes compare before they exchange bodies."""
    return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:16]

  def shard_bytes(self) -> list[int]:
    return [self.pull_bytes(s) for s in range(self.num_shards)]

  # -- bodies ---------------------------------------------------------------------------------

  def pack_push(self, s: int, grad_leaves, stats_leaves, sparse: bool) -> tuple[np.ndarray, int]:
    """Shard ``s``'s push body from the worker's gradient (and statistics): ``(body, nnz)``.

    ``nnz`` is -1 for a dense body; with ``sparse`` a body whose non-zeros are
    fewer than a third of its entries goes as indices and values.
    """
    grads = [grad_leaves[i] for i in self.leaves(s)]
    stats = list(stats_leaves) if s == 0 else []
    if sparse:
      flat = _concat(grads)
      idx = np.flatnonzero(flat)
      if 3 * idx.size < flat.size:
        body = np.concatenate([idx.astype(np.int32).view(F32), flat[idx], _concat(stats)])
        return body, int(idx.size)
    return _concat(grads + stats), -1   # one copy of every leaf: a dense body is the largest

  def unpack_push(self, s: int, body: np.ndarray | None, nnz: int):
    """``(gradient leaves, statistics leaves)`` of a push body, checked; raises BadMessage.

    Checked before anything is kept: the size (exact, from the layout), every
    value finite, and for a sparse body indices in range and strictly
    increasing (no duplicates).
    """
    n = self.grad_size(s)
    if not -1 <= nnz <= n:
      raise wire.BadMessage(f"nnz={nnz} is invalid for shard {s}; allowed: -1 (dense) or 0..{n}")
    expected = self.push_limit(s, nnz)
    body = _bytes(body)
    size = 0 if body is None else body.size
    if size != expected:
      raise wire.BadMessage(f"a push to shard {s} has {size} bytes; expected {expected}"
                            f" ({'dense' if nnz < 0 else f'{nnz} sparse entries'})")
    values = body.view(F32) if size else np.zeros([0], F32)
    if nnz < 0:
      flat, stats = values[:n], values[n:]
      _check_finite(flat, f"the gradient sent to shard {s}")
    else:
      idx, vals, stats = values[:nnz].view(np.int32), values[nnz:2 * nnz], values[2 * nnz:]
      if nnz and (idx[0] < 0 or idx[-1] >= n or np.any(idx[1:] <= idx[:-1])):
        raise wire.BadMessage(f"the sparse indices sent to shard {s} are not strictly "
                              f"increasing within 0..{n - 1}")
      _check_finite(vals, f"the gradient sent to shard {s}")
      flat = np.zeros([n], F32)
      flat[idx] = vals
    _check_finite(stats, "the BatchNorm statistics sent")
    return self._split(flat, self.leaves(s)), self._split_stats(stats, s)

  def unpack_pull(self, s: int, body: np.ndarray | None):
    """``(weight leaves, statistics leaves)`` of shard ``s``'s pull body (views, no copy)."""
    body = _bytes(body)
    size = 0 if body is None else body.size
    if size != self.pull_bytes(s):
      raise wire.BadMessage(f"a pull from shard {s} has {size} bytes; expected "
                            f"{self.pull_bytes(s)}")
    values = body.view(F32) if size else np.zeros([0], F32)
    n = self.grad_size(s)
    return self._split(values[:n], self.leaves(s)), self._split_stats(values[n:], s)

  def _split(self, flat: np.ndarray, leaves: range) -> list[np.ndarray]:
    out, start = [], 0
    for i in leaves:
      size = self._sizes[i]
      out.append(flat[start:start + size].reshape(self.shapes[i]))
      start += size
    return out

  def _split_stats(self, flat: np.ndarray, s: int) -> list[np.ndarray]:
    if s != 0:
      return []
    out, start = [], 0
    for shape, size in zip(self.stats_shapes, self._stats_sizes):
      out.append(flat[start:start + size].reshape(shape))
      start += size
    return out


def _bytes(body: np.ndarray | None) -> np.ndarray | None:
  """A body as a flat uint8 view (the wire's form), whatever array it came as."""
  if body is None or body.dtype == np.uint8:
    return body
  return np.ascontiguousarray(body).reshape(-1).view(np.uint8)


def _concat(leaves) -> np.ndarray:
  if not leaves:
    return np.zeros([0], F32)
  return np.concatenate([np.asarray(x, F32).reshape(-1) for x in leaves])


def _check_finite(values: np.ndarray, what: str) -> None:
  # A finite sum means every value is finite (a NaN or an infinity makes it NaN or infinite):
  # one vectorised pass, no temporary array. Only a non-finite sum (which finite values of
  # huge magnitude can also give, by overflow) needs min and max, which are exact.
  if values.size and not np.isfinite(values.sum()) and not (
      np.isfinite(values.min()) and np.isfinite(values.max())):
    raise NonFinite(f"{what} has a non-finite value (NaN or infinity); refused")


def _partition(sizes: list[int], stats_size: int, num_shards: int) -> tuple:
  """Contiguous ranges of ``sizes`` minimising the largest sum (exact DP; stats on the first)."""
  n = len(sizes)
  prefix = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
  cost = lambda s, a, b: int(prefix[b] - prefix[a]) + (stats_size if s == 0 else 0)
  # best[s][b]: the smallest largest shard over leaves [0, b) in s + 1 shards; choice: its cut.
  best = [[cost(0, 0, b) if b >= 1 else math.inf for b in range(n + 1)]]
  choice = [[0] * (n + 1)]
  for s in range(1, num_shards):
    row, cut = [math.inf] * (n + 1), [0] * (n + 1)
    for b in range(s + 1, n + 1):
      for a in range(s, b):
        value = max(best[s - 1][a], cost(s, a, b))
        if value < row[b]:
          row[b], cut[b] = value, a
    best.append(row)
    choice.append(cut)
  bounds, end = [], n
  for s in range(num_shards - 1, 0, -1):
    start = choice[s][end]
    bounds.append((start, end))
    end = start
  bounds.append((0, end))
  return tuple(reversed(bounds))
