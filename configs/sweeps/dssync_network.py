"""DS-Sync where its paper puts it: a network bottleneck, beside the same cluster without one.

  python -m experiments.reproduce --only=dssync_uniform,dssync_bottleneck --out=/tmp/claims

The DS-Sync paper's claim is about networks: BSP's all-reduce runs at its slowest link, while
DS-Sync's small groups, reshuffled, wait only for their own. Two studies of the claims table,
under issue 59's protocol (as ``mnist_protocol.py``: validation split, tuning seeds 0-2,
reporting seeds 100-104, equal server capacity, a virtual-time budget):

* ``:uniform``: the MNIST cluster's four speed tiers (1x, 1.5x, 2x, 3x of 10 ms) with
  communication as costly as computation: every worker link at 2.47e7 bytes/s, so one dense
  push of LeNet-5 (246,824 bytes) takes one base iteration; the servers' capacity is four such
  links in all (split among a scheme's servers).
* ``:bottleneck``: the same, with one worker of each tier (workers 3, 7, 11 and 15) on a link
  ten times slower.

BSP (a parameter server), BSP over a ring all-reduce (the DS-Sync paper's baseline) and
DS-Sync (groups of 4) at their best of {0.05, 0.1, 0.2} (the ladder past an edge); 40 virtual
seconds a run (about 3 of BSP's epochs on the uniform cluster), a 5-second warm-up then
cosine; target 98 %. 27 tuning trials, those the ladder adds and 15 reporting trials per study.
"""

from configs.sweeps import mnist_protocol
from gssp_jax.defaults import parse_arg
from gssp_jax.studies.sweep import sweep

PUSH_BYTES = 246_824
LINK = PUSH_BYTES / 0.01   # bytes/s: one push per base iteration (10 ms)
SLOW_WORKERS = (3, 7, 11, 15)
BUDGET = 40.0
SCHEMES = ("bsp", "bsp_allreduce", "dssync")
LEARNING_RATES = (0.05, 0.1, 0.2)


def _network(arg) -> str:
  args = parse_arg(arg, ("uniform", "bottleneck"))
  if len(args) != 1:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: 'uniform' or 'bottleneck'")
  (network,) = args
  return network


def get_config(arg=None):
  network = _network(arg)
  c = mnist_protocol.get_config()
  links = [LINK / 10 if w in SLOW_WORKERS and network == "bottleneck" else LINK
           for w in range(c.num_workers)]
  with c.ignore_type():   # a number per worker where the default is one number
    c.cluster.bandwidth = tuple(links)
  c.cluster.server_bandwidth = 4 * LINK
  c.train.virtual_budget = BUDGET
  c.optimizer.warmup_seconds = BUDGET / 8
  return c


def get_sweep(arg=None):
  _network(arg)
  return mnist_protocol.tuned_grid(sweep("sync.scheme", SCHEMES), LEARNING_RATES)
