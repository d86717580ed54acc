r"""Simulation efficiency: simulated worker-samples/s over the model's plain batched step's samples/s.

    python -m benchmarks.sim_efficiency [--model=lenet5|resnet18|vgg19] [--width=1.0] \
        [--workers=16,64,256] [--schemes=bsp,asp,ssp,gssp] [--epochs=1] [--executor=NAME]

For each worker count W the baseline is one jitted training step of the model
(``value_and_grad`` + SGD momentum, BatchNorm statistics updated) on a batch of
W x 32 random inputs of its dataset's shape (MNIST 32x32x1 for LeNet-5, CIFAR-10
32x32x3 for the CNNs). Each scheme runs through ``experiments.main``'s code path
with the model's config (``configs/mnist_lenet5.py``, ``configs/cifar10_resnet18.py``,
``configs/cifar10_vgg19.py``; ``--width`` sets ``model_args.width``, ``--executor``
the ``executor`` key), on a simulated ``tiers`` cluster (1, 1.5, 2, 3); its rate
is taken between its first and last evaluation, so compilation is excluded; the
test split is cut to 500 examples so evaluation is a small part of that span.

Printed per run: simulated samples/s, the baseline's, their ratio (efficiency),
the cost per simulated sample in microseconds (flat across worker counts when the
simulator scales) and the time from the call to the first evaluation (data
loading, tracing and compilation; the compile cost a user waits for). The header
names the backend, the device and whether XLA's deterministic-ops flag is set.
Peak memory is the process's maximum resident set size.
"""

import json
import os
import resource
import tempfile
import threading
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import optax

from configs import cifar10_resnet18
from configs import cifar10_vgg19
from configs import mnist_lenet5
from gssp_jax import config as config_lib
from gssp_jax import models
from gssp_jax.train import loop

from benchmarks import common

_CONFIGS = {"lenet5": mnist_lenet5, "resnet18": cifar10_resnet18, "vgg19": cifar10_vgg19}

_MODEL = flags.DEFINE_enum("model", "lenet5", list(_CONFIGS), "model (and its dataset's config)")
_WIDTH = flags.DEFINE_float("width", 1.0, "channel multiplier of resnet18/vgg19 (model_args.width)")
_EXECUTOR = flags.DEFINE_string("executor", None, "the config's `executor` (default: the config's)")
_WORKERS = flags.DEFINE_list("workers", ["16", "64", "256"], "worker counts")
_SCHEMES = flags.DEFINE_list("schemes", ["bsp", "asp", "ssp", "gssp"], "schemes")
_EPOCHS = flags.DEFINE_float("epochs", 1.0, "epochs simulated per run")


def baseline(name: str, width: float, total_batch: int) -> float:
  """Samples/s of one jitted batched training step of the model on ``total_batch`` inputs."""
  model = models.create_model(name, num_classes=10, **common.model_kwargs(name, width))
  x = jax.random.normal(jax.random.key(0), (total_batch,) + common.SHAPES[name])
  y = jax.random.randint(jax.random.key(1), (total_batch,), 0, 10)
  variables = model.init(jax.random.key(2), x[:1], train=False)
  params, stats = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  tx = optax.sgd(0.05, momentum=0.9)

  @jax.jit
  def step(params, stats, opt_state, x, y):
    def loss(p):
      logits, new_stats = model.apply({"params": p, **stats}, x, train=True, mutable=list(stats))
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new_stats
    grads, stats = jax.grad(loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state

  state = (params, stats, tx.init(params))
  state = step(*state, x, y)
  jax.block_until_ready(state)
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(5):
      state = step(*state, x, y)
    jax.block_until_ready(state)
    best = min(best, (time.perf_counter() - start) / 5)
  return total_batch / best


def run_config(name: str, width: float, executor: str | None, scheme: str, workers: int,
               epochs: float):
  """The config a simulated run uses: the model's config file with the benchmark's changes.

  Raises:
    ValueError: an executor given where the config has no ``executor`` key.
  """
  config = _CONFIGS[name].get_config()
  if name in common.CNNS:
    config.model_args.width = width
  else:
    common.model_kwargs(name, width)   # rejects a width LeNet-5 does not have
  config.num_workers = workers
  config.sync.scheme = scheme
  config.sync.num_groups = 4
  config.cluster.profile = "tiers"
  config.cluster.base_time = 0.01
  config.data.test_size = 500
  config.train.num_epochs = epochs
  config.train.eval_every = epochs / 4
  if executor is not None:   # only when asked: a tree without the key keeps working
    try:
      config_lib.override(config, {"executor": executor})
    except KeyError as e:
      raise ValueError(f"--executor={executor!r}: this version's config has no `executor` "
                       "key; leave --executor out") from e
  return config


def _watch_first_line(path: str, start: float, done: threading.Event, out: dict) -> None:
  """Records in ``out["first"]`` the seconds from ``start`` until ``path`` has a line."""
  while not done.is_set():
    if os.path.exists(path) and os.path.getsize(path) > 0:
      out["first"] = time.perf_counter() - start
      return
    time.sleep(0.02)


def simulated(config) -> tuple[float, float]:
  """Runs ``config``; returns (simulated samples/s between first and last evaluation,
  seconds from the call to the first evaluation)."""
  with tempfile.TemporaryDirectory() as workdir:
    path, seen, done = os.path.join(workdir, "metrics.jsonl"), {}, threading.Event()
    start = time.perf_counter()
    watcher = threading.Thread(target=_watch_first_line, args=(path, start, done, seen),
                               daemon=True)
    watcher.start()
    try:
      loop.train_and_evaluate(config, workdir)
    finally:
      done.set()
      watcher.join()
    lines = [json.loads(l) for l in open(path)]
  first, last = lines[0], lines[-1]
  rate = (last["pushes"] - first["pushes"]) * config.batch_size / (
      last["wall_time"] - first["wall_time"])
  return rate, seen.get("first", float("nan"))


def main(argv):
  del argv
  name, width = _MODEL.value, _WIDTH.value
  try:
    configs = {(w, s): run_config(name, width, _EXECUTOR.value, s, w, _EPOCHS.value)
               for w in map(int, _WORKERS.value) for s in _SCHEMES.value}
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(common.describe_backend())
  print(f"model {name}" + (f" width {width}" if name in common.CNNS else "")
        + f", executor {_EXECUTOR.value or 'the config default'}, {_EPOCHS.value} epochs per run")
  print("| workers | scheme | simulated samples/s | batched step samples/s | efficiency |"
        " µs per simulated sample | to first evaluation (s) |")
  print("|---|---|---|---|---|---|---|")
  for w in map(int, _WORKERS.value):
    base = baseline(name, width, w * 32)
    for scheme in _SCHEMES.value:
      rate, first = simulated(configs[(w, scheme)])
      print(f"| {w} | {scheme} | {rate:,.0f} | {base:,.0f} | {rate / base:.2f} |"
            f" {1e6 / rate:,.1f} | {first:.1f} |", flush=True)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak resident memory: {peak:,.0f} MiB")


if __name__ == "__main__":
  app.run(main)
