"""How a real run splits the model over its parameter-server shards, and how a shard's bytes look.

``config.dist.num_servers=S`` splits the parameters over S shard processes, balanced by
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

Bodies (the bytes of one shard and message, sent as segments: ``wire.chunks``):

* a **push** to shard s: its tensors' gradients, raveled, one segment each
  (dense), or one segment of ``nnz`` int32 flat indices followed by ``nnz``
  float32 values (sparse, when a compressor left fewer than a third
  non-zero); then, on shard 0, the worker's BatchNorm statistics, one segment
  each;
* a **pull** from shard s: its tensors of the worker's weights, then (shard 0)
  the statistics, one segment each (views of the shard's row).

A receiver takes a body as one buffer or as the messages it came in; a tensor
that lies within one message, 4-byte aligned, is used in place
(:func:`leaf_views`), any other is copied out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math

import jax
import numpy as np

from gssp_jax.runtime import wire

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
    object.__setattr__(self, "_spans", tuple(self._tensor_spans(s) for s in range(len(self.bounds))))

  def _tensor_spans(self, s: int) -> tuple:
    """``(start, end, shape)`` in float32 entries of shard ``s``'s tensors, then its statistics."""
    shapes = [self.shapes[i] for i in self.leaves(s)] + list(self.stats_shapes if s == 0 else ())
    ends = list(itertools.accumulate(math.prod(shape) for shape in shapes))
    return tuple(zip([0] + ends[:-1], ends, shapes))

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
      raise ValueError(f"config.dist.num_servers={num_shards} is invalid for a model of "
                       f"{len(shapes)} tensors; allowed: 1..{len(shapes)} (a shard holds whole "
                       "tensors)")
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

  def pack_push(self, s: int, grad_leaves, stats_leaves, sparse: bool) -> tuple[list, int]:
    """Shard ``s``'s push body from the worker's gradient (and statistics): ``(segments, nnz)``.

    ``nnz`` is -1 for a dense body, whose segments are the leaves themselves
    (float32 views, no copy: ``wire.chunks`` copies them once into the
    messages); with ``sparse`` a body whose non-zeros are fewer than a third
    of its entries goes as indices and values.
    """
    grads = [_flat(grad_leaves[i]) for i in self.leaves(s)]
    stats = [_flat(x) for x in stats_leaves] if s == 0 else []
    if sparse:
      flat = _concat(grads)
      idx = np.flatnonzero(flat)
      if 3 * idx.size < flat.size:
        body = np.concatenate([idx.astype(np.int32).view(F32), flat[idx], *stats])
        return [body], int(idx.size)
    return grads + stats, -1

  def unpack_push(self, s: int, body, nnz: int):
    """``(gradient leaves, statistics leaves)`` of a push body, checked; raises BadMessage.

    ``body``: one buffer, the list of messages it came in, or None. Checked
    before anything is kept: the size (exact, from the layout), every value
    finite, and for a sparse body indices in range and strictly increasing
    (no duplicates).
    """
    n = self._grad_sizes[s]
    if not -1 <= nnz <= n:
      raise wire.BadMessage(f"nnz={nnz} is invalid for shard {s}; allowed: -1 (dense) or 0..{n}")
    expected = self.push_limit(s, nnz)
    parts = _parts(body)
    size = sum(p.size for p in parts)
    if size != expected:
      raise wire.BadMessage(f"a push to shard {s} has {size} bytes; expected {expected}"
                            f" ({'dense' if nnz < 0 else f'{nnz} sparse entries'})")
    if nnz < 0:
      k = len(self.leaves(s))
      tensors = self._tensors(s, parts)
      if not _region_finite(parts, 0, size, tensors):   # one pass; which region, only now
        _check_region(parts, 0, 4 * n, tensors[:k], f"the gradient sent to shard {s}")
        _check_region(parts, 4 * n, size, tensors[k:], "the BatchNorm statistics sent")
      return tensors[:k], tensors[k:]
    stats_sizes = list(self._stats_sizes if s == 0 else ())
    values = leaf_views(parts, [size // 4])[0]
    idx, vals = values[:nnz].view(np.int32), values[nnz:2 * nnz]
    if nnz and (idx[0] < 0 or idx[-1] >= n or np.any(idx[1:] <= idx[:-1])):
      raise wire.BadMessage(f"the sparse indices sent to shard {s} are not strictly "
                            f"increasing within 0..{n - 1}")
    _check_finite(vals, f"the gradient sent to shard {s}")
    flat = np.zeros([n], F32)
    flat[idx] = vals
    grads = _cut(flat, [self._sizes[i] for i in self.leaves(s)])
    stats = _cut(values[2 * nnz:], stats_sizes)
    _check_region(parts, size - 4 * sum(stats_sizes), size, stats, "the BatchNorm statistics sent")
    return self._shaped(s, grads, stats)

  def assemble(self, bodies, treedefs) -> tuple:
    """The model's ``(params, model_state)`` trees from every shard's pull body (``bodies[s]``,
    as :meth:`unpack_pull` takes it); the statistics are shard 0's."""
    leaves, stats = [None] * len(self.shapes), []
    for s, body in enumerate(bodies):
      tensors, shard_stats = self.unpack_pull(s, body)
      for i, leaf in zip(self.leaves(s), tensors):
        leaves[i] = leaf
      if s == 0:
        stats = shard_stats
    return jax.tree.unflatten(treedefs[0], leaves), jax.tree.unflatten(treedefs[1], stats)

  def unpack_pull(self, s: int, body):
    """``(weight leaves, statistics leaves)`` of shard ``s``'s pull body (views where they can be).

    ``body``: one buffer, the list of messages it came in, or None.
    """
    parts = _parts(body)
    size = sum(p.size for p in parts)
    if size != self.pull_bytes(s):
      raise wire.BadMessage(f"a pull from shard {s} has {size} bytes; expected "
                            f"{self.pull_bytes(s)}")
    tensors = self._tensors(s, parts)
    k = len(self.leaves(s))
    return tensors[:k], tensors[k:]

  def _tensors(self, s: int, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Shard ``s``'s tensors, then its statistics, in their shapes, from a body's byte ``parts``.

    The caller has checked the size. A body in one part (every unary call, and
    any small body) is cut by the precomputed spans: one view each, no copy;
    a body in several parts goes through :func:`leaf_views`.
    """
    spans = self._spans[s]
    if len(parts) == 1:
      flat = parts[0].view(F32)
      return [flat[a:b].reshape(shape) for a, b, shape in spans]
    return [x.reshape(shape) for x, (_, _, shape) in
            zip(leaf_views(parts, self._entry_sizes(s)), spans)]

  def segments(self, s: int, flat: np.ndarray) -> list[np.ndarray]:
    """Shard ``s``'s flat float32 row (weights, then statistics) as a pull body's segments.

    One segment, the row itself, when it travels as one message (at most
    ``wire.CHUNK_BYTES``); else one view per tensor, so that no message cuts a
    tensor that fits in one (``wire.messages``) and the receiver uses it in place.
    """
    flat = np.asarray(flat).reshape(-1)
    if flat.nbytes <= wire.CHUNK_BYTES:
      return [flat]
    return _cut(flat, self._entry_sizes(s))

  def _entry_sizes(self, s: int) -> list[int]:
    """Float32 entries of each of shard ``s``'s tensors, then (shard 0) of each statistic."""
    return [self._sizes[i] for i in self.leaves(s)] + list(self._stats_sizes if s == 0 else ())

  def _shaped(self, s: int, grads, stats) -> tuple[list, list]:
    """Flat leaves of shard ``s`` (and its statistics) in their shapes (views)."""
    return ([x.reshape(self.shapes[i]) for i, x in zip(self.leaves(s), grads)],
            [x.reshape(shape) for x, shape in zip(stats, self.stats_shapes)])

  def split(self, s: int, flat: np.ndarray) -> list[np.ndarray]:
    """Shard ``s``'s tensors, in their shapes, from its flat float32 weights (views)."""
    return self._shaped(s, _cut(flat, [self._sizes[i] for i in self.leaves(s)]), [])[0]


def leaf_views(parts: list[np.ndarray], sizes) -> list[np.ndarray]:
  """Consecutive float32 arrays of ``sizes`` entries from a body's byte ``parts``.

  A tensor within one part at a 4-byte-aligned offset is a view of it (no
  copy); one that straddles parts (or sits unaligned) is copied out. The
  caller has checked that the parts hold exactly ``4 * sum(sizes)`` bytes.
  """
  out, p, offset = [], 0, 0
  for size in sizes:
    nbytes = 4 * size
    while p < len(parts) and offset == parts[p].size and nbytes:
      p, offset = p + 1, 0
    if not nbytes:
      out.append(np.zeros([0], F32))
    elif offset + nbytes <= parts[p].size and offset % 4 == 0:
      out.append(parts[p][offset:offset + nbytes].view(F32))
      offset += nbytes
    else:
      leaf = np.empty([size], F32)
      dest, filled = leaf.view(np.uint8), 0
      while filled < nbytes:
        if offset == parts[p].size:
          p, offset = p + 1, 0
        take = min(nbytes - filled, parts[p].size - offset)
        dest[filled:filled + take] = parts[p][offset:offset + take]
        filled, offset = filled + take, offset + take
      out.append(leaf)
  return out


def _parts(body) -> list[np.ndarray]:
  """A body (None, one buffer, or its messages) as a list of flat uint8 arrays."""
  if body is None:
    return []
  if isinstance(body, (list, tuple)):
    return [_bytes(x) for x in body]
  return [_bytes(body)]


def _bytes(body: np.ndarray) -> np.ndarray:
  """A buffer as a flat uint8 view (the wire's form), whatever array it came as."""
  if body.dtype == np.uint8:
    return body.reshape(-1)
  return np.ascontiguousarray(body).reshape(-1).view(np.uint8)


def _flat(x) -> np.ndarray:
  return np.asarray(x, F32).reshape(-1)


def _cut(flat: np.ndarray, sizes) -> list[np.ndarray]:
  out, start = [], 0
  for size in sizes:
    out.append(flat[start:start + size])
    start += size
  return out


def _concat(leaves) -> np.ndarray:
  if not leaves:
    return np.zeros([0], F32)
  return np.concatenate([_flat(x) for x in leaves])


def all_finite(arrays) -> bool:
  """Whether every value of every array is finite (no NaN, no infinity)."""
  return all(_finite(np.asarray(x).reshape(-1)) for x in arrays)


def _finite(values: np.ndarray) -> bool:
  """Whether every value of a flat float32 array is finite (exact, no temporary when aligned).

  Aligned data: a finite sum of squares means every value is finite (a NaN makes it NaN, an
  infinity infinite; squares are never negative, so infinities cannot cancel): one BLAS pass
  (``np.dot``, 2.5x faster than ``sum``). Only a non-finite result, which finite values above
  ~1e19 also give by overflow, needs min and max, which are exact. Data at an address that is
  not a multiple of 4 (a Flight batch is wherever gRPC put it) never reaches BLAS: NumPy would
  copy it first, 30x slower (measured: 5.2 ms against 0.17 ms for 2.8 M values); ``isfinite``
  takes it as it is (0.48 ms).
  """
  if not values.size:
    return True
  if not values.flags.aligned:
    return bool(np.isfinite(values).all())
  with np.errstate(over="ignore", invalid="ignore"):   # an overflow here is no error
    finite = bool(np.isfinite(np.dot(values, values)))
  return finite or bool(np.isfinite(values.min()) and np.isfinite(values.max()))


def _region_finite(parts: list[np.ndarray], start: int, end: int, leaves) -> bool:
  """Whether bytes ``[start, end)`` of a body (the float32 ``leaves``) are all finite.

  One pass per message over the region rather than one per tensor (a small
  model's dozens of tensors cost more in calls than in bytes); per tensor
  only when a message does not hold whole float32 values (no sender of this
  project cuts one, but a stranger's body might).
  """
  if any(p.size % 4 for p in parts):
    return all(_finite(x.reshape(-1)) for x in leaves)
  offset = 0
  for part in parts:
    a, b = max(start - offset, 0), min(end - offset, part.size)
    if a < b and not _finite(part[a:b].view(F32)):
      return False
    offset += part.size
  return True


def _check_region(parts: list[np.ndarray], start: int, end: int, leaves, what: str) -> None:
  """Raises NonFinite naming ``what`` unless bytes ``[start, end)`` are all finite."""
  if not _region_finite(parts, start, end, leaves):
    raise NonFinite(f"{what} has a non-finite value (NaN or infinity); refused")


def _check_finite(values: np.ndarray, what: str) -> None:
  if not _finite(values):
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
