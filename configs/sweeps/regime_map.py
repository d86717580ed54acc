"""Where each scheme wins: BSP, SSP, GSSP and DiLoCo over a grid of clusters (issue 59, item 7).

  python -m experiments.reproduce --only=regime_map --out=/tmp/claims --parallel=2

The claims table's regime map (``gssp_jax.studies.regimes``): LeNet-5/MNIST on 16 simulated
workers, 3 epochs, target 97 % test accuracy (the validation split held out: 5,000 images),
5 seeds, each scheme at a fixed rate, on 12 clusters:

- heterogeneity: four speed tiers of 4 workers from 1x to 1x (uniform), 2x and 4x a base
  iteration time of 10 ms, and 2x with a per-iteration log-normal jitter of 0.5;
- communication to computation: one dense push of LeNet-5 (246,824 bytes) over a worker's
  link takes 0.1, 1 or 10 base iterations (links of 2.47e8, 2.47e7 and 2.47e6 bytes/s); the
  servers' capacity is 4 workers' links in all (BSP's 16 pushes into one server share it;
  GSSP's 4 group servers get a quarter each: ``cluster.server_capacity='split'``).

Rates, fixed for this map (it does not tune): each scheme's choice in the committed claims
table of 2026-12-06 (``mnist_tuned``: BSP 0.2, SSP 0.05, GSSP 0.02; ``local_update_long``:
DiLoCo's outer 0.7 with inner AdamW 0.003, H = 8), chosen there on the test split and on the
seeds it reported, before this protocol; to be replaced by the rates that ``mnist_tuned``
chooses under it when that study is rerun. 12 cells x 4 schemes x 5 seeds = 240 trials, about
1.3 minutes each on a 2-core CPU at --parallel=2 (declared; ``reproduce`` measures it).
"""

from configs import mnist_lenet5_hetero
from configs.sweeps import local_update_mnist
from gssp_jax.studies.sweep import product, sweep

PUSH_BYTES = 246_824   # LeNet-5's 61,706 float32 parameters: one dense push
BASE_TIME = 0.01
SEEDS = (0, 1, 2, 3, 4)
# (tiers, jitter): the heterogeneity axis.
HETEROGENEITY = (((1.0, 1.0, 1.0, 1.0), 0.0), ((1.0, 4 / 3, 5 / 3, 2.0), 0.0),
                 ((1.0, 2.0, 3.0, 4.0), 0.0), ((1.0, 4 / 3, 5 / 3, 2.0), 0.5))
COMM_RATIOS = (0.1, 1.0, 10.0)
# DiLoCo as the local-update study runs it (its inner AdamW and outer Nesterov settings).
_LOCAL = {**local_update_mnist._INNER, **local_update_mnist._OUTER,   # pylint: disable=protected-access
          "local.optimizer.learning_rate": 3e-3}
SCHEMES = ({"sync.scheme": "bsp", "optimizer.learning_rate": 0.2},
           {"sync.scheme": "ssp", "optimizer.learning_rate": 0.05},
           {"sync.scheme": "gssp", "optimizer.learning_rate": 0.02},
           {"sync.scheme": "diloco", **_LOCAL})


def link(ratio: float) -> float:
  """A worker link's bytes/s at which one dense push takes ``ratio`` base iterations."""
  return PUSH_BYTES / (ratio * BASE_TIME)


def get_config():
  c = mnist_lenet5_hetero.get_config()
  c.cluster.base_time = BASE_TIME
  c.data.validation_size = 5000
  c.cluster.server_capacity = "split"   # GSSP's 4 group servers share BSP's one
  c.train.num_epochs = 3.0
  c.train.eval_every = 0.25
  c.train.target_accuracy = 0.97
  c.optimizer.warmup_epochs = 0.5
  return c


def get_sweep():
  clusters = [{"cluster.tiers": tiers, "cluster.jitter": jitter,
               "cluster.bandwidth": link(ratio), "cluster.server_bandwidth": 4 * link(ratio)}
              for tiers, jitter in HETEROGENEITY for ratio in COMM_RATIOS]
  return product(SCHEMES, sweep("seed", SEEDS), clusters)
