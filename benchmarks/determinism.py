r"""Determinism: the same config run twice gives the same metrics and the same weights, bit for bit.

    python -m benchmarks.determinism [--config=configs/mnist_lenet5.py:smoke] [--runs=2] \
        [--config.executor=levels ...]

Each run trains the config from scratch in its own workdir (``loop.train_and_evaluate``, the
main job's code path). Compared: every metrics line (all keys but the wall-clock ones) and every
array of the served weights and model state of the last checkpoint (``load_trained``). Prints
the backend header, one line per run (a SHA-256 of the weights, the last accuracy), and either
``identical`` or the first key or array that differs with its largest difference; exits 1 then.
On a GPU this checks XLA's deterministic-ops flag, which importing ``gssp_jax`` sets
(``GSSP_DETERMINISTIC=0`` turns it off: run with it to see what the flag buys).
"""

import hashlib
import json
import os
import sys
import tempfile

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax.train import loop
from gssp_jax.train import trained as trained_lib

from benchmarks import common

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mnist_lenet5.py:smoke",
                                          "the run's config (with --config.key=value overrides)")
_RUNS = flags.DEFINE_integer("runs", 2, "runs to compare (at least 2)")
_WALL_KEYS = ("wall_time",)


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in _WALL_KEYS} for line in f]


def _arrays(workdir: str) -> dict[str, np.ndarray]:
  """Every leaf of the last checkpoint's served params and model state, by its path."""
  t = trained_lib.load_trained(workdir)
  leaves = jax.tree_util.tree_leaves_with_path({"params": t.params, "state": t.model_state})
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def digest(arrays: dict[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  for key in sorted(arrays):
    h.update(key.encode())
    h.update(np.ascontiguousarray(arrays[key]).tobytes())
  return h.hexdigest()[:16]


def first_difference(a: dict, b: dict) -> str | None:
  """The first array (sorted by path) where ``a`` and ``b`` differ, with its largest gap."""
  if sorted(a) != sorted(b):
    return f"different arrays: {sorted(set(a) ^ set(b))[:3]}"
  for key in sorted(a):
    x, y = a[key], b[key]
    if x.shape != y.shape or x.dtype != y.dtype:
      return f"{key}: shape/dtype {x.shape} {x.dtype} vs {y.shape} {y.dtype}"
    if x.tobytes() != y.tobytes():
      gap = np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))
      return f"{key}: differs, largest difference {gap:.3g}"
  return None


def metrics_difference(a: list[dict], b: list[dict]) -> str | None:
  if len(a) != len(b):
    return f"{len(a)} metrics lines vs {len(b)}"
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      keys = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
      return f"metrics line {i}: {keys[:5]} differ, e.g. {keys[0]}: {x.get(keys[0])} vs {y.get(keys[0])}"
  return None


def main(argv):
  del argv
  if _RUNS.value < 2:
    raise app.UsageError(f"--runs={_RUNS.value}: at least 2 runs are needed to compare")
  config = _CONFIG.value
  try:
    config_lib.validate_config(config)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  print(common.describe_backend())
  results = []
  with tempfile.TemporaryDirectory() as root:
    for i in range(_RUNS.value):
      workdir = os.path.join(root, f"run{i}")
      loop.train_and_evaluate(config, workdir, progress=False)
      metrics, arrays = _metrics(workdir), _arrays(workdir)
      results.append((metrics, arrays))
      print(f"run {i}: weights sha256 {digest(arrays)}, {len(metrics)} evaluations, last "
            f"accuracy {metrics[-1].get('test_accuracy')}", flush=True)
  failures = [d for metrics, arrays in results[1:]
              for d in (metrics_difference(results[0][0], metrics),
                        first_difference(results[0][1], arrays)) if d]
  print("identical" if not failures else "NOT identical: " + "; ".join(failures))
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  app.run(main)
