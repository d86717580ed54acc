"""A validation split (``data.validation_size``): held out of the training set, never trained on,
scored at every evaluation beside the test set, the same examples for every run."""

import json

from flax import linen as nn
import jax
import numpy as np
import pytest

import helpers
from gssp_jax import cli
from gssp_jax import config as config_lib
from gssp_jax import data as data_lib
from gssp_jax.train import loop
from gssp_jax.base import tasks
from gssp_jax.base import workdir as workdir_lib


def test_the_split_is_one_fixed_draw_disjoint_and_whole():
  train, held = tasks.split_validation(1000, 100)
  assert len(held) == 100 and len(train) == 900
  assert not np.intersect1d(train, held).size
  np.testing.assert_array_equal(np.union1d(train, held), np.arange(1000))
  assert np.all(np.diff(train) > 0) and np.all(np.diff(held) > 0)   # both in the data's order
  again, held_again = tasks.split_validation(1000, 100)
  np.testing.assert_array_equal(held, held_again)
  np.testing.assert_array_equal(train, again)
  assert held.max() > 500   # drawn over the whole set, not its first or last rows
  for size in (1000, 1001, -1):
    with pytest.raises(ValueError, match=rf"validation_size={size} is invalid; allowed: 0 "):
      tasks.split_validation(1000, size)


def _labelled_by_index(n_train=300, n_test=50):
  """A dataset whose every example carries its own index in its single feature."""
  train_x = np.arange(n_train, dtype=np.float32)[:, None]
  test_x = np.arange(n_test, dtype=np.float32)[:, None]
  return data_lib.from_arrays(train_x, np.arange(n_train) % 3, test_x, np.arange(n_test) % 3)


class _Linear(nn.Module):

  @nn.compact
  def __call__(self, x, train=False):
    del train
    return nn.Dense(3)(x.reshape(len(x), -1))


def test_held_out_examples_are_never_trained_on_and_are_scored_beside_the_test_set():
  ds = _labelled_by_index()
  model = _Linear()
  plain = tasks.ClassificationTask(model, ds, False, 64, train_size=0, test_size=0)
  assert plain.val is None and np.shares_memory(plain.train["image"], ds.train_images)
  task = tasks.ClassificationTask(model, ds, False, 64, train_size=200, test_size=0,
                                  validation_size=60)
  _, held = tasks.split_validation(300, 60)
  trained_on = set(task.train["image"][:, 0].astype(int))
  scored = set(task.val["image"][:, 0].astype(int))
  assert scored == set(held) and not trained_on & scored
  assert len(trained_on) == 200 == task.num_train   # train_size counts what is left
  params, state = task.init(jax.random.PRNGKey(0))
  metrics = task.evaluate(params, state)
  assert set(metrics) == {"test_accuracy", "test_loss", "val_accuracy", "val_loss"}
  assert set(plain.evaluate(params, state)) == {"test_accuracy", "test_loss"}


def test_a_run_recorded_before_the_validation_split_still_resumes_and_counts_as_unchanged(
    tmp_path):
  """Every run recorded before ``data.validation_size`` existed held nothing out: it resumes,
  and a sweep (the claims table's committed trials) takes it as the same config."""
  config = config_lib.default_config()
  recorded, _ = helpers.recorded_without(config, tmp_path, "data.validation_size")
  config.data.validation_size = 500
  assert workdir_lib.config_changes(recorded, config) == [("data.validation_size", 0, 500)]


def test_a_negative_validation_size_is_refused():
  config = helpers.mnist_smoke(None, **{"data.validation_size": -1})
  with pytest.raises(ValueError, match=r"data.validation_size=-1 is invalid"):
    config_lib.validate_config(config)


def test_a_validation_size_past_the_training_set_is_refused_before_training(tmp_path, data_dir):
  config = helpers.mnist_smoke(data_dir, **{"data.validation_size": 60_000})
  with pytest.raises(ValueError, match=r"validation_size=60000 is invalid; allowed: 0 \(none\)"
                     r" to 59999"):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_run_reports_validation_beside_test_and_its_validation_does_not_see_the_test_split(
    tmp_path, data_dir):
  """Every evaluation has val_* beside test_*, the final line names both, and a run whose test
  split alone differs scores its validation set identically (nothing of the test split is in
  it or in what is trained)."""
  runs = {}
  for test_size in (200, 100):
    config = helpers.cluster_config("ssp", data_dir, test_size=test_size, num_epochs=1.0,
                                    **{"data.validation_size": 500})
    workdir = str(tmp_path / f"test{test_size}")
    summary = loop.train_and_evaluate(config, workdir, progress=False)
    runs[test_size] = helpers.metric_lines(workdir)
    assert "val_accuracy" in open(f"{workdir}/log.txt").read()
    line = cli.final_line(summary, workdir)
    assert "(val_accuracy " in line and line.startswith("final test_accuracy: ")
  for lines in runs.values():
    assert lines and all({"val_accuracy", "val_loss", "test_accuracy"} <= set(m) for m in lines)
  val = lambda lines: [(m["val_accuracy"], m["val_loss"], m["train_loss"]) for m in lines]
  assert val(runs[200]) == val(runs[100])
  assert [m["test_accuracy"] for m in runs[200]] != [m["test_accuracy"] for m in runs[100]]
  with open(tmp_path / "test200" / "config.json") as f:
    assert json.load(f)["data"]["validation_size"] == 500
