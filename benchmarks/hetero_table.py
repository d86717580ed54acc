"""Markdown table of simulated runs: one workdir per scheme under a root directory.

    python -m benchmarks.hetero_table /tmp/hetero

Columns: final accuracy, virtual time to the target, speedup over the BSP run in
the same root (BSP's time to target / the scheme's), final accuracy minus
BSP's, total virtual time, mean blocked time per worker, staleness, bytes.
"""

import json
import os
import sys


def main(root: str) -> None:
  runs = {}
  for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "summary.json")
    if os.path.exists(path):
      runs[name] = json.load(open(path))
  bsp = runs.get("bsp")
  print("| scheme | final acc. | time to target (virtual s) | speedup vs BSP | acc. − BSP |"
        " virtual time, all epochs (s) | mean blocked / worker (s) | staleness mean / max |"
        " pushed GB | wall (s) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, s in runs.items():
    f, t = s["final"], s["totals"]
    ttt = s["time_to_target"]
    speed = (f"{bsp['time_to_target'] / ttt:.2f}×" if bsp and bsp["time_to_target"] and ttt
             else "–")
    delta = f"{100 * (f['test_accuracy'] - bsp['final']['test_accuracy']):+.2f} pp" if bsp else "–"
    print(f"| {name} | {100 * f['test_accuracy']:.2f} % | "
          f"{'%.2f' % ttt if ttt else 'not reached'} | {speed} | {delta} | "
          f"{t['virtual_time']:.2f} | {f['blocked_time']:.2f} | "
          f"{f['staleness']['mean']:.2f} / {f['staleness']['max']} | "
          f"{t['bytes_pushed'] / 1e9:.2f} | {t['wall_time']:.0f} |")
  target = next(iter(runs.values()))["target"] if runs else None
  print(f"\ntarget: {target}")


if __name__ == "__main__":
  main(sys.argv[1])
