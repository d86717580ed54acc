"""``load_trained(workdir)``: the trained model of a run, from its latest checkpoint.

The weights are those the run evaluates (and a user would deploy): the fused
BSP state's parameters; in the simulator and the real runtime the served
replica's (``sim/executor.served_weights``: GSSP's global server, else the
mean of the server replicas).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import ml_collections

from gssp_jax import executors as executors_lib
from gssp_jax.base import tasks


class Trained(NamedTuple):
  """A run's trained model.

  Attributes:
    params: the served weights (host arrays), as ``task.evaluate`` takes them.
    model_state: their BatchNorm statistics ({} for models without).
    config: the run's config, as its ``config.json`` recorded it.
    position: the checkpoint's step (``updates`` for fused BSP, else ``pushes``).
  """
  params: Any
  model_state: Any
  config: ml_collections.ConfigDict
  position: int


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a run recorded in ``workdir/config.json``."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist: {workdir!r} is not a run's workdir")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def load_trained(workdir: str, *, task=None) -> Trained:
  """Loads the served weights of the latest checkpoint in ``workdir``, with the run's config.

  Example::

    trained = gssp_jax.train.load_trained("/tmp/gssp")
    task = gssp_jax.base.tasks.make_task(trained.config)
    task.evaluate(trained.params, trained.model_state)   # the last metrics line's accuracy

  Args:
    workdir: a run's workdir (``train_and_evaluate``'s, or one trial's of a sweep).
    task: the run's task if already built (saves loading the data again).

  Raises:
    FileNotFoundError: no ``config.json`` or no checkpoint in ``workdir``.
  """
  config = load_config(workdir)
  task = tasks.make_task(config) if task is None else task
  # The executor gives the exact state template the checkpoint was saved from; building it
  # starts nothing (a real run's server serves only once advanced).
  executor = executors_lib.make_executor(config, task, workdir)
  sharded = hasattr(executor, "restore_served")   # the real runtime: tensors over its shards
  try:
    step = executor.checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
    if sharded:
      params, model_state = executor.restore_served(step)
      return Trained(jax.device_get(params), jax.device_get(model_state), config, int(step))
    state, _ = executor.checkpointer.restore(step, executor.state)
  finally:
    executor.close() if sharded else executor.checkpointer.close()
  if hasattr(executor, "served_weights"):   # the simulator: server replicas, either layout
    params, model_state = executor.served_weights(state)
  else:
    params, model_state = state.params, state.model_state
  params, model_state = jax.device_get((params, model_state))
  return Trained(params, model_state, config, int(step))
