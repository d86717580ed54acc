"""A run's length and learning-rate schedule in virtual seconds (``train.virtual_budget``): every
event before the budget runs and none at or after it, the final evaluation is stamped at the
budget, and each round's rate is the schedule at its virtual time over the budget; in the
simulator (both runners) and in the real runtime fed the simulator's events. Evaluations at
multiples of ``train.eval_every_seconds``. Bad values and settings refused before anything runs."""

import json
import math

import numpy as np
import pytest

import dist_replay
import helpers
from gssp_jax import config as config_lib
from gssp_jax.train import loop
from gssp_jax.base import optim
from gssp_jax.base import workdir as workdir_lib

BUDGET = 0.4   # virtual seconds: about two epochs of the slow tier (4 iterations of 0.125 s each)


def _config(data_dir, scheme="ssp", **changes):
  """4 workers in tiers (1, 2.5) on 512 MNIST examples, TinyCNN, the budget; epochs cap at 8.
  The smoke config's schedule is cosine (``configs/mnist_lenet5.py``)."""
  return helpers.cluster_config(scheme, data_dir, model="helpers:TinyCNN", num_epochs=8.0,
                                **{"train.virtual_budget": BUDGET, **changes})


def _run_recording_rates(config, workdir):
  """Runs ``config`` as the loop does; returns ``[(round time, its learning rate)]`` and the
  executor. Each round's rate is what the simulator hands its device runner."""
  executor = loop.build_run(config, workdir)
  rates, add = [], executor.feed.add
  def recording_add(rnd, learning_rate, *args):
    if rnd is not None:   # the first jobs, dispatched before any round
      rates.append((rnd.time, learning_rate))
    return add(rnd, learning_rate, *args)
  executor.feed.add = recording_add
  executor.restore()
  while not executor.finished():
    if executor.advance():
      executor.evaluate()
  executor.close()
  return rates, executor


def test_the_schedule_follows_virtual_time_over_the_budget(tmp_path, data_dir):
  """Cosine: each round's rate is ``peak (1 + cos(pi t / B)) / 2`` at its time ``t``, hand-computed
  in float64 (the run's is float32); so a round at the budget's middle gets half the peak."""
  peak = 0.05
  config = _config(data_dir, **{"optimizer.schedule": "cosine",
                                "optimizer.learning_rate": peak})
  rates, _ = _run_recording_rates(config, str(tmp_path / "run"))
  times = np.array([t for t, _ in rates])
  got = np.array([lr for _, lr in rates], np.float64)
  assert len(rates) > 8 and times.max() < BUDGET and times.max() > 0.8 * BUDGET
  expected = peak * 0.5 * (1 + np.cos(np.pi * times / BUDGET))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert np.all(np.diff(got) <= 0) and got[0] > 0.9 * peak and got[-1] < 0.05 * peak
  half = optim.VirtualTimeSchedule(config.optimizer, BUDGET)
  assert half(BUDGET / 2) == np.float32(peak / 2) and half(2 * BUDGET) == 0.0
  assert half(0.0) == np.float32(peak)


def test_a_warm_up_in_virtual_seconds_then_the_schedule_over_the_rest(tmp_path, data_dir):
  """``optimizer.warmup_seconds = w``: linear from 0 to the peak over ``[0, w)``, then cosine
  over ``(t - w) / (B - w)``, as the epochs' warm-up is followed by cosine over the other steps."""
  peak, w = 0.05, 0.1
  config = _config(data_dir, **{"optimizer.schedule": "cosine", "optimizer.learning_rate": peak,
                                "optimizer.warmup_seconds": w})
  rates, _ = _run_recording_rates(config, str(tmp_path / "run"))
  times = np.array([t for t, _ in rates])
  got = np.array([lr for _, lr in rates], np.float64)
  expected = np.where(times < w, peak * times / w,
                      peak * 0.5 * (1 + np.cos(np.pi * (times - w) / (BUDGET - w))))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert (times < w).sum() >= 2 and (times >= w).sum() >= 4
  schedule = optim.VirtualTimeSchedule(config.optimizer, BUDGET)
  assert schedule(w / 2) == np.float32(peak / 2) and schedule(w) == np.float32(peak)
  assert schedule((w + BUDGET) / 2) == np.float32(peak / 2)


def test_a_constant_schedule_under_a_budget_is_the_rate_itself(tmp_path, data_dir):
  config = _config(data_dir, "asp", **{"optimizer.schedule": "constant"})
  rates, _ = _run_recording_rates(config, str(tmp_path / "run"))
  assert len(rates) > 8 and {float(lr) for _, lr in rates} == {float(np.float32(0.05))}


def test_the_run_stops_at_the_budget_with_its_final_evaluation_there(tmp_path, data_dir):
  """Evaluations every ``eval_every`` epochs of data as without a budget, then one stamped at the
  budget; every push before it counted, none after; the summary records the budget."""
  workdir = str(tmp_path / "run")
  summary = loop.train_and_evaluate(_config(data_dir, eval_every=0.5), workdir, progress=False)
  lines = helpers.metric_lines(workdir)
  assert summary["status"] == "done"
  assert lines[-1]["virtual_time"] == BUDGET == summary["totals"]["virtual_time"]
  assert all(m["virtual_time"] < BUDGET for m in lines[:-1]) and len(lines) >= 3
  assert lines[-1]["epoch"] < 8.0   # the budget ended it, not the epochs' cap
  assert summary["virtual_budget"] == {"seconds": BUDGET, "ended_at": BUDGET, "reached": True}
  with open(f"{workdir}/config.json") as f:
    assert json.load(f)["train"]["virtual_budget"] == BUDGET


def test_a_budget_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path, data_dir):
  """Stopped between evaluations (``train.stop_after_updates``), resumed: the same metric lines
  and the same end (the schedule reads only the rounds' times, the stop only the timeline)."""
  config = _config(data_dir, "gssp", eval_every=0.5, **{"train.eval_every_seconds": 0.07})
  whole = loop.train_and_evaluate(config, str(tmp_path / "whole"), progress=False)
  config.train.stop_after_updates = 13
  first = loop.train_and_evaluate(config, str(tmp_path / "split"), progress=False)
  assert first["status"] == "stopped" and first["virtual_budget"]["reached"] is False
  config.train.stop_after_updates = 0
  summary = loop.train_and_evaluate(config, str(tmp_path / "split"), progress=False)
  assert summary["status"] == "done"
  assert helpers.metric_lines(tmp_path / "split") == helpers.metric_lines(tmp_path / "whole")
  assert summary["virtual_budget"] == whole["virtual_budget"]
  assert summary["totals"]["pushes"] == whole["totals"]["pushes"]


def test_evaluations_every_n_virtual_seconds_are_stamped_there(tmp_path, data_dir):
  """``train.eval_every_seconds``: an evaluation at every multiple of it (every event before it
  run), beside the epochs' ones, and the final one at the budget."""
  workdir = str(tmp_path / "run")
  config = _config(data_dir, eval_every=8.0, **{"train.eval_every_seconds": 0.1})
  loop.train_and_evaluate(config, workdir, progress=False)
  times = [m["virtual_time"] for m in helpers.metric_lines(workdir)]
  assert times == [0.1, 0.2, 0.30000000000000004, BUDGET]   # k * 0.1, never a running sum
  config = _config(data_dir, eval_every=0.5, **{"train.eval_every_seconds": 0.15})
  loop.train_and_evaluate(config, str(tmp_path / "both"), progress=False)
  lines = helpers.metric_lines(tmp_path / "both")
  assert {0.15, 0.3, BUDGET} <= {m["virtual_time"] for m in lines}
  assert {0.5, 1.0} <= {m["epoch"] for m in lines}   # the epochs' points still come


def test_the_levels_runner_stops_at_the_budget_with_the_same_rates(tmp_path, data_dir):
  """The level-batched runner gets each round's rate from the same host code: same rounds, same
  rates, same end as the per-round runner."""
  runs = {}
  for runner in ("rounds", "levels"):
    config = _config(data_dir, "ssp", executor=runner)
    runs[runner] = _run_recording_rates(config, str(tmp_path / runner))
  (rates, sim), (level_rates, level_sim) = runs["rounds"], runs["levels"]
  assert level_rates == rates and level_sim.engine.now == sim.engine.now == BUDGET
  assert level_sim.engine.num_pushes == sim.engine.num_pushes


@pytest.mark.parametrize("ending", ["push", "clock"])
def test_the_runtime_fed_the_simulators_events_is_the_simulator_and_stops_at_the_budget(
    tmp_path, data_dir, ending):
  """The real runtime's control plane and shard, driven by the simulator's events (its clock the
  events' virtual times, ``dist_replay``): the same learning rates (the same weights and optimizer
  state, bit for bit). Then the run ends at the budget, by the next push (at the budget: not
  applied, answered stop) or by its clock passing the budget with no event (the server's wait
  loop); its final evaluation is stamped at the budget."""
  config = _config(data_dir, "ssp")   # cosine: every round's rate differs
  sim = dist_replay.simulate_events(config, str(tmp_path / "sim"))
  assert sim.engine.now == BUDGET and sim.engine.num_pushes >= 16
  run = dist_replay.RealRun(config, str(tmp_path / "real"), 1)
  try:
    run.replay(sim.engine.events)
    srv = run.srv
    want = dist_replay.expected_shard_state(sim.state, srv.treedefs[0], srv.treedefs[1],
                                            srv.layout, 0)
    assert not dist_replay.differences(run.cores()[0].state, want)
    assert srv.core.book.host["pushes"] == sim.engine.num_pushes and not srv.core.done
    if ending == "push":
      run.clock.now = BUDGET
      run.push(next(w for w, grad in enumerate(run.pending) if grad is not None),
               expect_stop=True)
    else:
      srv.evaluate()   # an evaluation before the budget (moves the next evaluation point on)
      assert not srv.finished()
      run.clock.now = BUDGET + 0.01
      assert srv.advance()
    assert srv.core.done and srv.core.book.host["pushes"] == sim.engine.num_pushes
    record = srv.evaluate()
    assert record["virtual_time"] == BUDGET and srv.finished() and srv.completed()
    assert srv.progress(record).endswith("| ETA 0m00s")   # the budget's end, not the epochs'
    assert srv.summary_fields([], None)["virtual_budget"] == {
        "seconds": BUDGET, "ended_at": BUDGET, "reached": True}
  finally:
    run.close()


def test_no_event_at_or_past_the_budget_runs(tmp_path, data_dir):
  """The timeline stops with its next event at or past the budget and every earlier one run."""
  rates, executor = _run_recording_rates(_config(data_dir, "gssp"), str(tmp_path / "run"))
  engine = executor.engine
  assert engine.next_time() >= BUDGET and engine.now == BUDGET
  assert all(t < BUDGET for t, _ in rates)
  assert executor.finished() and executor.completed()


def test_without_a_budget_the_schedule_still_follows_epochs(tmp_path, data_dir):
  """``virtual_budget`` 0 is the run as before: the epochs' table, the epochs' end."""
  config = _config(data_dir, **{"train.virtual_budget": 0.0, "optimizer.schedule": "cosine"})
  config.train.num_epochs = 1.0
  executor = loop.build_run(config, str(tmp_path / "run"))
  assert isinstance(executor.schedule, optim.LearningRateTable)
  executor.close()
  assert executor.summary_fields([], None)["virtual_budget"] is None


@pytest.mark.parametrize("key", ["virtual_budget", "eval_every_seconds"])
@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf, "600"])
def test_bad_virtual_seconds_are_refused(key, seconds):
  """(ml_collections makes a bool a float on these float keys, as it does an int.)"""
  config = helpers.cluster_config("ssp")
  with config.ignore_type():
    config.train[key] = seconds
  with pytest.raises(ValueError, match=rf"config.train.{key}=.* is invalid; allowed: a "
                     r"finite number of virtual seconds >= 0 \(0 = off"):
    config_lib.validate_config(config)


@pytest.mark.parametrize("changes, match", [
    ({}, r"config.executor='auto' \(runs as 'fused'\) cannot go with config.train.virtual_budget"
         r"=600.0: BSP without a cluster .* allowed: a simulated cluster"),
    ({"executor": "dist", "sync.scheme": "ssp", "train.eval_every_seconds": 5.0},
     r"config.executor='dist' \(runs as 'dist'\) cannot go with "
     r"config.train.eval_every_seconds=5.0: the real runtime evaluates at pushes"),
    ({"train.virtual_budget": 0.0, "train.eval_every_seconds": 5.0},
     r"config.executor='auto' \(runs as 'fused'\) cannot go with "
     r"config.train.eval_every_seconds=5.0: BSP without a cluster"),
    ({"sync.scheme": "ssp", "optimizer.warmup_epochs": 0.5},
     r"config.optimizer.warmup_epochs=0.5 cannot go with config.train.virtual_budget=600.0; "
     r"allowed: 0 \(a warm-up is counted in epochs; optimizer.warmup_seconds counts virtual "
     r"seconds\), or virtual_budget=0"),
    ({"sync.scheme": "ssp", "train.virtual_budget": 0.0, "optimizer.warmup_seconds": 5.0},
     r"config.optimizer.warmup_seconds=5.0 needs train.virtual_budget > 0"),
    ({"sync.scheme": "ssp", "optimizer.warmup_seconds": 600.0},
     r"config.optimizer.warmup_seconds=600.0 is invalid with train.virtual_budget=600.0; "
     r"allowed: fewer seconds than the budget"),
    ({"sync.scheme": "ssp", "optimizer.warmup_seconds": -1.0},
     r"config.optimizer.warmup_seconds=-1.0 is invalid; allowed: a finite number"),
    ({"sync.scheme": "local_sgd", "optimizer.warmup_seconds": 5.0},
     r"warmup_seconds=5.0 cannot go with sync.scheme='local_sgd'"),
    ({"sync.scheme": "diloco", "local.optimizer.schedule": "cosine"},
     r"config.local.optimizer.schedule='cosine' cannot go with config.train.virtual_budget=600.0;"
     r" allowed: 'constant'"),
])
def test_a_budget_with_a_setting_it_cannot_go_with_is_refused(changes, match):
  config = helpers.mnist_smoke(None, **{"train.virtual_budget": 600.0, **changes})
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_a_budget_goes_with_the_simulator_and_the_real_runtime():
  for executor in ("rounds", "levels", "dist"):
    config_lib.validate_config(helpers.mnist_smoke(
        None, **{"train.virtual_budget": 600.0, "executor": executor, "sync.scheme": "ssp"}))


def test_a_budget_is_refused_before_anything_is_built(tmp_path):
  config = helpers.mnist_smoke(None, **{"train.virtual_budget": 600.0})
  with pytest.raises(ValueError, match=r"virtual_budget=600.0"):
    loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


def test_a_run_recorded_before_the_budget_still_resumes_and_counts_as_unchanged(tmp_path):
  config = config_lib.default_config()
  recorded, path = helpers.recorded_without(config, tmp_path, "train.virtual_budget",
                                            "train.eval_every_seconds",
                                            "optimizer.warmup_seconds")
  config.train.virtual_budget = 600.0
  assert workdir_lib.config_changes(recorded, config) == [("train.virtual_budget", 0.0, 600.0)]
  with pytest.raises(ValueError, match=r"train.virtual_budget: 0.0 -> 600.0"):
    workdir_lib.check_resumable(config, str(path))
