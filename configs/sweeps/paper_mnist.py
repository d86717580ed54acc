"""The paper's MNIST comparison: every scheme on a 16-worker heterogeneous cluster, 3 seeds.

  # every scheme at SGD 0.05, seeds 0-2: 27 trials
  python -m experiments.sweep --sweep=configs/sweeps/paper_mnist.py --workdir=/tmp/paper_mnist \\
      --parallel=2
  python -m experiments.report /tmp/paper_mnist --out=results/paper_mnist
  # the same with the learning rate tuned per scheme over {0.02, 0.05, 0.1}: 81 trials
  python -m experiments.sweep --sweep=configs/sweeps/paper_mnist.py:tune \\
      --workdir=/tmp/paper_mnist_tune --parallel=2
  python -m experiments.report /tmp/paper_mnist_tune --out=results/paper_mnist_tune

Model and data: LeNet-5 on MNIST (60,000 / 10,000), batch 32 per worker.

Cluster (the heterogeneity preset): 16 simulated workers in four equal speed
tiers, 4 workers each at 1x, 1.5x, 2x and 3x a base iteration time of 10 ms
(``cluster.profile='tiers'``, ``cluster.tiers=(1, 1.5, 2, 3)``), so the slowest
worker is 3x the fastest, as in the GSSP paper's mixed-GPU cluster. Every
worker has a 10 Gb/s link with 0.1 ms latency; servers talk over the same.
No jitter: the comparison isolates persistent heterogeneity.

Schemes (one row each): BSP, ASP, SSP (s=3), Dynamic SSP (s in [3, 15]),
GSSP (4 speed groups, s=3 inside a group, peer exchange of each group's summed
gradients every 4 pushes), GSSP + GDTopK (the same with per-group dynamic top-k
and error feedback), InHAD (4 nodes), DS-Sync (groups of 4, reshuffled) and
CASP (up to 4 communities chosen by the actor-critic agent).

Optimizer, the same for every scheme: SGD 0.05, momentum 0.9, weight decay
5e-4, a 1-epoch linear warm-up then cosine decay over 8 epochs; each worker's
gradient is scaled by 1/16 at the server. The warm-up was chosen after a first
run without it (see docs/REPRODUCTION.md); it is applied to every scheme alike.
``:tune`` declares the learning rate as tuned (``tune(...)``) over
{0.02, 0.05, 0.1} for every scheme, BSP included; the report then shows each
scheme at its best rate and discloses the grid, the criterion and the choices.
Where a scheme's best rate is the lowest or highest it has tried, the sweep
runs it at the next rate of the ladder 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5
on every seed, until its best lies inside the rates tried or the ladder ends
(``gssp_jax.studies.grid_edge``; the added trials are in the workdir's extended.json).

Target: 98 % test accuracy, evaluated every quarter epoch; time to target is in
virtual (simulated cluster) seconds, interpolated linearly between the
evaluations around the target; speedups are per seed against BSP, reported as
median and min-max over the 3 seeds. A run that ends at chance accuracy or
whose loss stopped falling after the warm-up is recorded as ``collapsed``.
Cost, measured: 27 trials in 77 min with --parallel=2 on a 2-core CPU, partly
sharing the cores (docs/REPRODUCTION.md). ``:tune`` is the claims table's
``mnist_tuned`` study (``python -m experiments.reproduce --only=mnist_tuned``):
a median 2.6 minutes a trial at --parallel=2 on that CPU, 81 declared trials and
those the grid's edges add.
"""

from configs import mnist_lenet5_hetero
from gssp_jax.studies.sweep import product, sweep, tune, zipped

SCHEMES = ("bsp", "asp", "ssp", "dssp", "gssp", "gssp", "inhad", "dssync", "casp")
COMPRESSORS = ("none", "none", "none", "none", "none", "gdtopk", "none", "none", "none")
SEEDS = (0, 1, 2)
LEARNING_RATES = (0.02, 0.05, 0.1)
# Where a scheme's best rate is an end of those it tried, the sweep tries the next rate of this
# ladder on every seed, until its best lies inside them (gssp_jax.studies.grid_edge; issue 35).
LADDER = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def get_config(arg=None):
  if arg not in (None, "tune"):
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: none or 'tune'")
  c = mnist_lenet5_hetero.get_config()
  c.sync.group_size = 4   # DS-Sync's groups (the other schemes' trials leave it unread)
  c.optimizer.warmup_epochs = 1.0
  c.train.eval_every = 0.25
  return c


def get_sweep(arg=None):
  schemes = zipped(sweep("sync.scheme", SCHEMES), sweep("compress.name", COMPRESSORS))
  if arg == "tune":
    return product(schemes, tune("optimizer.learning_rate", LEARNING_RATES, ladder=LADDER),
                   sweep("seed", SEEDS))
  return product(schemes, sweep("seed", SEEDS))
