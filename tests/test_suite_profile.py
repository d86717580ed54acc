"""``benchmarks/suite_profile.py``: a pytest plugin that says where the suite's time goes."""

import csv
import os
import subprocess
import sys

import pytest

from benchmarks import suite_profile
from tests.conftest import REPO

_TESTS = '''
import jax
import jax.numpy as jnp


def test_compiles():
  jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(5.0)).block_until_ready()


def test_sleeps_and_compiles_nothing():
  import time
  time.sleep(0.3)
'''


def test_the_profile_times_each_test_and_its_compilations(tmp_path):
  (tmp_path / "test_tiny.py").write_text(_TESTS)
  path = tmp_path / "profile.csv"
  # No persistent cache (the session's is in the environment): a program read from it is not
  # compiled, and the test's program must be.
  env = {**{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
         suite_profile.ENV: str(path), "PYTHONPATH": str(REPO)}
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_profile",
       "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  with open(f"{path}.main", newline="") as f:
    rows = {r["test"].split("::")[1]: r for r in csv.DictReader(f)}
  assert set(rows) == {"test_compiles", "test_sleeps_and_compiles_nothing"}
  assert float(rows["test_compiles"]["compile_seconds"]) > 0
  assert float(rows["test_sleeps_and_compiles_nothing"]["compile_seconds"]) == 0
  assert float(rows["test_sleeps_and_compiles_nothing"]["seconds"]) >= 0.3
  text = suite_profile.summarize(str(path))
  assert text.startswith("2 tests, ") and "main: busy until" in text
  assert "test_tiny.py::test_sleeps_and_compiles_nothing" in text
  merged = tmp_path / "merged.csv"   # one CSV, as committed under results/suite
  suite_profile.merge(str(path), str(merged))
  assert merged.read_text().startswith("worker,start,seconds,")
  assert suite_profile.summarize(str(merged)) == text


def test_without_its_variable_the_profile_writes_nothing(tmp_path):
  (tmp_path / "test_tiny.py").write_text(_TESTS)
  env = {k: v for k, v in os.environ.items() if k != suite_profile.ENV}
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_profile",
       "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py"),
       "-k", "sleeps"], cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)},
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "1 passed" in proc.stdout
  assert not [n for n in os.listdir(tmp_path) if n.startswith("profile")]
  with pytest.raises(SystemExit, match="no rows in .*profile.csv"):
    suite_profile.summarize(str(tmp_path / "profile.csv"))
