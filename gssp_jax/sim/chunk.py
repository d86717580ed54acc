"""The level-batched executor's device program: a chunk of many pieces of the schedule per call.

A *piece* is what the host planner (``sim/planner.py``) cuts: up to ``J`` jobs
(worker gradients, each on the weights its worker pulled), computed together
as one ``vmap``, then up to ``Rr`` rounds, applied in order by a ``lax.scan``.
A *chunk* is ``L`` pieces, one jitted call: a ``lax.scan`` over the pieces.
Every shape is fixed for the run, so the chunk program compiles once:

* padded job slots are for the distinct out-of-range workers ``W, W + 1, ...``:
  they compute on worker ``W - 1``'s inputs and their results are dropped by
  the scatters (``mode="drop"``);
* padded round slots are empty rounds (nobody arrives or pulls, no replica
  applies, no exchange), which change nothing: no ``lax.cond`` decides it;
* a round names the workers that arrive (``Ka`` slots), the workers that pull
  (``Kp``) and the replicas it touches (``Kr``); a round reads and writes those
  rows only (``rounds.apply_round``), unless a slot count equals ``W`` (``R``),
  where the whole buffer is used in place and no gather is needed.

The weights, the statistics and the outstanding gradients are flat
``[W, P]``/``[R, P]`` buffers (``sim/flat.py``); compressor and inner-optimizer
states stay pytrees (only jobs touch them). The state is donated, so no round
copies a ``[W, P]`` buffer; tests read the compiled HLO to keep it so.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gssp_jax.sim import devices as devices_lib
from gssp_jax.sim import executor
from gssp_jax.sim import flat as flat_lib
from gssp_jax.sync import rounds as rounds_lib


class Shape(NamedTuple):
  """A run's static chunk shape.

  Attributes:
    pieces: L, pieces per device call.
    jobs: J, job slots per piece.
    rounds: Rr, round slots per piece.
    arrivals: Ka, arrival slots per round (W: every worker, no gather).
    pulls: Kp, pull slots per round (W: every worker, in place).
    replicas: Kr, replica slots per round (R: every replica).
    routes: Q, distinct worker -> replica routes a chunk may use.
  """
  pieces: int
  jobs: int
  rounds: int
  arrivals: int
  pulls: int
  replicas: int
  routes: int = 2


def init_state(layout: flat_lib.Layout, params, model_state, tx, compressor, num_workers: int,
               num_replicas: int, rng: jax.Array,
               inner: optax.GradientTransformation | None = None) -> executor.SimState:
  """``executor.init_state`` with flat weight, statistic and gradient buffers (pure; jit it).

  ``tx`` is initialised on one replica's flat ``[P]`` weights; the compressor
  and the inner optimizer keep their pytree states (jobs run on pytrees).
  """
  tree_state = executor.init_state(params, model_state, None, compressor, num_workers,
                                   num_replicas, rng, inner=inner)
  flat_params = layout.ravel_params(params)
  stack = lambda x, n: jnp.broadcast_to(x, (n, *x.shape))
  if layout.num_stats:
    flat_stats = layout.ravel_stats(model_state)
    replica_stats, worker_stats = stack(flat_stats, num_replicas), stack(flat_stats, num_workers)
  else:   # no statistics: no (zero-size) buffers either
    replica_stats = worker_stats = {}
  return tree_state.replace(
      replica_params=stack(flat_params, num_replicas), replica_model_state=replica_stats,
      tx_state=tx.init(flat_params), worker_params=stack(flat_params, num_workers),
      worker_model_state=worker_stats,
      grad_buf=jnp.zeros([num_workers, layout.num_params], jnp.float32))


def served_weights(layout: flat_lib.Layout, state: executor.SimState, eval_replica: int | None):
  """``executor.served_weights`` of a flat state, as the model's pytrees."""
  params, stats = executor.served_weights(state, eval_replica)
  return layout.unravel_params(params), unravel_stats(layout, stats)


def unravel_stats(layout: flat_lib.Layout, flat):
  """A flat statistics vector (``{}`` for a model without statistics) as the model state."""
  return layout.unravel_stats(flat) if layout.num_stats else {}


def ravel_stats(layout: flat_lib.Layout, tree):
  return layout.ravel_stats(tree) if layout.num_stats else {}


def jobs_body(layout: flat_lib.Layout, loss_fn: Callable, compressor, dense_bytes: int,
              stats_bytes: int, num_workers: int, *, grad_clip: float = 0.0,
              local: executor.LocalJob | None = None, job_batch: int = 0, mesh=None):
  """``(state, arrays, jobs) -> state``: one piece's jobs (pure).

  ``jobs`` holds ``workers [J]`` (padding: ids >= W), ``idx [J, B]`` (a
  local-update job's ``[J, H_max, B]``), ``iters``, ``ratios``, ``flushes``
  and, for local-update jobs, ``steps``. Each job is
  ``executor.make_worker_gradient`` (or ``make_local_update``) on its worker's
  unravelled weights, with the per-round executor's dropout keys, so both
  executors compute the same function of the same inputs.

  ``job_batch``: how many of the ``J`` slots one ``vmap`` computes together;
  the piece runs such batches one after another, unrolled (1: one job at a
  time, no ``vmap``). 0, or ``J`` and more: every slot in one ``vmap``.
  A ``vmap`` over per-worker weights turns a convolution into a grouped one,
  a slow path on XLA:CPU (``map_jobs``). The jobs are independent, so the
  value is the same function either way; its float rounding may differ
  (a grouped convolution sums in another order).

  ``mesh``: a one-axis ``jax.sharding.Mesh`` (``sim/devices.py``) over which the ``J`` slots
  are split, ``J / D`` per device, each computed as on one device, then gathered (one
  ``all_gather`` per output, per piece); None: one device.
  """
  executor.check_push_bytes(dense_bytes + stats_bytes, "the model's dense gradient and statistics")
  gradient = executor.make_worker_gradient(loss_fn, compressor, dense_bytes, grad_clip=grad_clip)
  if local is not None:
    local_update = executor.make_local_update(loss_fn, compressor, dense_bytes, local,
                                              grad_clip=grad_clip)

  def one_job(row, stats_row, inner, comp, batch, key, first, steps, ratio, flush):
    params, model_state = layout.unravel_params(row), unravel_stats(layout, stats_row)
    if local is None:
      loss, grad, new_ms, comp, nbytes = gradient(params, model_state, comp, batch,
                                                  jax.random.fold_in(key, first), ratio, flush)
    else:
      loss, grad, new_ms, inner, comp, nbytes = local_update(
          params, model_state, inner, comp, batch, key, first, steps, ratio, flush)
    flat_grad = flat_lib.ravel(grad, jnp.float32)
    return (flat_grad, ravel_stats(layout, new_ms), inner, comp, loss,
            nbytes + jnp.int32(stats_bytes))

  def jobs(state: executor.SimState, arrays, job):
    workers = job["workers"]
    safe = jnp.minimum(workers, num_workers - 1)   # padded jobs compute on worker W-1's inputs
    take = lambda tree: jax.tree.map(lambda x: x[safe], tree)
    put = lambda tree, v: jax.tree.map(
        lambda x, y: x.at[workers].set(y.astype(x.dtype), mode="drop", unique_indices=True),
        tree, v)
    batch = jax.tree.map(lambda a: a[job["idx"]], arrays)
    steps = job.get("steps")
    if steps is None:
      steps = jnp.ones(workers.shape, jnp.int32)
    keys = jax.vmap(lambda w: jax.random.fold_in(state.rng, w))(safe)
    comp = take(state.comp_state) if compressor is not None else None
    inner = take(state.inner_state) if local is not None else None
    grad, new_ms, inner, comp, loss, nbytes = map_jobs(
        one_job, (state.worker_params[safe], take(state.worker_model_state), inner, comp,
                  batch, keys, job["iters"], steps, job["ratios"], job["flushes"]), job_batch,
        mesh)
    return state.replace(
        grad_buf=put(state.grad_buf, grad),
        worker_model_state=put(state.worker_model_state, new_ms),
        inner_state=put(state.inner_state, inner) if local is not None else state.inner_state,
        comp_state=put(state.comp_state, comp) if compressor is not None else state.comp_state,
        job_loss=put(state.job_loss, loss),
        job_bytes=put(state.job_bytes, nbytes))
  return jobs


def jobs_per_vmap(job_batch: int, slots: int) -> int:
  """How many of a piece's ``slots`` job slots one ``vmap`` computes (:func:`jobs_body`'s
  ``job_batch``: 0, or ``slots`` and more, is all of them)."""
  return slots if not job_batch or job_batch >= slots else int(job_batch)


def map_jobs(one_job: Callable, xs: tuple, job_batch: int, mesh=None):
  """``one_job`` over the leading axis of every leaf of ``xs`` (its arguments; None: an absent
  state), ``job_batch`` at a time in one ``vmap`` (:func:`jobs_body`); with ``mesh``, each of
  its devices maps its share of the slots and every device gets all results.

  The batches are traced one after another (unrolled), not as a ``lax.map``: on XLA:CPU a
  convolution inside a loop body takes a slow path (jax#12868; LeNet-5's level executor ran
  3.2x slower through a ``lax.map`` of one job at a time, ``benchmarks/serial_loop.py``), and
  the jobs are independent, so unrolled they also run side by side on the CPU's cores.
  """
  if mesh is not None:
    axis = mesh.axis_names[0]

    def local(*part):   # this device's J / D slots, then everyone's results
      out = map_jobs(one_job, part, job_batch)
      return jax.tree.map(lambda y: jax.lax.all_gather(y, axis, tiled=True), out)
    spec = jax.sharding.PartitionSpec(axis)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec for _ in xs),
                         out_specs=jax.sharding.PartitionSpec(), check_vma=False)(*xs)
  slots = jax.tree.leaves(xs)[0].shape[0]
  batch = jobs_per_vmap(job_batch, slots)
  if batch == slots:
    return jax.vmap(one_job)(*xs)
  outs = []
  for start in range(0, slots, batch):
    part = jax.tree.map(lambda x: x[start:start + batch], xs)
    if batch == 1:   # no vmap at all: a plain (dense) convolution
      outs.append(jax.tree.map(lambda y: y[None], one_job(*jax.tree.map(lambda x: x[0], part))))
    else:
      outs.append(jax.vmap(one_job)(*part))
  return jax.tree.map(lambda *ys: jnp.concatenate(ys), *outs)


def piece_rows(num_workers: int, routes: jax.Array, rows: dict) -> dict:
  """A piece's round rows plus, for all its ``Rr`` slots at once, the ``[Rr, W]`` ``arrived``
  and ``pulls`` masks (from the slots' ids; padding past ``W`` marks nothing) and ``groups``
  (the slot's route): a few operations a piece instead of a scatter and a gather a round."""
  workers = jnp.arange(num_workers, dtype=jnp.int32)
  mask = lambda ids: jnp.any(ids[:, :, None] == workers, axis=1)
  return {**rows, "arrived": mask(rows["arrive_ids"]), "pulls": mask(rows["pull_ids"]),
          "groups": routes[rows["route"]]}


# What each field of an empty round slot holds (the planner's padding; ids past the end,
# ``W + i`` and ``R + i``, are padding too). A slot holding nothing else is an empty round:
# nobody arrives or pulls, no replica applies, averages or adopts, no exchange; it changes
# nothing.
REPLICA_PADDING = {"applies": False, "adopt": -1, "average": -1, "stats_mean": -1,
                   "adopt_weight": 1.0}
GROUP_PADDING = {"forward": False, "deliver": False}
SLOT_PADDING = {"route": 0, "aggregate": False, "learning_rate": 0.0}


def rounds_used(num_workers: int, num_replicas: int, rows: dict) -> jax.Array:
  """How many of a piece's round slots hold a round: one past the last slot with a field that
  is not its padding (traced ``int32``; ``rows``: the piece's ``[Rr, ...]`` rows as the plan
  carries them). The planner fills a piece's slots in order, so the slots past it are padding,
  empty rounds that would change nothing; a loop to this count leaves them out."""
  bounds = {"arrive_ids": num_workers, "pull_ids": num_workers, "replica_ids": num_replicas}
  padding = {**REPLICA_PADDING, **GROUP_PADDING, **SLOT_PADDING}
  busy = []
  for name, value in sorted(rows.items()):
    if name in bounds:
      held = value < bounds[name]
    elif name in padding:
      held = value != padding[name]
    else:
      raise ValueError(f"round row {name!r} has no padding value; known: "
                       f"{sorted([*bounds, *padding])}")
    busy.append(held.reshape(held.shape[0], -1).any(axis=1))
  busy = jnp.stack(busy).any(axis=0)
  return jnp.max(jnp.where(busy, jnp.arange(1, busy.shape[0] + 1, dtype=jnp.int32), 0))


def round_args(shape: Shape, num_workers: int, num_replicas: int, row: dict,
               empty: dict | None = None) -> dict[str, Any]:
  """One round slot's fields as ``rounds.apply_round``'s args (traced, pure).

  ``row``: one slot of :func:`piece_rows`. A slot count below ``W`` (``R``) also passes the
  ids, so the round touches those rows only. ``empty``: the optional fields the protocol never
  sets (``Protocol.round_fields``), as their empty host values (``rounds.empty_fields``): they
  are passed as those constants, not read from ``row``, so the passes they would drive
  (averaging, adoption, an exchange) are left out of the program (``rounds.apply_round``).
  """
  empty = empty or {}
  args = {k: row[k] for k in ("arrived", "pulls", "groups")}
  args.update({k: empty[k] if k in empty else row[k]
               for k in ("applies", "forward", "deliver", "aggregate", "adopt", "average",
                         "stats_mean", "adopt_weight", "learning_rate")})
  if shape.arrivals < num_workers:
    args["worker_ids"] = row["arrive_ids"]
  args["pull_ids"] = row["pull_ids"] if shape.pulls < num_workers else None
  if shape.replicas < num_replicas:
    args["replica_ids"] = row["replica_ids"]
  args["no_branches"] = True   # masks and fixed trip counts in the transforms (no host trips)
  return args


def never_set(round_fields, num_workers: int, num_replicas: int, num_groups: int) -> dict:
  """``{field: its empty value}`` for the optional round fields a protocol never sets (those
  not in its ``round_fields``): :func:`round_args`'s ``empty``."""
  empty = rounds_lib.empty_fields(num_workers, num_replicas, num_groups)
  return {name: empty[name] for name in rounds_lib.OPTIONAL_FIELDS if name not in round_fields}


class Packing(NamedTuple):
  """How a chunk's rows travel: one flat ``int32`` buffer, one transfer (not ~20, nor one per
  dtype: a transfer's fixed cost on the host, about 30 us, is most of a small one's).

  ``fields``: ``((part, name, dtype, shape, offset), ...)`` in packing order,
  ``part`` being ``jobs``, ``rounds`` or ``routes``, ``offset`` within its dtype's
  region; ``sizes``: ``((dtype, length), ...)``, the regions in the buffer's order.
  ``float32`` values travel as their bits, ``bool`` ones as 0 or 1.
  """
  fields: tuple
  sizes: tuple


# The dtypes a chunk's rows have, and how each travels in the int32 buffer: to it (host), back
# from it on the device (traced) and back from it on the host.
_AS_INT32 = {
    np.dtype(np.int32).str: (lambda x: x, lambda x: x, lambda x: x),
    np.dtype(np.float32).str: (lambda x: x.view(np.int32),
                               lambda x: jax.lax.bitcast_convert_type(x, jnp.float32),
                               lambda x: x.view(np.float32)),
    np.dtype(bool).str: (lambda x: x.astype(np.int32), lambda x: x != 0, lambda x: x != 0),
}


def packing_of(tree: dict) -> Packing:
  """The :class:`Packing` of a chunk's device tree (``planner.Chunk.device_tree``'s shapes)."""
  fields, sizes = [], {}
  items = [(part, name, value) for part in ("jobs", "rounds")
           for name, value in sorted(tree[part].items())] + [("routes", None, tree["routes"])]
  for part, name, value in items:
    dtype = np.dtype(value.dtype).str
    if dtype not in _AS_INT32:
      raise ValueError(f"chunk row {part}.{name} has dtype {dtype}; allowed: "
                       f"{sorted(_AS_INT32)}")
    fields.append((part, name, dtype, tuple(value.shape), sizes.get(dtype, 0)))
    sizes[dtype] = sizes.get(dtype, 0) + int(np.prod(value.shape))
  return Packing(tuple(fields), tuple(sorted(sizes.items())))


def pack(packing: Packing, tree: dict) -> np.ndarray:
  """A chunk's device tree as one flat ``int32`` buffer (host NumPy; see :class:`Packing`)."""
  parts = {dtype: [] for dtype, _ in packing.sizes}
  for part, name, dtype, _, _ in packing.fields:
    value = tree[part] if name is None else tree[part][name]
    parts[dtype].append(np.ravel(value))
  return np.concatenate([_AS_INT32[dtype][0](np.concatenate(values))
                         for dtype, values in parts.items()])


def _regions(packing: Packing, buffer, back: int) -> dict:
  """``{dtype: flat values}`` of a :func:`pack` buffer, each region converted back by
  ``_AS_INT32[dtype][back]`` (1: traced, on the device; 2: NumPy, on the host)."""
  regions, start = {}, 0
  for dtype, size in packing.sizes:
    regions[dtype] = _AS_INT32[dtype][back](buffer[start:start + size])
    start += size
  return regions


def host_regions(packing: Packing, buffer: np.ndarray) -> dict[str, np.ndarray]:
  """``{dtype: flat values}`` of a buffer from :func:`pack`, on the host (each field's values
  at its offset, in packing order: what the fingerprints of ``benchmarks/sim_overhead.py``
  hash)."""
  return _regions(packing, np.asarray(buffer, np.int32), 2)


def unpack(packing: Packing, buffer) -> dict:
  """:func:`pack`'s inverse, traced: static slices of the buffer."""
  regions = _regions(packing, buffer, 1)
  tree = {"jobs": {}, "rounds": {}}
  for part, name, dtype, shape, offset in packing.fields:
    value = regions[dtype][offset:offset + int(np.prod(shape))].reshape(shape)
    if name is None:
      tree[part] = value
    else:
      tree[part][name] = value
  return tree


def make_chunk_fn(layout: flat_lib.Layout, loss_fn: Callable, compressor,
                  tx: optax.GradientTransformationExtraArgs, dense_bytes: int, stats_bytes: int,
                  num_workers: int, num_replicas: int, shape: Shape, *, grad_clip: float = 0.0,
                  local: executor.LocalJob | None = None,
                  on_trace: Callable[[], None] = lambda: None, packing: Packing | None = None,
                  job_batch: int = 0, unroll_pieces: bool = False, mesh=None,
                  state_sharding=None, round_fields=rounds_lib.OPTIONAL_FIELDS,
                  num_groups: int = 1, used_rounds_only: bool = False):
  """``(state, arrays, plan) -> (state, done)``: one chunk, jitted, the state donated.

  ``plan`` is ``planner.Chunk``'s device arrays: ``jobs`` (each ``[L, J, ...]``),
  ``rounds`` (each ``[L, Rr, ...]``) and ``routes [Q, W]``; with ``packing``,
  those packed into one int32 buffer (:func:`pack`). ``done`` is a copy
  of the loss count, an output the host can wait on (the state is donated to
  the next call). ``on_trace`` is called each time it is traced. ``job_batch``:
  :func:`jobs_body`'s. ``unroll_pieces``: the ``L`` pieces traced one after another instead
  of a ``lax.scan`` over them (the CPU's choice: :func:`map_jobs`); the same function, a
  program ``L`` times the size. ``mesh``: the devices a piece's jobs are split over
  (:func:`jobs_body`); the arrays and the plan are replicated on all of them, and so is every
  round; the state is as ``state_sharding`` places it (``devices.state_shardings``: the
  workers' own buffers split by owner; None: replicated). ``round_fields``: the protocol's
  (``Protocol.round_fields``); the fields it never sets are constants of the program
  (:func:`never_set`), ``num_groups`` their ``[G]`` fields' size. ``used_rounds_only``: a
  piece's round loop stops after its last used slot (:func:`rounds_used`), the CPU's choice;
  else it runs all ``Rr`` (a loop whose trip count is data costs an accelerator a return to
  the host per trip). Either way the same rounds change the state.
  """
  jobs = jobs_body(layout, loss_fn, compressor, dense_bytes, stats_bytes, num_workers,
                   grad_clip=grad_clip, local=local, job_batch=job_batch, mesh=mesh)
  one_round = executor.round_body(tx, count_arrivals=False)
  empty = never_set(round_fields, num_workers, num_replicas, num_groups)

  def chunk(state: executor.SimState, arrays, plan):
    on_trace()
    if packing is not None:
      plan = unpack(packing, plan)
    routes = plan["routes"]

    def round_step(s, row):
      return one_round(s, round_args(shape, num_workers, num_replicas, row, empty)), None

    def piece(s, xs):
      job, rows = xs
      s = jobs(s, arrays, job)
      used = rounds_used(num_workers, num_replicas, rows) if used_rounds_only else None
      rows = piece_rows(num_workers, routes, rows)
      if used is None:
        s, _ = jax.lax.scan(round_step, s, rows)
      else:
        slot = lambda i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), rows)
        s = jax.lax.fori_loop(0, used, lambda i, s: round_step(s, slot(i))[0], s)
      # A worker arrives at most once a piece (its one job), so its counters move once a piece.
      return executor.count_arrivals_of(s, rows["arrived"]), None
    xs = (plan["jobs"], plan["rounds"])
    if unroll_pieces:   # no piece's jobs inside a loop body (see map_jobs)
      for i in range(shape.pieces):
        state, _ = piece(state, jax.tree.map(lambda x: x[i], xs))
    else:
      state, _ = jax.lax.scan(piece, state, xs)
    return state, state.loss_count + 0
  if mesh is None:
    return jax.jit(chunk, donate_argnums=(0,))
  whole = devices_lib.replicated(mesh)
  return jax.jit(chunk, donate_argnums=(0,),
                 out_shardings=(whole if state_sharding is None else state_sharding, whole))


def padded_ids(count: int, num: int) -> np.ndarray:
  """``count`` distinct out-of-range ids ``num, num + 1, ...`` (empty slots)."""
  return np.arange(num, num + count, dtype=np.int32)


def check_shape(shape: Shape, num_workers: int, num_replicas: int) -> Shape:
  """``shape`` if its slot counts are in range; else ValueError naming the first that is not."""
  limits = {"pieces": None, "jobs": num_workers, "rounds": None, "arrivals": num_workers,
            "pulls": num_workers, "replicas": num_replicas, "routes": None}
  for name, limit in limits.items():
    value = getattr(shape, name)
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
        or (limit is not None and value > limit)):
      allowed = "an int >= 1" + ("" if limit is None else f" and <= {limit}")
      raise ValueError(f"chunk shape {name}={value!r} is invalid; allowed: {allowed}")
  return shape

