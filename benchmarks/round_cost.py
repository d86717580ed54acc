r"""Cost of one simulated round with one arrival, as the number of workers grows.

    python -m benchmarks.round_cost [--workers=16,64,256] [--schemes=asp,gssp] \
        [--model=lenet5|seq2seq] [--rounds=50]

Times ``executor.make_round_fn`` alone (no gradient jobs): each round one
worker pushes, its replica (ASP: the server; GSSP: its group server of 4)
applies and the worker pulls, as in an asynchronous run. The model's real
parameter shapes (LeNet-5; or the Seq2Seq of ``configs/multi30k_seq2seq.py``
with 8000/6000-word vocabularies and Adam) and the config's optimizer. A round
that touches only the workers and replicas it involves costs the same at any W.
Printed: milliseconds per round (median of 3 repeats of ``--rounds`` rounds).
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import mnist_lenet5
from configs import multi30k_seq2seq
from gssp_jax import models
from gssp_jax import sync
from gssp_jax.sim import executor
from gssp_jax.base import optim

from benchmarks import common

_WORKERS = flags.DEFINE_list("workers", ["16", "64", "256"], "worker counts")
_SCHEMES = flags.DEFINE_list("schemes", ["asp", "gssp"], "schemes (asp, gssp with 4 groups)")
_MODEL = flags.DEFINE_enum("model", "lenet5", ["lenet5", "seq2seq"], "parameter shapes")
_ROUNDS = flags.DEFINE_integer("rounds", 50, "rounds per timed repeat")


def _params(name: str):
  """The model's parameters (real shapes) and its config's optimizer settings."""
  if name == "lenet5":
    config = mnist_lenet5.get_config()
    model = models.create_model("lenet5", num_classes=10)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 32, 32, 1)))
    return variables["params"], config.optimizer
  config = multi30k_seq2seq.get_config()
  model = models.create_model("seq2seq", src_vocab_size=8000, tgt_vocab_size=6000,
                              emb_dim=config.model_args.emb_dim,
                              hidden_dim=config.model_args.hidden_dim)
  src, tgt = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32)
  variables = jax.jit(lambda k: model.init({"params": k, "dropout": k}, src,
                                           jnp.full((1,), 8, jnp.int32), tgt))(jax.random.key(0))
  return variables["params"], config.optimizer


def round_ms(scheme_name: str, num_workers: int, params, opt_config, rounds: int) -> float:
  """Median over 3 repeats of the milliseconds of one one-arrival round."""
  scheme = sync.build_scheme(scheme_name, num_workers, num_groups=4)
  tx = optim.make_sync_chain(opt_config, scheme.transform, scheme.num_replicas)
  state = executor.init_state(params, {}, tx, None, num_workers, scheme.num_replicas,
                              jax.random.key(1))
  round_fn = executor.make_round_fn(tx)
  protocol = scheme.make_protocol()

  def args_of(worker):
    rnd = protocol.new_round(0.0)
    rnd.arrived[worker] = rnd.pulls[worker] = True
    rnd.applies[rnd.groups[worker] if scheme_name == "gssp" else 0] = True
    args = sync.round_args(rnd)
    args["learning_rate"] = np.float32(0.01)
    return args

  all_args = [args_of(w % num_workers) for w in range(rounds)]
  state = round_fn(state, all_args[0])   # compile
  jax.block_until_ready(state)
  times = []
  for _ in range(3):
    start = time.perf_counter()
    for args in all_args:
      state = round_fn(state, args)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - start) / rounds * 1e3)
  return float(np.median(times))


def main(argv):
  del argv
  print(common.describe_backend())
  params, opt_config = _params(_MODEL.value)
  size = sum(x.size for x in jax.tree.leaves(params))
  print(f"model {_MODEL.value}: {size} parameters, optimizer {opt_config.name}")
  for scheme_name in _SCHEMES.value:
    for workers in map(int, _WORKERS.value):
      ms = round_ms(scheme_name, workers, params, opt_config, _ROUNDS.value)
      print(f"{scheme_name:5s} W={workers:4d}: {ms:8.3f} ms per one-arrival round", flush=True)


if __name__ == "__main__":
  app.run(main)
