"""Config files and validation: bad values are rejected, naming the key, before compiling."""

import importlib

import pytest

from gssp_jax import config as config_lib
from gssp_jax import defaults
from gssp_jax import sync
from gssp_jax import executors
from gssp_jax.base import tasks

CONFIGS = ["mnist_lenet5", "cifar10_resnet18", "cifar10_vgg19", "multi30k_seq2seq"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_shipped_configs_are_valid(name, arg):
  config = importlib.import_module(f"configs.{name}").get_config(arg)
  config_lib.validate_config(config)


def test_unknown_config_arg_is_rejected():
  with pytest.raises(ValueError, match="'fast'.*allowed: smoke"):
    importlib.import_module("configs.mnist_lenet5").get_config("fast")


@pytest.mark.parametrize("key,value,match", [
    ("model", "resnet50", "config.model='resnet50'.*lenet5, resnet18, vgg19, seq2seq"),
    ("dataset", "imagenet", "config.dataset='imagenet'.*mnist, cifar10, multi30k"),
    ("dataset", "multi30k", "config.dataset='multi30k'.*for model 'lenet5'"),
    ("sync.scheme", "hogwild", "config.sync.scheme='hogwild'.*bsp, asp, ssp"),
    ("compress.name", "zip", "config.compress.name='zip'"),
    ("compress.ratio", 1.5, r"config.compress.ratio=1.5.*\(0, 1\]"),
    ("compress.ratio", 0.0, r"config.compress.ratio=0.0.*\(0, 1\]"),
    ("compress.scope", "layer", "config.compress.scope='layer'.*tensor, global"),
    ("optimizer.name", "lamdba", "config.optimizer.name='lamdba' is not an optax optimizer.*sgd, "
                                 "adam, adamw, an optax function"),
    ("num_workers", 0, "config.num_workers=0.*positive integer"),
    ("num_workers", -3, "config.num_workers=-3"),
    ("batch_size", -1, "config.batch_size=-1.*positive integer"),
    ("batch_size", 2.5, "config.batch_size=2.5"),
    ("optimizer.learning_rate", 0.0, "config.optimizer.learning_rate=0.0"),
    ("optimizer.momentum", 1.0, r"config.optimizer.momentum=1.0.*\[0, 1\)"),
    ("train.num_epochs", -1.0, "config.train.num_epochs=-1.0"),
    ("train.target_accuracy", 98.5, r"config.train.target_accuracy=98.5.*fraction"),
    ("data.train_size", -5, "config.data.train_size=-5"),
])
def test_invalid_values_name_the_key(key, value, match):
  config = config_lib.default_config()
  node = config
  *path, leaf = key.split(".")
  for part in path:
    node = node[part]
  with config.ignore_type():
    node[leaf] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_every_scheme_validates_and_builds_from_config():
  for scheme in sync.scheme_names():   # the registry's: a scheme added there is tested here
    config = config_lib.default_config()
    config.sync.scheme = scheme
    config.compress.name = "gdtopk" if scheme == "gssp" else "none"
    if scheme == "halos":
      # The global server's Delayed Nesterov: a Nesterov step without weight decay.
      config.optimizer.nesterov, config.optimizer.weight_decay = True, 0.0
    config_lib.validate_config(config)


def test_registered_schemes_validate_like_built_ins():
  import numpy as np  # pylint: disable=g-import-not-at-top
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top

  def build(config, worker_times):
    del worker_times
    W = config.num_workers
    if config.sync.staleness > 5:
      raise ValueError(f"mine staleness={config.sync.staleness} is invalid; allowed: 0..5")
    return sync.Scheme("mine", sync.asp(W), lambda: sync.ASPProtocol(W), W, 1,
                       np.zeros([W], np.int32))

  c = config_lib.default_config()
  c.sync.scheme = "mine"
  with pytest.raises(ValueError, match=r"config.sync.scheme='mine' is invalid; allowed: bsp"):
    config_lib.validate_config(c)
  sync.register_scheme("mine", build)
  try:
    assert sync.scheme_names()[-1] == "mine"
    config_lib.validate_config(c)
    assert executors.uses_simulator(c)
    c.sync.staleness = 9
    with pytest.raises(ValueError, match=r"mine staleness=9 is invalid"):
      config_lib.validate_config(c)
    c.sync.staleness, c.num_workers = 3, 4
    sync.register_scheme("mine", lambda config, times: sync.build_scheme("asp", 2))
    with pytest.raises(ValueError, match=r"allowed: a Scheme with num_workers=4"):
      config_lib.validate_config(c)
  finally:
    sync.unregister_scheme("mine")
  assert "mine" not in sync.scheme_names()
  for bad in ("bsp", "not a name", 3):
    with pytest.raises(ValueError, match=r"scheme name=.* is invalid; allowed: a new identifier"):
      sync.register_scheme(bad, build)
  with pytest.raises(ValueError, match=r"builder=None is invalid"):
    sync.register_scheme("other", None)


def test_which_runs_use_the_simulator():
  config = config_lib.default_config()
  assert not executors.uses_simulator(config)          # BSP, no cluster: the plain loop
  config.cluster.profile = "tiers"
  assert executors.uses_simulator(config)              # BSP on a simulated cluster
  config.cluster.profile, config.sync.scheme = "none", "gssp"
  assert executors.uses_simulator(config)              # other schemes: always simulated


@pytest.mark.parametrize("changes,match", [
    ({"sync.scheme": "gssp", "num_workers": 16, "sync.num_groups": 3},
     r"config.sync \(scheme 'gssp'\): num_groups=3 does not divide num_workers=16"),
    ({"sync.scheme": "ssp", "sync.staleness": -1}, r"ssp staleness=-1 is invalid"),
    ({"sync.scheme": "dssp", "sync.staleness_range": (5, 2)}, r"s_L=5 > s_U=2"),
    ({"sync.scheme": "gssp", "sync.inter_group": "ring"}, r"inter_group='ring'"),
    ({"sync.scheme": "dssync", "sync.group_size": 3}, r"group_size=3 is invalid"),
    ({"sync.scheme": "gsp"}, r"config.sync.scheme='gsp' is invalid; allowed: bsp, asp"),
    ({"compress.name": "gdtopk"}, r"gdtopk only with sync.scheme='gssp'"),
    ({"sync.scheme": "ssp", "sync.regroup_every_epoch": True},
     r"config.sync.regroup_every_epoch=True is invalid; allowed: True only with"),
])
def test_bad_sync_settings_name_the_value(changes, match):
  config = config_lib.override(config_lib.default_config(), changes, check_types=False)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_batch_larger_than_the_shard_is_rejected():
  config = config_lib.default_config()
  config.num_workers, config.batch_size = 4, 300
  with pytest.raises(ValueError, match="config.batch_size=300.*shard size 250"):
    tasks.validate_sizes(config, num_train=1000)
  with pytest.raises(ValueError, match="config.num_workers=4"):
    tasks.validate_sizes(config, num_train=3)


def test_override_sets_dotted_keys_and_names_unknown_ones():
  config = config_lib.override(config_lib.default_config(),
                               {"sync.scheme": "gssp", "cluster.tiers": (1.0, 2.0)})
  assert config.sync.scheme == "gssp" and config.cluster.tiers == (1.0, 2.0)
  with pytest.raises(KeyError, match="'sync.stalenes'"):
    config_lib.override(config, {"sync.stalenes": 2})
  with pytest.raises(KeyError, match="'clustr.speeds'"):
    config_lib.override(config, {"clustr.speeds": (1.0,)})


@pytest.mark.parametrize("key, meant, section", [
    ("num_epochs", "'train.num_epochs'", "the top-level keys: "),    # a key of another section
    ("sync.schem", "'sync.scheme'", "the keys under 'sync': "),      # a misspelling
    ("train.nesterov", "'optimizer.nesterov'", "the keys under 'train': "),
    ("lr", "'optimizer.learning_rate'", "the top-level keys: "),     # a habit's name
    ("cluster.tier", "'cluster.tiers'", "the keys under 'cluster': "),
])
def test_override_suggests_a_key_of_any_section_by_its_full_name(key, meant, section):
  with pytest.raises(KeyError) as e:
    config_lib.override(config_lib.default_config(), {key: 1})
  message = e.value.args[0]
  assert message.startswith(f"config has no key {key!r} (did you mean {meant}")
  allowed = message.split("; allowed: ", 1)[1]
  assert allowed.startswith(section) and len(allowed) > len(section) + 10


def test_override_of_a_key_nothing_resembles_lists_what_is_allowed_never_nothing():
  config = config_lib.default_config()
  for key, where in (("foo.bar", "the top-level keys: "), ("sync.zzz", "the keys under 'sync': "),
                     ("model_args.hidden", "the keys under 'model_args': ")):
    with pytest.raises(KeyError) as e:
      config_lib.override(config, {key: 1})
    message = e.value.args[0]
    assert "did you mean" not in message, message
    listed = message.split(f"; allowed: {where}", 1)[1]
    assert listed.strip(), message
  assert "scheme, staleness" in defaults.allowed_keys(config, "sync.zzz")
  assert defaults.similar_keys(config, "sync.num_group")[0] == "sync.num_groups"


def test_a_scheme_registered_from_outside_has_its_keys_checked_by_its_own_builder():
  """A researcher's scheme declares the sync keys it reads: its builder checks their values
  (at validation, before anything runs), and any other key changed from its default is
  refused as for a built-in scheme, naming who reads it."""
  def lagged(config, worker_times):
    del worker_times
    s = config.sync.staleness
    if s < 1:
      raise ValueError(f"config.sync.staleness={s} is invalid for 'lagged'; allowed: >= 1")
    return sync.build_scheme("ssp", config.num_workers, staleness=s)
  sync.register_scheme("lagged", lagged, sync_keys=("staleness",))
  try:
    assert sync.registry.SYNC_KEYS["lagged"] == ("staleness",)
    config = config_lib.default_config()
    config.sync.scheme, config.sync.staleness = "lagged", 5
    config_lib.validate_config(config)   # its own key, a value its builder takes
    config.sync.staleness = 0
    with pytest.raises(ValueError, match=r"staleness=0 is invalid for 'lagged'; allowed: >= 1"):
      config_lib.validate_config(config)
    config.sync.staleness, config.sync.num_groups = 3, 8
    with pytest.raises(ValueError, match=r"sync.num_groups=8 cannot apply: "
                                         r"sync.scheme='lagged' does not read it \(read only by "
                                         r"gssp, halos\)"):
      config_lib.validate_config(config)
    with pytest.raises(ValueError, match=r"sync_keys entry 'stalenes' is invalid; allowed: keys "
                                         r"of config.sync"):
      sync.register_scheme("lagged2", lagged, sync_keys=("stalenes",))
    with pytest.raises(ValueError, match=r"scheme name='gssp' is invalid"):
      sync.register_scheme("gssp", lagged)
  finally:
    sync.unregister_scheme("lagged")
  assert "lagged" not in sync.scheme_names() and "lagged" not in sync.registry.SYNC_KEYS
  sync.unregister_scheme("gssp")   # a built-in stays
  assert "gssp" in sync.scheme_names()


def test_the_hetero_configs_local_update_args_set_each_schemes_optimizers():
  from configs import mnist_lenet5_hetero  # pylint: disable=g-import-not-at-top
  base = mnist_lenet5_hetero.get_config()
  diloco = mnist_lenet5_hetero.get_config("diloco")
  assert (diloco.sync.scheme, diloco.local.steps, diloco.local.optimizer.name) == (
      "diloco", 8, "adamw")
  assert (diloco.local.optimizer.learning_rate, diloco.optimizer.learning_rate,
          diloco.optimizer.nesterov, diloco.optimizer.weight_decay) == (1e-3, 0.7, True, 0.0)
  halos = mnist_lenet5_hetero.get_config("halos,smoke")
  assert (halos.sync.scheme, halos.optimizer.learning_rate, halos.optimizer.momentum,
          halos.local.dylu, halos.train.num_epochs) == ("halos", 0.3, 0.5, True, 2.0)
  asynchronous = mnist_lenet5_hetero.get_config("async_local")
  assert (asynchronous.sync.scheme, asynchronous.local.delayed_nesterov) == (
      "async_local_sgd", 16)
  # Nothing else moves: the rest is the base config's.
  assert diloco.data.to_dict() == base.data.to_dict() and diloco.cluster == base.cluster
  for config in (diloco, halos, asynchronous):
    config_lib.validate_config(config)
  with pytest.raises(ValueError, match="diloco, halos are invalid together"):
    mnist_lenet5_hetero.get_config("diloco,halos")
  with pytest.raises(ValueError, match="unknown config arg 'dilcoo'; allowed: smoke, diloco"):
    mnist_lenet5_hetero.get_config("dilcoo")


def _counting_cluster_checks(monkeypatch):
  """Counts the calls of one builder's check (the cluster's), which every validation makes."""
  from gssp_jax.sim import cluster
  calls = []
  real = cluster.validate
  monkeypatch.setattr(cluster, "validate", lambda config: (calls.append(1), real(config))[1])
  return calls


def test_a_config_is_validated_once_a_run_and_again_when_it_changes(monkeypatch):
  calls = _counting_cluster_checks(monkeypatch)
  config = importlib.import_module("configs.mnist_lenet5").get_config("smoke")
  config.seed = 12345   # content no other test validated in this process
  config_lib.validate_config(config)   # where the run begins (experiments.main)
  assert not config_lib.ensure_valid(config) and len(calls) == 1   # the loop trusts it
  assert config_lib.ensure_valid(config, allow_unread=("sync.staleness",)) and len(calls) == 2
  config.num_workers = 3   # changed since: checked again, and a bad change refused
  assert config_lib.ensure_valid(config) and len(calls) == 3
  config.num_workers = 0
  with pytest.raises(ValueError, match="config.num_workers=0"):
    config_lib.ensure_valid(config)
  with pytest.raises(ValueError, match="config.num_workers=0"):   # a refusal is not remembered
    config_lib.ensure_valid(config)


def test_the_loop_does_not_validate_what_its_caller_validated(monkeypatch, tmp_path):
  """``train_and_evaluate`` after ``validate_config`` (``experiments.main``'s order) runs the
  builders' checks once in all: neither the loop's entry nor its run builder checks again."""
  from gssp_jax.train import loop
  calls = _counting_cluster_checks(monkeypatch)
  built = []

  def build(config, workdir):
    built.append(workdir)
    raise RuntimeError("stopped after the build")
  monkeypatch.setattr(loop, "_build_valid_run", build)
  config = importlib.import_module("configs.mnist_lenet5").get_config("smoke")
  config.seed = 23456
  config_lib.validate_config(config)
  with pytest.raises(RuntimeError, match="stopped after the build"):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert built and len(calls) == 1
  config.seed = 34567   # a notebook's call with a config nobody checked: the loop checks it
  with pytest.raises(RuntimeError, match="stopped after the build"):
    loop.train_and_evaluate(config, str(tmp_path / "run2"), progress=False)
  assert len(calls) == 2


def test_a_sweeps_trials_are_validated_once_when_it_loads_them(monkeypatch):
  from gssp_jax.studies import sweep
  calls = _counting_cluster_checks(monkeypatch)
  trials = sweep.expand("configs/sweeps/tiny.py", {"train.max_checkpoints": 7})
  assert len(calls) == len(trials) > 1
  assert not any(config_lib.ensure_valid(t.config, allow_unread=t.allow_unread) for t in trials)
  assert len(calls) == len(trials)
