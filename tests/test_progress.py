"""What a run shows and leaves behind: progress, log.txt, TensorBoard scalars, the trained model."""

import json

import pytest

from configs import mnist_lenet5
from gssp_jax import cli
from gssp_jax import config as config_lib
from gssp_jax import train
from gssp_jax import executors
from gssp_jax.base import tasks


def _small(data_dir, **changes):
  config = mnist_lenet5.get_config("smoke")
  config.data_dir = data_dir
  config.data.train_size, config.data.test_size = 512, 200
  config.train.num_epochs, config.train.eval_every = 1.0, 0.25
  return config_lib.override(config, changes)


def _metrics(workdir):
  return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def _scalars(workdir):
  from gssp_jax.train import observe  # pylint: disable=g-import-not-at-top
  return observe.read_scalars(str(workdir / "tensorboard"))


def _evaluate_loaded(workdir):
  trained = train.load_trained(str(workdir))
  task = tasks.make_task(trained.config)
  return trained, task.evaluate(trained.params, trained.model_state)


def test_a_script_run_shows_progress_logs_and_resumes_tensorboard_without_repeats(
    tmp_path, data_dir, capsys, monkeypatch):
  # Evaluations at updates 1, 2, 3, 4; a checkpoint every second one, none by time. Ctrl-C right
  # after the third evaluation was written: the resumed run redoes it from the checkpoint at 2.
  config = _small(data_dir, **{"train.checkpoint_every": 2,
                               "train.checkpoint_every_seconds": 0.0})
  progress = executors.FusedBSP.progress

  def interrupted_at_3(self, record):
    line = progress(self, record)
    if record["updates"] == 3:
      raise KeyboardInterrupt
    return line

  monkeypatch.setattr(executors.FusedBSP, "progress", interrupted_at_3)
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(config, str(tmp_path))
  shown = capsys.readouterr().out   # a plain script or a notebook cell: printed, no app.run
  assert shown.count("test_accuracy") == 2 and "ETA" in shown and "update 2/4" in shown
  assert "orbax" not in shown.lower()
  assert [s for s, _ in _scalars(tmp_path)["test_accuracy"]] == [1, 2, 3]

  monkeypatch.setattr(executors.FusedBSP, "progress", progress)
  summary = train.train_and_evaluate(config, str(tmp_path), progress=False)
  assert "test_accuracy" not in capsys.readouterr().out   # silenced
  log = (tmp_path / "log.txt").read_text()   # both sessions appended
  assert log.count("executor: fused") == 2 and "resumed from the checkpoint at update 2" in log
  # Each line once (the third's was cut by the interruption, then redone), none twice.
  assert [log.count(f"update {u}/4") for u in (1, 2, 3, 4)] == [1, 1, 1, 1]

  lines, board = _metrics(tmp_path), _scalars(tmp_path)
  assert [m["updates"] for m in lines] == [1, 2, 3, 4]
  for tag, key in (("test_accuracy", "test_accuracy"), ("train_loss", "train_loss"),
                   ("bytes_pushed", "bytes_pushed")):
    assert board[tag] == [(m["updates"], pytest.approx(m[key], rel=1e-6)) for m in lines], tag
  assert [s for s, _ in board["staleness/mean"]] == [1, 2, 3, 4]
  assert not any(tag.startswith("by_virtual_ms/") for tag in board)   # no virtual time here

  trained, results = _evaluate_loaded(tmp_path)
  assert trained.position == 4 and trained.config.num_workers == config.num_workers
  assert results["test_accuracy"] == summary["final"]["test_accuracy"]


@pytest.mark.slow
def test_a_simulated_gssp_run_logs_its_cluster_once_and_serves_the_global_model(
    tmp_path, data_dir):
  config = _small(data_dir, **{
      "num_workers": 2, "sync.scheme": "gssp", "sync.num_groups": 2,
      "sync.inter_group": "global", "cluster.speeds": (1.0, 3.0), "train.eval_every": 0.5})
  # As experiments.main and a sweep trial do: the loop must not open log.txt a second time.
  with cli.log_to_file(str(tmp_path / "log.txt")):
    summary = train.train_and_evaluate(config, str(tmp_path))
  log = (tmp_path / "log.txt").read_text().splitlines()
  header = next(i for i, line in enumerate(log) if "simulated cluster:" in line)
  progress = [i for i, line in enumerate(log) if "test_accuracy" in line]
  assert len(progress) == 2 and header < progress[0]
  assert "slowdown 1 x1, 3 x1" in log[header] and "base_time 0.05 s" in log[header]
  assert ("scheme: gssp, staleness bound 3 clocks ahead (in its group), inter-group global"
          in log[header + 1])
  assert all(" updates | ETA" in log[i] for i in progress)   # the measured figure's unit
  assert "groups: [[0], [1]]" in log[header + 1]

  lines, board = _metrics(tmp_path), _scalars(tmp_path)
  assert [s for s, _ in board["test_accuracy"]] == [m["pushes"] for m in lines]
  assert board["by_virtual_ms/test_accuracy"] == [
      (round(m["virtual_time"] * 1000), pytest.approx(m["test_accuracy"])) for m in lines]
  assert [v for _, v in board["blocked_time"]] == pytest.approx(
      [m["blocked_time"] for m in lines])

  trained, results = _evaluate_loaded(tmp_path)   # the global server's weights
  assert trained.position == summary["final"]["pushes"]
  assert results["test_accuracy"] == summary["final"]["test_accuracy"]


def test_the_eta_leaves_compilation_out_and_a_resume_starts_from_the_rate_before():
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  now = [0.0]
  clock = lambda: now[0]
  # A resumed run: 2,470 of 3,000 pushes done in 600 s before; this session compiles for 60 s.
  eta = workdir_lib.Eta(2470, (2470, 600.0), clock=clock)
  now[0] = 60.0 + 20.0   # the first report, 100 pushes after 20 s of real work
  assert abs(eta.seconds_left(2570, 3000) - 430 / (2470 / 600.0)) < 1e-6   # not 430 / (100 / 80)
  now[0] = 100.0         # then 200 more pushes in 20 s: the rate since the first report
  assert abs(eta.seconds_left(2770, 3000) - 230 / 10.0) < 1e-6
  # A fresh run has no rate before it: its first report counts from its start.
  fresh = workdir_lib.Eta(0, (0, 0.0), clock=clock)
  now[0] = 150.0
  assert abs(fresh.seconds_left(100, 300) - 200 / (100 / 50.0)) < 1e-6
