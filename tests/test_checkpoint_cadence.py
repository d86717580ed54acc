"""When a run checkpoints: by wall time (``train.checkpoint_every_seconds``), by evaluation count
(``train.checkpoint_every``), always at the end; bad values refused before anything is built."""

import json
import pathlib

import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax.studies import report
from gssp_jax import executors
from gssp_jax.train import loop
from gssp_jax.base import workdir as workdir_lib


@pytest.mark.parametrize("evaluations, every, since, every_seconds, want", [
    (1, 0, 0.0, 600.0, False),      # the defaults, early on: not yet
    (1, 0, 600.0, 600.0, True),     # 600 s since the last save
    (7, 0, 599.9, 600.0, False),
    (3, 1, 0.0, 600.0, True),       # every evaluation by count
    (4, 2, 0.0, 0.0, True),
    (3, 2, 1e6, 0.0, False),        # 0 s: never by time
    (3, 2, 700.0, 600.0, True),     # either rule suffices
    (5, 0, 1e6, 0.0, False),        # both off: the end and signals only
])
def test_should_checkpoint(evaluations, every, since, every_seconds, want):
  assert loop.should_checkpoint(evaluations, every, since, every_seconds) is want


def _config(data_dir, **changes):
  # Updates 1..4, an evaluation after each (4 workers x 32 of 512 examples, a quarter epoch
  # apart); every checkpoint kept, so the steps on disk are every save.
  return helpers.mnist_smoke(data_dir, eval_every=0.25,
                             **{"model": "helpers:TinyCNN", "train.max_checkpoints": 10,
                                **changes})


def _checkpoint_steps(workdir):
  return sorted(int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").iterdir()
                if p.name.isdigit())


@pytest.mark.parametrize("changes, steps", [
    ({}, [4]),                                           # 600 s never pass: the end only
    ({"train.checkpoint_every": 1}, [1, 2, 3, 4]),
    ({"train.checkpoint_every": 3}, [3, 4]),
    ({"train.checkpoint_every_seconds": 1e-9}, [1, 2, 3, 4]),
])
def test_a_run_checkpoints_by_count_by_time_and_at_the_end(tmp_path, data_dir, changes, steps):
  summary = loop.train_and_evaluate(_config(data_dir, **changes), str(tmp_path), progress=False)
  assert summary["totals"]["updates"] == 4   # (too short to learn: "collapsed", not "done")
  assert _checkpoint_steps(tmp_path) == steps


def test_the_wall_clock_decides_with_the_default_600_seconds(tmp_path, data_dir, monkeypatch):
  """Each evaluation takes 400 s of an injected clock: saves after the 2nd (800 s) and the 4th
  (800 s after that save), not the 1st or the 3rd (400 s since the start or the last save)."""
  now = [0.0]
  evaluate = executors.FusedBSP.evaluate

  def slow(self):
    now[0] += 400.0
    return evaluate(self)
  monkeypatch.setattr(executors.FusedBSP, "evaluate", slow)
  saves = []
  save = executors.FusedBSP.save

  def counted(self):
    saves.append(self.updates)
    save(self)
  monkeypatch.setattr(executors.FusedBSP, "save", counted)
  loop.train_and_evaluate(_config(data_dir), str(tmp_path), progress=False,
                          clock=lambda: now[0])
  assert saves == [2, 4, 4]   # the last one, the end's, finds step 4 saved already
  assert _checkpoint_steps(tmp_path) == [2, 4]


@pytest.mark.parametrize("key, value, allowed", [
    ("checkpoint_every_seconds", -1, "a finite number of wall seconds >= 0"),
    ("checkpoint_every_seconds", "600", "a finite number of wall seconds >= 0"),
    ("checkpoint_every_seconds", float("inf"), "a finite number of wall seconds >= 0"),
    ("checkpoint_every", -1, "an integer >= 0"),
    ("checkpoint_every", "1", "an integer >= 0"),
    ("checkpoint_every", 1.5, "an integer >= 0"),
])
def test_bad_cadences_are_refused_before_anything_is_built(tmp_path, key, value, allowed):
  config = helpers.mnist_smoke(None)
  with config.ignore_type():   # as a config file may set it (ml_collections makes -1 a float)
    config.train[key] = value
  with pytest.raises(ValueError, match=rf"config\.train\.{key}=\S+ is invalid; allowed: "
                     rf"{allowed}"):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_zero_turns_either_rule_off():
  config = helpers.mnist_smoke(None, **{"train.checkpoint_every": 0,
                                        "train.checkpoint_every_seconds": 0})
  config_lib.validate_config(config)
  defaults = config_lib.default_config().train
  assert (defaults.checkpoint_every, defaults.checkpoint_every_seconds) == (0, 600.0)


def test_the_cadence_may_change_on_resume_and_is_bookkeeping(tmp_path):
  """A run recorded before the key resumes; changing either key is no change of the run."""
  config = config_lib.default_config()
  recorded, path = helpers.recorded_without(config, tmp_path, "train.checkpoint_every_seconds")
  config.train.checkpoint_every_seconds = 60.0
  config.train.checkpoint_every = 5
  assert workdir_lib.config_changes(recorded, config) == []
  workdir_lib.check_resumable(config, str(path))
  other = config_lib.default_config()
  assert report.differing_keys([recorded, json.loads(config.to_json()),
                               json.loads(other.to_json())]) == []
