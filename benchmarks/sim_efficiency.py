"""Simulation efficiency: simulated worker-samples/s over a plain batched LeNet-5 step's samples/s.

    python -m benchmarks.sim_efficiency [--workers=16,64,256] [--schemes=bsp,asp,ssp,gssp]

For each worker count W the baseline is one jitted LeNet-5 training step
(``value_and_grad`` + SGD momentum) on a batch of W x 32 MNIST-shaped inputs.
Each scheme runs through ``experiments.main``'s code path (the simulator,
16-tier-style cluster ``tiers`` (1, 1.5, 2, 3), MNIST), and its rate is taken
between its first and last evaluation, so compilation is excluded; the test
split is cut to 500 images so evaluation is a small part of that span. Peak
memory is the process's maximum resident set size.
"""

import json
import resource
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import optax

from configs import mnist_lenet5
from gssp_jax import models
from gssp_jax.train import loop

_WORKERS = flags.DEFINE_list("workers", ["16", "64", "256"], "worker counts")
_SCHEMES = flags.DEFINE_list("schemes", ["bsp", "asp", "ssp", "gssp"], "schemes")
_EPOCHS = flags.DEFINE_float("epochs", 1.0, "epochs simulated per run")


def baseline(total_batch: int) -> float:
  model = models.create_model("lenet5", num_classes=10)
  x = jax.random.normal(jax.random.key(0), (total_batch, 32, 32, 1))
  y = jax.random.randint(jax.random.key(1), (total_batch,), 0, 10)
  params = model.init(jax.random.key(2), x[:1])["params"]
  tx = optax.sgd(0.05, momentum=0.9)

  @jax.jit
  def step(params, opt_state, x, y):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, x), y).mean()
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  state = (params, tx.init(params))
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


def simulated(scheme: str, workers: int, epochs: float) -> float:
  config = mnist_lenet5.get_config()
  config.num_workers = workers
  config.sync.scheme = scheme
  config.sync.num_groups = 4
  config.cluster.profile = "tiers"
  config.cluster.base_time = 0.01
  config.data.test_size = 500
  config.train.num_epochs = epochs
  config.train.eval_every = epochs / 4
  with tempfile.TemporaryDirectory() as workdir:
    loop.train_and_evaluate(config, workdir)
    lines = [json.loads(l) for l in open(f"{workdir}/metrics.jsonl")]
  first, last = lines[0], lines[-1]
  return (last["pushes"] - first["pushes"]) * config.batch_size / (
      last["wall_time"] - first["wall_time"])


def main(argv):
  del argv
  print("| workers | scheme | simulated samples/s | batched step samples/s | efficiency |")
  print("|---|---|---|---|---|")
  for w in map(int, _WORKERS.value):
    base = baseline(w * 32)
    for scheme in _SCHEMES.value:
      rate = simulated(scheme, w, _EPOCHS.value)
      print(f"| {w} | {scheme} | {rate:,.0f} | {base:,.0f} | {rate / base:.2f} |", flush=True)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak resident memory: {peak:,.0f} MiB")


if __name__ == "__main__":
  app.run(main)
