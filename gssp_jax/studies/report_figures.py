"""The sweep report's figures: one small function per figure, each drawn from a plain table.

Every figure has a pure helper that builds what it draws (``metric_curves``,
``time_to_target_table``, ``staleness_table``, ``per_worker_table``), so what a
figure shows is tested without looking at pixels. Conventions, the same in
every figure:

* one colour per configuration (the trials that differ only in the seed);
* spreads over seeds are min–max ranges, drawn as bands or error bars that
  never leave the axes (a std bar can run below zero; a range cannot);
* a figure with nothing to draw (no trial reached the target) is still
  written, saying so in words, and the reason comes back as a note for
  ``report.md`` and a warning.
"""

from __future__ import annotations

import math
import os
import statistics
import warnings

import numpy as np

from gssp_jax.studies import report_labels

# More distinct slowdown factors than this (e.g. a log-normal cluster) get a colour bar
# instead of one legend entry each.
_MAX_TIER_LEGEND = 8


def _configs(rows: list[dict]) -> dict[str, list[dict]]:
  """The trials of each configuration (legend label), in the rows' order."""
  out: dict[str, list[dict]] = {}
  for r, lab in zip(rows, report_labels.short_labels(rows)):
    out.setdefault(lab, []).append(r)
  return out


def _last(row: dict) -> dict:
  return row["_metrics"][-1] if row.get("_metrics") else {}


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def timed_series(metrics: list[dict], metric: str) -> np.ndarray:
  """A trial's ``[N, 2]`` (virtual time, ``metric``) evaluations in time order, those with both
  finite; ``[0, 2]`` if none."""
  pts = sorted((m["virtual_time"], m[metric]) for m in metrics
               if _finite(m.get("virtual_time")) and _finite(m.get(metric)))
  return np.asarray(pts, np.float64).reshape(-1, 2)


def metric_curves(rows: list[dict], metric: str) -> list[dict]:
  """Per configuration: ``metric`` against virtual time, mean and min–max over seeds.

  Seeds are evaluated at different virtual times, so each seed is interpolated
  linearly onto the union of the seeds' evaluation times, within the span that
  every seed covers (no seed is extrapolated).

  Returns:
    dicts with ``label``, ``seeds``, and ``[T]`` arrays ``time``, ``mean``,
    ``lo``, ``hi``; configurations without a timed evaluation are left out.
  """
  out = []
  for lab, members in _configs(rows).items():
    series = [s for s in (timed_series(r["_metrics"], metric) for r in members) if len(s)]
    if not series:
      continue
    start, end = max(s[0, 0] for s in series), min(s[-1, 0] for s in series)
    t = np.unique(np.concatenate([s[:, 0] for s in series]))
    t = t[(t >= start) & (t <= end)]
    ys = np.stack([np.interp(t, s[:, 0], s[:, 1]) for s in series])
    out.append({"label": lab, "seeds": len(series), "time": t, "mean": ys.mean(0),
                "lo": ys.min(0), "hi": ys.max(0)})
  return out


def _baselines(configs: dict[str, list[dict]]) -> dict[tuple, str]:
  """Per context (see ``report_labels.context``), the label of its BSP configuration (uncompressed
  where there are several)."""
  bsp: dict[tuple, str] = {}
  for lab, members in configs.items():
    r = members[0]
    ctx = report_labels.context(r, r.get("_tuned", ()))
    if r["scheme"] == "bsp" and (ctx not in bsp
                                 or r["_overrides"].get("compress.name", "none") == "none"):
      bsp[ctx] = lab
  return bsp


def time_to_target_table(rows: list[dict]) -> list[dict]:
  """Per configuration, what the time-to-target and final-metric panels draw.

  The bar is the mean time over the seeds that reached the target (a
  collapsed or diverged seed never does); ``speedup`` is the statistic of
  report.md's speedup table: the median over seeds of BSP's time with the same
  seed divided by this trial's (``speedup_vs_bsp``), over the ``speedup_n``
  seeds where both reached the target. A ratio of the two bars' means would
  disagree with that table when the seeds differ (BSP's bar averaging 2 seeds
  and another's holding 1 once showed "1.07× faster" beside a table's 0.76×). The label
  prints the table's figure itself (:func:`speedup_text`).

  Returns:
    dicts with ``label``, ``scheme``, ``seeds``, ``times`` (one per seed that
    reached), ``reached``, ``mean``, ``lo``, ``hi`` (None when none reached),
    ``baseline`` (the BSP label or None), ``speedup`` (None without a seed
    where both reached), ``speedup_n``, ``finals`` (finite final metrics),
    ``final``, ``final_lo``, ``final_hi``.
  """
  configs = _configs(rows)
  bsp = _baselines(configs)
  table = []
  for lab, members in configs.items():
    times = [r["time_to_target"] for r in members if r["time_to_target"] is not None]
    finals = [r["final"] for r in members if _finite(r["final"])]
    ctx = report_labels.context(members[0], members[0].get("_tuned", ()))
    speedups = [r["speedup_vs_bsp"] for r in members if r.get("speedup_vs_bsp") is not None]
    table.append({
        "speedup": statistics.median(speedups) if speedups else None,
        "speedup_n": len(speedups),
        "label": lab, "scheme": members[0]["scheme"], "seeds": len(members), "times": times,
        "reached": len(times), "mean": statistics.fmean(times) if times else None,
        "lo": min(times) if times else None, "hi": max(times) if times else None,
        "baseline": bsp.get(ctx), "finals": finals,
        "final": statistics.fmean(finals) if finals else None,
        "final_lo": min(finals) if finals else None, "final_hi": max(finals) if finals else None})
  return table


COMPACT_LABELS_ABOVE = 4   # bars per figure beyond which their labels are short (5 overlapped)


def speedup_text(speedup: float, baseline: str = "BSP", seeds: int = 1,
                 compact: bool = False) -> str:
  """A bar's label: the median per-seed speedup against ``baseline`` over ``seeds`` seeds, as
  report.md's table prints it (``0.59× vs BSP``, never its inverse), and which way it goes.

  ``compact``: one short word per line (``0.59×``, ``slower``), for a figure with many bars
  whose title names the baseline and the median.
  """
  shown = f"{speedup:.2f}"   # the table's figure, so the two read the same
  way = "as fast" if shown == "1.00" else ("faster" if speedup > 1 else "slower")
  if compact:
    return f"{shown}×\n{way}"
  over = f"; median, {seeds} seeds" if seeds > 1 else ""
  return f"{shown}× vs {baseline}\n({way}{over})"


def staleness_table(rows: list[dict]) -> list[dict]:
  """Per configuration, every one (BSP's all-zero staleness included), the staleness
  histogram of the applied gradients at the last evaluation, pooled over seeds.

  Returns:
    dicts with ``label``, ``fractions`` (``[S+1]`` fractions of the applied
    gradients with staleness 0..S; None where no seed recorded a histogram),
    ``applied`` and ``mean``.
  """
  table = []
  for lab, members in _configs(rows).items():
    hists = [np.asarray(h, np.float64) for r in members
             if (h := (_last(r).get("staleness") or {}).get("hist"))]
    if not hists:
      table.append({"label": lab, "fractions": None, "applied": 0, "mean": None})
      continue
    pooled = np.zeros(max(h.size for h in hists))
    for h in hists:
      pooled[:h.size] += h
    total = pooled.sum()
    fractions = pooled / total if total else pooled
    table.append({"label": lab, "fractions": fractions, "applied": int(total),
                  "mean": float(np.dot(np.arange(pooled.size), fractions)) if total else None})
  return table


def per_worker_table(rows: list[dict], key: str) -> list[dict]:
  """Per configuration, the per-worker figure ``key`` at the last evaluation, mean over seeds,
  with each worker's slowdown factor (``summary.json``'s ``cluster.speeds``).

  Returns:
    dicts with ``label``, ``seeds``, ``values`` (``[W]``) and ``speeds``
    (``[W]``, or None where the run did not record them); configurations
    without ``key`` are left out.
  """
  table = []
  for lab, members in _configs(rows).items():
    have = [r for r in members if _last(r).get(key)]
    if not have:
      continue
    size = len(_last(have[0])[key])
    values = np.mean([_last(r)[key] for r in have if len(_last(r)[key]) == size], axis=0)
    speeds = have[0].get("_speeds")
    table.append({"label": lab, "seeds": len(have), "values": values,
                  "speeds": (np.asarray(speeds, np.float64)
                             if speeds is not None and len(speeds) == size else None)})
  return table


def _save(fig, out_dir: str, fname: str) -> str:
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, fname), dpi=150)
  plt.close(fig)
  return fname


def _say(ax, text: str) -> None:
  """Writes ``text`` across an empty panel instead of a plot."""
  ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, fontsize=10,
          transform=ax.transAxes)
  ax.set_xticks([])
  ax.set_yticks([])


def _metric_name(metric: str) -> str:
  return metric.replace("_", " ")


def plot_metric(curves: list[dict], color: dict, metric: str, target, out_dir: str) -> str:
  """The metric against virtual time: a line per configuration (mean over seeds) with its
  min–max band; for accuracies that come near the target a second panel zooms in on it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  top = max((float(c["hi"].max()) for c in curves if c["hi"].size), default=-math.inf)
  zoom = metric == "test_accuracy" and target and top >= target - 0.02
  fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(12 if zoom else 8, 4.8), squeeze=False)
  seeds = max(c["seeds"] for c in curves)
  for ax in axes[0]:
    for c in curves:
      ax.plot(c["time"], c["mean"], color=color[c["label"]], linewidth=1.4,
              label=f"{c['label']} ({c['seeds']} seed{'s' * (c['seeds'] > 1)})")
      if c["seeds"] > 1:
        ax.fill_between(c["time"], c["lo"], c["hi"], color=color[c["label"]], alpha=0.2,
                        linewidth=0)
    if target:
      ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target}")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel(_metric_name(metric))
    ax.grid(alpha=0.3)
  band = " (line: mean over seeds, band: min–max)" if seeds > 1 else ""
  axes[0][0].set_title(f"{_metric_name(metric).capitalize()} against virtual time{band}",
                       fontsize=10)
  axes[0][0].legend(fontsize=7)
  if zoom:
    axes[0][1].set_ylim(max(0.0, target - 0.05), min(1.0, max(top, target) + 0.005))
    axes[0][1].set_title(f"Zoom near the target {target}", fontsize=10)
  return _save(fig, out_dir, "metric_vs_virtual_time.png")


def plot_time_to_target(table: list[dict], color: dict, metric: str, target,
                        out_dir: str) -> tuple[str, list[str]]:
  """Time to target and final metric, one bar per configuration (mean over seeds, min–max
  error bar, a dot per seed), with how many seeds reached the target and the speedup against
  BSP. Returns the file name and notes (why a part could not be drawn)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  notes = []
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
  xs = np.arange(len(table))
  labs = [t["label"] for t in table]
  colors = [color[lab] for lab in labs]
  if not any(t["reached"] for t in table):
    notes.append(f"no trial reached the target {target} ({_metric_name(metric)}): "
                 "no time to target to plot")
    _say(ax1, f"No trial reached the target {target}\n({_metric_name(metric)}),\n"
              "so there is no time to target to plot.")
    ax1.set_title("Time to target", fontsize=10)
  else:
    _bars(ax1, xs, [t["mean"] for t in table], [t["lo"] for t in table],
          [t["hi"] for t in table], [t["times"] for t in table], colors)
    top = max(t["hi"] for t in table if t["reached"])
    # Several BSP configurations (e.g. a learning-rate sweep): name the one compared with.
    several = len({t["baseline"] for t in table if t["baseline"]}) > 1
    # Many bars: short labels (the title names the baseline and the median), else they overlap.
    compact = len(table) > COMPACT_LABELS_ABOVE and not several
    lines = 1
    for x, t in zip(xs, table):
      reach = f"{t['reached']}/{t['seeds']}" + ("" if compact else " seeds")
      if not t["reached"]:
        ax1.text(x, 0, f"not reached\n({reach})", ha="center", va="bottom", fontsize=7)
        continue
      text = reach
      if t["speedup"] is not None and t["label"] != t["baseline"]:
        text += "\n" + speedup_text(t["speedup"], t["baseline"] if several else "BSP",
                                     t["speedup_n"], compact=compact)
      lines = max(lines, text.count("\n") + 1)
      ax1.text(x, t["hi"] + 0.02 * top, text, ha="center", va="bottom", fontsize=7)
    ax1.set_ylim(0, top * (1.15 + 0.12 * lines))   # room for each bar's lines of text
    ax1.set_ylabel(f"virtual seconds to {_metric_name(metric)} {target}")
    ax1.set_title("Time to target (bar: mean over the seeds that reached it, "
                  "error bar: min–max)\nspeedup: median over seeds of BSP's time / this "
                  "trial's, same seed (report.md's table)"
                  + ("\nlabels: seeds that reached it; speedup vs BSP" if compact else ""),
                  fontsize=9)
    unreached = [t["label"] for t in table if t["scheme"] == "bsp" and not t["reached"]]
    if unreached:
      ax1.text(0.01, 0.98, f"BSP ({', '.join(unreached)}) did not reach the target: no "
               "speedup against it", fontsize=8, transform=ax1.transAxes, va="top")
    ax1.set_xticks(xs, labs, rotation=45, ha="right", fontsize=8)
  if any(t["final"] is not None for t in table):
    _bars(ax2, xs, [t["final"] for t in table], [t["final_lo"] for t in table],
          [t["final_hi"] for t in table], [t["finals"] for t in table], colors)
    lo = min(t["final_lo"] for t in table if t["final"] is not None)
    hi = max(t["final_hi"] for t in table if t["final"] is not None)
    # Accuracies sit close together: the axis starts just below the lowest seed (and says so in
    # its label), so no bar or error bar is cut; a tenth of the axis is left above the highest.
    bottom = max(0.0, lo - (0.1 * (hi - lo) or 0.01)) if metric == "test_accuracy" else 0.0
    ax2.set_ylim(bottom, hi + (0.1 * (hi - bottom) or 0.01))
    ax2.set_ylabel(f"final {_metric_name(metric)}"
                   + (f" (axis starts at {bottom:.3g})" if bottom else ""))
    ax2.set_title("Final metric (bar: mean over seeds, error bar: min–max)", fontsize=9)
    ax2.set_xticks(xs, labs, rotation=45, ha="right", fontsize=8)
  else:
    _say(ax2, "No trial recorded a final metric.")
  for ax in (ax1, ax2):
    ax.grid(axis="y", alpha=0.3)
    if ax.get_xticks().size:   # keep an empty first or last slot ("not reached") in view
      ax.set_xlim(-0.6, len(table) - 0.4)
  return _save(fig, out_dir, "time_to_target.png"), notes


def _bars(ax, xs, means, los, his, points, colors) -> None:
  """Bars with min–max error bars and a dot per seed; a None mean draws no bar."""
  for x, mean, lo, hi, pts, c in zip(xs, means, los, his, points, colors):
    if mean is None:
      continue
    ax.bar(x, mean, color=c, alpha=0.85)
    if len(pts) > 1:
      # max(0, ·): a mean of equal values can land an ulp outside them, and matplotlib
      # refuses a negative error.
      ax.errorbar(x, mean, yerr=[[max(0.0, mean - lo)], [max(0.0, hi - mean)]], color="black",
                  capsize=3, linewidth=1)
      ax.plot([x] * len(pts), pts, "o", color="black", markersize=2.5)


def plot_staleness(table: list[dict], color: dict, out_dir: str) -> str:
  """The staleness histogram as small multiples: one panel per configuration, shared axes."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ncols = min(3, len(table))
  nrows = math.ceil(len(table) / ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 2.6 * nrows), sharex=True,
                           sharey=True, squeeze=False)
  width = max((t["fractions"].size for t in table if t["fractions"] is not None), default=1)
  for ax, t in zip(axes.flat, table):
    if t["fractions"] is None:
      ax.text(0.5, 0.5, "no staleness recorded", ha="center", va="center",
              transform=ax.transAxes, fontsize=8)
      ax.set_title(t["label"], fontsize=9)
      continue
    ax.bar(np.arange(t["fractions"].size), t["fractions"], width=0.9, color=color[t["label"]])
    ax.set_title(f"{t['label']} (mean {t['mean']:.2f})", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
  for ax in axes.flat[len(table):]:
    ax.set_visible(False)
  axes[0][0].set_xlim(-0.8, width - 0.2)
  axes[0][0].set_ylim(0, 1.05)
  fig.supxlabel("staleness of an applied gradient (updates)", fontsize=9)
  fig.supylabel("fraction of applied gradients", fontsize=9)
  fig.suptitle("Staleness distribution (all seeds pooled)", fontsize=10)
  return _save(fig, out_dir, "staleness.png")


def _tier_colors(speeds: list[float]):
  """A colour per slowdown factor (fastest darkest), and whether they fit a legend."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cmap = plt.get_cmap("viridis")
  lo, hi = min(speeds), max(speeds)
  norm = plt.Normalize(lo, hi if hi > lo else lo + 1)
  return (lambda s: cmap(0.85 * norm(s))), norm, cmap


def plot_per_worker(table: list[dict], title: str, ylabel: str, fname: str,
                    out_dir: str) -> str:
  """A group of bars per configuration, one bar per worker, coloured by its speed tier.

  A worker at zero gets a marker on the axis, and a configuration at zero for every worker
  says so, so that nothing vanishes; a log scale only where values span over 50× and none is
  zero (a zero has no place on one).
  """
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(table) + 2), 5))
  known = sorted({float(s) for t in table if t["speeds"] is not None for s in t["speeds"]})
  tone, norm, cmap = _tier_colors(known or [1.0])
  seen = set()
  overall = max(float(t["values"].max()) for t in table)
  positive = [v for t in table for v in t["values"] if v > 0]
  log = bool(positive) and max(positive) / min(positive) > 50 and all(
      t["values"].all() for t in table)
  if log:
    ax.set_yscale("log")
  for g, t in enumerate(table):
    w = t["values"].size
    xs = g + (np.arange(w) - (w - 1) / 2) * (0.8 / w)
    for x, v, i in zip(xs, t["values"], range(w)):
      s = float(t["speeds"][i]) if t["speeds"] is not None else None
      lab = (f"slowdown ×{s:g}" if s is not None else "slowdown unknown")
      # A white edge keeps workers of one tier (one colour) apart: one bar per worker.
      ax.bar(x, v, width=0.8 / w, color=tone(s) if s is not None else "grey",
             edgecolor="white", linewidth=0.6,
             label=None if lab in seen or len(known) > _MAX_TIER_LEGEND else lab)
      seen.add(lab)
      if v == 0:
        ax.plot(x, 0, marker="_", markersize=8, color=tone(s) if s is not None else "grey",
                clip_on=False)
    if not t["values"].any():
      ax.text(g, 0, "0 for every\nworker", ha="center", va="bottom", fontsize=7)
    elif not log and t["values"].max() < 0.01 * overall:   # bars too short to see: give their size
      ax.text(g, 0, f"max {t['values'].max():.3g}\n(too small\nto see)", ha="center",
              va="bottom", fontsize=7)
  ax.set_xticks(range(len(table)), [t["label"] for t in table], rotation=45, ha="right",
                fontsize=8)
  if len(known) > _MAX_TIER_LEGEND:
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                 label="worker's slowdown factor")
  else:
    ax.legend(fontsize=7, title="worker's tier", title_fontsize=7)
  seeds = max(t["seeds"] for t in table)
  ax.set_title(f"{title}\nworkers in order within each configuration"
               + (f" (mean over {seeds} seeds)" if seeds > 1 else ""), fontsize=10)
  ax.set_ylabel(ylabel)
  ax.grid(axis="y", alpha=0.3)
  return _save(fig, out_dir, fname)


def plot(rows: list[dict], out_dir: str) -> tuple[list[str], list[str]]:
  """Writes the report's PNG figures; returns their file names and notes on what could not be
  drawn (each also raised as a warning)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  if not rows:
    return [], []
  labels = list(_configs(rows))
  cmap = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
  color = {lab: cmap(i % cmap.N) for i, lab in enumerate(labels)}
  metric, target = rows[0]["metric"], rows[0]["target"]
  names, notes = [], []
  curves = metric_curves(rows, metric)
  if curves:
    names.append(plot_metric(curves, color, metric, target, out_dir))
  if target is not None:
    name, more = plot_time_to_target(time_to_target_table(rows), color, metric, target,
                                     out_dir)
    names.append(name)
    notes += more
  stale = staleness_table(rows)
  if any(t["fractions"] is not None for t in stale):
    names.append(plot_staleness(stale, color, out_dir))
  for key, title, ylabel, fname in (
      ("blocked_time_per_worker", "Blocked time of each worker (report.md's blocked_time: "
       "their mean)", "blocked virtual time (s)",
       "blocked_time.png"),
      ("bytes_pushed_per_worker", "Bytes pushed per worker link", "bytes pushed",
       "bytes_per_link.png")):
    table = per_worker_table(rows, key)
    if table:
      names.append(plot_per_worker(table, title, ylabel, fname, out_dir))
  for note in notes:
    warnings.warn(f"report figures: {note}", stacklevel=2)
  return names, notes
