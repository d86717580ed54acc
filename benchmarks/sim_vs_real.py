r"""The simulator against real runs: the same cluster imposed on the real runtime, then simulated.

  python -m benchmarks.sim_vs_real --schemes=bsp,asp,ssp,gssp,diloco \
      --clusters=tiers,trace_ar,bottleneck --out=/tmp/sim_vs_real

Needs root (network namespaces and ``tc``); every namespace it makes is removed on the way out
(``tests/netns.py``). For each scheme and cluster:

1. **The real run.** A server in one network namespace and each mesh (one process) in its own,
   on a private bridge (``tests/netns.py``). The cluster's compute time is imposed by sleeping
   (``dist.emulate_cluster``: each iteration stretched to ``compute_time(w, k)`` on top of its
   real step, which must stay below it), **the network by the kernel**: an ``htb`` class on
   each end of every host's veth link, at the cluster's bandwidth (a mesh's link both ways, the
   server's interface both ways), generic segmentation off (``gso_max_segs 1``) so that no
   64 KB super-packet slips past the shaper, and the rate raised by a full frame's headers over
   its TCP payload (1514 / 1448) so that the payload moves at the modelled bandwidth
   (``dist.emulate_network=False``: nothing sleeps for a transfer). This kernel has no
   ``netem``: no latency is imposed, and the model's latency is the cost measured below.
   The server records every applied push (``dist.record_pushes``).
2. **The measured costs.** Once per invocation, an ASP run on the same hosts with the links
   unshaped: each mesh's time between pushes beyond its compute is what the real runtime adds
   to an iteration (a pull's and a push's serialisation, the calls, the server's update); half
   of its median is fed to the model as the latency of every push and pull.
3. **The simulation.** The same config on the simulator's timeline (``sync.TimelineEngine``
   with the scheme's legs and shared links, as ``experiments.main`` runs it), with that
   latency, to the real run's number of pushes.
4. **The comparison**, start-up excluded (from each run's first push to its last): the span
   (virtual against wall), the staleness histograms' total-variation distance, each mesh's
   share of the pushes and its blocked time, and the order of the pushes (the Spearman
   correlation of each push's rank in time).

Targets (issue 62): span within 5 %, staleness distance <= 0.05, pushes per mesh within 3 %.
On 2 cores the compute times are long (``--base_time=0.2`` s a step) so that the processes do
not contend for the cores; a bigger machine takes shorter ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))   # netns.py: the namespaces, shared with tests
import netns  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

CLUSTERS = ("tiers", "trace_ar", "bottleneck")
SCHEMES = ("bsp", "asp", "ssp", "gssp", "diloco")
WIRE_OVERHEAD = 1514 / 1448   # a full Ethernet frame over the TCP payload it carries
SERVER_PORT = 5801
TARGETS = {"span": 0.05, "staleness_tv": 0.05, "pushes": 0.03}
# Per-iteration jitter of the modelled clusters (a trace has its own): without it two meshes of
# one speed push at the same virtual instant, a tie the simulator breaks by index and a real run
# by microseconds, which moves staleness between them (the histograms differ, not the means).
# The real run sleeps to the same seeded times, so both see the same jittered iterations.
JITTER = 0.05
LOCAL_STEPS = 4   # DiLoCo's inner steps: a push every 4 iterations, so a run has a quarter of them

if __name__ == "__main__":
  flags.DEFINE_list("schemes", list(SCHEMES), "schemes compared")
  flags.DEFINE_list("clusters", list(CLUSTERS), "clusters: " + ", ".join(CLUSTERS))
  flags.DEFINE_integer("meshes", 4, "meshes (simulated workers)")
  flags.DEFINE_integer("pushes", 200, "iterations of a run, all meshes together (DiLoCo pushes "
                       "a quarter as many)")
  flags.DEFINE_float("base_time", 0.2, "seconds of a base iteration (long enough on 2 cores)")
  flags.DEFINE_float("bandwidth", 2.5e6, "bytes/s of a mesh's link (a LeNet-5 push: 0.1 s)")
  flags.DEFINE_string("out", "/tmp/sim_vs_real", "where runs, logs and results.json go")
  flags.DEFINE_float("timeout", 300.0, "seconds a real run may take, start-up included")


@dataclasses.dataclass(frozen=True)
class Case:
  """One comparison: a scheme on a cluster, with ``meshes`` meshes and ``pushes`` pushes."""
  scheme: str
  cluster: str
  meshes: int = 4
  pushes: int = 200
  base_time: float = 0.2
  bandwidth: float = 2.5e6

  @property
  def name(self) -> str:
    return f"{self.scheme}-{self.cluster}"


def _bandwidths(case: Case) -> list[float]:
  """Each mesh's link: the same, but mesh W-1's at a fifth on the ``bottleneck`` cluster."""
  links = [case.bandwidth] * case.meshes
  if case.cluster == "bottleneck":
    links[-1] = case.bandwidth / 5
  return links


def overrides(case: Case, latency: float = 1e-4) -> dict[str, Any]:
  """The config keys of ``case`` over ``configs/mnist_lenet5.py:smoke`` (dotted, as
  ``config.override`` takes them)."""
  local_steps = LOCAL_STEPS if case.scheme == "diloco" else 1
  keys: dict[str, Any] = {
      "num_workers": case.meshes, "sync.scheme": case.scheme,
      "data.train_size": case.pushes * 32, "data.test_size": 200,
      "train.num_epochs": 1.0, "train.eval_every": 1.0,
      "cluster.base_time": case.base_time, "cluster.latency": latency,
      "cluster.bandwidth": tuple(_bandwidths(case)),
      "cluster.server_bandwidth": case.bandwidth * case.meshes,
      "dist.emulate_network": False, "dist.record_pushes": True, "dist.heartbeat_timeout": 30.0}
  if case.scheme == "gssp":
    keys.update({"sync.num_groups": 2})
  if case.scheme == "diloco":
    keys.update({"local.steps": local_steps})
  if case.cluster == "trace_ar":
    keys.update({"cluster.profile": "trace", "cluster.trace_file": "stragglers/trace-AR.parquet",
                 "cluster.trace_map": "cycle"})
  elif case.cluster in ("tiers", "bottleneck"):   # the project's tiers, one mesh each at W = 4
    tiers = (1.0, 1.5, 2.0, 3.0) if case.meshes % 4 == 0 else (1.0, 2.0)[:2 - case.meshes % 2]
    keys.update({"cluster.profile": "tiers", "cluster.tiers": tiers, "cluster.jitter": JITTER})
  else:
    raise ValueError(f"cluster {case.cluster!r} is invalid; allowed: {', '.join(CLUSTERS)}")
  return keys


def make_config(case: Case, latency: float = 1e-4):
  from configs import mnist_lenet5  # pylint: disable=g-import-not-at-top
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  config = mnist_lenet5.get_config("smoke")
  config_lib.override(config, overrides(case, latency), check_types=False)
  return config


_CONFIG_FILE = '''"""{name}: written by benchmarks/sim_vs_real.py."""
import json
from configs import mnist_lenet5
from gssp_jax import config as config_lib

def get_config():
  config = mnist_lenet5.get_config("smoke")
  changes = {{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads({keys!r}).items()}}
  return config_lib.override(config, changes, check_types=False)
'''


# -- the real run ---------------------------------------------------------------------------------

def _shape(host, port: str, switch: str, up: float, down: float) -> None:
  """``host``'s link at ``up`` bytes/s out of it and ``down`` into it (the switch's port)."""
  for namespace, dev, rate in ((host.name, "eth0", up), (switch, port, down)):
    bits = f"{int(rate * WIRE_OVERHEAD * 8)}bit"
    for argv in (["ip", "link", "set", "dev", dev, "gso_max_segs", "1"],
                 ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
                  "default", "10", "r2q", "1"],
                 ["tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                  "rate", bits, "ceil", bits, "burst", "1600", "cburst", "1600"]):
      subprocess.run(["ip", "netns", "exec", namespace, *argv], check=True, timeout=10,
                     capture_output=True)


def real_run(case: Case, out: str, *, shaped: bool = True, timeout: float = 300.0) -> dict:
  """Runs ``case`` for real across namespaces; returns its ``summary.json`` (with a push log)."""
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.runtime import auth  # pylint: disable=g-import-not-at-top
  check = make_config(case)
  with check.unlocked():
    check.executor = "dist"
  config_lib.validate_config(check)   # a bad case stops here, before any process starts
  run_dir = os.path.join(out, case.name + ("" if shaped else "-unshaped"))
  os.makedirs(run_dir, exist_ok=True)
  workdir, logs = os.path.join(run_dir, "run"), os.path.join(run_dir, "logs")
  os.makedirs(logs, exist_ok=True)
  keys = {k: list(v) if isinstance(v, tuple) else v for k, v in overrides(case).items()}
  config_path = os.path.join(run_dir, "config.py")
  with open(config_path, "w") as f:
    f.write(_CONFIG_FILE.format(name=case.name, keys=json.dumps(keys)))
  env = {"GSSP_DATA_DIR": os.environ.get("GSSP_DATA_DIR", ""), "PYTHONUNBUFFERED": "1",
         auth.SECRET_ENV: auth.new_secret(), auth.RUN_ID_ENV: auth.new_run_id(),
         "JAX_COMPILATION_CACHE_DIR": os.path.join(out, "xla"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 30), "PYTHONPATH": REPO}
  start = time.monotonic()
  with netns.hosts(1 + case.meshes, log_dir=os.path.join(run_dir, "netns")) as hosts:
    server, meshes = hosts[0], hosts[1:]
    switch = server.name[:-len("h0")] + "switch"
    if shaped:
      total = case.bandwidth * case.meshes
      _shape(server, "p0", switch, total, total)
      for i, (host, link) in enumerate(zip(meshes, _bandwidths(case))):
        _shape(host, f"p{i + 1}", switch, link, link)
    address = f"{server.address}:{SERVER_PORT}"
    base = [sys.executable, "-m", "experiments.launch", f"--config={config_path}",
            f"--workdir={workdir}"]
    procs = [server.popen(base + ["--role=server", f"--config.dist.server_address={address}"],
                          env=env, cwd=REPO, log=os.path.join(logs, "server.txt"))]
    for w, host in enumerate(meshes):
      procs.append(host.popen(base + ["--role=worker", f"--mesh={w}",
                                      f"--config.dist.server_address={address}"],
                              env=env, cwd=REPO, log=os.path.join(logs, f"mesh{w}.txt")))
    for proc in procs:
      left = timeout - (time.monotonic() - start)
      try:
        proc.wait(timeout=max(1.0, left))
      except subprocess.TimeoutExpired:
        raise RuntimeError(f"{case.name}: the real run did not end within {timeout:g} s; "
                           f"logs in {logs}") from None
    codes = [p.returncode for p in procs]
  if any(codes):
    raise RuntimeError(f"{case.name}: the real run failed (exit codes {codes}); logs in {logs}")
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


# -- the costs and the simulation ---------------------------------------------------------------

def iteration_overhead(summary: dict, case: Case) -> float:
  """Seconds a real iteration takes beyond its compute, on unshaped links (ASP: nobody waits):
  the median over meshes of (time between its pushes - its mean compute time)."""
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  cluster = cluster_lib.cluster_from_config(make_config(case))
  log = np.asarray(summary["push_log"])
  extra = []
  for w in range(case.meshes):
    times = log[log[:, 1] == w, 0]
    if times.size >= 3:
      gaps = np.diff(times)
      compute = np.mean([cluster.compute_time(w, k) for k in range(1, times.size)])
      extra.append(float(np.median(gaps)) - compute)
  return float(np.median(extra))


def simulate(case: Case, num_pushes: int, latency: float, push_bytes: int) -> dict:
  """The simulator's timeline of ``case`` (transfer latency ``latency``, pushes and pulls of
  ``push_bytes``: the real run's) to ``num_pushes``."""
  from gssp_jax import sync  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import simulate as simulate_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sim import traffic as traffic_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync import registry  # pylint: disable=g-import-not-at-top
  config = make_config(case, latency)
  cluster = cluster_lib.cluster_from_config(config)
  scheme = registry.scheme_from_config(config, worker_times=cluster.mean_times)
  spe = config.data.train_size // (case.meshes * config.batch_size)
  steps, local = simulate_lib.local_plan(config, cluster.mean_times, spe)
  push = int(push_bytes)
  traffic = traffic_lib.Traffic(scheme.legs, cluster, lambda w, k: push, push, push,
                                shared=True, capacity="each")
  compute = ((lambda w, k: simulate_lib.job_time(cluster, w, k, int(steps[w])))
             if local is not None else cluster.compute_time)
  engine = traffic.engine(scheme.make_protocol(), compute, record=True)
  acct = sync.accounting.Accounting(case.meshes, scheme.num_replicas,
                                    aggregating=engine.protocol.aggregating,
                                    push_iterations=steps)
  while engine.num_pushes < num_pushes:
    for rnd in engine.step():
      acct.apply(rnd)
  return {"push_log": [[t, w] for t, w, _ in engine.pushes[:num_pushes]],
          "staleness": acct.summary(), "blocked": engine.blocked_time.tolist()}


# -- the comparison ---------------------------------------------------------------------------------

def tv_distance(hist_a, hist_b) -> float:
  """Total variation distance of two histograms (counts of 0, 1, 2, ...)."""
  n = max(len(hist_a), len(hist_b))
  a, b = (np.pad(np.asarray(h, float), (0, n - len(h))) for h in (hist_a, hist_b))
  return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


def _ranked(log) -> dict:
  """``(mesh, its k-th push) -> rank of that push in time``."""
  seen: dict = {}
  out = {}
  for rank, (_, w) in enumerate(sorted(log, key=lambda e: e[0])):
    k = seen.get(int(w), 0)
    seen[int(w)] = k + 1
    out[(int(w), k)] = rank
  return out


def compare(real: dict, sim: dict, meshes: int) -> dict:
  """The figures of one case (module doc), and whether each meets its target."""
  rlog, slog = np.asarray(real["push_log"]), np.asarray(sim["push_log"])
  span_real = float(rlog[-1, 0] - rlog[0, 0])
  span_sim = float(slog[-1, 0] - slog[0, 0])
  per = lambda log: np.bincount(log[:, 1].astype(int), minlength=meshes)
  pr, ps = per(rlog), per(slog)
  rr, rs = _ranked(real["push_log"]), _ranked(sim["push_log"])
  common = sorted(set(rr) & set(rs))
  order = float(np.corrcoef([rr[c] for c in common], [rs[c] for c in common])[0, 1])
  figures = {
      "pushes": int(len(rlog)), "span_real": span_real, "span_sim": span_sim,
      "span_error": span_sim / span_real - 1,
      "staleness_tv": tv_distance(real["totals"]["staleness"]["hist"], sim["staleness"]["hist"]),
      "staleness_mean_real": real["totals"]["staleness"]["mean"],
      "staleness_mean_sim": sim["staleness"]["mean"],
      "pushes_real": pr.tolist(), "pushes_sim": ps.tolist(),
      "pushes_error": float(np.max(np.abs(ps - pr) / np.maximum(pr, 1))),
      "blocked_real": real["totals"]["blocked_time_per_worker"], "blocked_sim": sim["blocked"],
      "order_correlation": order}
  figures["met"] = {"span": abs(figures["span_error"]) <= TARGETS["span"],
                    "staleness_tv": figures["staleness_tv"] <= TARGETS["staleness_tv"],
                    "pushes": figures["pushes_error"] <= TARGETS["pushes"]}
  return figures


def run_case(case: Case, out: str, latency: float, timeout: float = 300.0) -> dict:
  real = real_run(case, out, timeout=timeout)
  push_bytes = real["totals"]["bytes_pushed"] // max(real["totals"]["staleness"]["applied"], 1)
  sim = simulate(case, len(real["push_log"]), latency, push_bytes)
  return compare(real, sim, case.meshes)


def calibrate(out: str, meshes: int, pushes: int, base_time: float, bandwidth: float,
              timeout: float = 300.0) -> float:
  """Half the real runtime's measured cost per iteration (module doc, 2.): the latency fed in."""
  case = Case("asp", "tiers", meshes, pushes, base_time, bandwidth)
  summary = real_run(case, out, shaped=False, timeout=timeout)
  return max(iteration_overhead(summary, case), 0.0) / 2


def _line(case: Case, f: dict) -> str:
  ok = lambda key: "" if f["met"][key] else " (missed)"
  return (f"{case.scheme:7s} {case.cluster:10s} pushes {f['pushes']:3d}  span real "
          f"{f['span_real']:6.2f} s sim {f['span_sim']:6.2f} s ({f['span_error']:+.1%}"
          f"{ok('span')})  staleness tv {f['staleness_tv']:.3f}{ok('staleness_tv')} (means "
          f"{f['staleness_mean_real']:.2f} / {f['staleness_mean_sim']:.2f})  pushes per mesh "
          f"within {f['pushes_error']:.1%}{ok('pushes')}  order r {f['order_correlation']:.3f}")


def main(argv):
  del argv
  f = flags.FLAGS
  if reason := netns.skip_reason():
    raise SystemExit(f"sim_vs_real needs network namespaces: {reason}")
  os.makedirs(f.out, exist_ok=True)
  latency = calibrate(f.out, f.meshes, f.pushes, f.base_time, f.bandwidth, f.timeout)
  print(f"measured: {2 * latency * 1e3:.1f} ms a real iteration beyond its compute (unshaped "
        f"ASP): {latency * 1e3:.1f} ms fed as each push's and pull's latency", flush=True)
  results = {"latency": latency, "cases": {}}
  for scheme in f.schemes:
    for cluster in f.clusters:
      case = Case(scheme, cluster, f.meshes, f.pushes, f.base_time, f.bandwidth)
      figures = run_case(case, f.out, latency, f.timeout)
      results["cases"][case.name] = figures
      print(_line(case, figures), flush=True)
      with open(os.path.join(f.out, "results.json"), "w") as out:
        json.dump(results, out, indent=1)
  print(f"results: {os.path.join(f.out, 'results.json')}")


if __name__ == "__main__":
  app.run(main)
