"""Gradient compressors with per-worker error feedback: top-k, DGC and GDTopK.

Each sits in front of the aggregation step,
``optax.chain(topk(W, ...), <aggregator>, optax.sgd(...))``, takes gradients
with a leading worker axis and returns the dense *sent* gradients.
"""

from __future__ import annotations

import math

from gssp_jax import checks
from gssp_jax import defaults
from gssp_jax.compress.dgc import dgc
from gssp_jax.compress.gdtopk import gdtopk
from gssp_jax.compress.gdtopk import gdtopk_continuous_ratios
from gssp_jax.compress.gdtopk import gdtopk_group_ratios
from gssp_jax.compress.gdtopk import worker_ratios
from gssp_jax.compress.topk import expected_push_bytes
from gssp_jax.compress.topk import push_bytes
from gssp_jax.compress.topk import residual_norm
from gssp_jax.compress.topk import topk
from gssp_jax.compress.topk import TopKState

COMPRESSORS = {"topk": topk, "dgc": dgc, "gdtopk": gdtopk}


def make_compressor(name: str, num_workers: int, **kwargs):
  """Builds the compressor ``name`` ("none" gives None: no compression step).

  Raises:
    ValueError: for an unknown name, naming it and the allowed ones.
  """
  if name == "none":
    return None
  if name not in COMPRESSORS:
    raise ValueError(f"unknown compressor {name!r}; allowed: none, {', '.join(COMPRESSORS)}")
  return COMPRESSORS[name](num_workers, **kwargs)



def validate(config) -> None:
  """``config.compress.*``: a known compressor and scope, ratios in (0, 1], ``compute_time``
  finite seconds >= 0 (0 without a compressor).

  Which schemes take ``gdtopk`` the scheme registry checks (``sync.registry.validate``).

  Raises:
    ValueError: one line naming the key, its value and what is allowed.
  """
  checks.choice(config, "compress.name", defaults.COMPRESSORS)
  checks.choice(config, "compress.scope", defaults.COMPRESS_SCOPES)
  for key in ("compress.ratio", "compress.sample_ratio"):
    value = checks.get(config, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
      checks.fail(key, value, "a number in (0, 1]")
  _check_compute_time(config.compress.name, config.compress.get("compute_time", 0.0))

def _check_compute_time(name: str, seconds) -> None:
  """``compress.compute_time``: finite seconds >= 0, and 0 without a compressor (nothing to time)."""
  if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
      or not 0 <= seconds < math.inf):
    checks.fail("compress.compute_time", seconds, "a finite number of seconds >= 0")
  if seconds and name == "none":
    raise ValueError(f"config.compress.compute_time={seconds!r} cannot apply with "
                     "compress.name='none': no push is compressed; allowed: 0, or a compressor ("
                     f"{', '.join(COMPRESSORS)})")


__all__ = [
    "COMPRESSORS", "TopKState", "dgc", "expected_push_bytes", "gdtopk", "gdtopk_continuous_ratios",
    "gdtopk_group_ratios", "make_compressor", "push_bytes", "residual_norm", "topk", "validate",
    "worker_ratios",
]
