"""What the end-to-end tests share: small LeNet-5/MNIST runs, on a simulated cluster or not.

The test files import it as ``helpers`` (pytest puts ``tests/`` on the path). Runs
built from the same helper with the same sizes compile the same programs, which
the session's compilation cache (conftest.py) then compiles only once.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from configs import mnist_lenet5
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.sim import chunk
from gssp_jax.sim import executor
from gssp_jax.sim import flat
from gssp_jax.sim import levels


class TinyCNN(nn.Module):
  """conv3x3(4, stride 2) -> ReLU -> 4x4 pool -> dense: an MNIST classifier that compiles fast.

  For the tests whose claim does not depend on the model (two executors or runners agree, a
  resume is exact): ``model="helpers:TinyCNN"`` (a user model named by module, so a
  subprocess resolves it too). LeNet-5's convolutions were most of their compile time.
  """
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2))(x))
    x = nn.avg_pool(x, (4, 4), strides=(4, 4)).reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes)(x).astype(jnp.float32)


def mnist_smoke(data_dir=None, *, train_size=512, test_size=200, num_epochs=1.0,
                eval_every=0.5, **changes):
  """``configs/mnist_lenet5.py:smoke`` (4 BSP workers x batch 32), cut to ``train_size``.

  Args:
    data_dir: the offline data directory, or None to leave ``data_dir`` unset.
    train_size, test_size: examples used; 512 / 4 workers / batch 32 = 4 iterations
      per worker per epoch.
    num_epochs, eval_every: ``train.*``.
    **changes: dotted keys, as ``config.override`` takes them, applied last.
  """
  config = mnist_lenet5.get_config("smoke")
  if data_dir is not None:
    config.data_dir = data_dir
  config.data.train_size, config.data.test_size = train_size, test_size
  config.train.num_epochs, config.train.eval_every = num_epochs, eval_every
  return config_lib.override(config, changes)


def cluster_config(scheme, data_dir=None, **changes):
  """:func:`mnist_smoke` with ``scheme`` on 4 workers in two speed tiers (1, 2.5), jitter 0.1.

  GSSP gets 2 groups (a sync key the scheme does not read is an error, so only it).
  ``changes`` (dotted keys, or ``mnist_smoke``'s sizes) override any of these.
  """
  keys = {"num_workers": 4, "sync.scheme": scheme, "cluster.profile": "tiers",
          "cluster.tiers": (1.0, 2.5), "cluster.jitter": 0.1}
  if scheme == "gssp":
    keys["sync.num_groups"] = 2
  sizes = {k: changes.pop(k) for k in ("train_size", "test_size", "num_epochs", "eval_every")
           if k in changes}
  return mnist_smoke(data_dir, **sizes, **{**keys, **changes})


def metric_lines(workdir):
  """The run's ``metrics.jsonl`` lines without ``wall_time`` (the one key that varies)."""
  with open(f"{workdir}/metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  for line in lines:
    line.pop("wall_time")
  return lines


def timeline_steps(scheme, speeds, max_pushes, num_examples, batch_size, *, seed=0,
                   ratios=lambda workers: np.ones([workers.size], np.float32),
                   flushes=lambda iters: np.zeros(iters.shape, bool),
                   learning_rate=lambda pushes: 0.05):
  """The executor's steps as ``sim/simulate.py`` builds them, for the runners' unit tests.

  A timeline of ``scheme`` on workers of iteration times ``speeds`` (messages 0.45
  s), run to ``max_pushes``: the first step is every worker's first job, then one
  step per round with the jobs of the workers it pulled. Jobs draw random batches
  of ``batch_size`` from ``num_examples`` (``seed``). ``ratios(workers)``,
  ``flushes(iterations)`` and ``learning_rate(pushes so far)`` set the jobs'
  compression ratios and error-feedback flushes and each round's learning rate.
  """
  rng = np.random.default_rng(seed)
  dispatched = np.zeros([scheme.num_workers], np.int64)

  def jobs(workers):
    ks = dispatched[workers].copy()
    dispatched[workers] += 1
    return executor.Jobs(workers=workers.astype(np.int32),
                         idx=rng.integers(0, num_examples,
                                          size=(workers.size, batch_size)).astype(np.int32),
                         iters=ks.astype(np.int32), ratios=ratios(workers),
                         flushes=flushes(ks))

  engine = sync.TimelineEngine(scheme.make_protocol(), lambda w, k: speeds[w],
                               message_delay=lambda m: 0.45, record=False)
  steps = [executor.Step(None, jobs(np.arange(scheme.num_workers)))]
  while engine.num_pushes < max_pushes:
    for rnd in engine.step():
      args = sync.round_args(rnd)
      args["learning_rate"] = np.float32(learning_rate(engine.num_pushes))
      pulled = np.flatnonzero(rnd.pulls)
      steps.append(executor.Step(args, jobs(pulled) if pulled.size else None))
  return steps


def level_runner(loss_fn, compressor, tx, dense_bytes, stats_bytes, scheme, params, model_state,
                 rng, *, shape=None, grad_clip=0.0, local=None, job_shape=(1,), job_batch=0,
                 unroll_pieces=False):
  """The level executor's flat initial state and step runner, for the runners' equivalence tests.

  ``tx`` is the same sync chain the per-round runner uses (its optimizers are
  elementwise, so one chain serves the flat weights too). ``shape`` defaults to
  small pieces (2 per call, 4 job and 4 round slots, 2 pull slots) and the
  protocol's declared round bounds; ``job_batch`` is ``chunk.jobs_body``'s (0: one ``vmap``),
  ``unroll_pieces`` ``chunk.make_chunk_fn``'s. Returns ``(state, run, layout)``.
  """
  W, R = scheme.num_workers, scheme.num_replicas
  protocol = scheme.make_protocol()
  layout = flat.make_layout(params, model_state)
  if shape is None:
    arrivals, replicas = protocol.round_bounds()
    shape = chunk.Shape(pieces=2, jobs=min(W, 4), rounds=max(4, -(-W // 2)), arrivals=arrivals,
                        pulls=min(W, 2), replicas=min(replicas, R))
  init = lambda p, m, r: chunk.init_state(layout, p, m, tx, compressor, W, R, r,
                                          inner=None if local is None else local.inner)
  state = jax.jit(init)(params, model_state, rng)
  run = levels.make_step_runner(layout, loss_fn, compressor, tx, dense_bytes, stats_bytes, W, R,
                                protocol.num_groups, shape, job_shape, protocol.route,
                                grad_clip=grad_clip, local=local, job_batch=job_batch,
                                unroll_pieces=unroll_pieces, round_fields=protocol.round_fields,
                                one_exchange=protocol.one_exchange_per_round)
  return state, run, layout


def as_trees(layout, state):
  """A flat (level executor) state's weights, statistics and gradients as the model's pytrees.

  The sync chain's state stays as it is (its clocks compare directly).
  """
  params = lambda rows: jax.vmap(layout.unravel_params)(rows)
  stats = (lambda rows: jax.vmap(layout.unravel_stats)(rows)) if layout.num_stats else (
      lambda rows: {})
  return state.replace(replica_params=params(state.replica_params),
                       worker_params=params(state.worker_params),
                       replica_model_state=stats(state.replica_model_state),
                       worker_model_state=stats(state.worker_model_state),
                       grad_buf=params(state.grad_buf))


def recorded_without(config, tmp_path, *keys):
  """``config`` as a run recorded before its dotted ``keys`` existed: asserts that it counts as
  unchanged (``workdir.config_changes``) and resumes (``check_resumable``); returns the record
  (a dict) and its ``config.json``'s path."""
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  recorded = json.loads(config.to_json())
  for key in keys:
    *parents, leaf = key.split(".")
    node = recorded
    for parent in parents:
      node = node[parent]
    del node[leaf]
  assert workdir_lib.config_changes(recorded, config) == []
  path = tmp_path / "config.json"
  path.write_text(json.dumps(recorded))
  workdir_lib.check_resumable(config, str(path))
  return recorded, path
