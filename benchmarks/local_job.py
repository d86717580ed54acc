r"""Seconds of one local-update job (Local SGD, DiLoCo, async Local-SGD, HALoS), jitted.

    python -m benchmarks.local_job [--model=resnet18] [--width=0.25] [--steps=8] \
        [--batch=32] [--repeats=3]

One worker's job as the simulator runs it (``executor.make_local_update``):
``--steps`` inner AdamW steps of the model on ``--batch`` random inputs of its
dataset's shape, BatchNorm statistics updated, then the pseudo-gradient.
Printed: the first call (tracing and compilation included) and each of
``--repeats`` calls after it, and the same number of plain one-step gradients
(``jax.value_and_grad`` of the same loss) for scale. A job should cost about
``--steps`` gradients; on XLA:CPU a convolution inside a loop body or a
conditional runs on a slow path (jax#12868), which is why the job's steps are
unrolled (``executor.MAX_UNROLLED_STEPS``).
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import optax

from gssp_jax import models
from gssp_jax.sim import executor

from benchmarks import common

_MODEL = flags.DEFINE_enum("model", "resnet18", list(common.SHAPES), "model")
_WIDTH = flags.DEFINE_float("width", 0.25, "channel multiplier of resnet18/vgg19")
_STEPS = flags.DEFINE_integer("steps", 8, "inner steps of the job")
_BATCH = flags.DEFINE_integer("batch", 32, "examples per inner step")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed calls after the first")


def _timed(fn, *args, repeats: int) -> tuple[float, list[float]]:
  """Seconds of the first call of ``fn`` and of ``repeats`` more, each to completion."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first, times = time.perf_counter() - start, []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, times


def main(argv):
  del argv
  name, steps, batch = _MODEL.value, _STEPS.value, _BATCH.value
  model = models.create_model(name, num_classes=10, **common.model_kwargs(name, _WIDTH.value))
  x = jax.random.normal(jax.random.key(1), (steps, batch, *common.SHAPES[name]))
  y = jax.random.randint(jax.random.key(2), (steps, batch), 0, 10)
  variables = model.init(jax.random.key(0), x[0, :1], train=False)
  params = variables["params"]
  model_state = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(p, ms, data, rng):
    out, new = model.apply({"params": p, **ms}, data["x"], train=True, mutable=list(ms),
                           rngs={"dropout": rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(out, data["y"]).mean()
    return loss, {k: new[k] for k in ms}

  local = executor.LocalJob(optax.adamw(1e-3), steps)
  update = executor.make_local_update(loss_fn, None, 4, local)
  job = jax.jit(lambda p, ms, opt, data: update(
      p, ms, opt, None, data, jax.random.key(3), jnp.int32(0), jnp.int32(steps),
      jnp.float32(1.0), jnp.bool_(False)))
  grad = jax.jit(lambda p, ms, data: jax.value_and_grad(loss_fn, has_aux=True)(
      p, ms, data, jax.random.key(3)))
  print(common.describe_backend())
  print(f"model {name}" + (f" width {_WIDTH.value}" if name in common.CNNS else "")
        + f", {steps} inner AdamW steps of {batch} examples")
  first, times = _timed(job, params, model_state, local.inner.init(params),
                        {"x": x, "y": y}, repeats=_REPEATS.value)
  print(f"local-update job: first call {first:.1f} s, then "
        + ", ".join(f"{t:.3f}" for t in times) + " s")
  first, times = _timed(grad, params, model_state, {"x": x[0], "y": y[0]},
                        repeats=_REPEATS.value)
  print(f"one gradient: first call {first:.1f} s, then "
        + ", ".join(f"{t:.3f}" for t in times) + f" s (x{steps}: {min(times) * steps:.3f} s)")


if __name__ == "__main__":
  app.run(main)
