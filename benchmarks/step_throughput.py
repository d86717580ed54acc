r"""Training throughput of the framework's step against a bare jit(grad) + optax loop.

  python -m benchmarks.step_throughput [--models=lenet5,resnet18] [--workers=1,4]

Both sides train the same model with the same optimizer on the same number of
samples per update (``workers x batch``), on synthetic inputs of the dataset's
shape (the data pipeline is not what is measured). The framework side is what
``train_and_evaluate`` runs: a host loop of one jitted, donating round that
gathers each worker's batch from the on-device training arrays, computes the
per-worker gradients and applies the BSP server update. The bare side is a
Python loop calling ``jax.jit`` of ``jax.grad`` + ``optax`` on one batch of
``workers x batch`` already on the device. Prints samples/s, the ratio, the cost
per sample in microseconds and the framework's first call (tracing and
compilation); the header names the backend, the device and whether XLA's
deterministic-ops flag is set. ``--width`` scales the CNNs' channels.

There is no ``--executor`` here: the framework side is the BSP chunk runner
itself, which no executor choice changes; ``benchmarks.sim_efficiency`` takes one.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import jax
import numpy as np
import optax

from gssp_jax import config as config_lib
from gssp_jax import data as data_lib
from gssp_jax import models as models_lib
from gssp_jax.data import sharding
from gssp_jax.base import optim
from gssp_jax.base import step as step_lib
from gssp_jax.base import tasks

from benchmarks import common

_MODELS = flags.DEFINE_list("models", ["lenet5", "resnet18"], "Models to measure.")
_WIDTH = flags.DEFINE_float("width", 1.0, "Channel multiplier of resnet18/vgg19.")
_WORKERS = flags.DEFINE_list("workers", ["1", "4"], "Worker counts to measure.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Per-worker batch size.")
_STEPS = flags.DEFINE_integer("steps", 0, "Timed updates per measurement (0 = per model default).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Measurements per side; the best is reported.")

_DEFAULT_STEPS = {"lenet5": 200, "resnet18": 8, "vgg19": 8}


def _synthetic_dataset(shape, n: int) -> data_lib.ImageDataset:
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (n,) + shape, dtype=np.uint8)
  labels = rng.integers(0, 10, n).astype(np.int32)
  c = shape[-1]
  return data_lib.ImageDataset("synthetic", images, labels, images[:8], labels[:8], 10,
                               (0.5,) * c, (0.25,) * c)


def _best_rate(fn, samples: int, repeats: int) -> tuple[float, float]:
  """(best samples/s over ``repeats`` calls, seconds of the first call: compile and warm up)."""
  t = time.perf_counter()
  fn()
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return samples / min(times), first


def measure(model_name: str, workers: int, batch: int, steps: int, repeats: int,
            width: float = 1.0):
  """(framework samples/s, bare samples/s, framework's first call in seconds)."""
  config = config_lib.default_config()
  shape = common.SHAPES[model_name]
  n = workers * batch * steps
  model = models_lib.create_model(model_name, num_classes=10,
                                  **common.model_kwargs(model_name, width))
  task = tasks.ClassificationTask(model,
                                  _synthetic_dataset(shape, n), augment=False,
                                  eval_batch_size=8)
  tx = optim.make_optimizer(config.optimizer, steps, steps)

  # Framework: the chunk runner train_and_evaluate uses.
  state = step_lib.init_train_state(task, tx, 0)
  run = step_lib.make_chunk_runner(step_lib.make_bsp_step(task.loss, tx, workers), batch)
  arrays = jax.device_put(task.train)
  order = jax.device_put(sharding.epoch_order(sharding.worker_shards(n, workers, 0), 0, 0))
  holder = {"state": state}

  def framework():
    s, metrics = run(holder["state"], arrays, order, 0, steps)
    holder["state"] = s
    jax.block_until_ready(metrics)

  # Bare: jit(grad) + optax on the same number of samples per update.
  params, model_state = task.init(jax.random.PRNGKey(0))
  opt_state = tx.init(params)
  model = task.model
  mean, std = task._mean, task._std

  def loss_fn(p, ms, x, y):
    x = data_lib.normalize_images(x, mean, std)
    if ms:
      logits, new = model.apply({"params": p, **ms}, x, train=True, mutable=list(ms))
    else:
      logits, new = model.apply({"params": p}, x, train=True), {}
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

  @jax.jit
  def bare_step(p, ms, o, x, y):
    grads, new_ms = jax.grad(loss_fn, has_aux=True)(p, ms, x, y)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), new_ms, o

  x = jax.device_put(task.train["image"][: workers * batch])
  y = jax.device_put(task.train["label"][: workers * batch])
  bare_state = {"v": (params, model_state, opt_state)}

  def bare():
    p, ms, o = bare_state["v"]
    for _ in range(steps):
      p, ms, o = bare_step(p, ms, o, x, y)
    jax.block_until_ready(p)
    bare_state["v"] = (p, ms, o)

  samples = workers * batch * steps
  fw, compile_s = _best_rate(framework, samples, repeats)
  br, _ = _best_rate(bare, samples, repeats)
  return fw, br, compile_s


def main(argv):
  del argv
  try:
    for name in _MODELS.value:
      if name not in common.SHAPES:
        raise ValueError(f"model {name!r} is invalid; allowed: {', '.join(common.SHAPES)}")
    common.model_kwargs("resnet18", _WIDTH.value)   # a width > 0 (LeNet-5 ignores it)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(common.describe_backend())
  print(f"per-worker batch {_BATCH.value}, width {_WIDTH.value} (resnet18/vgg19)")
  print(f"{'model':10s} {'workers':>7s} {'samples/update':>14s} {'framework/s':>12s}"
        f" {'bare/s':>10s} {'framework cost':>15s} {'µs/sample':>10s} {'first call s':>12s}")
  for name in _MODELS.value:
    for w in (int(v) for v in _WORKERS.value):
      steps = _STEPS.value or _DEFAULT_STEPS[name]
      fw, br, compile_s = measure(name, w, _BATCH.value, steps, _REPEATS.value,
                                  _WIDTH.value if name in common.CNNS else 1.0)
      print(f"{name:10s} {w:7d} {w * _BATCH.value:14d} {fw:12.1f} {br:10.1f}"
            f" {br / fw:14.3f}x {1e6 / fw:10.1f} {compile_s:12.1f}", flush=True)


if __name__ == "__main__":
  app.run(main)
