"""The process environment for XLA: deterministic GPU runs, per-process GPU memory shares."""

import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import helpers
from gssp_jax import xla_env

FLAG = "--xla_gpu_deterministic_ops=true"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clean_env(**extra):
  """os.environ without the variables under test, plus ``extra``."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", xla_env.OPT_OUT_VAR, *xla_env.MEM_FRACTION_VARS)}
  env.update(extra)
  return env


# ---------------------------------------------------------------- determinism


def test_deterministic_env_adds_the_flag():
  assert xla_env.deterministic_env({}) == {"XLA_FLAGS": FLAG}
  assert xla_env.deterministic_env({"XLA_FLAGS": "  "}) == {"XLA_FLAGS": FLAG}


def test_deterministic_env_keeps_the_users_flags_in_order():
  user = "--xla_dump_to=/tmp/dump --xla_force_host_platform_device_count=2"
  assert xla_env.deterministic_env({"XLA_FLAGS": user}) == {"XLA_FLAGS": f"{user} {FLAG}"}
  # The weaker flag is not the same switch: the full one is still added.
  weaker = "--xla_gpu_exclude_nondeterministic_ops=true"
  assert xla_env.deterministic_env({"XLA_FLAGS": weaker}) == {"XLA_FLAGS": f"{weaker} {FLAG}"}


@pytest.mark.parametrize("user", ["--xla_gpu_deterministic_ops=false",
                                  "--xla_gpu_deterministic_ops",
                                  "--xla_dump_to=/tmp/d -xla_gpu_deterministic_ops=true"])
def test_a_value_the_user_gave_the_flag_is_kept(user):
  assert xla_env.deterministic_env({"XLA_FLAGS": user}) == {}


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_opt_out(value):
  assert xla_env.deterministic_env({xla_env.OPT_OUT_VAR: value}) == {}
  assert not xla_env.deterministic_enabled({xla_env.OPT_OUT_VAR: value})


@pytest.mark.parametrize("value", ["1", "true", "Yes", ""])
def test_opt_in_spellings(value):
  assert xla_env.deterministic_env({xla_env.OPT_OUT_VAR: value}) == {"XLA_FLAGS": FLAG}


def test_an_invalid_opt_out_value_is_rejected():
  with pytest.raises(ValueError, match=r"GSSP_DETERMINISTIC='maybe' is invalid; allowed: "
                                       r"1/true/yes/on \(default\) or 0/false/no/off"):
    xla_env.deterministic_env({xla_env.OPT_OUT_VAR: "maybe"})


def test_apply_is_idempotent():
  environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
  assert xla_env.apply_deterministic_env(environ) == {"XLA_FLAGS": f"--xla_dump_to=/tmp/d {FLAG}"}
  before = dict(environ)
  assert xla_env.apply_deterministic_env(environ) == {}
  assert environ == before


def test_apply_warns_when_a_gpu_backend_started_first(monkeypatch, caplog):
  # The only branch a CPU cannot reach for real: pretend a CUDA backend is running.
  monkeypatch.setattr(xla_env, "_initialized_platforms", lambda: ["cpu", "cuda"])
  environ = {}
  with caplog.at_level(logging.WARNING):
    xla_env.apply_deterministic_env(environ)
  assert environ == {"XLA_FLAGS": FLAG}   # still written: child processes inherit it
  assert "may not be run-to-run deterministic" in caplog.text


def test_no_warning_when_only_a_cpu_backend_started(monkeypatch, caplog):
  jax.devices()   # the CPU backend is up in this process
  assert xla_env._initialized_platforms() == ["cpu"]
  with caplog.at_level(logging.WARNING):
    xla_env.apply_deterministic_env({})
  assert "deterministic" not in caplog.text


def test_this_test_process_has_the_flag():
  """conftest.py sets it before any backend starts, so rerun/resume tests hold on a GPU."""
  if not xla_env.deterministic_enabled(os.environ):
    pytest.skip("GSSP_DETERMINISTIC opts out")
  assert xla_env.DETERMINISTIC_FLAG in xla_env._flag_names(os.environ["XLA_FLAGS"])


def test_with_flag_appends_a_flag_once_by_its_exact_name():
  name = "xla_llvm_disable_expensive_passes"
  assert xla_env.with_flag({}, name) == {"XLA_FLAGS": f"--{name}=true"}
  assert xla_env.with_flag({"XLA_FLAGS": FLAG}, name, "false") == {
      "XLA_FLAGS": f"{FLAG} --{name}=false"}
  assert xla_env.with_flag({"XLA_FLAGS": f"--{name}=false"}, name) == {}   # the user decided
  # A flag whose name merely contains it (or a value that does) is another flag.
  other = f"--{name}_x=1 --xla_dump_to=/tmp/{name}"
  assert xla_env.with_flag({"XLA_FLAGS": other}, name) == {"XLA_FLAGS": f"{other} --{name}=true"}


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_importing_gssp_jax_sets_the_flag_before_the_backend_starts():
  code = """
      import os
      import gssp_jax
      from jax._src import xla_bridge
      assert not xla_bridge.backends_are_initialized()
      print("XLA_FLAGS=" + os.environ["XLA_FLAGS"])
      import jax.numpy as jnp
      print(float(jnp.ones(3).sum()))   # the backend starts: XLA parses XLA_FLAGS now
      """
  result = _python(code, _clean_env(XLA_FLAGS="--xla_cpu_enable_fast_math=false"))
  # XLA aborts on a flag it does not know, so a started backend also proves the name.
  assert result.returncode == 0, result.stderr
  assert f"XLA_FLAGS=--xla_cpu_enable_fast_math=false {FLAG}\n3.0\n" == result.stdout


def test_importing_gssp_jax_respects_the_opt_out():
  result = _python("import os, gssp_jax; print(os.environ.get('XLA_FLAGS'))",
                   _clean_env(GSSP_DETERMINISTIC="0"))
  assert result.returncode == 0, result.stderr
  assert result.stdout == "None\n"


# ---------------------------------------------------------------- precision


def test_highest_precision_fixture_compiles_matmuls_and_convolutions_at_float32(
    highest_precision):
  del highest_precision
  x = jnp.ones((4, 4))
  dot = jax.jit(jnp.dot).lower(x, x).as_text()
  conv = jax.jit(lambda a, k: jax.lax.conv(a, k, (1, 1), "SAME")).lower(
      jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))).as_text()
  assert "precision = [HIGHEST, HIGHEST]" in dot
  assert "precision HIGHEST" in conv and "precision DEFAULT" not in conv


# ---------------------------------------------------------------- GPU memory shares


@pytest.mark.parametrize("processes, share", [(1, 0.9), (2, 0.45), (3, 0.3), (4, 0.225),
                                              (7, 0.128)])
def test_memory_share(processes, share):
  assert xla_env.memory_share(processes) == share
  assert xla_env.memory_share(processes) * processes <= xla_env.GPU_MEMORY_TOTAL


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_memory_share_rejects_bad_counts(bad):
  with pytest.raises(ValueError, match=rf"processes={bad!r} is invalid; allowed: an int >= 1"):
    xla_env.memory_share(bad)


def test_child_env_gives_each_child_a_share_and_the_flag():
  parent = {"PATH": "/bin", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
  env = xla_env.child_env(parent, 3)
  assert env == {"PATH": "/bin", "XLA_FLAGS": f"--xla_dump_to=/tmp/d {FLAG}",
                 "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.300"}
  assert parent == {"PATH": "/bin", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}   # not modified


@pytest.mark.parametrize("name", xla_env.MEM_FRACTION_VARS)
def test_child_env_keeps_a_fraction_the_user_set(name):
  env = xla_env.child_env({name: "0.2"}, 4)
  # Only the user's variable: jaxlib refuses to start with both names set.
  assert {k: v for k, v in env.items() if k in xla_env.MEM_FRACTION_VARS} == {name: "0.2"}
  assert xla_env.user_memory_fraction(env) == (name, "0.2")


def test_child_env_respects_the_opt_out():
  env = xla_env.child_env({xla_env.OPT_OUT_VAR: "0"}, 2)
  assert env == {xla_env.OPT_OUT_VAR: "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"}


_PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
if sys.argv[1] == "gssp":
  import gssp_jax
import jax
jax.devices()
"""


def test_the_backend_probe_says_nothing_where_nothing_is_wrong():
  """jax logs "Unable to initialize backend 'tpu'" at INFO on machines without a TPU; a
  process that imported gssp_jax does not (the same process without it does: the check bites)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = {who: subprocess.run([sys.executable, "-c", _PROBE, who], capture_output=True, text=True,
                             timeout=120, env=env, check=True).stdout
         for who in ("gssp", "plain")}
  assert "Unable to initialize backend" in out["plain"]
  assert "Unable to initialize backend" not in out["gssp"]


# ---------------------------------------------------------------- compilation cache

_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_COMPILATION_CACHE_MAX_SIZE")


def test_compilation_cache_env_caches_every_program_under_a_size_cap():
  env = xla_env.compilation_cache_env({}, "/c/xla")
  assert env == {"JAX_COMPILATION_CACHE_DIR": "/c/xla",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)}   # the cap turns on jax's lock


def test_compilation_cache_env_keeps_what_the_user_set():
  user = {"JAX_COMPILATION_CACHE_DIR": "/mine", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"}
  assert xla_env.compilation_cache_env(user, "/c/xla") == {
      "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30)}


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_compilation_cache_opt_out(value):
  assert xla_env.compilation_cache_env({"GSSP_COMPILATION_CACHE": value}, "/c") == {}


def test_compilation_cache_rejects_a_bad_opt_out_value():
  with pytest.raises(ValueError, match=r"GSSP_COMPILATION_CACHE='maybe' is invalid; allowed"):
    xla_env.compilation_cache_env({"GSSP_COMPILATION_CACHE": "maybe"}, "/c")


@pytest.mark.slow
def test_a_rerun_of_the_main_job_compiles_nothing_new(tmp_path):
  """experiments.main's second run of the same config reads its programs from the cache."""
  env = _clean_env(GSSP_CACHE_DIR=str(tmp_path / "cache"), JAX_LOG_COMPILES="1",
                   GSSP_DATA_DIR=os.environ.get("GSSP_DATA_DIR",
                                                os.path.join(REPO, "..", "shared", "data")))
  for name in (*_CACHE_VARS, xla_env.CACHE_OPT_OUT_VAR):   # conftest turns it off for the suite
    env.pop(name, None)
  logs = []
  for run in range(2):
    result = subprocess.run(
        [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
         "--config.train.num_epochs=0.5", f"--workdir={tmp_path / f'run{run}'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logs.append(result.stderr)
  assert any((tmp_path / "cache" / "xla").iterdir())
  # jax logs "Finished XLA compilation" for every program it needs, a cache hit too.
  programs = [log.count("Finished XLA compilation of") for log in logs]
  hits = [log.count("Persistent compilation cache hit") for log in logs]
  assert hits[0] == 0 and programs[0] > 10, (hits, programs)
  # The rerun needs the same programs and reads (nearly) all of them from the cache.
  assert programs[1] == programs[0] and hits[1] >= 0.9 * programs[1], (hits, programs)


@pytest.mark.slow
def test_the_suites_faster_compilation_computes_the_same_bits(tmp_path, data_dir):
  """tests/conftest.py compiles every test process's programs without LLVM's expensive passes
  (``--xla_llvm_disable_expensive_passes``): that changes how fast XLA:CPU compiles, not what
  the programs compute. The main job's smoke run (LeNet-5, half an epoch) records the same
  evaluations, every loss to the bit, with the flag and with XLA's default codegen (the codegen
  users run; each compiled afresh, no cache). Checked once by hand on the hetero GSSP and the
  ResNet-18 smoke configs too (2026-11-28: identical metrics, docs/log/performance-2026-11.md)."""
  runs = []
  for flags in ("", "--xla_llvm_disable_expensive_passes=true"):
    env = _clean_env(XLA_FLAGS=flags, GSSP_DATA_DIR=data_dir, GSSP_CACHE_DIR=str(tmp_path / "c"))
    for name in _CACHE_VARS:
      env.pop(name, None)
    workdir = str(tmp_path / f"run{len(runs)}")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.main", "--config=configs/mnist_lenet5.py:smoke",
         "--config.train.num_epochs=0.5", "--config.train.eval_every=0.25",
         f"--workdir={workdir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs.append(helpers.metric_lines(workdir))
  assert len(runs[0]) == 2 and runs[0][-1]["epoch"] == 0.5 and "test_loss" in runs[0][-1]
  assert runs[0] == runs[1]
