"""GSSP against BSP on clusters as researchers meet them: a real straggler trace, a geo network.

  python -m experiments.reproduce --only=trace_ar,halos_network --out=/tmp/claims --parallel=2

Two studies of the claims table (issue 62), on the MNIST protocol's base (``mnist_protocol.py``:
LeNet-5/MNIST, 16 workers, 5,000 training images held out for validation, equal server capacity,
a virtual-time budget with the schedule following it), shorter and smaller than it:

* ``:trace_ar``: the compute times of ``stragglers/trace-AR.parquet`` (a real job's trace, 4
  replicas, one a persistent 2.2x straggler; ``sim/traces.py``), its 4 replicas cycled over the
  16 workers (``cluster.trace_map='cycle'``: 4 persistent stragglers, each copy started later in
  the trace), relative to a median iteration of 10 ms (``cluster.base_time``); 10 Gb/s links.
* ``:halos``: the HALoS paper's setting: 4 regions of 4 workers with its bandwidths between
  regions (0.117-0.935 Gb/s; ``cluster.topology='halos'``), its workers' relative throughputs
  as slowdowns (``max / throughput``: 1x to 8.5x of 10 ms), the one server (BSP's) in region 0,
  GSSP's groups the regions (``sync.grouping='contiguous'``: a group server in each region).

BSP and GSSP (4 groups, s = 3, peer exchange), each at its best of {0.05, 0.1} (the ladder past
a best at an edge) chosen on the validation split over tuning seeds 0 and 1, then reported on
seeds 100, 101 and 102 alone. 16 virtual seconds a run (``:halos``: 32, its BSP rounds being
slow), a warm-up of an eighth then cosine; target 97 %. 8 tuning trials, those the ladder adds
and 6 reporting trials per study.
"""

from configs.sweeps import mnist_protocol
from gssp_jax.defaults import parse_arg
from gssp_jax.studies.sweep import sweep

SCHEMES = ("bsp", "gssp")
LEARNING_RATES = (0.05, 0.1)
TUNING_SEEDS = (0, 1)
REPORTING_SEEDS = (100, 101, 102)
# HALoS's workers (utnslab/halos examples/env.yaml): relative throughputs, one row per region.
HALOS_THROUGHPUT = ((0.232, 0.907, 0.828, 0.347), (0.574, 0.531, 0.722, 0.194),
                    (0.852, 0.132, 0.896, 0.107), (0.827, 0.515, 0.527, 0.788))
BUDGETS = {"trace_ar": 16.0, "halos": 32.0}


def _cluster(arg) -> str:
  args = parse_arg(arg, tuple(BUDGETS))
  if len(args) != 1:
    raise ValueError(f"sweep arg {arg!r} is invalid; allowed: one of {', '.join(BUDGETS)}")
  (name,) = args
  return name


def halos_slowdowns() -> tuple[float, ...]:
  """Each worker's slowdown, in region order: the fastest's throughput over its own."""
  flat = [t for row in HALOS_THROUGHPUT for t in row]
  return tuple(max(flat) / t for t in flat)


def get_config(arg=None):
  name = _cluster(arg)
  c = mnist_protocol.get_config()
  c.sync.group_size = 2   # back to the default: no DS-Sync trial here reads it
  c.train.target_accuracy = 0.97
  c.train.virtual_budget = BUDGETS[name]
  c.optimizer.warmup_seconds = BUDGETS[name] / 8
  if name == "trace_ar":
    c.cluster.profile = "trace"
    c.cluster.trace_file = "stragglers/trace-AR.parquet"
    c.cluster.trace_map = "cycle"
  else:
    c.cluster.topology = "halos"
    c.cluster.speeds = halos_slowdowns()
    c.sync.grouping = "contiguous"
  return c


def get_sweep(arg=None):
  _cluster(arg)
  return mnist_protocol.tuned_grid(sweep("sync.scheme", SCHEMES), LEARNING_RATES, TUNING_SEEDS,
                                   REPORTING_SEEDS)
