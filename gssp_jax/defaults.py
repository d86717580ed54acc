"""The defaults every config starts from: the constants of the contract and ``default_config``.

A leaf: it imports nothing of gssp_jax, so everything that needs a default (the
builders that validate their own keys, the config files under ``configs/``)
imports it without pulling in the rest. :mod:`gssp_jax.config` validates.
"""

from __future__ import annotations

import difflib

import ml_collections

# Model -> datasets it can train on.
MODEL_DATASETS = {
    "lenet5": ("mnist", "cifar10"),
    "resnet18": ("cifar10", "mnist"),
    "vgg19": ("cifar10", "mnist"),
    "seq2seq": ("multi30k",),
}
DATASETS = ("mnist", "cifar10", "multi30k")
COMPRESSORS = ("none", "topk", "dgc", "gdtopk")
COMPRESS_SCOPES = ("tensor", "global")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine")
WEIGHT_DECAY_MODES = ("progress", "per_step")
# auto: fused for BSP without a cluster; otherwise the simulator with the dependency-level
# batched runner (levels) on every backend; a resumed run keeps the runner its checkpoint was
# written by (executors.py).
# dist: the real multi-process runtime's parameter server (set by experiments.launch; gssp_jax/runtime).
EXECUTORS = ("auto", "fused", "rounds", "levels", "dist")
DATA_PLANES = ("flight", "grpc")


def default_config() -> ml_collections.ConfigDict:
  """Every key the framework reads, with its default."""
  c = ml_collections.ConfigDict()
  c.model = "lenet5"
  # Extra constructor arguments of the model (e.g. emb_dim, hidden_dim, dropout for seq2seq).
  c.model_args = ml_collections.ConfigDict()
  c.dataset = "mnist"
  c.data_dir = ""        # '' -> $GSSP_DATA_DIR -> prepared TFDS -> download (if data_download)
  # Download the canonical files (checksummed, into $GSSP_CACHE_DIR) when no local source has
  # them; offline this fails within seconds with a message saying how to provide the files.
  c.data_download = True
  c.data_url = ""        # base URL for data_download; '' -> $GSSP_DATA_URL -> canonical mirrors
  c.data = ml_collections.ConfigDict()
  c.data.train_size = 0  # use only the first N training examples (0 = all)
  c.data.test_size = 0   # evaluate on the first N test examples (0 = all)
  # Hold N examples out of the training set (one fixed draw, the same for every run) and score
  # them at each evaluation beside the test set (val_accuracy, val_loss; Multi30k: its own
  # validation split, val_bleu): what tuning chooses rates on. 0 = none.
  c.data.validation_size = 0
  c.data.augment = False  # random crop (4-pixel padding) + horizontal flip, in JAX
  c.data.max_len = 0     # translation: truncate sentences to this many tokens (0 = no limit)
  c.data.eval_batch_size = 500
  c.seed = 0
  # What advances the run: auto | fused (BSP, no cluster: one jitted chunk of updates, no
  # virtual time) | rounds (the simulated cluster, one device call per round; any scheme) |
  # levels (the simulated cluster, the schedule planned ahead and run in compiled chunks of many
  # dependency levels; for accelerators, also runs on a CPU).
  c.executor = "auto"
  # levels executor: pieces (dependency levels) per device call, a power of two up to 64, or 0 =
  # chosen by the run (16 on an accelerator, 2 on a CPU, where each piece is traced into the
  # program; fewer when an evaluation interval holds fewer). It sets only how often the host
  # dispatches: a resumed run may change it.
  c.levels_per_call = 0
  # levels executor: job slots per piece (the gradients of one vmap), 1..num_workers, or 0 =
  # min(num_workers, 64), halved down to 4 where jobs run one at a time (a CPU) while the run's
  # opening fills under 80 % of them (levels.job_slots_filled). Bounds the activations in memory
  # (ResNet-18 at 256 workers).
  c.level_job_slots = 0
  # levels executor: job slots computed together in one vmap; a piece's slots run as such
  # batches one after another. 1..num_workers, or 0 = chosen by the run: 1 on a CPU
  # (a vmap over weight copies makes convolutions grouped ones, XLA:CPU's slow path), every
  # slot at once on an accelerator.
  c.level_job_batch = 0
  # levels executor: local devices one simulation uses, 0 = all. A piece's job slots are split
  # over them (level_job_slots must divide evenly), the state replicated on each; the results
  # are those of one device. Each device holds the whole state. A resumed run may change it.
  c.devices = 1
  c.num_workers = 4
  c.batch_size = 32      # per worker

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "sgd"   # sgd | adam | adamw | any optax optimizer's name | "module:function"
  c.optimizer.args = ""      # other optimizers' keyword arguments: "b1=0.95,b2=0.98"
  c.optimizer.learning_rate = 0.05
  c.optimizer.momentum = 0.9
  c.optimizer.nesterov = False
  c.optimizer.weight_decay = 5e-4
  # progress: decay per unit of applied gradient mass (every scheme decays per epoch as BSP);
  # per_step: at every server optimizer step (the GSSP authors' code). Same in the BSP loop.
  c.optimizer.weight_decay_mode = "progress"
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_epochs = 0.0
  # Under train.virtual_budget: a linear warm-up over this many virtual seconds (warmup_epochs
  # counts epochs of data, which a budget does not follow).
  c.optimizer.warmup_seconds = 0.0
  # Global-norm clip of each worker's gradient (0 = off), in every executor: before its
  # compressor and before any server scales it (1/W per push, K/W per GSSP delivery), so it
  # bounds the same quantity for every scheme. BSP's step is the mean of the clipped worker
  # gradients, not the clip of their mean. The server optimizers do not clip.
  c.optimizer.grad_clip = 0.0

  c.sync = ml_collections.ConfigDict()
  c.sync.scheme = "bsp"
  c.sync.staleness = 3                # ssp, gssp (inside a group): clocks ahead of the slowest
  c.sync.staleness_range = (3, 15)    # dssp: (s_L, s_U)
  c.sync.num_groups = 4               # gssp groups
  c.sync.grouping = "speed"           # speed | kmeans | round_robin | contiguous
  c.sync.regroup_every_epoch = False  # gssp: regroup by the speeds measured over each epoch
  c.sync.inter_group = "peer"         # gssp exchange: peer | global
  c.sync.forward_every = 0            # gssp: pushes per forward (0 = the group's size)
  c.sync.num_nodes = 4                # inhad: machines workers aggregate on
  c.sync.inhad_threshold = 0          # inhad: iteration numbers per server update (0 = W)
  c.sync.group_size = 2               # dssync: workers per averaging group
  c.sync.casp = ml_collections.ConfigDict()
  c.sync.casp.max_communities = 4     # the agent picks k in 1..max_communities
  c.sync.casp.reconfigure_every = 64  # community pushes between the agent's decisions
  c.sync.casp.traffic_penalty = 0.01  # reward = progress/time - penalty * pushes/time
  # The local-update schemes (local_sgd, diloco, async_local_sgd; gssp_jax/sync/local.py): a
  # worker's job is local.steps inner optimizer steps (local.optimizer.*, its state kept per
  # worker) from the weights it pulled; it pushes the pseudo-gradient pulled - local, which the
  # server applies with the outer optimizer, config.optimizer.* (local_sgd: SGD at rate 1, no
  # momentum: model averaging). Every other scheme leaves local.* at its defaults.
  c.local = ml_collections.ConfigDict()
  c.local.steps = 1                   # H: inner steps per job (one push = H data iterations)
  c.local.dylu = False                # async_local_sgd: H_w = floor(H * fastest time / w's time)
  c.local.delayed_nesterov = 0        # async_local_sgd: N > 0 = Delayed Nesterov, the momentum
  #                                     stepped every N pushes (optimizer.momentum is its beta)
  c.local.optimizer = ml_collections.ConfigDict()
  c.local.optimizer.name = "sgd"      # as optimizer.name (any optax optimizer too)
  c.local.optimizer.args = ""
  c.local.optimizer.learning_rate = 0.05
  c.local.optimizer.momentum = 0.0
  c.local.optimizer.nesterov = False
  c.local.optimizer.weight_decay = 0.0
  c.local.optimizer.schedule = "constant"   # over each worker's own inner steps
  c.local.optimizer.warmup_epochs = 0.0
  # halos: local servers per group (sync.num_groups, sync.grouping) with Delayed Nesterov, a
  # global server with its own (optimizer.learning_rate, optimizer.momentum); every
  # sync.forward_every local updates after its last merge (0: the group's size) a local server
  # sends its progress; it merges the reply as (1 - merge_weight) local + merge_weight global.
  c.local.halos = ml_collections.ConfigDict()
  c.local.halos.merge_weight = 0.25
  c.local.halos.local_learning_rate = 3.2   # a push g moves its local server 3.2 g / local_period
  c.local.halos.local_momentum = 0.9
  c.local.halos.local_period = 16           # N of the local servers' Delayed Nesterov
  c.local.halos.global_period = 2           # N of the global server's
  # The simulated cluster (gssp_jax.sim). profile 'none' with every other cluster key at its
  # default: BSP trains in the fused loop (no virtual time), any other scheme in the simulator
  # on a homogeneous cluster. Setting any timing key (speeds, base_time, jitter, bandwidth, ...)
  # simulates BSP too; a key the profile does not read (tiers, sigma, trace_file) is an error.
  c.cluster = ml_collections.ConfigDict()
  c.cluster.profile = "none"          # none | homogeneous | tiers | lognormal | trace
  c.cluster.speeds = ()               # per-worker slowdown factors (1 = base, 2 = twice as slow)
  c.cluster.tiers = (1.0, 1.5, 2.0, 3.0)  # 'tiers': workers split evenly over these factors
  c.cluster.sigma = 0.5               # 'lognormal': factors exp(sigma * N(0, 1)), seeded
  # 'trace': a CSV (one row per iteration, one column per replica) or a Parquet per-operation
  # trace (.parquet, the straggler-analysis format); worker w is replica w (sim/traces.py).
  c.cluster.trace_file = ""
  c.cluster.trace_units = "relative"  # 'relative': times / the trace's median * base_time; 'seconds'
  c.cluster.trace_map = "replica"     # more workers than replicas: 'cycle' (w follows w mod R)
  c.cluster.base_time = 0.05          # seconds per iteration at factor 1
  c.cluster.calibrate = False         # measure the real step time here and use it as base_time
  c.cluster.jitter = 0.0              # sigma of per-iteration log-normal noise
  c.cluster.straggler_prob = 0.0      # per-iteration chance a transient straggle starts
  c.cluster.straggler_slowdown = 5.0
  c.cluster.straggler_duration = 10   # iterations a straggle lasts
  c.cluster.bandwidth = 1.25e9        # bytes/s of each worker's link (10 Gb/s); or one per worker
  c.cluster.latency = 1e-4            # seconds per message on a worker link; or one per worker
  c.cluster.server_bandwidth = 1.25e9  # each server's interface: its pushes in, its pulls out
  #                                    (shared, below), and messages between servers
  c.cluster.shared_server_links = True  # pushes overlapping at a server share its bandwidth
  #                                    (max-min fair), and so do pulls, InHAD's pushes on a
  #                                    node's link, a CASP community's legs on its leader's,
  #                                    its uploads at the server, exchanges with a global
  #                                    server at its interface (sync/legs.py); False: alone
  # each: every server interface has server_bandwidth; split: a scheme's G servers share it
  # (1/G each), so every scheme has the same server capacity in all (with shared links).
  c.cluster.server_capacity = "each"
  c.cluster.server_latency = 1e-4
  # Seconds a server spends applying one update (a round that changes its weights: a step, an
  # adoption, an average); its updates queue, and a pull leaves when those before it are done.
  # Where there is no server (BSP over a ring, DS-Sync) each worker's own apply, in parallel.
  # 0: instantaneous. The simulator only (the real runtime's servers take their real time).
  c.cluster.server_update_time = 0.0
  c.cluster.node_bandwidth = 2.5e10   # inside a machine, worker -> node aggregator (InHAD)
  c.cluster.node_latency = 5e-6
  # A network topology (sim/topology.py): '' none; 'halos' (4 regions, the HALoS paper's
  # bandwidths between them); 'oversubscribed' (4 racks, 4:1 uplinks); 'regions' (the keys below).
  c.cluster.topology = ""
  c.cluster.regions = ()              # 'regions': each worker's region, 0..R-1
  c.cluster.region_bandwidth = ()     # 'regions': R x R bytes/s between regions (diagonal: inside)
  c.cluster.region_latency = ()      # 'regions': R x R seconds between regions; () none
  c.cluster.uplink_bandwidth = ()    # 'regions': R bytes/s, each region's uplink; () or 0 none
  c.cluster.server_region = 0         # the one (or the global) server's region, with a topology
  c.compress = ml_collections.ConfigDict()
  c.compress.name = "none"
  c.compress.ratio = 0.01          # fraction of entries each worker sends (top-k, dgc)
  c.compress.scope = "tensor"      # top-k per tensor or over the whole model
  c.compress.sample_ratio = 0.01   # dgc: fraction sampled to estimate the threshold
  c.compress.error_feedback = True
  # Seconds a worker spends compressing one push, added before it leaves (0: free). Needs a
  # compressor (name != 'none'); the simulator only (the real runtime compresses for real).
  c.compress.compute_time = 0.0

  c.train = ml_collections.ConfigDict()
  c.train.num_epochs = 1.0
  c.train.eval_every = 1.0        # epochs between evaluations (fractions allowed)
  # Also evaluate at every multiple of this many virtual seconds (0 = off), stamped there
  # exactly (every event before it has run): curves of several schemes at equal virtual times.
  # The simulator only (the real runtime evaluates at pushes).
  c.train.eval_every_seconds = 0.0
  # Seconds of the run's clock it trains for (0 = off: its length is train.num_epochs). > 0: the
  # run applies every event before this time and none at or after it, ends there with its final
  # evaluation (virtual_time = the budget), and optimizer.schedule follows time / budget instead
  # of epochs. train.num_epochs then caps the data it may read. The clock: the simulated
  # cluster's, or the real runtime's wall clock since its start (not the fused BSP loop, which
  # has none); no warm-up.
  c.train.virtual_budget = 0.0
  c.train.target_accuracy = 0.0   # vision: time_to_target interpolates to it (0 = none)
  c.train.target_bleu = 0.0       # translation: likewise for BLEU
  # Checkpoints, after an evaluation: once this many wall seconds have passed since the last
  # save (or the session's start; 0 = never by time), and at every multiple of checkpoint_every
  # evaluations (0 = never by count). The end of a run, Ctrl-C and SIGTERM always save.
  c.train.checkpoint_every_seconds = 600.0
  c.train.checkpoint_every = 0
  c.train.max_checkpoints = 2
  c.train.log_every = 200         # updates between progress lines (chunk length cap)
  c.train.stop_after_updates = 0  # stop (checkpointed, resumable) after this many updates (0 = never)

  # The real multi-process runtime (python -m experiments.launch; gssp_jax/runtime). Per-process
  # settings: they may differ between the server and the meshes, and between sessions.
  c.dist = ml_collections.ConfigDict()
  c.dist.server_address = ""      # host:port the parameter server binds ('' = 127.0.0.1, free port)
  c.dist.heartbeat_timeout = 10.0  # seconds without a heartbeat before the server drops a mesh
  c.dist.join_timeout = 300.0     # seconds a mesh may take to join at the start (imports, data)
  c.dist.retry_seconds = 60.0     # seconds a mesh keeps retrying an unreachable server
  c.dist.hang_timeout = 300.0     # seconds one iteration may compute before the mesh stops beating
  c.dist.save_timeout = 120.0     # seconds the launcher waits, after Ctrl-C/SIGTERM, for the server
                                  # to save its checkpoint and stop, before SIGKILL
  c.dist.emulate_cluster = True   # cluster.* timing keys slow the meshes down by sleeping
  # With emulate_cluster: False leaves a mesh's pushes and pulls to the real network (a network
  # imposed by the kernel, benchmarks/sim_vs_real.py); compute is still stretched by sleeping.
  c.dist.emulate_network = True
  c.dist.record_pushes = False    # summary.json's push_log: [seconds, mesh] of every applied push
  c.dist.num_servers = 1          # parameter shards: shard 0 in the server, 1..S-1 processes apart
  c.dist.all_lost_timeout = 60.0  # seconds with every mesh lost before the run ends as failed
  # Where large bodies (pushes, pulls, joins of over 4 MiB) travel: 'flight' (Arrow Flight, no
  # copy into bytes; docs/PERFORMANCE.md) or 'grpc' (grpcio streams, the wire's size limits).
  c.dist.data_plane = "flight"
  # TLS on every port (the run secret, GSSP_SECRET_FILE or GSSP_SECRET, is always required):
  # 'run': mutual TLS with a key and certificate every process derives from the secret and the
  # run id (no files; a listener without the secret gets nothing reusable, a caller without it
  # gets no byte read); 'files': the PEM files below; 'none': plain TCP, the token only.
  c.dist.tls_mode = "run"
  # With tls_mode='files': this process's certificate and key and the CA of the run's certificates.
  c.dist.tls_cert = ""
  c.dist.tls_key = ""
  c.dist.tls_ca = ""
  c.dist.tls_client_auth = False  # mutual TLS: servers also require a client certificate (tls_ca)
  c.dist.tls_server_name = ""     # the name the servers' certificates carry, if not their host
  return c


def validation_metric(metric: str) -> str:
  """The held-out set's name for an evaluation ``metric`` (``data.validation_size``):
  ``val_accuracy`` for ``test_accuracy``, ``val_bleu`` for ``bleu``."""
  return "val_" + metric.removeprefix("test_")


def comparable(value):
  """A config value comparable with its default (tuples and lists alike)."""
  return tuple(value) if isinstance(value, (tuple, list)) else value


def parse_arg(arg: str | None, allowed: tuple[str, ...] = ("smoke",)) -> set[str]:
  """Parses a config file's ``:arg`` (comma-separated flags such as ``smoke``)."""
  flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
  unknown = sorted(flags - set(allowed))
  if unknown:
    raise ValueError(f"unknown config arg {unknown[0]!r}; allowed: {', '.join(allowed)}")
  return flags


# -- a key the config lacks: what to suggest, and what is allowed --------------------------------


def dotted_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every leaf key of ``config`` as a dotted name (``train.num_epochs``), in definition order."""
  out = []
  for name, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      out += dotted_keys(value, f"{prefix}{name}.")
    else:
      out.append(prefix + name)
  return out


# Names a researcher types from habit -> the config's own.
_ALIASES = {"lr": "learning_rate", "epochs": "num_epochs", "workers": "num_workers",
            "wd": "weight_decay", "groups": "num_groups", "staleness_bound": "staleness"}


def similar_keys(config: ml_collections.ConfigDict, key: str, n: int = 3) -> list[str]:
  """Up to ``n`` full names of existing keys that ``key`` probably meant, in any section.

  In this order: keys whose last part is ``key``'s, or its usual name (``num_epochs`` ->
  ``train.num_epochs``, ``lr`` -> ``optimizer.learning_rate``); close spellings of the last
  part in the same section (``sync.schem`` -> ``sync.scheme``); then in any section.
  """
  keys = [k for k in dotted_keys(config) if not key.startswith(k + ".")]
  section, _, leaf = key.rpartition(".")
  leaf = _ALIASES.get(leaf, leaf)
  same = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
  if same:
    return sorted(same, key=lambda k: (k.rpartition(".")[0] != section, k.count(".")))[:n]
  siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == section}
  close = difflib.get_close_matches(leaf, list(siblings), n=n, cutoff=0.7)
  if close:
    return [siblings[name] for name in close]
  by_leaf: dict[str, list[str]] = {}
  for k in keys:
    by_leaf.setdefault(k.rpartition(".")[2], []).append(k)
  near = difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.8)
  return [k for name in near for k in by_leaf[name]][:n]


def allowed_keys(config: ml_collections.ConfigDict, key: str) -> str:
  """The keys of the deepest section of ``config`` that ``key`` names (never empty):
  ``the keys under 'sync': scheme, staleness, ...`` or ``the top-level keys: model, ...``."""
  node, path = config, []
  for part in key.split(".")[:-1]:
    child = node.get(part) if hasattr(node, "get") else None
    if not isinstance(child, ml_collections.ConfigDict):
      break
    node, path = child, path + [part]
  names = list(node.keys())
  where = f"the keys under {'.'.join(path)!r}" if path else "the top-level keys"
  listed = ", ".join(names) if names else "none (an empty section takes no keys)"
  return f"{where}: {listed}"


def unknown_key_message(config: ml_collections.ConfigDict, key: str) -> str:
  """``config has no key 'num_epochs' (did you mean 'train.num_epochs'?); allowed: ...``."""
  hint = similar_keys(config, key)
  said = f" (did you mean {' or '.join(map(repr, hint))}?)" if hint else ""
  return f"config has no key {key!r}{said}; allowed: {allowed_keys(config, key)}"
