"""A researcher's own model and dataset, defined in this file, through every path a run takes.

The model is a small MLP, the dataset four Gaussian blobs in 8 dimensions given as arrays.
Named by spec (``"<this file>:TinyMLP"``), every process of a run imports them: the simulator,
a sweep of two processes, the real runtime's server and two meshes, and ``load_trained``.
"""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import data
from gssp_jax import models
from gssp_jax.train import loop
from gssp_jax.base import tasks
from gssp_jax.train import trained

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = f"{os.path.abspath(__file__)}:TinyMLP"
DATASET = f"{os.path.abspath(__file__)}:blobs"


class TinyMLP(nn.Module):
  """Any Flax classifier with the call convention: ``__call__(x, train=...)`` -> logits."""
  num_classes: int
  hidden: int = 32

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = nn.relu(nn.Dense(self.hidden)(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes)(x)


def blobs() -> data.ImageDataset:
  """Four well-separated Gaussian blobs in 8-D (float32 features, not images)."""
  rng = np.random.default_rng(0)
  centers = rng.normal(0.0, 4.0, (4, 8))

  def split(n):
    labels = rng.integers(0, 4, n)
    return (centers[labels] + rng.normal(0.0, 1.0, (n, 8))).astype(np.float32), labels

  (train_x, train_y), (test_x, test_y) = split(512), split(128)
  return data.from_arrays(train_x, train_y, test_x, test_y, name="blobs")


def user_config(scheme="gssp", **changes):
  """4 workers in two speed tiers on the blobs with the MLP (no augmentation)."""
  config = helpers.cluster_config(scheme, train_size=0, test_size=0, num_epochs=2.0,
                                  eval_every=1.0)
  config.optimizer.learning_rate = 0.05
  return config_lib.override(config, {"model": MODEL, "dataset": DATASET,
                                      "model_args": {"hidden": 32}, **changes})


def _python(args, tmp_path, timeout=420):
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  return result


@pytest.mark.parametrize("executor", ["rounds", "levels"])
def test_a_user_model_and_dataset_train_in_the_simulator_and_restore(tmp_path, executor):
  config = user_config(executor=executor)
  summary = loop.train_and_evaluate(config, str(tmp_path), progress=False)
  assert summary["status"] == "done"
  accuracy = summary["final"]["test_accuracy"]
  assert accuracy > 0.9, summary["final"]
  # The checkpoint restores the user model: its weights, as the model's own pytree whichever
  # executor's layout saved them (levels keeps one flat vector), give the run's final accuracy.
  t = trained.load_trained(str(tmp_path))
  task = tasks.make_task(t.config)
  assert isinstance(task.model, nn.Module) and type(task.model).__name__ == "TinyMLP"
  want, _ = task.init(jax.random.key(0))
  assert jax.tree.structure(t.params) == jax.tree.structure(want)
  assert task.evaluate(t.params, t.model_state)["test_accuracy"] == accuracy


def test_registered_model_and_arrays_in_one_process(tmp_path):
  models.register_model("tiny_mlp", TinyMLP)
  data.register_dataset("blob_arrays", blobs())   # the dataset object itself
  config = user_config("asp", model="tiny_mlp", dataset="blob_arrays")
  summary = loop.train_and_evaluate(config, str(tmp_path), progress=False)
  assert summary["final"]["test_accuracy"] > 0.9


@pytest.mark.slow
def test_a_sweep_of_two_processes_runs_the_user_code(tmp_path):
  sweep_file = tmp_path / "user_sweep.py"
  sweep_file.write_text(f'''
from configs import mnist_lenet5
from gssp_jax.studies.sweep import product, sweep

def get_config(arg=None):
  c = mnist_lenet5.get_config("smoke")
  c.model, c.dataset = {MODEL!r}, {DATASET!r}
  c.model_args = {{"hidden": 16}}
  c.data.train_size = c.data.test_size = 0
  c.data_dir = {os.environ.get("GSSP_DATA_DIR", "")!r}
  c.train.num_epochs, c.train.eval_every = 1.0, 1.0
  c.train.target_accuracy = 0.5
  return c

def get_sweep(arg=None):
  return product(sweep("sync.scheme", ["bsp", "asp"]))
''')
  workdir = tmp_path / "sweep"
  _python(["-m", "experiments.sweep", f"--sweep={sweep_file}", f"--workdir={workdir}",
           "--parallel=2"], tmp_path)
  trials = sorted(p for p in workdir.iterdir() if p.is_dir())
  assert len(trials) == 2
  for trial in trials:
    summary = json.loads((trial / "summary.json").read_text())
    assert summary["status"] == "done" and summary["final"]["test_accuracy"] > 0.5, summary


@pytest.mark.slow
def test_two_meshes_of_the_real_runtime_train_the_user_code(tmp_path):
  workdir = tmp_path / "real"
  _python(["-m", "experiments.launch", "--config=configs/mnist_lenet5_hetero.py:smoke",
           f"--config.model={MODEL}", f"--config.dataset={DATASET}",
           "--config.data.train_size=0", "--config.data.test_size=0",
           "--config.num_workers=2", "--config.sync.num_groups=2",
           "--config.cluster.tiers=(1.0,2.0)", "--config.cluster.base_time=0.02",
           "--config.optimizer.learning_rate=0.05", "--config.train.num_epochs=2",
           "--processes_per_mesh=1", "--config.dist.num_servers=2",
           f"--workdir={workdir}"], tmp_path)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["status"] == "done" and summary["final"]["meshes_alive"] == 2
  assert summary["final"]["test_accuracy"] > 0.8, summary["final"]
  assert summary["config"]["model"] == MODEL and summary["config"]["dataset"] == DATASET


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("changes, message", [
    ({"model": "no_such_module_xyz:Net"}, r"config.model='no_such_module_xyz:Net': cannot import"),
    ({"model": f"{os.path.abspath(__file__)}:Missing"}, r"has no 'Missing'"),
    ({"model": "lenet6"}, r"config.model='lenet6' is invalid; allowed: lenet5, .*register_model"),
    ({"dataset": "/nope/data.py:load"}, r"cannot import '/nope/data.py' \(ImportError: no file"),
    ({"dataset": "multi30k"}, r"an image-classification dataset for the user model"),
    ({"model": "seq2seq"}, r"config.dataset=.* multi30k for model 'seq2seq'"),
    ({"model_args": {"hidden": 8, "depth": 2}},
     r"config.model='.*:TinyMLP' takes no depth; allowed: .* model_args among \['hidden'\]"),
])
def test_bad_user_code_is_refused_before_anything_runs(tmp_path, changes, message):
  config = user_config(**changes)
  with pytest.raises(ValueError, match=message):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def _returns_a_list():
  return [1, 2, 3]


def test_a_loader_or_factory_that_gives_the_wrong_thing_is_named(tmp_path):
  with pytest.raises(ValueError, match=r"gave list; allowed: an ImageDataset"):
    data.load_dataset(f"{os.path.abspath(__file__)}:_returns_a_list")
  with pytest.raises(ValueError, match=r"cannot be built with \['num_classes', 'width'\]"):
    models.create_model(MODEL, num_classes=4, width=2)
  with pytest.raises(ValueError, match=r"returned list; allowed: a flax.linen Module"):
    models.create_model(f"{os.path.abspath(__file__)}:_returns_a_list")
  with pytest.raises(ValueError, match=r"data.augment=True needs images \[N, H, W, C\]"):
    tasks.make_task(user_config(**{"data.augment": True}))


@pytest.mark.parametrize("call, message", [
    (lambda: models.register_model("lenet5", TinyMLP), r"name 'lenet5' is invalid"),
    (lambda: models.register_model("My Net", TinyMLP), r"name 'My Net' is invalid"),
    (lambda: models.register_model("ok", 3), r"3 is not callable"),
    (lambda: data.register_dataset("mnist", blobs), r"name 'mnist' is invalid"),
    (lambda: data.register_dataset("ok", [1]), r"\[1\] is invalid; allowed: an ImageDataset"),
])
def test_registration_checks_its_arguments(call, message):
  with pytest.raises(ValueError, match=message):
    call()


@pytest.mark.parametrize("args, message", [
    ((np.zeros((4, 3), np.int64), np.zeros(4), np.zeros((2, 3)), np.zeros(2)), r"train_x is int64"),
    ((np.zeros((4, 3)), np.zeros(5, int), np.zeros((2, 3)), np.zeros(2, int)), r"train_y is int64 \(5,\)"),
    ((np.zeros((4, 3)), np.zeros(4, int), np.zeros((2, 5)), np.zeros(2, int)), r"test_x rows are \(5,\)"),
    ((np.zeros((4, 3)), np.array([0, 1, 2, -1]), np.zeros((2, 3)), np.zeros(2, int)), r"labels span \[-1, 3\)"),
])
def test_from_arrays_checks_shapes_dtypes_and_labels(args, message):
  with pytest.raises(ValueError, match=message):
    data.from_arrays(*args)


def test_from_arrays_standardises_by_the_training_set():
  x = np.array([[0.0, 10.0], [2.0, 30.0]], np.float32)
  ds = data.from_arrays(x, np.array([0, 1]), x, np.array([1, 0]))
  normalised = np.asarray(data.normalize_images(ds.train_images, ds.mean, ds.std))
  np.testing.assert_allclose(normalised, [[-1.0, -1.0], [1.0, 1.0]], rtol=1e-5)
  assert ds.num_classes == 2 and ds.train_labels.dtype == np.int32


def test_a_prepared_tfds_dataset_by_builder_name(tmp_path, monkeypatch):
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("array_record")
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))

  class TinyShapes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A user's TFDS dataset: 6x6 grey images, 3 classes (plain Tensor features)."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          "image": tfds.features.Tensor(shape=(6, 6, 1), dtype=np.uint8),
          "label": tfds.features.ClassLabel(num_classes=3)}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(9), "test": self._generate_examples(3)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {"image": np.full((6, 6, 1), 20 * i, np.uint8), "label": i % 3}

  TinyShapes(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
  ds = data.load_dataset("tfds:tiny_shapes")
  assert ds.train_images.shape == (9, 6, 6, 1) and ds.test_images.shape == (3, 6, 6, 1)
  assert ds.num_classes == 3 and sorted(ds.train_labels.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
  with pytest.raises(data.DataError, match=r"tfds:no_such_builder.*prepare it once"):
    data.load_dataset("tfds:no_such_builder")
