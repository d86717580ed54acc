"""What every executor needs before it starts: the checked workdir, the task, the compressor.

Shared by the fused BSP executor (``executors.py``) and the simulator
(``sim/simulate.py``), so neither imports the loop that drives them.
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from gssp_jax import compress
from gssp_jax import defaults
from gssp_jax.base import tasks
from gssp_jax.base import workdir as workdir_lib


def make_compressor(config: ml_collections.ConfigDict):
  """The workers' gradient compressor named by ``config.compress`` (None for ``none``)."""
  c = config.compress
  kwargs = {
      "topk": dict(ratio=c.ratio, scope=c.scope, error_feedback=c.error_feedback),
      "dgc": dict(ratio=c.ratio, sample_ratio=c.sample_ratio, error_feedback=c.error_feedback,
                  seed=config.seed),
      "gdtopk": dict(scope=c.scope, error_feedback=c.error_feedback),
  }.get(c.name, {})
  return compress.make_compressor(c.name, config.num_workers, **kwargs)


def prepare_run(config: ml_collections.ConfigDict, workdir: str):
  """Checks a workdir can hold this run (same config if resuming), builds the task, records the config."""
  os.makedirs(workdir, exist_ok=True)
  config_path = os.path.join(workdir, "config.json")
  if os.path.exists(config_path):
    workdir_lib.check_resumable(config, config_path)
  task = tasks.make_task(config)
  tasks.validate_sizes(config, task.num_train)
  workdir_lib.write_json(config_path, json.loads(config.to_json()))
  return task


def metric_and_target(config: ml_collections.ConfigDict, task) -> tuple[str, float]:
  """The evaluation metric the task reports and the config's target for it."""
  if isinstance(task, tasks.TranslationTask):
    return "bleu", config.train.target_bleu
  return "test_accuracy", config.train.target_accuracy


def metrics_text(record: dict, metric: str) -> str:
  """``metric`` of ``record`` for a progress line, the validation set's beside it where scored."""
  text = f"{metric} {record[metric]:.4f}"
  held_out = defaults.validation_metric(metric)
  return text + (f" | {held_out} {record[held_out]:.4f}" if held_out in record else "")


def init_model(task, seed: int):
  """``(params, model_state, train_rng)`` of a simulated or real run, from one jitted program.

  The simulator and the real runtime's server both start from these weights
  (a jitted initialisation rounds a few BatchNorm weights one ulp away from
  an eager one, so every executor that must agree uses this one). The
  dropout base key is the second half of ``PRNGKey(seed)``'s split.
  """
  def init(seed):
    init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
    params, model_state = task.init(init_rng)
    return params, model_state, train_rng
  return jax.jit(init)(seed)
