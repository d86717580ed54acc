r"""Real runs of the multi-process runtime on an emulated heterogeneous cluster (loopback).

    python -m benchmarks.dist_groups [--base_time=0.2] [--rate_epochs=3] [--epochs=4] \
        [--target=0.85] [--parts=rate,target] [--workdir=DIR] [--keep] [--timeout=400]

Every run is ``python -m experiments.launch`` with
``configs/mnist_lenet5_hetero.py:smoke`` (LeNet-5, 2,048 MNIST examples,
batch 32 per mesh, SGD 0.05 momentum 0.9, cosine), one-process meshes that
sleep to the cluster's iteration time (``cluster.base_time`` x the mesh's
speed factor; ``dist.emulate_cluster``). Each run is a child process group
bounded by ``--timeout``; it and every process it started are killed at the
end, on a failure and on Ctrl-C.

* ``rate``: the fast group's update rate (pushes/s per fast mesh, from
  ``pushes_per_worker`` and ``wall_time`` between the first and the last
  evaluation, so start-up is excluded) alone (2 meshes, GSSP with 1 group,
  speed 1) and beside a 3x slower group (4 meshes, GSSP with 2 groups, tiers
  (1, 3)). The ratio with/alone should be close to 1 (target >= 0.90): GSSP
  never makes a fast group wait for a slow one. The meshes' logged real
  compute per iteration is printed beside it: the emulation holds only while
  it stays below ``base_time``.
* ``target``: wall seconds to ``--target`` test accuracy, BSP across all 4
  meshes against GSSP (2 groups), on the same cluster (tiers (1, 3)), same
  optimizer and learning rate, one seed. BSP is deterministic (its real run
  retraces the simulator's accuracies); GSSP's accuracy depends on the real
  arrival order, so it differs from run to run: repeat before quoting it. With
  ``--simulate`` the simulator
  (``experiments.main``) runs the same config on the same cluster model, and
  its virtual time to target is printed beside the real wall time; then the
  times to a few other accuracies from the same runs.

The data comes from ``$GSSP_DATA_DIR`` (or ``--config``'s ``data_dir``), as
for ``experiments.launch``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from gssp_jax.base import health

from benchmarks import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/mnist_lenet5_hetero.py:smoke"
PARTS = ("rate", "target")

_BASE_TIME = flags.DEFINE_float("base_time", 0.2, "emulated seconds per iteration at speed 1")
_RATE_EPOCHS = flags.DEFINE_float("rate_epochs", 3.0, "epochs of the update-rate runs")
_EPOCHS = flags.DEFINE_float("epochs", 4.0, "epochs of the time-to-target runs")
_TARGET = flags.DEFINE_float("target", 0.85, "test accuracy of the time-to-target runs")
_EVAL_EVERY = flags.DEFINE_float("eval_every", 0.25, "epochs between evaluations")
_PARTS = flags.DEFINE_list("parts", list(PARTS), "which measurements: rate, target")
_WORKDIR = flags.DEFINE_string("workdir", None, "parent of the runs' workdirs (default: a temp dir)")
_KEEP = flags.DEFINE_bool("keep", False, "keep the runs' workdirs")
_TIMEOUT = flags.DEFINE_float("timeout", 400.0, "seconds one run may take before it is killed")
_SIMULATE = flags.DEFINE_bool("simulate", True, "also simulate the time-to-target runs")
_LEVELS = (0.7, 0.8, 0.9)   # further accuracies whose times are printed from the same runs

_COMPUTE = re.compile(r"mesh (\d+) rank 0: compute per iteration median ([\d.]+) ms, p90 "
                      r"([\d.]+) ms, max ([\d.]+) ms over (\d+) iterations; (\S+) exceeded")


# -- one bounded run --------------------------------------------------------------------------


def _pids(workdir: str) -> list[int]:
  try:
    with open(os.path.join(workdir, "logs", "pids.json")) as f:
      return [int(p) for p in json.load(f).values()]
  except (OSError, ValueError):
    return []


def _kill(proc: subprocess.Popen, workdir: str) -> None:
  """Ends the launcher and every process it started: SIGTERM (its own teardown), then SIGKILL."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
      pass
  try:
    os.killpg(proc.pid, signal.SIGKILL)   # the launcher's session: it and its children
  except ProcessLookupError:
    pass
  for pid in _pids(workdir):   # a child that left the group (none do today) still goes
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait()


def launch(workdir: str, flags_: list[str], timeout: float, entry: str = "launch") -> float:
  """Runs ``experiments.<entry>`` in ``workdir``; returns its seconds. Raises if it fails."""
  os.makedirs(workdir, exist_ok=True)
  cmd = [sys.executable, "-m", f"experiments.{entry}", f"--config={CONFIG}",
         f"--workdir={workdir}", *flags_]
  start = time.perf_counter()
  with open(os.path.join(workdir, "launcher.txt"), "wb") as out:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
  try:
    code = proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    raise RuntimeError(f"the run in {workdir} took over {timeout:.0f} s (--timeout); killed; "
                       f"see {workdir}/launcher.txt and {workdir}/logs") from None
  finally:
    _kill(proc, workdir)   # also on Ctrl-C (KeyboardInterrupt) and every other exception
  if code:
    with open(os.path.join(workdir, "launcher.txt"), errors="replace") as f:
      tail = f.read()[-2000:]
    raise RuntimeError(f"the run in {workdir} exited with code {code}:\n{tail}")
  return time.perf_counter() - start


def run_flags(scheme: str, meshes: int, groups: int, tiers: tuple[float, ...], epochs: float,
              target: float | None = None) -> list[str]:
  out = [f"--config.num_workers={meshes}", f"--config.sync.scheme={scheme}",
         f"--config.cluster.tiers=({','.join(map(str, tiers))},)",
         f"--config.cluster.base_time={_BASE_TIME.value}",
         f"--config.train.num_epochs={epochs}", f"--config.train.eval_every={_EVAL_EVERY.value}"]
  if scheme == "gssp":   # a sync key the scheme does not read is an error
    out.append(f"--config.sync.num_groups={groups}")
  if target is not None:
    out.append(f"--config.train.target_accuracy={target}")
  return out


def metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def summary(workdir: str) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def compute_times(workdir: str) -> dict[int, tuple]:
  """Per mesh: (median ms, p90 ms, max ms, iterations, iterations over the emulated time)."""
  out = {}
  logs = os.path.join(workdir, "logs")
  for name in sorted(os.listdir(logs)):
    if name.startswith("mesh") and name.endswith("_rank0.txt"):
      with open(os.path.join(logs, name), errors="replace") as f:
        for m in _COMPUTE.finditer(f.read()):
          out[int(m[1])] = (float(m[2]), float(m[3]), float(m[4]), int(m[5]), m[6])
  return out


def fast_rate(lines: list[dict], fast: np.ndarray) -> tuple[float, float, int]:
  """Pushes/s per fast mesh between the first and last evaluation: (rate, seconds, pushes)."""
  first, last = lines[0], lines[-1]
  pushes = int((np.array(last["pushes_per_worker"]) - first["pushes_per_worker"])[fast].sum())
  seconds = last["wall_time"] - first["wall_time"]
  if len(lines) < 2 or seconds <= 0:
    raise RuntimeError("fewer than 2 evaluations: raise --rate_epochs or lower --eval_every")
  return pushes / seconds / fast.sum(), seconds, pushes


# -- the two measurements ---------------------------------------------------------------------


def measure_rate(root: str) -> None:
  base = _BASE_TIME.value
  runs = {"alone (2 meshes, 1 group, speeds 1)": ("alone", 2, 1, (1.0,)),
          "with a 3x slower group (4 meshes, 2 groups, tiers (1, 3))": ("hetero", 4, 2, (1.0, 3.0))}
  rows, rates = [], {}
  for label, (name, meshes, groups, tiers) in runs.items():
    workdir = os.path.join(root, f"rate_{name}")
    seconds = launch(workdir, run_flags("gssp", meshes, groups, tiers, _RATE_EPOCHS.value),
                     _TIMEOUT.value)
    lines, summ = metrics(workdir), summary(workdir)
    group_of = np.array(summ["scheme"]["groups"])
    speeds = np.array(summ["cluster"].get("speeds", [1.0] * meshes))
    fast = group_of == group_of[int(np.argmin(speeds))]
    rate, span, pushes = fast_rate(lines, fast)
    blocked = np.array(lines[-1]["blocked_time_per_worker"])[fast].mean()
    rates[name] = rate
    rows.append((label, rate, 1 / rate - base, span, pushes, blocked, len(lines), seconds,
                 compute_times(workdir)))
  print(f"\n(a) the fast group's update rate, GSSP (s = 3), emulated base time {base} s")
  print("| run | pushes/s per fast mesh | overhead per iteration beyond base_time (ms) |"
        " measured over (s) | fast pushes | blocked per fast mesh (s) | evaluations |"
        " run incl. start-up (s) |")
  print("|---|---|---|---|---|---|---|---|")
  for label, rate, overhead, span, pushes, blocked, evals, seconds, _ in rows:
    print(f"| {label} | {rate:.2f} | {1e3 * overhead:.0f} | {span:.1f} | {pushes} |"
          f" {blocked:.2f} | {evals} | {seconds:.0f} |")
  print(f"ideal: {1 / base:.2f} pushes/s per mesh. ratio with/alone: "
        f"{rates['hetero'] / rates['alone']:.3f} (target >= 0.90)")
  print("\nreal compute per iteration, logged by each mesh (median / p90 / max ms; iterations;"
        f" iterations over the emulated time, {1e3 * base:.0f} ms x speed):")
  for label, *_, compute in rows:
    cells = "; ".join(f"mesh {w}: {c[0]:.1f} / {c[1]:.1f} / {c[2]:.1f} ms, {c[3]} it, {c[4]} over"
                      for w, c in sorted(compute.items()))
    print(f"  {label}: {cells or 'no log line found'}")


def measure_target(root: str) -> None:
  target, results, histories = _TARGET.value, {}, {}
  for scheme in ("bsp", "gssp"):
    workdir = os.path.join(root, f"target_{scheme}")
    run = run_flags(scheme, 4, 2, (1.0, 3.0), _EPOCHS.value, target)
    seconds = launch(workdir, run, _TIMEOUT.value)
    lines, summ = metrics(workdir), summary(workdir)
    histories[scheme] = {"real": lines}
    if _SIMULATE.value:
      launch(workdir + "_sim", run, _TIMEOUT.value, entry="main")
      histories[scheme]["simulated"] = metrics(workdir + "_sim")
    first = next((m for m in lines if m["test_accuracy"] >= target), None)
    results[scheme] = {"time": summ.get("time_to_target"),
                       "first_eval": first["wall_time"] if first else None,
                       "pushes": first["pushes"] if first else None,
                       "final": summ["final"]["test_accuracy"],
                       "best": max(m["test_accuracy"] for m in lines),
                       "wall": summ["final"]["wall_time"], "seconds": seconds,
                       "updates": summ["final"]["updates"],
                       "sim": (summary(workdir + "_sim").get("time_to_target")
                               if _SIMULATE.value else None)}
  fmt = lambda x, f="{:.1f}": "not reached" if x is None else f.format(x)
  print(f"\n(b) wall seconds to {target:.2f} test accuracy, 4 meshes, tiers (1, 3), base time "
        f"{_BASE_TIME.value} s, {_EPOCHS.value:g} epochs, one seed (0)")
  print("| scheme | time to target (s, interpolated) | first evaluation at target (s) |"
        " pushes then | final accuracy | best accuracy | server updates | training wall (s) |"
        " run incl. start-up (s) | simulator, virtual s to target |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for scheme, r in results.items():
    print(f"| {scheme} | {fmt(r['time'])} | {fmt(r['first_eval'])} | {fmt(r['pushes'], '{}')} |"
          f" {r['final']:.4f} | {r['best']:.4f} | {r['updates']} | {r['wall']:.1f} |"
          f" {r['seconds']:.0f} | {fmt(r['sim']) if _SIMULATE.value else 'not run'} |")
  bsp, gssp = results["bsp"]["time"], results["gssp"]["time"]
  if bsp is not None and gssp is not None:
    print(f"speedup of GSSP over BSP to {target:.2f}: {bsp / gssp:.2f}x")
  else:
    print(f"no speedup: a scheme did not reach {target:.2f}; lower --target or raise --epochs")
  levels = sorted(set(_LEVELS) | {target})
  print("\nseconds to each accuracy (interpolated between evaluations), from the same runs:")
  print("| run | " + " | ".join(f"{a:.2f}" for a in levels) + " |")
  print("|---|" + "---|" * len(levels))
  for kind in ("real", "simulated"):
    if kind == "simulated" and not _SIMULATE.value:
      continue
    times = {scheme: [health.time_to(h[kind], "test_accuracy", a,
                                     time_key="wall_time" if kind == "real" else "virtual_time")
                      for a in levels] for scheme, h in histories.items()}
    for scheme, row in times.items():
      print(f"| {scheme} ({kind}) | " + " | ".join(fmt(t) for t in row) + " |")
    ratio = [b / g if b and g else None for b, g in zip(times["bsp"], times["gssp"])]
    print(f"| speedup GSSP/BSP ({kind}) | " + " | ".join(fmt(x, "{:.2f}x") for x in ratio)
          + " |")


def main(argv):
  del argv
  parts = list(_PARTS.value)
  bad = [p for p in parts if p not in PARTS]
  if bad or not parts:
    raise app.UsageError(f"--parts={','.join(parts)} is invalid; allowed: a list of "
                         f"{', '.join(PARTS)}")
  if not _BASE_TIME.value > 0:
    raise app.UsageError(f"--base_time={_BASE_TIME.value} is invalid; allowed: seconds > 0")
  if not 0 < _TARGET.value <= 1:
    raise app.UsageError(f"--target={_TARGET.value} is invalid; allowed: 0 < target <= 1")
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="dist_groups_")
  os.makedirs(root, exist_ok=True)
  names = [os.path.join(root, n) for n in ("rate_alone", "rate_hetero", "target_bsp",
                                           "target_gssp", "target_bsp_sim", "target_gssp_sim")]
  taken = [n for n in names if os.path.exists(n)]
  if taken:
    raise app.UsageError(f"--workdir={root} already holds {', '.join(taken)}; a run there "
                         "would resume it. Allowed: a directory without them (or none)")
  print(common.describe_backend())
  print(f"real runs of {CONFIG} through experiments.launch, one-process meshes and the server"
        f" on loopback; {os.cpu_count()} CPU cores; load average at start "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
  try:
    if "rate" in parts:
      measure_rate(root)
    if "target" in parts:
      measure_target(root)
  finally:
    print(f"\nload average at the end {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if _KEEP.value:
      print(f"workdirs kept under {root}")
    elif _WORKDIR.value:   # the user's directory stays; only the runs' workdirs go
      for name in names:
        shutil.rmtree(name, ignore_errors=True)
    else:
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
