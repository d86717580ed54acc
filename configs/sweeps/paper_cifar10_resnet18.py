"""ResNet-18 on CIFAR-10 across schemes on a heterogeneous cluster: reduced for a CPU, or full size.

  # reduced (default): 21 min on a 2-core CPU (docs/REPRODUCTION.md)
  python -m experiments.sweep --sweep=configs/sweeps/paper_cifar10_resnet18.py \\
      --workdir=/tmp/paper_resnet18 --parallel=2
  # full size, for GPUs: every scheme, 3 seeds, the paper's model and data
  python -m experiments.sweep --sweep=configs/sweeps/paper_cifar10_resnet18.py:full \\
      --workdir=/tmp/paper_resnet18_full
  python -m experiments.report /tmp/paper_resnet18 --out=results/paper_cifar10_resnet18

Cluster: workers in four equal speed tiers (1x, 1.5x, 2x, 3x a base iteration of
100 ms for a batch of 32), 10 Gb/s links with 0.1 ms latency. GSSP: 4 speed
groups, s = 3, peer exchange. Optimizer for every scheme: SGD 0.1, momentum
0.9, weight decay 5e-4, 1-epoch warm-up then cosine; augmentation on.

Reduced (what fits a 2-core CPU in well under an hour; the numbers in
docs/REPRODUCTION.md come from this): ResNet-18 at a quarter of the width
(16-32-64-128 channels, 701,466 parameters, ``model_args.width=0.25``), 8
workers x 32, the first 8,192 training and 2,000 test images, 4 epochs,
schemes BSP, SSP, GSSP and GSSP + GDTopK, seed 0. Accuracy after 4 short
epochs is far below the paper's ~93 %; the comparison is between schemes at
equal work, and the target (50 %) is set for that budget.

Full (``:full``): the paper-size ResNet-18 (11,173,962 parameters), 16
workers, all 50,000 / 10,000 images, 30 epochs, target 90 %, every scheme,
seeds 0-2, evaluated every quarter epoch (time to target is interpolated
between evaluations; speedups are reported as median and min-max over seeds):
27 trials, each about 10^5 gradient evaluations of batch 32 plus 120
evaluations of the 10,000 test images (an estimate; not run here).
"""

from configs import cifar10_resnet18
from gssp_jax.studies.sweep import product, sweep, zipped

ALL_SCHEMES = ("bsp", "asp", "ssp", "dssp", "gssp", "gssp", "inhad", "dssync", "casp")
ALL_COMPRESSORS = ("none", "none", "none", "none", "none", "gdtopk", "none", "none", "none")


def hetero(c, num_workers: int):
  """The heterogeneous cluster and GSSP settings shared by the CIFAR-10 sweeps."""
  c.num_workers = num_workers
  c.cluster.profile = "tiers"
  c.cluster.tiers = (1.0, 1.5, 2.0, 3.0)
  c.cluster.base_time = 0.1
  c.sync.num_groups = 4
  c.sync.staleness = 3
  c.sync.inter_group = "peer"
  c.sync.num_nodes = 4
  c.optimizer.warmup_epochs = 1.0
  c.train.eval_every = 0.5
  return c


def cifar_config(c, arg=None):
  """A CIFAR-10 config made into this sweep's base: reduced (arg None) or ``full``."""
  c = hetero(c, 16 if arg == "full" else 8)
  if arg == "full":
    c.train.eval_every = 0.25   # time to target not quantised by half-epoch evaluations
    return c
  if arg is not None:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: none (reduced) or 'full'")
  c.model_args.width = 0.25
  c.data.train_size, c.data.test_size = 8192, 2000
  c.data.eval_batch_size = 500
  c.train.num_epochs = 4.0
  c.train.target_accuracy = 0.5
  return c


def get_config(arg=None):
  return cifar_config(cifar10_resnet18.get_config(), arg)


def get_sweep(arg=None):
  if arg == "full":
    return product(zipped(sweep("sync.scheme", ALL_SCHEMES),
                          sweep("compress.name", ALL_COMPRESSORS)), sweep("seed", [0, 1, 2]))
  return product(zipped(sweep("sync.scheme", ["bsp", "ssp", "gssp", "gssp"]),
                        sweep("compress.name", ["none", "none", "none", "gdtopk"])),
                 sweep("seed", [0]))
