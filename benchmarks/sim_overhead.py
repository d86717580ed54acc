r"""The simulator's host cost per simulated gradient, and the hot path's proxies of GPU speed.

    python -m benchmarks.sim_overhead [--workers=16,256] \
        [--schemes=bsp,asp,ssp,dssp,gssp,async_local_sgd] [--pushes=3000] [--executor=levels] \
        [--parts=host,proxies] [--parts=fingerprint]

On a GPU the simulator is fast only if the host keeps ahead of the device and
never makes it wait. Neither shows in a CPU's wall time, where the device work
dominates, so this benchmark measures what predicts it, on any machine:

* ``host``: microseconds of host time per simulated gradient (one push): the
  CPU time of the simulating thread, with the device's work stubbed out: the
  executor's device program is replaced by
  one that returns its input at once, and everything else runs as in a real
  run (timeline, protocol, accounting, jobs, the planner, the chunks' rows and
  their transfer to the device). ``--pushes`` pushes of the MNIST/LeNet-5
  config (``configs/mnist_lenet5.py``) on a ``tiers`` cluster (1, 1.5, 2,
  3), GSSP with 4 groups, the local-update scheme with 4 inner steps. The
  median and the range of ``--repeats`` timings are printed (this VM's speed
  varies by up to 2x between identical runs: the minimum is the least
  disturbed).
* ``proxies``: a real run of a negligible model (one dense layer) on the same
  cluster, 3 epochs of 2,048 examples (128 per worker at 256 workers),
  evaluated 6 times: eager JAX operations (``watch.EagerOps``) and
  device-to-host reads between evaluations (``watch.HostReads``; on an
  accelerator also ``jax.transfer_guard_device_to_host``, which stops the
  run), compilations in all and after the first evaluation (``jax.monitoring``).

* ``fingerprint``: a sha256 of everything the host path produces in
  ``--pushes`` pushes of every scheme (and GSSP global, 64 workers,
  regrouping, a lognormal cluster), the device stubbed: every chunk's rows as
  they cross to the device, the host counters, the staleness accounting and
  the timeline's state. Two checkouts that print the same lines plan, time and
  count every run the same (run this file in both: it imports the checkout it
  runs in); a host-path change that claims to change nothing shows it here.

Targets (issue 33): at most 40 µs per gradient at 16 workers and 60 at 256;
no eager operation and no transfer between evaluations; at most 8 compilations
per run, none after the first evaluation.
"""

import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import numpy as np

from configs import mnist_lenet5
from gssp_jax import config as config_lib
from gssp_jax import models
from gssp_jax.sim import chunk as chunk_lib
from gssp_jax.sim import simulate
from gssp_jax.sim import watch
from gssp_jax import executors
from gssp_jax.base import run as run_lib

from benchmarks import common



def _define_flags() -> None:
  """The command line's flags (defined only when run as a program: the tests import this
  module beside ``sim_efficiency``, whose flags share names)."""
  flags.DEFINE_list("workers", ["16", "256"], "worker counts")
  flags.DEFINE_list("schemes", ["bsp", "asp", "ssp", "dssp", "gssp", "async_local_sgd"],
                    "schemes")
  flags.DEFINE_integer("pushes", 3000, "pushes timed per run (host part)")
  flags.DEFINE_integer("repeats", 5, "timings per run; their median and range printed")
  flags.DEFINE_integer("window", 500, "pushes per window; the least window's figure is printed "
                       "too (0: none)")
  flags.DEFINE_enum("executor", "levels", list(simulate.RUNNERS), "the simulator's runner")
  flags.DEFINE_list("parts", ["host", "proxies"], "host, proxies, fingerprint")


class Linear(nn.Module):
  """The negligible model of the proxies: one dense layer."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


def run_config(scheme: str, workers: int, executor: str, **changes):
  """The MNIST config on the tiers cluster with ``scheme`` on ``workers`` workers."""
  config = mnist_lenet5.get_config()
  keys = {"num_workers": workers, "sync.scheme": scheme, "cluster.profile": "tiers",
          "cluster.tiers": (1.0, 1.5, 2.0, 3.0), "cluster.base_time": 0.01,
          "data.test_size": 500, "executor": executor}
  if scheme in ("gssp", "halos"):
    keys["sync.num_groups"] = 4
  if scheme in ("local_sgd", "diloco", "async_local_sgd", "halos"):
    keys["local.steps"] = 4
  return config_lib.override(config, {**keys, **changes})


def _stub(sim: simulate.Simulation) -> None:
  """Replaces the simulator's device program by one that does nothing (the host part)."""
  done = jax.numpy.zeros([], jax.numpy.int32)
  if sim.layout is not None:   # levels: the chunk program
    sim.feed.chunk_fn = lambda state, arrays, plan: (state, done)
  else:                        # rounds: the step runner
    sim.feed.run_steps = lambda state, arrays, steps: state


def host_us_per_gradient(scheme: str, workers: int, executor: str, pushes: int,
                         window: int = 0) -> float | tuple[float, float]:
  """Host µs per push over ``pushes`` pushes, the device's work stubbed out.

  Measured as the CPU time of the thread that runs the simulation (the host
  path is that one thread), so another process on the machine does not count.
  ``window`` > 0: also the least of the figures of successive windows of that
  many pushes (each with its rounds' deferred accounting), returned as
  ``(whole run, least window)``: a shared machine's slow spells last seconds,
  so the least window is the least disturbed figure.
  """
  config = run_config(scheme, workers, executor, **{"train.stop_after_updates": pushes,
                                                     "train.eval_every": 1000.0,
                                                     "train.num_epochs": 1000.0})
  with tempfile.TemporaryDirectory() as workdir:
    config_lib.validate_config(config)
    task = run_lib.prepare_run(config, workdir)
    sim = simulate.Simulation(config, task, workdir, runner=executor)
    _stub(sim)
    sim.restore()
    windows = []
    start = time.thread_time()
    for stop in (range(window, pushes, window) if window else ()):
      sim._stop_after, done, since = stop, sim.engine.num_pushes, time.thread_time()  # pylint: disable=protected-access
      sim.advance()
      sim._account()   # pylint: disable=protected-access  (its rounds' deferred accounting)
      windows.append((time.thread_time() - since) / max(sim.engine.num_pushes - done, 1) * 1e6)
    sim._stop_after = pushes   # pylint: disable=protected-access
    sim.advance()
    sim.flush_host()   # what the next evaluation does first: the deferred accounting, the last rows
    seconds = time.thread_time() - start
    done = sim.engine.num_pushes
    sim.close()
  whole = seconds / done * 1e6
  return (whole, min(windows)) if window else whole


def proxies(scheme: str, workers: int, executor: str) -> dict:
  """Eager ops, transfers and compilations of a short real run of a negligible model."""
  config = run_config(scheme, workers, executor, **{
      "model": "benchmark_linear", "data.train_size": max(2048, 128 * workers),
      "train.num_epochs": 3.0,
      "train.eval_every": 0.5})
  compilations = watch.compilations()
  start = compilations.mark()
  eager, reads, transfers, evaluations, after_first = [], 0, 0, 0, 0
  with tempfile.TemporaryDirectory() as workdir:
    config_lib.validate_config(config)
    task = run_lib.prepare_run(config, workdir)
    run = executors.make_executor(config, task, workdir)
    run.restore()
    while not run.finished():
      ops, host_reads, mark = watch.EagerOps(), watch.HostReads(), compilations.mark()
      try:
        with ops.active(), host_reads.active(), \
            jax.transfer_guard_device_to_host("disallow_explicit"):
          run.advance()
      except Exception as e:  # pylint: disable=broad-except  (a disallowed transfer)
        if "transfer" not in str(e).lower():
          raise
        transfers += 1
        break
      eager += ops.names
      reads += host_reads.count
      if evaluations:
        after_first += len(compilations.since(mark))
      run.evaluate()
      evaluations += 1
    run.close()
  return {"eager": len(eager), "eager_names": sorted(set(eager)),
          "transfers": transfers + reads,
          "compilations": len(compilations.since(start)), "after_first": after_first,
          "evaluations": evaluations}


FINGERPRINT_CASES = (
    *[(s, 16, {"optimizer.nesterov": True, "optimizer.weight_decay": 0.0} if s == "halos" else {})
      for s in ("bsp", "asp", "ssp", "dssp", "gssp", "inhad", "dssync", "casp", "local_sgd",
                "diloco", "async_local_sgd", "halos")],
    ("gssp", 16, {"sync.inter_group": "global"}), ("ssp", 64, {}), ("gssp", 64, {}),
    ("gssp", 16, {"sync.regroup_every_epoch": True, "data.train_size": 4096}),
    ("ssp", 16, {"cluster.profile": "lognormal"}), ("dssp", 64, {}),
    ("async_local_sgd", 64, {}))


def fingerprint(scheme: str, workers: int, pushes: int, changes: dict) -> str:
  """sha256 (16 hex digits) of a stubbed run's chunk rows, host counters, accounting, timeline."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  config = run_config(scheme, workers, "levels", **{
      "train.stop_after_updates": pushes, "train.eval_every": 1000.0,
      "train.num_epochs": 1000.0, **changes})
  digest = hashlib.sha256()
  done = jax.numpy.zeros([], jax.numpy.int32)

  def chunk_fn(state, arrays, plan):   # the rows as they cross to the device
    del arrays
    # Per dtype, as they crossed before they were one int32 buffer: the same digests.
    for x in chunk_lib.host_regions(sim.feed.packing, np.asarray(plan)).values():
      digest.update(np.asarray(x).tobytes())
    return state, done
  with tempfile.TemporaryDirectory() as workdir:
    config_lib.validate_config(config)
    task = run_lib.prepare_run(config, workdir)
    sim = simulate.Simulation(config, task, workdir, runner="levels")
    sim.feed.chunk_fn = chunk_fn
    sim.restore()
    sim.advance()
    sim.flush_host()
    engine = sim.engine
    for x in (engine.blocked_time_so_far(), engine.iteration, engine.pushed_at,
              np.array([engine.now, engine.num_pushes])):
      digest.update(np.asarray(x).tobytes())
    host = {k: np.asarray(v).tolist() if isinstance(v, np.ndarray) else v
            for k, v in sim.book.host.items() if k != "wall_time"}
    for part in (host, sim.book.acct.summary(), sim.book.acct.data_summary()):
      digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    sim.close()
  return digest.hexdigest()[:16]


def main(argv):
  del argv
  f = flags.FLAGS
  logging.set_verbosity(logging.ERROR)
  models.register_model("benchmark_linear", Linear)
  print(common.describe_backend())
  print(f"executor {f.executor}")
  workers = [int(w) for w in f.workers]
  if "host" in f.parts:
    least = f", least window of {f.window} pushes" if f.window else ""
    print(f"\nhost µs per simulated gradient, device work stubbed, {f.pushes} pushes "
          f"(median, min-max of {f.repeats}{least}):")
    print("| scheme | " + " | ".join(f"{w} workers" for w in workers) + " |")
    print("|---|" + "---|" * len(workers))
    for scheme in f.schemes:
      cells = []
      for w in workers:
        runs = [host_us_per_gradient(scheme, w, f.executor, f.pushes, f.window)
                for _ in range(f.repeats)]
        times = [r[0] if f.window else r for r in runs]
        cell = f"{np.median(times):,.1f} ({min(times):,.1f}-{max(times):,.1f})"
        if f.window:
          cell += f"; {min(r[1] for r in runs):,.1f}"
        cells.append(cell)
      print(f"| {scheme} | " + " | ".join(cells) + " |", flush=True)
  if "fingerprint" in f.parts:
    print(f"\nfingerprints of the host path, {f.pushes} pushes, device stubbed:")
    for scheme, w, changes in FINGERPRINT_CASES:
      print(f"{scheme} {w} {changes or ''} {fingerprint(scheme, w, f.pushes, changes)}",
            flush=True)
  if "proxies" in f.parts:
    print("\nthe hot path of a real run (negligible model, 3 epochs, 6 evaluations):")
    print("| scheme | workers | eager ops between evaluations | device-to-host transfers |"
          " compilations per run | after the first evaluation |")
    print("|---|---|---|---|---|---|")
    for scheme in f.schemes:
      for w in workers:
        r = proxies(scheme, w, f.executor)
        names = f" ({', '.join(r['eager_names'][:6])})" if r["eager"] else ""
        print(f"| {scheme} | {w} | {r['eager']}{names} | {r['transfers']} |"
              f" {r['compilations']} | {r['after_first']} |", flush=True)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
