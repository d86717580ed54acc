r"""Simulation efficiency: simulated worker-samples/s over the model's plain batched step's samples/s.

    python -m benchmarks.sim_efficiency [--model=lenet5|resnet18|vgg19] [--width=1.0] \
        [--workers=16,64,256] [--schemes=bsp,asp,ssp,gssp] [--epochs=1] [--executor=NAME] \
        [--levels_per_call=0,8] [--level_job_batch=0,1] [--level_job_slots=0,8]

For each worker count W the baseline is one jitted training step of the model
(``value_and_grad`` + SGD momentum, BatchNorm statistics updated) on a batch of
W x 32 random inputs of its dataset's shape (MNIST 32x32x1 for LeNet-5, CIFAR-10
32x32x3 for the CNNs). Each scheme runs through ``experiments.main``'s code path
with the model's config (``configs/mnist_lenet5.py``, ``configs/cifar10_resnet18.py``,
``configs/cifar10_vgg19.py``; ``--width`` sets ``model_args.width``, ``--executor``
the ``executor`` key, ``--levels_per_call`` the ``levels_per_call`` key,
``--level_job_batch`` the ``level_job_batch`` key and ``--level_job_slots`` the
``level_job_slots`` key, one run per value), on a simulated
``tiers`` cluster (1, 1.5, 2, 3); its rate
is taken between its first and last evaluation, so compilation is excluded; the
test split is cut to 500 examples so evaluation is a small part of that span.

Printed per run: simulated samples/s, the baseline's, their ratio (efficiency),
the cost per simulated sample in microseconds (flat across worker counts when the
simulator scales) and the time from the call to the first evaluation (data
loading, tracing and compilation; the compile cost a user waits for). Executors
compile some programs lazily (a ``levels`` bucket, a sparse round's id size, the
first time one occurs), so compilations can fall inside the measured span: the
compilations in it (tracing, lowering, XLA) are counted and timed
(``jax.monitoring``), and the rate is printed twice, as run and without that time
and the checkpoint saves inside the span ("steady"; the saves' and the evaluations'
seconds in the span are printed: by default a run checkpoints after an evaluation every 600 wall
seconds, ``train.checkpoint_every_seconds``; a 16-worker ResNet-18 state is about 2 GB). A short run (small
``--epochs``) with many compilations in its span measures mostly compilation. The header
names the backend, the device and whether XLA's deterministic-ops flag is set.
Peak memory is the process's maximum resident set size.
"""

import resource
import time

from absl import app
from absl import flags
import jax
import optax

from gssp_jax import models

from benchmarks import common
from benchmarks import sim_rates


_MODEL = flags.DEFINE_enum("model", "lenet5", list(sim_rates.CONFIGS), "model (and its dataset's config)")
_WIDTH = flags.DEFINE_float("width", 1.0, "channel multiplier of resnet18/vgg19 (model_args.width)")
_EXECUTOR = flags.DEFINE_string("executor", None, "the config's `executor` (default: the config's)")
_WORKERS = flags.DEFINE_list("workers", ["16", "64", "256"], "worker counts")
_SCHEMES = flags.DEFINE_list("schemes", ["bsp", "asp", "ssp", "gssp"], "schemes")
_EPOCHS = flags.DEFINE_float("epochs", 1.0, "epochs simulated per run")
_LEVELS_PER_CALL = flags.DEFINE_list("levels_per_call", ["0"], "the config's `levels_per_call`, "
                                     "one run per value (0: chosen by the run; other values need "
                                     "--executor=levels)")
_JOB_BATCH = flags.DEFINE_list("level_job_batch", ["0"], "the config's `level_job_batch`, one "
                               "run per value (0: chosen by the run, 1 on a CPU and all of a "
                               "piece's job slots in one vmap on an accelerator; other values "
                               "need --executor=levels)")
_JOB_SLOTS = flags.DEFINE_list("level_job_slots", ["0"], "the config's `level_job_slots` (J, a "
                               "piece's job slots), one run per value (0: chosen by the run, "
                               "min(W, 64); other values need --executor=levels)")


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


def main(argv):
  del argv
  name, width = _MODEL.value, _WIDTH.value
  try:
    per_call = [(int(k), int(b), int(j)) for k in _LEVELS_PER_CALL.value
                for b in _JOB_BATCH.value for j in _JOB_SLOTS.value]
    configs = {(w, k, s): sim_rates.run_config(name, width, _EXECUTOR.value, s, w, _EPOCHS.value, *k)
               for w in map(int, _WORKERS.value) for k in per_call for s in _SCHEMES.value}
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(common.describe_backend())
  print(f"model {name}" + (f" width {width}" if name in common.CNNS else "")
        + f", executor {_EXECUTOR.value or 'the config default'}, {_EPOCHS.value} epochs per run")
  clock = sim_rates.CompileClock()
  jax.monitoring.register_event_duration_secs_listener(clock)
  print("| workers | levels per call, job batch, job slots | scheme | simulated samples/s |"
        " batched step samples/s | efficiency | µs per simulated sample | compilations in the span (s) |"
        " checkpoint saves, evaluations in the span (s) |"
        " steady samples/s | steady efficiency | to first evaluation (s) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for w in map(int, _WORKERS.value):
    base = baseline(name, width, w * 32)
    for k in per_call:
      for scheme in _SCHEMES.value:
        r = sim_rates.simulated(configs[(w, k, scheme)], clock)
        print(f"| {w} | {k[0]}, {k[1]}, {k[2]} | {scheme} | {r['rate']:,.0f} | {base:,.0f} |"
              f" {r['rate'] / base:.2f} |"
              f" {1e6 / r['rate']:,.1f} | {r['compiles']} ({r['compile_s']:.1f}) |"
              f" {r['save_s']:.1f}, {r['eval_s']:.1f} |"
              f" {r['steady']:,.0f} | {r['steady'] / base:.2f} | {r['first']:.1f} |", flush=True)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f"peak resident memory: {peak:,.0f} MiB")


if __name__ == "__main__":
  app.run(main)
