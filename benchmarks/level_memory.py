r"""The level executor's device memory, compiled and not run: does a run fit its card?

    python -m benchmarks.level_memory [--model=resnet18] [--workers=16,256] [--schemes=gssp] \
        [--level_job_slots=0] [--level_job_batch=0] [--one_vmap] [--devices=1]

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python -m benchmarks.level_memory --devices=1,4

``--model``, ``--width``, ``--workers``, ``--schemes``, ``--level_job_slots`` and
``--level_job_batch`` are ``benchmarks.sim_efficiency``'s flags (one run per value of each;
``--epochs`` does not change the program). Each run is built abstractly
(``simulate.Simulation(..., abstract=True)``: the device state and the training arrays as
shapes, nothing allocated, no calibration) from ``sim_efficiency``'s config, and its chunk
program is compiled for this backend; printed is XLA's memory analysis of that program
(``levels.chunk_memory``): the state and the other arguments, the temporaries, and the peak
(arguments + outputs - the donated state the outputs reuse + temporaries). The ``[W, P]``
worker weights and outstanding gradients are printed beside it (``W x P x 4`` bytes each).

On a CPU the job batch chosen by the run is 1 (one job at a time); an accelerator computes a
piece's job slots in one ``vmap``, and ``--one_vmap`` compiles that program here (the job
batch set to the run's job slots, in place of ``--level_job_batch``). Buffer assignment differs between backends (a GPU's
convolutions also take cuDNN workspace, and its client reserves part of the card), so a
CPU's figure is an estimate of a GPU's: the arguments are the same bytes, the temporaries
are XLA:CPU's.

``--devices``: ``config.devices`` per run (``sim/devices.py``; on a CPU, several devices need
``XLA_FLAGS=--xla_force_host_platform_device_count=N``). The figures are per device: a piece's
job slots are split over the devices, and so are the per-worker buffers that only the jobs read,
by owner (``sim/devices.py``); the rest of the state is on each.
"""

from __future__ import annotations

import itertools
import tempfile

from absl import app
from absl import flags

from gssp_jax.sim import chunk
from gssp_jax.sim import levels
from gssp_jax.sim import simulate
from gssp_jax.base import tasks

from benchmarks import common
from benchmarks import sim_efficiency  # noqa: F401  (its flags)
from benchmarks import sim_rates

GIB = 2 ** 30

_DEVICES = flags.DEFINE_list("devices", ["1"], "config.devices of each run (0: all local "
                              "devices)")
_ONE_VMAP = flags.DEFINE_bool("one_vmap", False, "every job slot of a piece in one vmap, as an "
                              "accelerator runs them (the job batch = the job slots)")


def measure(config) -> dict:
  """``levels.chunk_memory`` of ``config``'s run, built abstractly, plus its shape and P."""
  task = tasks.make_task(config)
  with tempfile.TemporaryDirectory() as workdir:
    sim = simulate.Simulation(config, task, workdir, runner="levels", abstract=True)
    try:
      memory = sim.chunk_memory()
    finally:
      sim.close()
    return {**memory, "shape": sim.feed.shape, "job_batch": sim.feed.job_batch,
            "params": sim.layout.num_params,
            "devices": 1 if sim.mesh is None else sim.mesh.size}


def main(argv):
  del argv
  f = flags.FLAGS
  print(common.describe_backend())
  print(f"model {f.model}" + (f" width {f.width}" if f.model in common.CNNS else ""))
  print("| workers | scheme | devices | job slots, job batch | parameters P | worker weights +"
        " gradients (2 x W x P x 4) | arguments | temporaries | peak, per device |")
  print("|---|---|---|---|---|---|---|---|---|")
  batches = [None] if _ONE_VMAP.value else list(map(int, f.level_job_batch))
  for w, scheme, slots, batch, devices in itertools.product(
      map(int, f.workers), f.schemes, map(int, f.level_job_slots), batches,
      map(int, _DEVICES.value)):
    if batch is None:   # --one_vmap: the job slots the run will have
      batch = levels.job_slots_for(slots, w)
    try:
      config = sim_rates.run_config(f.model, f.width, "levels", scheme, w, f.epochs,
                                         job_batch=batch, job_slots=slots)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
    config.devices = devices
    r = measure(config)
    per_vmap = chunk.jobs_per_vmap(r["job_batch"], r["shape"].jobs)
    print(f"| {w} | {scheme} | {r['devices']} | {r['shape'].jobs}, {per_vmap} | {r['params']:,} |"
          f" {2 * w * r['params'] * 4 / GIB:.2f} GiB | {r['arguments'] / GIB:.2f} GiB |"
          f" {r['temporaries'] / GIB:.2f} GiB | {r['peak'] / GIB:.2f} GiB |", flush=True)


if __name__ == "__main__":
  flags.FLAGS.set_default("schemes", ["gssp"])
  flags.FLAGS.set_default("workers", ["16", "256"])
  app.run(main)
