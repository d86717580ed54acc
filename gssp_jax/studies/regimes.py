"""Where each scheme wins: its speedup over BSP over a grid of clusters, with intervals.

A regime study runs BSP and the schemes of :data:`SCHEMES` at fixed rates on a grid of
clusters: a **heterogeneity** axis (the ratio of the slowest speed tier to the fastest, and
the per-iteration jitter) and a **communication-to-computation ratio** axis (one dense push
over a worker's link, in units of the base iteration time). Each cell sets every scheme
against BSP in that cell, seed by seed (``studies.claims.compare``: the median speedup to the
target and its exact 95 % interval); the cell's verdict is whether the scheme is faster than
BSP there (``evidence.judge`` against 1). :func:`plot` draws one heat map per scheme.

A cell's coordinates are read from its trials' records: the tier ratio from the cluster's
speeds, the jitter from the config the run read, and the ratio from BSP's pushes in that cell
(bytes per push over the link's bandwidth, over the base time), so the figure needs nothing
from the sweep file.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Sequence

import numpy as np

from gssp_jax.studies import claims
from gssp_jax.studies import evidence

SCHEMES = (("ssp", "none"), ("gssp", "none"), ("diloco", "none"))


def coordinates(row: dict) -> tuple[float, float, str]:
  """A trial's cell: ``(tier ratio, jitter, bandwidth as JSON)`` (the last one groups; the
  ratio it makes is :func:`comm_ratio`'s)."""
  speeds = row.get("_speeds") or [1.0]
  cluster = row.get("_cluster_config") or {}
  return (round(max(speeds) / min(speeds), 3), float(cluster.get("jitter", 0.0)),
          json.dumps(cluster.get("bandwidth")))


def comm_ratio(bsp_rows: Sequence[dict]) -> float | None:
  """The cell's communication-to-computation ratio from its BSP trials: seconds of one dense
  push over the slowest worker link, over the base iteration time; None without a push."""
  for row in bsp_rows:
    pushes, pushed, base = row.get("_pushes"), row.get("bytes_pushed"), row.get("_base_time")
    bandwidth = np.min(np.asarray((row.get("_cluster_config") or {}).get("bandwidth") or 0.0))
    if pushes and pushed and base and bandwidth > 0:
      return float(pushed / pushes / bandwidth / base)
  return None


def cells(workdir: str) -> list[dict[str, Any]]:
  """Per cell and scheme: the speedup over BSP (an ``evidence.Estimate``) and the verdict.

  Raises:
    ValueError: nothing finished; two trials of one scheme, cell and seed.
  """
  by_cell: dict[tuple, dict[tuple, dict[int, dict]]] = {}
  for row in claims.counted(workdir):
    seeds = by_cell.setdefault(coordinates(row), {}).setdefault(claims.scheme_of(row), {})
    if row["seed"] in seeds:
      raise ValueError(f"{workdir}: two trials of {claims.scheme_of(row)} on seed {row['seed']} "
                       f"in one cell ({seeds[row['seed']]['trial']}, {row['trial']})")
    seeds[row["seed"]] = row
  out = []
  for (tiers, jitter, _), schemes in sorted(by_cell.items()):
    bsp = schemes.get(claims.BSP)
    ratio = comm_ratio(list(bsp.values())) if bsp else None
    for key in SCHEMES:
      if key not in schemes or bsp is None:
        continue
      comp = claims.compare(claims.of_trials(schemes[key]), claims.of_trials(bsp))
      out.append({"scheme": claims.name(key), "tier_ratio": tiers, "jitter": jitter,
                  "comm_ratio": ratio, "speedup": comp["speedup"],
                  "verdict": evidence.judge(comp["speedup"], 1.0)})
  return out


def heterogeneity(cell: dict) -> str:
  return f"{cell['tier_ratio']:g}x" + (f", jitter {cell['jitter']:g}" if cell["jitter"] else "")


def ratio_label(cell: dict) -> str:
  return "?" if cell["comm_ratio"] is None else f"{cell['comm_ratio']:.2g}"


def table_lines(found: Sequence[dict]) -> list[str]:
  """Markdown: a row per cell, a column per scheme: speedup over BSP [95 %], verdict."""
  schemes = list(dict.fromkeys(c["scheme"] for c in found))
  keys = list(dict.fromkeys((heterogeneity(c), ratio_label(c)) for c in found))
  lines = ["| heterogeneity (tier ratio, jitter) | communication / computation | "
           + " | ".join(schemes) + " |", "|---|---|" + "---|" * len(schemes)]
  for het, ratio in keys:
    row = {c["scheme"]: c for c in found if (heterogeneity(c), ratio_label(c)) == (het, ratio)}
    lines.append(f"| {het} | {ratio} | " + " | ".join(
        (f"{row[s]['speedup'].text()}x, {row[s]['verdict']}" if row[s]["speedup"] else
         "no seed compared") if s in row else "–" for s in schemes) + " |")
  return lines


def write(workdir: str, out_dir: str) -> dict[str, str]:
  """``regime_map.csv`` and ``regime_map.png`` of the study in ``workdir`` under ``out_dir``."""
  found = cells(workdir)
  os.makedirs(out_dir, exist_ok=True)
  paths = {"csv": os.path.join(out_dir, "regime_map.csv"),
           "png": os.path.join(out_dir, "regime_map.png")}
  with open(paths["csv"], "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["scheme", "tier_ratio", "jitter", "comm_ratio", "speedup_median",
                     "speedup_lo", "speedup_hi", "speedup_n", "verdict"])
    for c in found:
      est = c["speedup"].as_dict() if c["speedup"] else {}
      writer.writerow([c["scheme"], c["tier_ratio"], c["jitter"], c["comm_ratio"],
                       *(est.get(k) for k in ("median", "lo", "hi", "n")), c["verdict"]])
  plot(found, paths["png"])
  return paths


_GLYPH = {evidence.HOLDS: "faster", evidence.FAILS: "not faster", evidence.UNSURE: "?"}


def plot(found: Sequence[dict], path: str) -> str:
  """One heat map per scheme: rows heterogeneity, columns the communication ratio; the colour
  is the median speedup over BSP (log scale, white at 1), each cell annotated with its interval
  and verdict (faster than BSP, not faster, or ? where inconclusive)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import colors as mcolors  # pylint: disable=g-import-not-at-top
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  schemes = list(dict.fromkeys(c["scheme"] for c in found)) or ["(none)"]
  hets = list(dict.fromkeys(heterogeneity(c) for c in found))
  ratios = sorted(dict.fromkeys(ratio_label(c) for c in found),
                  key=lambda r: float("inf") if r == "?" else float(r))
  fig, axes = plt.subplots(1, len(schemes), figsize=(3.4 * len(schemes) + 1.2,
                                                     0.55 * max(1, len(hets)) + 1.6),
                           squeeze=False, constrained_layout=True)
  norm = mcolors.TwoSlopeNorm(vcenter=0.0, vmin=-2.0, vmax=2.0)
  for ax, scheme in zip(axes[0], schemes):
    grid = np.full((len(hets), len(ratios)), np.nan)
    for c in (c for c in found if c["scheme"] == scheme):
      i, j = hets.index(heterogeneity(c)), ratios.index(ratio_label(c))
      if c["speedup"]:
        grid[i, j] = np.clip(np.log2(max(c["speedup"].median, 1e-3)), -2, 2)
        ax.text(j, i, f"{c['speedup'].text()}\n{_GLYPH[c['verdict']]}", ha="center",
                va="center", fontsize=6)
    image = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto")
    ax.set_title(f"{scheme} over BSP", fontsize=8)
    ax.set_xticks(range(len(ratios)), ratios, fontsize=7)
    ax.set_yticks(range(len(hets)), hets, fontsize=7)
    ax.set_xlabel("communication / computation", fontsize=7)
  axes[0][0].set_ylabel("heterogeneity", fontsize=7)
  bar = fig.colorbar(image, ax=list(axes[0]), shrink=0.8)
  bar.set_ticks([-2, -1, 0, 1, 2], labels=["1/4", "1/2", "1", "2", "4"])
  bar.set_label("speedup over BSP (median)", fontsize=7)
  bar.ax.tick_params(labelsize=7)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
