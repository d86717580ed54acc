"""A sweep's results: one row per trial, speedups against BSP, mean ± std over seeds, plots.

Numbers are read from each trial's ``summary.json`` and ``metrics.jsonl``;
nothing is recomputed, so the report says exactly what the runs recorded.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from typing import Any

_SCHEME_KEYS = ("sync.", "compress.")


def _load(trial_dir: str) -> dict | None:
  summary_path = os.path.join(trial_dir, "summary.json")
  if not os.path.exists(summary_path):
    return None
  with open(summary_path) as f:
    summary = json.load(f)
  overrides = {}
  trial_path = os.path.join(trial_dir, "trial.json")
  if os.path.exists(trial_path):
    with open(trial_path) as f:
      overrides = json.load(f)["overrides"]
  metrics = []
  metrics_path = os.path.join(trial_dir, "metrics.jsonl")
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      metrics = [json.loads(line) for line in f if line.strip()]
  return {"name": os.path.basename(trial_dir), "overrides": overrides, "summary": summary,
          "metrics": metrics}


def collect(workdir: str) -> list[dict[str, Any]]:
  """One row per trial that wrote a summary: swept values and the recorded figures."""
  rows = []
  for name in sorted(os.listdir(workdir)):
    trial = _load(os.path.join(workdir, name))
    if trial is None:
      continue
    s = trial["summary"]
    final = s.get("final") or {}
    totals = s.get("totals", {})
    metric = s.get("metric", "test_accuracy")
    rows.append({
        "trial": trial["name"], **{k: v for k, v in trial["overrides"].items()},
        "scheme": s["config"]["sync"]["scheme"], "seed": s["config"]["seed"],
        "status": s["status"], "metric": metric, "final": final.get(metric),
        "time_to_target": s.get("time_to_target"),
        "virtual_time": totals.get("virtual_time"),
        "bytes_pushed": totals.get("bytes_pushed"),
        "blocked_time": final.get("blocked_time"),
        "staleness_mean": (final.get("staleness") or {}).get("mean"),
        "_metrics": trial["metrics"], "_overrides": trial["overrides"],
    })
  _add_baselines(rows)
  return rows


def _context(row: dict) -> tuple:
  """What a trial shares with its BSP baseline: every swept value but the scheme's own keys."""
  return tuple(sorted((k, json.dumps(v)) for k, v in row["_overrides"].items()
                      if not k.startswith(_SCHEME_KEYS)))


def _add_baselines(rows: list[dict]) -> None:
  """Speedup (BSP's time to target / the trial's) and final-metric delta vs the matching BSP."""
  bsp: dict[tuple, dict] = {}
  for r in rows:   # per context, the BSP trial (uncompressed if there are several)
    if r["scheme"] == "bsp" and (_context(r) not in bsp
                                 or r["_overrides"].get("compress.name", "none") == "none"):
      bsp[_context(r)] = r
  for row in rows:
    base = bsp.get(_context(row))
    row["speedup_vs_bsp"] = (base["time_to_target"] / row["time_to_target"]
                             if base and base["time_to_target"] and row["time_to_target"]
                             else None)
    row["delta_vs_bsp"] = (row["final"] - base["final"]
                           if base and row["final"] is not None and base["final"] is not None
                           else None)


COLUMNS = ("final", "time_to_target", "speedup_vs_bsp", "delta_vs_bsp", "virtual_time",
           "bytes_pushed", "blocked_time", "staleness_mean")


def aggregate(rows: list[dict]) -> list[dict]:
  """Mean and std over seeds of every figure, per combination of the other swept values."""
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    key = tuple(sorted((k, json.dumps(v)) for k, v in row["_overrides"].items() if k != "seed"))
    groups.setdefault(key, []).append(row)
  out = []
  for key, members in groups.items():
    agg = {k: json.loads(v) for k, v in key}
    agg["seeds"] = len(members)
    for col in COLUMNS:
      values = [m[col] for m in members if m[col] is not None]
      agg[col] = statistics.fmean(values) if values else None
      agg[col + "_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
    out.append(agg)
  return out


def _fmt(value, col: str) -> str:
  if value is None:
    return "–"
  if col == "bytes_pushed":
    return f"{value / 1e9:.3f} GB"
  if col == "speedup_vs_bsp":
    return f"{value:.2f}×"
  return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_report(workdir: str, out_dir: str | None = None) -> dict[str, str]:
  """Writes ``report.md``, ``report.csv`` (per trial) and ``summary.csv`` (over seeds) and plots."""
  out_dir = out_dir or workdir
  os.makedirs(out_dir, exist_ok=True)
  rows = collect(workdir)
  if not rows:
    raise ValueError(f"no finished trial (summary.json) under {workdir}")
  swept = sorted({k for r in rows for k in r["_overrides"]})
  cols = ["trial", *swept, "status", "metric", *COLUMNS]
  paths = {"csv": os.path.join(out_dir, "report.csv"),
           "summary_csv": os.path.join(out_dir, "summary.csv"),
           "md": os.path.join(out_dir, "report.md")}
  with open(paths["csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  agg = aggregate(rows)
  agg_cols = [k for k in swept if k != "seed"] + ["seeds"] + [
      c for col in COLUMNS for c in (col, col + "_std")]
  with open(paths["summary_csv"], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=agg_cols, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(agg)
  lines = [f"# Sweep report: {workdir}", "", "## Per trial", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(_fmt(r.get(c), c) for c in cols) + " |" for r in rows]
  lines += ["", "## Mean ± std over seeds", "",
            "| " + " | ".join(agg_cols[:agg_cols.index("seeds") + 1] + list(COLUMNS)) + " |",
            "|" + "---|" * (agg_cols.index("seeds") + 1 + len(COLUMNS))]
  for a in agg:
    head = [_fmt(a.get(k), k) for k in agg_cols[:agg_cols.index("seeds") + 1]]
    body = [f"{_fmt(a[c], c)} ± {_fmt(a[c + '_std'], c)}" if a[c] is not None else "–"
            for c in COLUMNS]
    lines.append("| " + " | ".join(head + body) + " |")
  lines += ["", "Speedup: the matching BSP trial's virtual time to target divided by this "
            "trial's (same swept values but the sync/compress keys).", ""]
  for name in plot(rows, out_dir):
    lines.append(f"![{name}]({name})")
  with open(paths["md"], "w") as f:
    f.write("\n".join(lines) + "\n")
  return paths


def plot(rows: list[dict], out_dir: str) -> list[str]:
  """PNG figures, one question each; returns their file names."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = []

  def finish(fig, ax, xlabel, ylabel, title, fname, grid=True):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
      ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, fname), dpi=120)
    plt.close(fig)
    names.append(fname)

  timed = [r for r in rows if r["_metrics"] and r["_metrics"][-1].get("virtual_time") is not None]
  if timed:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in timed:
      m = r["_metrics"]
      ax.plot([x["virtual_time"] for x in m], [x.get(r["metric"]) for x in m], marker="o",
              markersize=3, label=r["trial"])
    finish(fig, ax, "virtual time (s)", timed[0]["metric"].replace("_", " "),
           "Test metric against virtual time", "metric_vs_virtual_time.png")
  hists = [r for r in timed if (r["_metrics"][-1].get("staleness") or {}).get("hist")]
  if hists:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in hists:
      h = r["_metrics"][-1]["staleness"]["hist"]
      total = max(sum(h), 1)
      ax.step(range(len(h)), [c / total for c in h], where="mid", label=r["trial"])
    finish(fig, ax, "staleness of an applied gradient (updates)", "fraction of applied gradients",
           "Staleness distribution", "staleness.png")
  for key, title, ylabel, fname in (
      ("blocked_time_per_worker", "Blocked time per worker", "blocked virtual time (s)",
       "blocked_time.png"),
      ("bytes_pushed_per_worker", "Bytes pushed per worker link", "bytes pushed",
       "bytes_per_link.png")):
    have = [r for r in timed if r["_metrics"][-1].get(key)]
    if not have:
      continue
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(have)
    for i, r in enumerate(have):
      values = r["_metrics"][-1][key]
      ax.bar([w + i * width for w in range(len(values))], values, width=width, label=r["trial"])
    finish(fig, ax, "worker", ylabel, title, fname, grid=False)
  return names
