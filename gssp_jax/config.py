"""The configuration contract: defaults every config file starts from, and validation.

Config files under ``configs/`` call :func:`default_config` and change only what
differs. :func:`validate_config` runs before any data is read or anything is
compiled, and names the offending key, its value and what is allowed.
"""

from __future__ import annotations

from typing import Collection

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
# auto: fused for BSP without a cluster; otherwise the simulator, with the per-round runner on a
# CPU and the dependency-level batched runner on an accelerator (train/executors.py).
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
  # chosen by the run (16, fewer when an evaluation interval holds fewer). It sets only how
  # often the host dispatches: a resumed run may change it.
  c.levels_per_call = 0
  # levels executor: job slots per piece (the gradients of one vmap), 1..num_workers, or 0 =
  # min(num_workers, 64). Bounds the activations in memory (ResNet-18 at 256 workers).
  c.level_job_slots = 0
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
  c.cluster.trace_file = ""           # 'trace': CSV, one row per iteration, one column per worker
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
  #                                    (max-min fair), and so do pulls; False: each alone
  c.cluster.server_latency = 1e-4
  c.cluster.node_bandwidth = 2.5e10   # inside a machine, worker -> node aggregator (InHAD)
  c.cluster.node_latency = 5e-6
  c.compress = ml_collections.ConfigDict()
  c.compress.name = "none"
  c.compress.ratio = 0.01          # fraction of entries each worker sends (top-k, dgc)
  c.compress.scope = "tensor"      # top-k per tensor or over the whole model
  c.compress.sample_ratio = 0.01   # dgc: fraction sampled to estimate the threshold
  c.compress.error_feedback = True

  c.train = ml_collections.ConfigDict()
  c.train.num_epochs = 1.0
  c.train.eval_every = 1.0        # epochs between evaluations (fractions allowed)
  c.train.target_accuracy = 0.0   # vision: time_to_target is the first eval reaching it (0 = none)
  c.train.target_bleu = 0.0       # translation: likewise for BLEU
  c.train.checkpoint_every = 1    # evaluations between checkpoints (the final state is always saved)
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
  c.dist.num_servers = 1          # parameter shards (experiments.launch --num_servers sets it)
  c.dist.all_lost_timeout = 60.0  # seconds with every mesh lost before the run ends as failed
  # Where large bodies (pushes, pulls, joins of over 4 MiB) travel: 'flight' (Arrow Flight, no
  # copy into bytes; docs/PERFORMANCE.md) or 'grpc' (grpcio streams, the wire's size limits).
  c.dist.data_plane = "flight"
  # TLS (optional; the run secret, GSSP_SECRET_FILE or GSSP_SECRET, is always required): PEM
  # files of this process's certificate and key and of the CA that signed the run's certificates.
  c.dist.tls_cert = ""
  c.dist.tls_key = ""
  c.dist.tls_ca = ""
  c.dist.tls_client_auth = False  # mutual TLS: servers also require a client certificate (tls_ca)
  c.dist.tls_server_name = ""     # the name the servers' certificates carry, if not their host
  return c


def override(config: ml_collections.ConfigDict, changes: dict, *,
             check_types: bool = True) -> ml_collections.ConfigDict:
  """Sets dotted keys in place (``{"sync.scheme": "gssp"}``), as ``--config.key=value`` does.

  Raises:
    KeyError: a key that the config does not have, naming it.
  """
  for key, value in changes.items():
    node = config
    *path, leaf = key.split(".")
    for part in path:
      if part not in node:
        raise KeyError(f"config has no key {key!r} (no {part!r} under it)")
      node = node[part]
    if leaf not in node:
      raise KeyError(f"config has no key {key!r}")
    if check_types:
      node[leaf] = value
    else:
      with node.ignore_type():
        node[leaf] = value
  return config


def _fail(key: str, value, allowed: str) -> None:
  raise ValueError(f"config.{key}={value!r} is invalid; allowed: {allowed}")


def _check_model_and_dataset(config) -> None:
  """Built-in model and dataset (a pair that fits), or user ones (resolved, i.e. imported, now)."""
  from gssp_jax import models  # pylint: disable=g-import-not-at-top (flax: keep config light)
  from gssp_jax.data import user  # pylint: disable=g-import-not-at-top
  model, dataset = config.model, config.dataset
  user_model, user_data = models.is_user_model(model), user.is_user_dataset(dataset)
  try:
    if user_model:
      models.check_user_model_args(model, dict(config.model_args))
    if user_data:
      user.check_name(dataset)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  if not user_model:
    _choice(config, "model", tuple(MODEL_DATASETS) + (
        "a name given to gssp_jax.models.register_model",
        "'package.module:Name' or 'path/file.py:Name' (a Flax module)"))
  if not user_data:
    _choice(config, "dataset", DATASETS + (
        "'tfds:<builder>'", "a name given to gssp_jax.data.register_dataset",
        "'package.module:load' or 'path/file.py:load'"))
  if user_model and dataset == "multi30k":
    _fail("dataset", dataset, f"an image-classification dataset for the user model {model!r} "
          "(mnist, cifar10 or a user dataset); multi30k trains model='seq2seq'")
  if not user_model and user_data and model == "seq2seq":
    _fail("dataset", dataset, "multi30k for model 'seq2seq' (user datasets are classification)")
  if not user_model and not user_data and dataset not in MODEL_DATASETS[model]:
    _fail("dataset", dataset, f"{', '.join(MODEL_DATASETS[model])} for model {model!r}")


def _check_optimizer(config, where: str) -> None:
  """``{where}.name`` built in (no ``args``), or an optax/user optimizer whose args it takes."""
  from gssp_jax.train import optim  # pylint: disable=g-import-not-at-top (optim imports sync)
  cfg = _get(config, where)
  args = cfg.get("args", "")
  if cfg.name in OPTIMIZERS and args == "":
    return
  optim.optimizer_constructor(cfg.name, args, f"config.{where}")


def _choice(config, key: str, allowed) -> None:
  value = _get(config, key)
  if value not in allowed:
    _fail(key, value, ", ".join(allowed))


def _get(config, key: str):
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _positive(config, key: str, kind=(int, float)) -> None:
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
    _fail(key, value, "a positive number" if kind != int else "a positive integer")


def _non_negative(config, key: str) -> None:
  value = _get(config, key)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
    _fail(key, value, "a number >= 0")


def validate_config(config: ml_collections.ConfigDict, *,
                    allow_unread: Collection[str] = ()) -> None:
  """Raises ValueError naming the first invalid key; runs before any compilation.

  Args:
    config: the run's config.
    allow_unread: dotted ``sync.*`` keys that may differ from their default
      although the scheme does not read them: what a sweep's base config sets
      for its other trials (``sweep.expand``). Their range checks still run.
  """
  _check_model_and_dataset(config)
  width = config.model_args.get("width", 1.0)
  if config.model in ("resnet18", "vgg19") and (
      isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0):
    _fail("model_args.width", width, "a number > 0 (1.0 = the paper's channel counts)")
  from gssp_jax.sync import registry  # pylint: disable=g-import-not-at-top (light config import)
  _choice(config, "sync.scheme", registry.scheme_names())
  _choice(config, "compress.name", COMPRESSORS)
  _choice(config, "compress.scope", COMPRESS_SCOPES)
  for key in ("compress.ratio", "compress.sample_ratio"):
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
      _fail(key, value, "a number in (0, 1]")
  _check_optimizer(config, "optimizer")
  _choice(config, "optimizer.schedule", SCHEDULES)
  _choice(config, "optimizer.weight_decay_mode", WEIGHT_DECAY_MODES)
  if not isinstance(config.seed, int) or isinstance(config.seed, bool):
    _fail("seed", config.seed, "an integer")
  for key in ("num_workers", "batch_size", "data.eval_batch_size", "train.checkpoint_every",
              "train.max_checkpoints", "train.log_every"):
    _positive(config, key, int)
  for key in ("optimizer.learning_rate", "train.num_epochs", "train.eval_every"):
    _positive(config, key)
  for key in ("optimizer.momentum", "optimizer.weight_decay", "optimizer.warmup_epochs",
              "optimizer.grad_clip", "train.target_accuracy", "train.target_bleu",
              "train.stop_after_updates", "data.train_size", "data.test_size", "data.max_len"):
    _non_negative(config, key)
  for key in ("data.train_size", "data.test_size", "data.max_len", "train.stop_after_updates"):
    if not isinstance(_get(config, key), int):
      _fail(key, _get(config, key), "an integer >= 0")
  if config.optimizer.momentum >= 1:
    _fail("optimizer.momentum", config.optimizer.momentum, "a number in [0, 1)")
  if config.train.target_accuracy > 1:
    _fail("train.target_accuracy", config.train.target_accuracy,
          "a fraction in [0, 1] (0 = no target)")
  if config.data.train_size and config.data.train_size < config.num_workers:
    _fail("data.train_size", config.data.train_size,
          f"0 (all) or at least num_workers={config.num_workers}")
  validate_sync(config, allow_unread=allow_unread)
  validate_local(config)
  validate_dist(config)
  from gssp_jax.sim import cluster  # pylint: disable=g-import-not-at-top
  cluster.cluster_from_config(config, base_time=1.0 if config.cluster.calibrate else None)
  validate_executor(config)


def validate_sync(config: ml_collections.ConfigDict, *,
                  allow_unread: Collection[str] = ()) -> None:
  """Builds the scheme named by ``config.sync`` (host-only, no compilation) to check it.

  Raises:
    ValueError: naming the ``config.sync`` key's value and what is allowed.
  """
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top  (keeps config import light)
  if config.compress.name == "gdtopk" and config.sync.scheme != "gssp":
    _fail("compress.name", "gdtopk", "gdtopk only with sync.scheme='gssp' (its ratios are "
          "per GSSP group); use topk or dgc otherwise")
  if config.sync.regroup_every_epoch and config.sync.scheme != "gssp":
    _fail("sync.regroup_every_epoch", True, "True only with sync.scheme='gssp' (False otherwise)")
  check_unread_sync_keys(config, allow_unread)
  try:
    sync.scheme_from_config(config)
  except ValueError as e:
    raise ValueError(f"config.sync (scheme {config.sync.scheme!r}): {e}") from None


def validate_local(config: ml_collections.ConfigDict) -> None:
  """``config.local.*``: in range, and changed from its defaults only under a local-update scheme.

  Raises:
    ValueError: naming the key, its value and what is allowed.
  """
  if "local" not in config:   # a config recorded before the local-update schemes
    return
  from gssp_jax.sync import local as local_lib  # pylint: disable=g-import-not-at-top
  _check_optimizer(config, "local.optimizer")
  _choice(config, "local.optimizer.schedule", SCHEDULES)
  _positive(config, "local.optimizer.learning_rate")
  for key in ("local.optimizer.momentum", "local.optimizer.weight_decay",
              "local.optimizer.warmup_epochs"):
    _non_negative(config, key)
  if config.local.optimizer.momentum >= 1:
    _fail("local.optimizer.momentum", config.local.optimizer.momentum, "a number in [0, 1)")
  _check_bool("local.optimizer.nesterov", config.local.optimizer.nesterov)
  if local_lib.is_local(config.sync.scheme):
    local_lib.check_local_config(config)
    return
  defaults = default_config().local
  for key in ("steps", "dylu", "delayed_nesterov", *(f"optimizer.{k}" for k in defaults.optimizer),
              *(f"halos.{k}" for k in defaults.get("halos", {}))):
    value, default = _get(config.local, key), _get(defaults, key)
    if comparable(value) != comparable(default):
      raise ValueError(
          f"config.local.{key}={value!r} cannot apply: sync.scheme={config.sync.scheme!r} is not"
          f" a local-update scheme ({', '.join(local_lib.LOCAL_SCHEMES)}); leave it at its"
          f" default {default!r}")


def _int_at_least(minimum: int):
  def check(key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      _fail(key, value, f"an integer >= {minimum}")
  return check


def _one_of(*allowed):
  def check(key, value):
    if value not in allowed:
      _fail(key, value, ", ".join(allowed))
  return check


def _check_staleness_range(key, value):
  ok = (isinstance(value, (tuple, list)) and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and value[0] <= value[1])
  if not ok:
    _fail(key, value, "a pair (s_L, s_U) of ints with 0 <= s_L <= s_U")


def _check_bool(key, value):
  if not isinstance(value, bool):
    _fail(key, value, "True or False")


def _check_non_negative(key, value):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
    _fail(key, value, "a number >= 0")


# The range/type check of every sync key, run under every scheme: a scheme's builder checks
# the keys it reads (with their relations, e.g. num_groups dividing num_workers); these check
# the others, which must still hold a value that could apply.
_SYNC_CHECKS = {
    "staleness": _int_at_least(0),
    "staleness_range": _check_staleness_range,
    "num_groups": _int_at_least(1),
    "grouping": _one_of("speed", "kmeans", "round_robin", "contiguous"),
    "regroup_every_epoch": _check_bool,
    "inter_group": _one_of("peer", "global"),
    "forward_every": _int_at_least(0),
    "num_nodes": _int_at_least(1),
    "inhad_threshold": _int_at_least(0),
    "group_size": _int_at_least(1),
    "casp.max_communities": _int_at_least(1),
    "casp.reconfigure_every": _int_at_least(1),
    "casp.traffic_penalty": _check_non_negative,
}


def comparable(value):
  """A config value comparable with its default (tuples and lists alike)."""
  return tuple(value) if isinstance(value, (tuple, list)) else value


def _sync_values(config: ml_collections.ConfigDict):
  """``(key, value, default)`` of every sync key in ``_SYNC_CHECKS`` that ``config`` has.

  A config recorded before a key existed lacks it: its default applies, so it is skipped.
  """
  defaults = default_config().sync
  for key in _SYNC_CHECKS:
    try:
      value = _get(config.sync, key)
    except (KeyError, AttributeError):
      continue
    yield key, value, _get(defaults, key)


def check_unread_sync_keys(config: ml_collections.ConfigDict,
                           allow_unread: Collection[str] = ()) -> None:
  """Range-checks the sync keys the scheme does not read and rejects any changed from its default.

  Registered schemes (``sync.register_scheme``) may read any key, so only the
  range checks run for them; keys in ``allow_unread`` are only range-checked.

  Raises:
    ValueError: one line naming the key, its value, and why it cannot apply.
  """
  from gssp_jax.sync import registry  # pylint: disable=g-import-not-at-top (light config import)
  scheme = config.sync.scheme
  reads = registry.SYNC_KEYS.get(scheme)
  for key, value, default in _sync_values(config):
    if reads is not None and key in reads:
      continue   # the scheme's builder checks it
    _SYNC_CHECKS[key](f"sync.{key}", value)
    if (reads is not None and f"sync.{key}" not in allow_unread
        and comparable(value) != comparable(default)):
      readers = [name for name, keys in registry.SYNC_KEYS.items() if key in keys]
      raise ValueError(
          f"config.sync.{key}={value!r} cannot apply: sync.scheme={scheme!r} does not read it"
          f" (read only by {', '.join(readers)}); leave it at its default {default!r}")


def cluster_is_set(config: ml_collections.ConfigDict) -> bool:
  """True when ``config.cluster`` describes a cluster: a profile, or any key off its default."""
  if config.cluster.profile != "none":
    return True
  defaults = default_config().cluster
  return any(comparable(config.cluster[key]) != comparable(defaults[key])
             for key in defaults if key in config.cluster)


def changed_sync_keys(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The dotted ``sync.*`` keys (but ``scheme``) whose value differs from the default."""
  return tuple(f"sync.{key}" for key, value, default in _sync_values(config)
               if comparable(value) != comparable(default))


def uses_simulator(config: ml_collections.ConfigDict) -> bool:
  """BSP without a cluster description trains in the fused loop; everything else is simulated."""
  return config.sync.scheme != "bsp" or cluster_is_set(config)


def validate_executor(config: ml_collections.ConfigDict) -> None:
  """``config.executor`` is known and can run this config (fused: BSP without a cluster)."""
  name = config.get("executor", "auto")
  if name not in EXECUTORS:
    _fail("executor", name, ", ".join(EXECUTORS))
  if name == "fused" and uses_simulator(config):
    why = (f"sync.scheme={config.sync.scheme!r}" if config.sync.scheme != "bsp"
           else "config.cluster describes a cluster")
    raise ValueError(f"config.executor='fused' cannot apply: {why}, and the fused executor"
                     " trains only BSP without a cluster (no virtual time); use 'rounds' or"
                     " 'auto'")
  validate_levels_per_call(config)


def validate_levels_per_call(config: ml_collections.ConfigDict, backend: str | None = None) -> None:
  """``levels_per_call`` (0 or a power of two up to 64) and ``level_job_slots`` (0..W).

  Either set (not 0) is an error unless the run uses the ``levels`` executor.

  Args:
    config: the run's config.
    backend: the JAX backend ``executor='auto'`` resolves against (``jax.default_backend()``
      if None; only read when a key is set under ``auto``).
  """
  value = config.get("levels_per_call", 0)
  if (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64
      or value & (value - 1)):
    _fail("levels_per_call", value, "0 (chosen by the run) or a power of two from 1 to 64")
  slots = config.get("level_job_slots", 0)
  if (isinstance(slots, bool) or not isinstance(slots, int)
      or not 0 <= slots <= config.num_workers):
    _fail("level_job_slots", slots, f"0 (min(num_workers, 64)) or 1..num_workers "
          f"({config.num_workers})")
  for key, set_value in (("levels_per_call", value), ("level_job_slots", slots)):
    if not set_value:
      continue
    name = config.get("executor", "auto")
    if name == "auto" and uses_simulator(config):
      if backend is None:
        import jax  # pylint: disable=g-import-not-at-top
        backend = jax.default_backend()
      name = "rounds" if backend == "cpu" else "levels"
    if name != "levels":
      raise ValueError(f"config.{key}={set_value} cannot apply: it sets the levels executor, and"
                       f" this run uses {name!r} (config.executor="
                       f"{config.get('executor', 'auto')!r}); set config.executor='levels' or "
                       f"leave {key}=0")


def validate_dist(config: ml_collections.ConfigDict) -> None:
  """``config.dist.*``: positive timeouts, a host:port address (the runtime's own checks aside)."""
  if "dist" not in config:
    return
  for key in ("dist.heartbeat_timeout", "dist.join_timeout", "dist.retry_seconds",
              "dist.hang_timeout", "dist.save_timeout", "dist.all_lost_timeout"):
    _positive(config, key)
  _positive(config, "dist.num_servers", int)
  for key in ("emulate_cluster", "tls_client_auth"):
    if not isinstance(config.dist[key], bool):
      _fail(f"dist.{key}", config.dist[key], "True or False")
  tls = {k: config.dist[k] for k in ("tls_cert", "tls_key", "tls_ca")}
  if any(tls.values()) and not all(tls.values()):
    missing = [k for k, v in tls.items() if not v]
    _fail(f"dist.{missing[0]}", "", "a PEM file: TLS needs dist.tls_cert, dist.tls_key and "
          "dist.tls_ca together")
  if config.dist.tls_client_auth and not config.dist.tls_cert:
    _fail("dist.tls_client_auth", True, "False, or True with dist.tls_cert/tls_key/tls_ca set")
  if config.dist.get("data_plane", "grpc") not in DATA_PLANES:
    _fail("dist.data_plane", config.dist.data_plane, " or ".join(map(repr, DATA_PLANES)))
  if config.dist.get("data_plane", "grpc") == "flight":
    from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
    if not flight.available():
      _fail("dist.data_plane", "flight", "'grpc' where pyarrow (with Flight) is not installed "
            "(pip install pyarrow)")
  if config.dist.server_address:
    from gssp_jax.runtime import wire  # pylint: disable=g-import-not-at-top
    wire.check_address("config.dist.server_address", config.dist.server_address)
  if config.get("executor", "auto") == "dist":
    from gssp_jax import runtime  # pylint: disable=g-import-not-at-top
    runtime.check_real_run(config)


def validate_sizes(config: ml_collections.ConfigDict, num_train: int) -> None:
  """Checks that need the dataset's size (still before any compilation)."""
  shard = num_train // config.num_workers
  if shard < 1:
    _fail("num_workers", config.num_workers,
          f"at most the number of training examples ({num_train})")
  if config.batch_size > shard:
    _fail("batch_size", config.batch_size,
          f"at most the per-worker shard size {shard} (= {num_train} training examples //"
          f" num_workers={config.num_workers})")


def parse_arg(arg: str | None, allowed: tuple[str, ...] = ("smoke",)) -> set[str]:
  """Parses a config file's ``:arg`` (comma-separated flags such as ``smoke``)."""
  flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
  unknown = sorted(flags - set(allowed))
  if unknown:
    raise ValueError(f"unknown config arg {unknown[0]!r}; allowed: {', '.join(allowed)}")
  return flags
