"""The training loop: the per-worker seam, BSP, smoke runs, exact resume, divergence."""

import importlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
from gssp_jax import compress
from gssp_jax import config as config_lib
from gssp_jax import data as data_lib
from gssp_jax.base import environment
from gssp_jax.train import loop
from gssp_jax.base import optim
from gssp_jax.base import step as step_lib
from gssp_jax.base import tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name, data_dir, arg="smoke", **overrides):
  config = importlib.import_module(f"configs.{name}").get_config(arg)
  config.data_dir = data_dir
  return config_lib.override(config, overrides)


def _lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _synthetic_task(num_examples=256, seed=0):
  """Random 32x32 images (augmented: the rng's crops and flips) for the tests whose claim does
  not depend on the model (a fused step against per-worker gradients, one worker against plain
  SGD, top-k at ratio 1, the clip): ``helpers.TinyCNN``, whose compilations are a fraction of
  LeNet-5's (these tests compiled LeNet-5 for about 55 s in all)."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (num_examples, 32, 32, 1), dtype=np.uint8)
  labels = rng.integers(0, 10, num_examples).astype(np.int32)
  ds = data_lib.ImageDataset("synthetic", images, labels, images[:16], labels[:16], 10,
                             (0.5,), (0.25,))
  return tasks.ClassificationTask(helpers.TinyCNN(num_classes=10), ds, augment=True,
                                  eval_batch_size=8)


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_fused_mean_gradient_equals_mean_of_per_worker_gradients():
  task = _synthetic_task()
  params, model_state = task.init(jax.random.PRNGKey(0))
  idx = np.arange(4 * 16).reshape(4, 16)
  batches = jax.tree.map(lambda a: jnp.asarray(a[idx]), task.train)
  rngs = step_lib.worker_rngs(jax.random.PRNGKey(1), jnp.int32(3), 4)
  stacked, _, losses_a = jax.jit(step_lib.worker_gradients, static_argnums=0)(
      task.loss, params, model_state, batches, rngs)
  fused, _, losses_b = jax.jit(step_lib.mean_worker_gradient, static_argnums=0)(
      task.loss, params, model_state, batches, rngs)
  assert jax.tree.leaves(stacked)[0].shape[0] == 4  # the leading worker axis
  np.testing.assert_allclose(losses_a, losses_b, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(fused)):
    np.testing.assert_allclose(a.mean(0), b, rtol=2e-4, atol=1e-6)


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_bsp_with_one_worker_is_plain_sgd():
  task = _synthetic_task()
  config = config_lib.default_config()
  tx = optim.make_optimizer(config.optimizer, 10, 10)
  state = step_lib.init_train_state(task, tx, seed=0)
  order = np.arange(64, dtype=np.int32)[None, :]
  run = step_lib.make_chunk_runner(step_lib.make_bsp_step(task.loss, tx, 1), 16)
  new_state, metrics = run(state, jax.device_put(task.train), jnp.asarray(order), 0, 4)
  assert metrics["loss"].shape == (4,) and np.all(np.isfinite(metrics["loss"]))

  # The same four updates by hand: grad of the worker's loss, optax, apply.
  state = step_lib.init_train_state(task, tx, seed=0)
  params, opt_state = state.params, state.opt_state
  for t in range(4):
    batch = jax.tree.map(lambda a: jnp.asarray(a[order[0, t * 16:(t + 1) * 16]]), task.train)
    rng = step_lib.worker_rngs(state.rng, jnp.int32(t), 1)[0]
    grads, _ = jax.grad(task.loss, has_aux=True)(params, {}, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  assert int(new_state.step) == 4
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mnist_lenet5", "cifar10_resnet18", "cifar10_vgg19",
                                  "multi30k_seq2seq"])
@pytest.mark.slow
def test_smoke_configs_train_end_to_end(name, data_dir, tmp_path):
  config = _config(name, data_dir)
  if name.startswith("cifar10"):
    # A quarter of the channels: the same layers, blocks, BatchNorm and augmentation at
    # ~1/16 of the convolutions' cost, which at full width was most of this test's time.
    config.model_args.width = 0.25
  summary = loop.train_and_evaluate(config, str(tmp_path))
  lines = _lines(tmp_path)
  assert len(lines) >= 2
  assert lines[-1]["train_loss"] < lines[0]["train_loss"], [m["train_loss"] for m in lines]
  for key in ("epoch", "updates", "virtual_time", "wall_time", "train_loss", "bytes_pushed",
              "bytes_pulled", "blocked_time", "staleness"):
    assert key in lines[-1]
  metric = "bleu" if name.startswith("multi30k") else "test_accuracy"
  assert summary["metric"] == metric and metric in lines[-1]
  assert summary["status"] == "done" and summary["final"] == lines[-1]
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["final"] == lines[-1]
  # What it ran on: the versions behind the figures and the machine, in the summary and the log.
  env = summary["environment"]
  assert env["packages"]["jax"] == jax.__version__ and env["backend"] == jax.default_backend()
  assert env["cpu"] and env["devices"] and env["python"].count(".") == 2
  if os.path.exists("/proc/cpuinfo") and platform.machine() == "x86_64":
    assert "sse4_2" in env["cpu_features"] and " ".join(env["cpu_features"]) in (
        tmp_path / "log.txt").read_text()
  assert f"jax {jax.__version__}" in (tmp_path / "log.txt").read_text()
  if name == "mnist_lenet5":
    assert lines[-1]["test_accuracy"] > 0.5  # chance is 0.1


def _without_wall_time(lines):
  return [{k: v for k, v in m.items() if k != "wall_time"} for m in lines]


def test_resumed_run_is_bit_identical(data_dir, tmp_path):
  overrides = {"train.eval_every": 0.5, "train.num_epochs": 2.0}
  whole = tmp_path / "whole"
  loop.train_and_evaluate(_config("mnist_lenet5", data_dir, **overrides), str(whole))

  split = tmp_path / "split"
  stopped = loop.train_and_evaluate(
      _config("mnist_lenet5", data_dir, **{**overrides, "train.stop_after_updates": 11}),
      str(split))
  assert stopped["status"] == "stopped" and stopped["totals"]["updates"] == 11
  # A crash after metrics were written past the checkpoint: the resumed run redoes them.
  with open(split / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"updates": 10**6, "bogus": True}) + "\n")
  resumed = loop.train_and_evaluate(_config("mnist_lenet5", data_dir, **overrides), str(split))
  assert resumed["status"] == "done"
  assert _without_wall_time(_lines(split)) == _without_wall_time(_lines(whole))


def test_resuming_with_another_config_is_refused(data_dir, tmp_path):
  loop.train_and_evaluate(
      _config("mnist_lenet5", data_dir, **{"train.stop_after_updates": 2}), str(tmp_path))
  with pytest.raises(ValueError, match="different config.*batch_size"):
    loop.train_and_evaluate(_config("mnist_lenet5", data_dir, batch_size=16), str(tmp_path))


def test_non_finite_loss_stops_with_a_clear_error(data_dir, tmp_path):
  config = _config("mnist_lenet5", data_dir, **{"optimizer.learning_rate": 1e30,
                                                "optimizer.schedule": "constant"})
  with pytest.raises(FloatingPointError, match="non-finite training loss"):
    loop.train_and_evaluate(config, str(tmp_path))
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["status"] == "diverged"


def test_main_command_line(data_dir, tmp_path):
  cmd = [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
         f"--workdir={tmp_path}", f"--config.data_dir={data_dir}", "--config.num_workers=2",
         "--config.train.num_epochs=1"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "final test_accuracy:" in out.stdout
  assert "samples/s" in out.stderr  # the progress line
  log = (tmp_path / "log.txt").read_text()   # ... also kept in the workdir, without Orbax chatter
  assert "samples/s" in log and "test_accuracy" in log and "/orbax/" not in log
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["config"]["num_workers"] == 2


def test_invalid_flag_value_fails_before_training(data_dir, tmp_path):
  cmd = [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
         f"--workdir={tmp_path}", "--config.sync.scheme=nope"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "config.sync.scheme='nope'" in out.stderr
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_no_data_and_no_network_fails_fast_saying_how_to_get_data(tmp_path, monkeypatch):
  with socket.socket() as s:  # a local port nobody listens on: a mirror that is down
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  monkeypatch.delenv("GSSP_DATA_DIR", raising=False)
  monkeypatch.setenv("GSSP_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
  config = _config("mnist_lenet5", "", data_url=f"http://127.0.0.1:{port}")
  assert config.data_download  # on by default: with a network the main command gets its data
  start = time.perf_counter()
  with pytest.raises(data_lib.DataError) as err:
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert time.perf_counter() - start < 10
  message = str(err.value)
  assert "download: failed" in message and "GSSP_DATA_DIR" in message
  assert "train-images-idx3-ubyte.gz" in message  # the expected layout


def _run_rounds(task, tx, compressor, rounds=3, workers=2, batch=16):
  state = step_lib.init_train_state(task, tx, 0, compressor)
  order = np.arange(workers * batch * rounds, dtype=np.int32).reshape(workers, -1)
  run = step_lib.make_chunk_runner(step_lib.make_bsp_step(task.loss, tx, workers, compressor),
                                   batch)
  return run(state, jax.device_put(task.train), jnp.asarray(order), 0, rounds)


@pytest.mark.usefixtures("highest_precision")   # exactness: float32, not a GPU's TF32
def test_bsp_with_top_k_keeping_everything_equals_uncompressed_bsp():
  task = _synthetic_task()
  tx = optim.make_optimizer(config_lib.default_config().optimizer, 10, 10)
  plain, plain_metrics = _run_rounds(task, tx, None)
  topk, topk_metrics = _run_rounds(task, tx, compress.topk(2, ratio=1.0))
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(topk.params)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
  # Dense pushes either way: every float32 gradient of every worker in every round.
  dense = sum(x.size for x in jax.tree.leaves(plain.params)) * 4
  np.testing.assert_array_equal(plain_metrics["push_bytes"], np.full((3, 2), dense))
  np.testing.assert_array_equal(topk_metrics["push_bytes"], plain_metrics["push_bytes"])


def test_bsp_with_top_k_trains_and_pushes_fewer_bytes(data_dir, tmp_path):
  config = _config("mnist_lenet5", data_dir, **{"compress.name": "topk", "compress.ratio": 0.05})
  summary = loop.train_and_evaluate(config, str(tmp_path))
  lines = _lines(tmp_path)
  assert lines[-1]["train_loss"] < lines[0]["train_loss"]
  assert lines[-1]["test_accuracy"] > 0.3
  dense = summary["totals"]["updates"] * config.num_workers * 61706 * 4
  assert summary["totals"]["bytes_pulled"] == dense
  # ceil(0.05 * n) values + int32 indices per tensor, per worker, per round.
  leaves = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]
  per_push = sum(min(-(-n * 5 // 100) * 8, n * 4) for n in leaves)
  assert summary["totals"]["bytes_pushed"] == summary["totals"]["updates"] * 4 * per_push


def test_bsp_with_dgc_trains_and_pushes_fewer_bytes(data_dir, tmp_path):
  config = _config("mnist_lenet5", data_dir, **{"compress.name": "dgc", "compress.ratio": 0.05,
                                                "compress.sample_ratio": 0.2})
  summary = loop.train_and_evaluate(config, str(tmp_path))
  lines = _lines(tmp_path)
  assert lines[-1]["train_loss"] < lines[0]["train_loss"]
  assert 0 < summary["totals"]["bytes_pushed"] < summary["totals"]["bytes_pulled"] / 4


def test_the_wrong_workdir_error_lists_every_changed_key_the_scheme_first(tmp_path):
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  old = config_lib.default_config()
  path = tmp_path / "config.json"
  path.write_text(old.to_json())
  changes = {"sync.scheme": "gssp", "sync.num_groups": 2, "batch_size": 16, "num_workers": 8,
             "optimizer.learning_rate": 0.2, "optimizer.momentum": 0.5, "seed": 3}
  new = config_lib.override(old, changes)
  with pytest.raises(ValueError) as err:
    workdir_lib.check_resumable(new, str(path))
  message = str(err.value)
  assert "(sync.scheme: 'bsp' -> 'gssp', " in message
  for key in changes:
    assert f"{key}: " in message, key


def sign_descent(learning_rate, scale=1.0):
  """A user's optimizer (``optimizer.name='test_train:sign_descent'``): signSGD."""
  return optax.chain(optax.scale_by_sign(), optax.scale(-scale * learning_rate)
                     if not callable(learning_rate) else optax.scale_by_schedule(
                         lambda n: -scale * learning_rate(n)))


def test_any_optax_optimizer_by_name_or_a_users_function_with_its_arguments():
  """``optimizer.name`` an optax constructor (its ``args`` as keyword arguments) or
  ``module:function``; the run keeps the learning rate (schedule) and weight decay (progress)."""
  from gssp_jax.base import optim  # pylint: disable=g-import-not-at-top
  params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array([0.5])}
  grads = {"w": jnp.array([0.1, 0.2, -0.3]), "b": jnp.array([1.0])}
  cfg = config_lib.override(config_lib.default_config(), {
      "optimizer.name": "lion", "optimizer.args": "b1=0.95, b2=0.98",
      "optimizer.learning_rate": 0.01, "optimizer.weight_decay": 0.0}).optimizer
  config_lib.validate_config(config_lib.override(config_lib.default_config(), {
      "optimizer.name": "lion", "optimizer.args": "b1=0.95, b2=0.98"}))
  ours = optim.make_optimizer(cfg, 10, 100)
  theirs = optax.lion(0.01, b1=0.95, b2=0.98)
  s1, s2 = ours.init(params), theirs.init(params)
  for _ in range(3):   # the same steps, bit for bit
    u1, s1 = ours.update(grads, s1, params)
    u2, s2 = theirs.update(grads, s2, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      np.testing.assert_array_equal(a, b)
  # Weight decay: the run's L2 (added to the gradient), not the constructor's own.
  cfg.weight_decay = 0.1
  decayed, _ = optim.make_optimizer(cfg, 10, 100).update(grads, optim.make_optimizer(
      cfg, 10, 100).init(params), params)
  want, _ = theirs.update(jax.tree.map(lambda g, p: g + 0.1 * p, grads, params),
                          theirs.init(params), params)
  for a, b in zip(jax.tree.leaves(decayed), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  user = config_lib.override(config_lib.default_config(), {
      "optimizer.name": f"{__name__}:sign_descent", "optimizer.args": "scale=2.0"})
  config_lib.validate_config(user)
  user.optimizer.weight_decay = 0.0
  step, _ = optim.make_optimizer(user.optimizer, 10, 100, unit_learning_rate=True).update(
      grads, optim.make_optimizer(user.optimizer, 10, 100, unit_learning_rate=True).init(params))
  np.testing.assert_array_equal(step["w"], [-2.0, -2.0, 2.0])
  for changes, match in (({"optimizer.name": "lion", "optimizer.args": "beta=1"},
                          r"'beta', which lion does not take; allowed: b1, b2"),
                         ({"optimizer.name": "lion", "optimizer.args": "weight_decay=0.1"},
                          r"sets 'weight_decay'; allowed: not learning_rate or weight_decay"),
                         ({"optimizer.name": "adamz"}, r"optimizer.name='adamz' is not an optax"),
                         ({"optimizer.name": "sgd", "optimizer.args": "momentum=0.5"},
                          r"'sgd' is built in: it takes no config.optimizer.args"),
                         ({"local.optimizer.name": "lion", "local.optimizer.args": "b1=x"},
                          r"local.optimizer.args='b1=x' is invalid at 'b1=x'")):
    with pytest.raises(ValueError, match=match):
      config_lib.validate_config(config_lib.override(config_lib.default_config(), changes))


def test_an_optax_optimizer_by_name_trains_in_the_simulator_and_the_bsp_loop(data_dir, tmp_path):
  import helpers  # pylint: disable=g-import-not-at-top
  for name, config in (
      ("gssp", helpers.cluster_config("gssp", data_dir, **{
          "optimizer.name": "nadam", "optimizer.args": "b2=0.99",
          "optimizer.learning_rate": 1e-3})),
      ("bsp", helpers.mnist_smoke(data_dir, **{"optimizer.name": "nadam",
                                               "optimizer.learning_rate": 1e-3}))):
    summary = loop.train_and_evaluate(config, str(tmp_path / name), progress=False)
    assert summary["status"] == "done", name
    assert summary["config"]["optimizer"]["name"] == "nadam"
    assert summary["final"]["test_accuracy"] > 0.2, (name, summary["final"]["test_accuracy"])


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_recorded_from_a_checkout_and_from_a_worktree_of_it(tmp_path):
  def git(*args, cwd=tmp_path / "repo"):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()
  (tmp_path / "repo").mkdir()
  git("init", "-q")
  (tmp_path / "repo" / "a.py").write_text("x = 1\n")
  git("add", "a.py")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
  head = git("rev-parse", "--short=12", "HEAD")
  git("worktree", "add", "-q", "--detach", str(tmp_path / "tree"))
  assert (tmp_path / "tree" / ".git").is_file()
  assert environment._commit(str(tmp_path / "repo")) == head
  assert environment._commit(str(tmp_path / "tree")) == head   # was None: .git is a file there
  (tmp_path / "tree" / "a.py").write_text("x = 2\n")
  assert environment._commit(str(tmp_path / "tree")) == head + "+dirty"
  assert environment._commit(str(tmp_path)) is None   # no checkout
  # An untracked file among the code makes a tree dirty; one elsewhere (notes) does not.
  (tmp_path / "repo" / "notes.md").write_text("a note\n")
  assert environment._commit(str(tmp_path / "repo")) == head
  (tmp_path / "repo" / "gssp_jax").mkdir()
  (tmp_path / "repo" / "gssp_jax" / "new.py").write_text("y = 1\n")
  assert environment._commit(str(tmp_path / "repo")) == head + "+dirty"
