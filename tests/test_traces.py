"""Real straggler traces as a cluster (``sim/traces.py``): the per-operation Parquet format of the
straggler-analysis artifact and the CSV of iteration times, read by the documented rule, scaled,
mapped to the workers, and refused with one line when bad."""

import collections
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import traces
from gssp_jax.train import loop


def _sample(data_dir, name):
  path = os.path.join(data_dir, "stragglers", f"trace-{name}.parquet")
  if not os.path.exists(path):
    pytest.skip(f"no {path}")
  return path


def _by_the_rule(path):
  """The rule computed independently, row by row: replica d's time at step k is the largest over
  its ranks of the rank's summed forward- and backward-compute durations; steps in order."""
  rows = pq.read_table(path).to_pylist()
  summed = collections.defaultdict(float)
  for row in rows:
    if row["optype"] in ("forward-compute", "backward-compute"):
      summed[(row["dp_rank"], row["step"], row["rank"])] += row["duration"]
  replica_step = collections.defaultdict(float)
  for (d, k, _), total in summed.items():
    replica_step[(d, k)] = max(replica_step[(d, k)], total)
  replicas = sorted({d for d, _ in replica_step})
  steps = sorted({k for _, k in replica_step})
  return np.array([[replica_step[(d, k)] for d in replicas] for k in steps])


def _config(path, workers=4, **changes):
  return helpers.mnist_smoke(**{"num_workers": workers, "cluster.profile": "trace",
                                "cluster.trace_file": path, **changes})


@pytest.mark.parametrize("name,replicas,steps", [("AR", 4, 44), ("ST", 2, 32)])
def test_the_sample_traces_read_by_the_rule(data_dir, name, replicas, steps):
  path = _sample(data_dir, name)
  table = traces.read_table(path)
  expected = _by_the_rule(path)
  assert table.shape == expected.shape == (steps, replicas)
  np.testing.assert_allclose(table, expected, rtol=1e-6)
  means = table.mean(0)
  np.testing.assert_allclose(means, expected.mean(0), rtol=1e-6)
  if name == "AR":   # replica 0 is the persistent straggler, about 2.2x the others
    assert 2.0 < means[0] / means[1:].mean() < 2.5
    assert np.ptp(means[1:]) / means[1:].mean() < 0.02
  else:   # balanced replicas
    assert abs(means[0] / means[1] - 1) < 0.02


def test_relative_units_set_the_median_to_base_time_and_seconds_keep_the_trace(data_dir):
  path = _sample(data_dir, "AR")
  table = traces.read_table(path)
  relative = cluster_lib.cluster_from_config(_config(path, **{"cluster.base_time": 0.2}))
  assert np.median(relative.trace) == pytest.approx(0.2)
  np.testing.assert_allclose(relative.trace, table * (0.2 / np.median(table)), rtol=1e-12)
  assert relative.describe()["trace_scale"] == pytest.approx(0.2 / np.median(table))
  seconds = cluster_lib.cluster_from_config(_config(path, **{"cluster.trace_units": "seconds"}))
  np.testing.assert_array_equal(seconds.trace, table)
  assert seconds.compute_time(0, 44 + 3) == pytest.approx(table[3, 0])   # cycled
  # The pace of a relative trace can come from calibration (a stand-in base time validates it).
  config_lib.validate_config(_config(path, **{"cluster.calibrate": True}))


def test_a_relative_path_is_found_in_the_data_directory(data_dir, monkeypatch):
  _sample(data_dir, "ST")
  monkeypatch.chdir("/")
  config = _config("stragglers/trace-ST.parquet", workers=2)
  config.data_dir = data_dir
  assert cluster_lib.cluster_from_config(config).trace.shape == (32, 2)


def test_workers_map_to_replicas_and_more_are_refused_or_cycled(data_dir):
  path = _sample(data_dir, "ST")
  table = traces.read_table(path)
  two = cluster_lib.cluster_from_config(_config(path, workers=2, **{
      "cluster.trace_units": "seconds"}))
  np.testing.assert_array_equal(two.trace, table)
  one = cluster_lib.cluster_from_config(_config(path, workers=1, **{
      "cluster.trace_units": "seconds"}))
  np.testing.assert_array_equal(one.trace, table[:, :1])   # worker w is replica w
  with pytest.raises(ValueError, match=r"^config.cluster.trace_file='.*trace-ST.parquet' is "
                     r"invalid: 2 replica\(s\) for num_workers=4; allowed: num_workers <= 2, or "
                     r"cluster.trace_map='cycle'"):
    config_lib.validate_config(_config(path))
  cycled = cluster_lib.cluster_from_config(_config(path, workers=5, **{
      "cluster.trace_units": "seconds", "cluster.trace_map": "cycle"}))
  # 5 workers over 2 replicas: 3 copies, each started 32 // 3 = 10 iterations later.
  for w in range(5):
    np.testing.assert_array_equal(cycled.trace[:, w], np.roll(table[:, w % 2], -(w // 2) * 10))
  with pytest.raises(ValueError, match=r"config.cluster.trace_map='wrap' is invalid; allowed: "
                                       r"'replica', 'cycle'"):
    config_lib.validate_config(_config(path, workers=2, **{"cluster.trace_map": "wrap"}))
  with pytest.raises(ValueError, match=r"config.cluster.trace_units='ms' is invalid; allowed: "
                                       r"'relative', 'seconds'"):
    config_lib.validate_config(_config(path, workers=2, **{"cluster.trace_units": "ms"}))
  with pytest.raises(ValueError, match=r"config.cluster.trace_map='cycle' cannot apply with "
                                       r"cluster.profile='tiers'"):
    config_lib.validate_config(helpers.mnist_smoke(**{
        "cluster.profile": "tiers", "cluster.tiers": (1.0, 2.0), "cluster.trace_map": "cycle"}))


def _write(path, **columns):
  pq.write_table(pa.table(columns), path)
  return str(path)


_GOOD = dict(dp_rank=[0, 0, 1, 1, 0, 1], rank=[0, 0, 1, 1, 0, 1], step=[5, 5, 5, 5, 9, 9],
             optype=["forward-compute", "backward-compute"] * 2 + ["forward-compute"] * 2,
             duration=[0.1, 0.2, 0.3, 0.3, 0.1, 0.4])


def test_a_small_parquet_trace_by_hand(tmp_path):
  path = _write(tmp_path / "t.parquet", **_GOOD, start_ts=[0.0] * 6)
  np.testing.assert_allclose(traces.read_table(path), [[0.3, 0.6], [0.1, 0.4]])
  # Rows of other operations, or with no operation named, are not compute: left out.
  extra = {k: v + [v[0]] for k, v in _GOOD.items()}
  for optype in ("optimizer", None):
    extra["optype"] = _GOOD["optype"] + [optype]
    extra["duration"] = _GOOD["duration"] + [9.0]
    path = _write(tmp_path / "t2.parquet", **extra)
    np.testing.assert_allclose(traces.read_table(path), [[0.3, 0.6], [0.1, 0.4]])


@pytest.mark.parametrize("change,match", [
    ({"duration": None}, r"missing column\(s\) duration; allowed: a Parquet trace with the "
                         r"columns dp_rank, rank, step, optype, duration"),
    ({"optype": ["optimizer"] * 6}, r"no forward-compute or backward-compute rows"),
    ({"step": [5, 5, 5, 5, 9, 11]}, r"replica \(dp_rank\) 1 has no compute rows at step 9"),
    ({"duration": [0.1, 0.2, 0.3, 0.0, 0.1, 0.4]}, r"a compute operation of non-positive or non-finite duration 0.0"),
    ({"duration": [0.1, 0.2, 0.3, float("nan"), 0.1, 0.4]}, r"a compute .* duration nan"),
])
def test_a_bad_parquet_trace_is_one_line_before_anything_runs(tmp_path, change, match):
  columns = {k: v for k, v in {**_GOOD, **change}.items() if v is not None}
  path = _write(tmp_path / "bad.parquet", **columns)
  with pytest.raises(ValueError, match=r"^config.cluster.trace_file='.*bad.parquet' is invalid: "
                                       + match) as e:
    config_lib.validate_config(_config(path, workers=2))
  assert "\n" not in str(e.value)


def test_a_bad_csv_or_a_file_that_is_not_parquet_is_one_line(tmp_path):
  not_parquet = tmp_path / "x.parquet"
  not_parquet.write_text("0.1,0.2\n")
  with pytest.raises(ValueError, match=r"x.parquet' is invalid: not a Parquet file"):
    config_lib.validate_config(_config(str(not_parquet), workers=2))
  csv = tmp_path / "t.csv"
  csv.write_text("0.1,0.2\n0.1,-0.2\n")
  with pytest.raises(ValueError, match=r"a non-positive or non-finite iteration time -0.2 "
                                       r"\(iteration 1, replica 1\)"):
    config_lib.validate_config(_config(str(csv), workers=2))
  csv.write_text("a,b\n0.1,x\n")
  with pytest.raises(ValueError, match=r"t.csv' is invalid: a value that is not a number"):
    config_lib.validate_config(_config(str(csv), workers=2))
  with pytest.raises(ValueError, match=r"config.cluster.trace_file='/nonexistent.parquet' is "
                                       r"invalid; allowed: an existing CSV"):
    config_lib.validate_config(_config("/nonexistent.parquet", workers=2))


def test_a_run_on_the_straggler_trace(tmp_path, data_dir):
  """4 BSP workers on ``trace-AR``: the summary states the trace's scaled means and BSP's
  iterations each wait for the straggler (replica 0, about 2.2x), so its virtual time is at
  least the sum of the per-iteration maxima it ran."""
  path = _sample(data_dir, "AR")
  config = helpers.mnist_smoke(data_dir, num_epochs=1.0, eval_every=1.0, **{
      "num_workers": 4, "cluster.profile": "trace", "cluster.trace_file": path,
      "cluster.base_time": 0.1})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"), progress=False)
  table = traces.read_table(path) * (0.1 / np.median(traces.read_table(path)))
  np.testing.assert_allclose(summary["cluster"]["trace_mean_iteration_time"], table.mean(0),
                             rtol=1e-9)
  iterations = 512 // (4 * 32)   # one epoch
  assert summary["totals"]["virtual_time"] >= table[:iterations].max(1).sum() * (1 - 1e-9)
  assert summary["totals"]["virtual_time"] < table[:iterations].max(1).sum() * 1.2   # plus the network


def test_a_trace_run_recorded_before_trace_units_resumes_in_seconds(tmp_path):
  """A run recorded before ``cluster.trace_units`` read its trace in seconds: resuming it with
  the new default (relative) is refused, naming the key; with 'seconds' it resumes."""
  import json
  from gssp_jax.base import workdir as workdir_lib
  csv = tmp_path / "t.csv"
  csv.write_text("0.1,0.2\n")
  config = _config(str(csv), workers=2)
  recorded = json.loads(config.to_json())
  del recorded["cluster"]["trace_units"], recorded["cluster"]["trace_map"]
  assert workdir_lib.config_changes(recorded, config) == [
      ("cluster.trace_units", "seconds", "relative")]
  config.cluster.trace_units = "seconds"
  assert workdir_lib.config_changes(recorded, config) == []
  untraced = helpers.mnist_smoke()   # a run without a trace is unaffected by the new keys
  recorded = json.loads(untraced.to_json())
  del recorded["cluster"]["trace_units"], recorded["cluster"]["trace_map"]
  assert workdir_lib.config_changes(recorded, untraced) == []
