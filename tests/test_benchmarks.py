"""The benchmarks' own arithmetic: compile-time accounting and the determinism check's diffs."""

import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

from benchmarks import determinism
from benchmarks import sim_rates
from gssp_jax import executors

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_compile_clock_counts_union_of_nested_intervals_inside_the_span():
  clock = sim_rates.CompileClock()
  clock.intervals = [(0.0, 2.0), (1.0, 1.5), (4.0, 6.0), (9.0, 12.0), (20.0, 21.0)]
  clock.backend_ends = [1.5, 6.0, 12.0, 21.0]
  # Span [1, 10]: [1, 2] (the nested one adds nothing), [4, 6], [9, 10] -> 1 + 2 + 1 seconds.
  count, seconds = clock.between(1.0, 10.0)
  assert count == 2 and abs(seconds - 4.0) < 1e-12


def test_compile_clock_keeps_only_compile_events():
  clock = sim_rates.CompileClock()
  clock("/jax/compilation_cache/cache_retrieval_time_sec", 5.0)
  clock(sim_rates.BACKEND_COMPILE_EVENT, 0.5)
  clock("/jax/core/compile/jaxpr_trace_duration", 0.25)
  assert len(clock.intervals) == 2 and len(clock.backend_ends) == 1


def test_first_difference_names_the_array_and_its_gap():
  a = {"w": np.zeros(3, np.float32), "b": np.ones(2, np.float32)}
  assert determinism.first_difference(a, {k: v.copy() for k, v in a.items()}) is None
  b = {"w": np.array([0, 0, 1e-7], np.float32), "b": np.ones(2, np.float32)}
  assert determinism.first_difference(a, b) == "w: differs, largest difference 1e-07"
  assert "shape/dtype" in determinism.first_difference(a, {"w": np.zeros(4, np.float32),
                                                          "b": a["b"]})
  assert determinism.digest(a) == determinism.digest(dict(reversed(list(a.items()))))
  assert determinism.digest(a) != determinism.digest(b)


def test_metrics_difference_ignores_nothing_but_what_it_was_given():
  run = [{"epoch": 1.0, "test_accuracy": 0.5}]
  assert determinism.metrics_difference(run, [dict(run[0])]) is None
  assert "test_accuracy" in determinism.metrics_difference(run, [{"epoch": 1.0,
                                                                  "test_accuracy": 0.51}])
  assert determinism.metrics_difference(run, run * 2) == "1 metrics lines vs 2"


def test_flight_probe_moves_the_bytes_all_three_ways(tmp_path):
  """The Arrow Flight probe runs and prints one row per variant (a transport check, no timing)."""
  pytest.importorskip("pyarrow.flight")
  proc = subprocess.run([sys.executable, "-m", "benchmarks.flight_probe", "--mb=0.5",
                         "--rounds=1", "--reps=2"], cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line for line in proc.stdout.splitlines()
          if line.startswith("| ") and not line.startswith("| variant")]
  assert [row.split("|")[1].strip() for row in rows] == ["raw stream", "grpc copy", "flight"]
  assert rows[0].rstrip().endswith("| 1.00 |")


@pytest.mark.parametrize("executor", ["levels", "rounds"])
def test_sim_overhead_times_the_host_path_with_the_device_stubbed(data_dir, monkeypatch, executor):
  """A few hundred stubbed pushes run end to end: a positive figure, and no device call made."""
  from benchmarks import sim_overhead  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  calls = []
  stub = sim_overhead._stub

  def counting_stub(sim):
    stub(sim)
    name = "chunk_fn" if executor == "levels" else "run_steps"
    inner = getattr(sim.feed, name)
    setattr(sim.feed, name, lambda *args: (calls.append(1), inner(*args))[1])
  monkeypatch.setattr(sim_overhead, "_stub", counting_stub)
  us = sim_overhead.host_us_per_gradient("gssp", 8, executor, 200)
  assert 0 < us < 1e5 and calls   # the stub ran in place of the device


def test_sim_overhead_fingerprints_the_host_path_the_same_twice_and_tells_schemes_apart(
    data_dir, monkeypatch):
  """The fingerprint is a function of the run: the same twice; another scheme, another."""
  from benchmarks import sim_overhead  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  first = sim_overhead.fingerprint("gssp", 8, 200, {})
  assert first == sim_overhead.fingerprint("gssp", 8, 200, {})
  assert first != sim_overhead.fingerprint("gssp", 8, 200, {"sync.staleness": 0})
  assert len(first) == 16 and int(first, 16) >= 0


def test_chunk_profile_fill_counts_only_the_pieces_that_ran():
  """Jobs noted for a chunk still to come (the last pulls' at a run's end) are not counted
  against the pieces that ran."""
  from benchmarks import chunk_profile  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import chunk  # pylint: disable=g-import-not-at-top
  from tests import test_levels  # pylint: disable=g-import-not-at-top
  shape = chunk.Shape(pieces=4, jobs=3, rounds=3, arrivals=1, pulls=2, replicas=1)
  planner = test_levels._planner(shape)  # pylint: disable=protected-access
  test_levels._add_jobs(planner, [0, 1, 2])  # pylint: disable=protected-access
  planner.add_round(test_levels._round([0], [0]), 0.1)  # pylint: disable=protected-access
  test_levels._add_jobs(planner, [0])  # pylint: disable=protected-access
  planner.flush()   # piece 0 runs: 3 jobs, 1 round; worker 0's new job waits
  stats = chunk_profile.fill(types.SimpleNamespace(planner=planner, shape=shape, chunks=1))
  assert (stats["pieces"], stats["jobs_per_piece"], stats["rounds_per_piece"]) == (1, 3, 1)
  assert stats["job_fill"] == 1 and stats["round_fill"] == pytest.approx(1 / 3)


def test_chunk_profile_times_chunks_and_tables_the_traced_kernels(tmp_path, data_dir):
  """A tiny levels run: every chunk timed, slot fill in (0, 1], and the traced chunk's XLA
  work listed (on a CPU, the XLA threads' events)."""
  import helpers  # pylint: disable=g-import-not-at-top
  from benchmarks import chunk_profile  # pylint: disable=g-import-not-at-top
  config = helpers.cluster_config("gssp", data_dir, executor="levels", model="helpers:TinyCNN",
                                  levels_per_call=2)
  clock = chunk_profile.ChunkClock(skip=1, trace=1, trace_dir=str(tmp_path / "trace"))
  runner = chunk_profile.profile_run(config, clock, str(tmp_path / "run"))
  stats = chunk_profile.fill(runner)
  assert len(clock.times) == runner.chunks >= 2 and min(clock.times) > 0
  assert 0 < stats["job_fill"] <= 1 and 0 < stats["round_fill"] <= 1
  assert stats["pieces"] >= stats["chunks"]
  table = chunk_profile.kernel_table(str(tmp_path / "trace"), top=5)
  assert table and all(0 < len(rows) <= 5 for _, _, rows in table)
  assert all(ms >= 0 and n >= 1 for _, _, rows in table for ms, n, _ in rows)


def test_sim_efficiency_run_config_sets_the_level_keys_it_is_given_and_checks_them():
  """``--levels_per_call``, ``--level_job_batch`` and ``--level_job_slots`` reach the config;
  a value the config rejects is an error before any run, as ``experiments.main`` gives it."""
  config = sim_rates.run_config("lenet5", 1.0, "levels", "gssp", 16, 0.5,
                                     levels_per_call=8, job_batch=4, job_slots=12)
  assert (config.levels_per_call, config.level_job_batch, config.level_job_slots) == (8, 4, 12)
  assert config.num_workers == 16 and config.sync.scheme == "gssp"
  default = sim_rates.run_config("lenet5", 1.0, "levels", "gssp", 16, 0.5)
  assert (default.levels_per_call, default.level_job_batch, default.level_job_slots) == (0, 0, 0)
  with pytest.raises(ValueError, match="level_job_slots"):
    sim_rates.run_config("lenet5", 1.0, "levels", "gssp", 16, 0.5, job_slots=17)
  with pytest.raises(ValueError, match="level_job_slots"):
    sim_rates.run_config("lenet5", 1.0, "rounds", "gssp", 16, 0.5, job_slots=8)


def test_level_memory_measures_a_run_built_abstractly(data_dir, monkeypatch):
  """``benchmarks.level_memory``: a LeNet-5 run of 4 workers compiled, not run; its arguments
  hold the 4 workers' weights and gradients, and all slots in one vmap take more scratch."""
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  from benchmarks import level_memory  # pylint: disable=g-import-not-at-top
  one = level_memory.measure(sim_rates.run_config("lenet5", 1.0, "levels", "gssp", 4, 0.5,
                                                       job_batch=1))
  every = level_memory.measure(sim_rates.run_config("lenet5", 1.0, "levels", "gssp", 4,
                                                         0.5, job_batch=4))
  assert one["params"] == every["params"] == 61_706 and one["shape"].jobs == 4
  assert (one["job_batch"], every["job_batch"]) == (1, 4)
  assert one["arguments"] == every["arguments"] > 2 * 4 * 61_706 * 4
  assert every["temporaries"] > one["temporaries"] > 0


def test_a_local_update_push_counts_its_local_steps_as_samples():
  """The simulator benchmarks' rates: a local-update push is ``local.steps`` batches; DyLU, whose
  steps differ by worker, is refused rather than miscounted."""
  config = sim_rates.run_config("lenet5", 1.0, None, "ssp", 16, 0.5)
  assert sim_rates.samples_per_push(config) == config.batch_size
  config = sim_rates.run_config("lenet5", 1.0, None, "async_local_sgd", 16, 0.5)
  config.local.steps = 4
  assert sim_rates.samples_per_push(config) == 4 * config.batch_size
  config.local.dylu = True
  with pytest.raises(ValueError, match="local.dylu=True"):
    sim_rates.samples_per_push(config)


def test_the_serial_loop_trains_the_configs_model_one_step_per_gradient(data_dir):
  """``serial_loop``'s reference: the config's model (a user's, by file) and optimizer, one
  jitted step per gradient; its rate is positive and its config names the tiny model."""
  from benchmarks import serial_loop   # pylint: disable=g-import-not-at-top (defines flags)
  config = serial_loop.sim_config("tiny", "gssp", 4, "levels", 0.1)
  assert config.model == serial_loop.TINY_MODEL and config.executor == "levels"
  config.data_dir = data_dir
  config.data.train_size = 2048
  assert serial_loop.serial_rate(config, 0.3) > 0
  # The ceiling: the gradients alone, on weight copies or on shared weights in one vmap.
  assert serial_loop.jobs_rate(config, 0.3, 4, shared=False) > 0
  assert serial_loop.jobs_rate(config, 0.3, 4, shared=True) > 0
  # `auto` per scheme: a barrier scheme keeps rounds on this CPU, the others run levels.
  assert [executors.executor_name(serial_loop.sim_config("tiny", s, 4, "auto", 0.1),
                                  backend="cpu") for s in ("bsp", "gssp")] == ["rounds", "levels"]
