"""SSP, GSSP and the local-update schemes on two heterogeneous MNIST clusters, 3 seeds, tuned rates.

  # the 4-tier cluster, then the continuous one with a straggler: 28 trials each
  python -m experiments.sweep --sweep=configs/sweeps/local_update_mnist.py:tiers \\
      --workdir=/tmp/local_update_tiers --parallel=2
  python -m experiments.report /tmp/local_update_tiers --out=results/local_update_tiers
  python -m experiments.sweep --sweep=configs/sweeps/local_update_mnist.py:straggler \\
      --workdir=/tmp/local_update_straggler --parallel=2
  python -m experiments.report /tmp/local_update_straggler --out=results/local_update_straggler
  # the same grid on 2,048 examples for 1 epoch: checks the sweep end to end in minutes
  python -m experiments.sweep --sweep=configs/sweeps/local_update_mnist.py:tiers,smoke \\
      --workdir=/tmp/local_update_smoke --parallel=2
  # 8 epochs, every rate on every seed, extended past a best at an edge (``long``, below)
  python -m experiments.sweep --sweep=configs/sweeps/local_update_mnist.py:tiers,long \\
      --workdir=/tmp/local_update_long --parallel=2

Model and data: LeNet-5 on MNIST (60,000 / 10,000), batch 32 per worker, 16 workers,
3 epochs, evaluated every quarter epoch, target 98 % test accuracy.

Clusters (``tiers`` and ``straggler``; 10 ms base iteration, 10 Gb/s links, 0.1 ms latency, the
server's link shared by the transfers that overlap on it):
* ``tiers``: the heterogeneity preset, 4 workers each at 1x, 1.5x, 2x and 3x, no jitter.
* ``straggler``: continuous speeds, 15 workers at the quantiles of a log-normal (sigma 0.3,
  fastest 1x, slowest 3.0x: :data:`STRAGGLER_SPEEDS`), one persistent straggler at 8x,
  and per-iteration jitter (log-normal, sigma 0.2) on every worker.

Schemes (:data:`SCHEMES`), each with the settings of its paper where it has one:
* BSP, SSP (s = 3), GSSP (4 speed groups, s = 3, peer exchange every 4 pushes), GSSP + GDTopK:
  SGD, momentum 0.9, weight decay 5e-4, half an epoch of linear warm-up then cosine; each
  gradient scaled by 1/16 at the server. Tuned: ``optimizer.learning_rate`` in {0.02, 0.05}.
* DiLoCo: H = 8 inner AdamW steps (half an epoch of warm-up then cosine over each worker's own
  steps, no weight decay); outer SGD with Nesterov momentum 0.9 at rate 0.7, constant (the
  DiLoCo paper's). Tuned: ``local.optimizer.learning_rate`` in {1e-3, 3e-3}.
* Asynchronous Local-SGD + DyLU: the same inner steps, H_w = floor(8 x fastest / w's time),
  Delayed Nesterov with N = 16 (one step per W pushes), outer rate 0.7, momentum 0.9.
  Tuned as DiLoCo.
* HALoS: the same inner steps and DyLU; a local server per speed group (4 groups) with the
  authors' local Delayed Nesterov (rate 3.2, momentum 0.9, N = 16), the global server at rate
  0.3, momentum 0.5, N = 2, merge weight 0.25 (the authors' settings). Tuned as DiLoCo.

Tuning protocol: seed 0 runs every scheme at every rate of its grid; the report picks each
scheme's rate (fewest unhealthy seeds, then time to target, then final accuracy: gssp_jax.studies.report's
criterion, which on one seed is just that)
on seed 0 alone (``tune_seeds``); seeds 1 and 2 run at that rate only (:data:`CHOSEN`, copied
from the seed-0 report). 14 + 14 trials per cluster instead of 42: on this CPU the full grid
over 3 seeds did not fit a session.

The two grids are different keys because the schemes' rates are different things: an SGD step
on the mean gradient against an AdamW step inside a worker's job. Each grid holds its family's
usual value (0.05 for this SGD recipe, ``docs/REPRODUCTION.md``; 1e-3 for Adam on LeNet-5) and
one neighbour: for SGD the smaller 0.02, because with half an epoch of warm-up 0.1 broke SSP and
GSSP (both collapsed on seed 0 of the tiers cluster in a first run of this sweep, which had
{0.05, 0.1}; BSP at 0.1 was slower than at 0.05); for AdamW the larger 3e-3. Each scheme is reported at its best
value by the report's criterion (``gssp_jax.studies.report.TUNING_CRITERION``), chosen per cluster.

``long`` (declared on 2026-11-27, before any of its trials ran, after the 3-epoch ``tiers``
study had shown that in 3 epochs only BSP and SSP reach the 98 % target, so the local-update
schemes' speed claims could not be judged from it): the same cluster and schemes for 8 epochs
(``mnist_tuned``'s budget), every rate of each grid on every seed (no seed-0 tuning: the best
rate is chosen by the report's criterion over the 3 seeds), and each grid extended past a best
at its edge along :data:`SGD_LADDER` or :data:`INNER_LADDER` (``gssp_jax.studies.grid_edge``).

Cost, measured: see docs/REPRODUCTION.md (a trial is 1.5-3 min on this 2-core CPU; ``long``
about 2.7 times that).
"""

import statistics

from configs import mnist_lenet5_hetero
from gssp_jax.defaults import default_config, parse_arg
from gssp_jax.studies.sweep import Grid, product, report_on, sweep, tune

SEEDS = (0, 1, 2)
SGD_RATES = (0.02, 0.05)
INNER_RATES = (1e-3, 3e-3)
CLUSTERS = ("tiers", "straggler")
SGD_LADDER = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)       # ``long``: past a best at an edge
# 3e-5 and 1e-4 added on 2026-12-03, after the study had ended with asynchronous Local-SGD's
# best at 3e-4, then the ladder's lowest rung: the grid-edge rule goes on from there.
INNER_LADDER = (3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
LONG_EPOCHS = 8.0
LOCAL = ("diloco", "async_local_sgd", "halos")


def _straggler_speeds() -> tuple[float, ...]:
  normal = statistics.NormalDist(0.0, 0.3)
  quantiles = [normal.inv_cdf((i + 0.5) / 15) for i in range(15)]
  fastest = min(quantiles)
  return tuple(round(2.718281828459045 ** (q - fastest), 3) for q in quantiles) + (8.0,)


STRAGGLER_SPEEDS = _straggler_speeds()

_INNER = {"local.steps": 8, "local.optimizer.name": "adamw", "local.optimizer.schedule": "cosine",
          "local.optimizer.warmup_epochs": 0.5}
_OUTER = {"optimizer.learning_rate": 0.7, "optimizer.momentum": 0.9, "optimizer.nesterov": True,
          "optimizer.weight_decay": 0.0, "optimizer.schedule": "constant",
          "optimizer.warmup_epochs": 0.0}

# Each row: its overrides of the base config (scheme-specific settings only under their scheme).
SCHEMES = (
    {"sync.scheme": "bsp", "compress.name": "none"},
    {"sync.scheme": "ssp", "compress.name": "none"},
    {"sync.scheme": "gssp", "compress.name": "none"},
    {"sync.scheme": "gssp", "compress.name": "gdtopk"},
    {"sync.scheme": "diloco", "compress.name": "none", **_INNER, **_OUTER},
    {"sync.scheme": "async_local_sgd", "compress.name": "none", **_INNER, **_OUTER,
     "local.dylu": True, "local.delayed_nesterov": 16},
    {"sync.scheme": "halos", "compress.name": "none", **_INNER, **_OUTER,
     "local.dylu": True, "optimizer.learning_rate": 0.3, "optimizer.momentum": 0.5},
)


def _args(arg) -> tuple[str, bool, bool]:
  """``(cluster, smoke, long)`` of a sweep arg such as ``tiers``, ``straggler,smoke`` or
  ``tiers,long`` (``protocol``, :func:`_protocol`'s, is read apart)."""
  args = parse_arg(arg, CLUSTERS + ("smoke", "long", "protocol")) - {"protocol"}
  clusters = [a for a in CLUSTERS if a in args]
  if len(clusters) != 1:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: exactly one of {CLUSTERS},"
                     " optionally with ',smoke' and/or ',long' (e.g. 'tiers', "
                     "'straggler,smoke' or 'tiers,long')")
  return clusters[0], "smoke" in args, "long" in args


def _protocol(arg) -> bool:
  """``,protocol``: issue 59's (the claims table's ``local_update_protocol`` study, with
  ``long``): a validation split of 5,000 images that chooses the rates, tuning seeds 0-2 and
  reporting seeds 100-104 kept apart (``sweep.report_on``), and equal server capacity
  (``cluster.server_capacity='split'``: HALoS's group servers share BSP's one)."""
  return "protocol" in parse_arg(arg, CLUSTERS + ("smoke", "long", "protocol"))


REPORTING_SEEDS = (100, 101, 102, 103, 104)


def get_config(arg=None):
  cluster, smoke, long = _args(arg)
  if _protocol(arg) and not long:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: 'protocol' with 'long' (every "
                     "rate on every tuning seed)")
  c = mnist_lenet5_hetero.get_config("smoke" if smoke else None)
  if _protocol(arg):
    c.data.validation_size = 5000
    c.cluster.server_capacity = "split"
  c.train.num_epochs = 1.0 if smoke else (LONG_EPOCHS if long else 3.0)
  c.train.eval_every = 0.25
  c.optimizer.warmup_epochs = 0.5
  if cluster == "straggler":
    c.cluster.profile = "lognormal"
    c.cluster.tiers = default_config().cluster.tiers
    c.cluster.speeds = STRAGGLER_SPEEDS
    c.cluster.jitter = 0.2
  return c


def _label(scheme: dict) -> str:
  return scheme["sync.scheme"] + ("+" + scheme["compress.name"] if scheme["compress.name"] != "none"
                                  else "")


# Each scheme's rate as the report chose it on seed 0 (the criterion of gssp_jax.studies.report), per
# cluster: seeds 1 and 2 run at it alone. Filled in from the seed-0 trials' report
# (results/local_update_<cluster>/report.md, "Tuning"); a scheme missing here runs seed 0
# only.
CHOSEN = {
    "tiers": {"bsp": 0.05, "ssp": 0.05, "gssp": 0.02, "gssp+gdtopk": 0.02, "diloco": 0.003, "async_local_sgd": 0.001, "halos": 0.003},
    "straggler": {"bsp": 0.05, "ssp": 0.05, "gssp": 0.02, "gssp+gdtopk": 0.02, "diloco": 0.003, "async_local_sgd": 0.001, "halos": 0.003},
}


def _check_chosen() -> None:
  labels = {_label(s): s["sync.scheme"] in LOCAL for s in SCHEMES}
  for cluster, chosen in CHOSEN.items():
    for label, rate in chosen.items():
      if label not in labels or rate not in (INNER_RATES if labels[label] else SGD_RATES):
        raise ValueError(f"CHOSEN[{cluster!r}][{label!r}]={rate!r} is invalid; allowed: a scheme "
                         f"of {sorted(labels)} and a rate of its grid")


def get_sweep(arg=None):
  cluster, _, long = _args(arg)
  if not long:
    _check_chosen()
  grid = []
  for seed in SEEDS:   # seed by seed: a sweep cut short holds whole seeds of every scheme
    for scheme in SCHEMES:
      # The scheme, its tuned rate and the seed first: they head the trial's (directory) name.
      head = {k: scheme[k] for k in ("sync.scheme", "compress.name")}
      settings = {k: v for k, v in scheme.items() if k not in head}
      key = ("local.optimizer.learning_rate" if scheme["sync.scheme"] in LOCAL
             else "optimizer.learning_rate")
      rates = INNER_RATES if key.startswith("local.") else SGD_RATES
      if seed != SEEDS[0] and not long:   # tuned on the first seed; the others at its choice
        chosen = CHOSEN[cluster].get(_label(scheme))
        if chosen is None:
          continue
        rates = (chosen,)
      grid += product([head], tune(key, rates), sweep("seed", [seed]), [settings])
  tuned = ("optimizer.learning_rate", "local.optimizer.learning_rate")
  if long:   # every rate on every seed, extended past a best at an edge
    grid = Grid(grid, tuned=tuned, ladders={"optimizer.learning_rate": SGD_LADDER,
                                            "local.optimizer.learning_rate": INNER_LADDER})
    return report_on(grid, REPORTING_SEEDS) if _protocol(arg) else grid
  return Grid(grid, tuned=tuned, tune_seeds=SEEDS[:1])
