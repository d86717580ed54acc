"""A mesh's compute: the worker's gradient (or local-update job) at a job, in one process or many.

Two classes behind one interface (``compute``, ``state``/``set_state``,
``comp_state``, ``inner``):

* :class:`OneProcess`: the simulator's own job (``sim.executor.make_job_fn``)
  on a one-worker state, so a one-process mesh computes exactly the
  simulator's gradient;
* :class:`Spmd`: one jitted SPMD program over the mesh's devices across its
  processes (:func:`make_mesh_step`, :func:`make_mesh_local_step`): each rank
  feeds its slice of the batch, every rank gets the whole worker's result.

The links to the servers and the cluster emulation are the mesh worker's
(``runtime/worker.py``), apart from both.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np
import optax

from gssp_jax.sim import executor as sim_executor
from gssp_jax.sync import transforms


def _job_gradient(loss_fn, compressor, dense_bytes: int, grad_clip: float):
  """The simulator's worker gradient with the dropout key folded in from ``(w, k)``."""
  gradient = sim_executor.make_worker_gradient(loss_fn, compressor, dense_bytes,
                                               grad_clip=grad_clip)

  def step(params, model_state, comp, batch, base_rng, w, k, ratio, flush):
    rng = jax.random.fold_in(jax.random.fold_in(base_rng, w), k)
    return gradient(params, model_state, comp, batch, rng, ratio, flush)
  return step


def make_mesh_step(loss_fn, compressor, mesh: Mesh | None, dense_bytes: int, *,
                   grad_clip: float = 0.0):
  """``(params, model_state, comp, batch, rng, w, k, ratio, flush) -> (loss, grad, ms, comp, bytes)``.

  ``mesh`` None (a one-process mesh): a plain ``jit``. Else one jitted SPMD
  program over ``mesh``: the batch split over the ``data`` axis, everything
  else replicated, so the gradient is the mean over the whole worker batch, as
  one device would get it (up to float summation order). That mean gradient
  (the protocol worker's) is clipped to global norm ``grad_clip``
  (``optimizer.grad_clip``; 0 = off) before its compressor, as the simulator's
  job clips it; the servers do not clip.
  """
  step = _job_gradient(loss_fn, compressor, dense_bytes, grad_clip)
  if mesh is None:
    return jax.jit(step), None, None
  replicated = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec("data"))
  shardings = (replicated,) * 3 + (split,) + (replicated,) * 5
  return (jax.jit(step, in_shardings=shardings, out_shardings=replicated), replicated, split)


def make_mesh_local_step(loss_fn, compressor, mesh: Mesh, dense_bytes: int,
                         local: sim_executor.LocalJob, *, grad_clip: float = 0.0):
  """A multi-process mesh's local-update job: ``(params, ms, inner, comp, batches [H_max, B], rng,
  w, first, steps, ratio, flush) -> (loss, push, ms, inner, comp, bytes)``.

  The simulator's ``make_local_update`` as one SPMD program over ``mesh``: each
  inner step's batch is split over the ``data`` axis (``batches`` sharded on
  its second axis), so every inner gradient is the mean over the whole worker
  batch, clipped to ``grad_clip`` before the inner optimizer; the weights, the
  inner optimizer state (kept by the mesh across its jobs) and the pushed
  pseudo-gradient are replicated. The dropout key of step ``i`` is the
  simulator's ``fold_in(fold_in(rng, w), first + i)``.
  """
  update = sim_executor.make_local_update(loss_fn, compressor, dense_bytes, local,
                                          grad_clip=grad_clip)

  def step(params, model_state, inner, comp, batches, base_rng, w, first, steps, ratio, flush):
    return update(params, model_state, inner, comp, batches, jax.random.fold_in(base_rng, w),
                  first, steps, ratio, flush)
  replicated = NamedSharding(mesh, PartitionSpec())
  split = NamedSharding(mesh, PartitionSpec(None, "data"))
  shardings = (replicated,) * 4 + (split,) + (replicated,) * 6
  return (jax.jit(step, in_shardings=shardings, out_shardings=replicated), replicated, split)


class OneProcess:
  """A one-process mesh: ``make_job_fn`` on the one-worker state, as the simulator runs it.

  Args:
    task: the run's task (its loss and training arrays).
    compressor: the worker's compressor (or None).
    dense_bytes, stats_bytes: bytes of a dense gradient and of the model state.
    templates: ``(params, model_state)`` host zeros of the model's shapes.
    worker: the protocol worker ``w`` (its compressor's and dropout keys).
    train_rng: the run's training key.
    local: the local-update job (``sim.executor.LocalJob``) or None.
    grad_clip: ``optimizer.grad_clip``.
  """

  def __init__(self, task, compressor, dense_bytes: int, stats_bytes: int, templates,
               worker: int, train_rng, local, grad_clip: float):
    params, model_state = templates
    self.w, self.local, self.stats_bytes = worker, local, stats_bytes
    self.job_fn = sim_executor.make_job_fn(task.loss, compressor, dense_bytes, stats_bytes,
                                           grad_clip=grad_clip, local=local)
    self.arrays = jax.device_put(task.train)
    inner = local.inner if local is not None else None
    self.one = sim_executor.init_state(params, model_state, optax.identity(), None, 1, 1,
                                       train_rng, inner=inner)
    one = _compressor_state(compressor, params, worker)
    self.comp_state = () if one is None else jax.device_put(transforms.stack(one, 1))

  def inner(self):
    """The inner optimizer state, as the one-worker state's row (``()`` but local updates)."""
    return self.one.inner_state

  def set_inner(self, inner_state) -> None:
    self.one = self.one.replace(inner_state=inner_state)

  def compute(self, job: dict, idx, params, model_state, steps: int):
    """``(loss, grad, model_state, bytes)`` of ``job`` on batches ``idx`` (host arrays)."""
    state = self.one.replace(worker_params=_one_row(params),
                             worker_model_state=_one_row(model_state),
                             comp_state=self.comp_state)
    state = self.job_fn(state, self.arrays, np.zeros([1], np.int32), idx[None].astype(np.int32),
                        np.array([job["iteration"] * steps], np.int32),
                        np.array([job["ratio"]], np.float32), np.array([job["flush"]], bool),
                        None if self.local is None else np.array([steps], np.int32),
                        key_workers=np.array([self.w], np.int32))
    self.one, self.comp_state = state, state.comp_state
    row = lambda tree: jax.tree.map(lambda x: x[0], tree)
    loss, grad, new_ms, nbytes = jax.device_get((state.job_loss[0], row(state.grad_buf),
                                                 row(state.worker_model_state),
                                                 state.job_bytes[0]))
    return loss, grad, new_ms, int(nbytes) - self.stats_bytes


class Spmd:
  """A mesh of several processes: one SPMD program over ``mesh`` (this process is ``rank`` of
  ``num_processes``; each feeds its ``batch_size / num_processes`` examples of every batch).

  Args: as :class:`OneProcess`, plus ``mesh``, ``rank``, ``num_processes`` and ``batch_size``.
  """

  def __init__(self, task, compressor, dense_bytes: int, templates, worker: int, train_rng,
               local, grad_clip: float, *, mesh: Mesh, rank: int, num_processes: int,
               batch_size: int):
    params, _ = templates
    self.task, self.w, self.local, self.train_rng = task, worker, local, train_rng
    self.per, self.rank = batch_size // num_processes, rank
    if local is None:
      self.step, self.replicated, self.split = make_mesh_step(
          task.loss, compressor, mesh, dense_bytes, grad_clip=grad_clip)
    else:
      self.step, self.replicated, self.split = make_mesh_local_step(
          task.loss, compressor, mesh, dense_bytes, local, grad_clip=grad_clip)
    # A local-update scheme's inner optimizer state: this mesh's own, across its jobs.
    self.inner_state = (self._put(local.inner.init(params), self.replicated)
                        if local is not None else ())
    one = _compressor_state(compressor, params, worker)
    self.comp_state = () if one is None else self._put(one, self.replicated)

  def inner(self):
    return self.inner_state

  def set_inner(self, inner_state) -> None:
    self.inner_state = inner_state

  def _put(self, tree, sharding):
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        tree)

  def compute(self, job: dict, idx, params, model_state, steps: int):
    """:meth:`OneProcess.compute` over the mesh: every rank returns the same host arrays."""
    k = job["iteration"]
    mine = idx[..., self.rank * self.per:(self.rank + 1) * self.per]   # this rank's slice
    batch = jax.tree.map(lambda a: a[mine], self.task.train)
    put = lambda tree: self._put(tree, self.replicated)
    flags = (put(np.float32(job["ratio"])), put(np.bool_(job["flush"])))
    if self.local is None:
      loss, grad, new_ms, self.comp_state, nbytes = self.step(
          put(params), put(model_state), self.comp_state, self._put(batch, self.split),
          put(self.train_rng), put(np.int32(self.w)), put(np.int32(k)), *flags)
    else:
      loss, grad, new_ms, self.inner_state, self.comp_state, nbytes = self.step(
          put(params), put(model_state), self.inner_state, self.comp_state,
          self._put(batch, self.split), put(self.train_rng), put(np.int32(self.w)),
          put(np.int32(k * steps)), put(np.int32(steps)), *flags)
    local_copy = lambda tree: jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)
    return local_copy((loss, grad, new_ms, nbytes))


def _compressor_state(compressor, params, worker: int):
  """The worker's compressor state (None without one); keys folded in as ``init_state`` does."""
  if compressor is None:
    return None
  one = compressor.init(params)
  if hasattr(one, "rng"):   # per-worker keys, as the simulator's init_state folds them
    one = one._replace(rng=jax.random.key_data(jax.random.fold_in(
        jax.random.wrap_key_data(one.rng), worker)))
  return one


def _one_row(tree):
  return jax.tree.map(lambda x: np.asarray(x)[None], tree)
