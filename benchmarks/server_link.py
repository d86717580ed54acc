r"""What a shared server link changes: virtual time per epoch of each scheme, each push alone or shared.

    python -m benchmarks.server_link [--payload_mb=44.7] [--workers=16] [--base_time=0.1] \
        [--bandwidth=1.25e9] [--server_bandwidth=1.25e9] [--pushes=1600] \
        [--schemes=bsp,asp,ssp,gssp,inhad,dssync]

No gradients: the simulator's own timeline (``sync.TimelineEngine``) and traffic
model (``sim.traffic.Traffic``, the same calls ``sim/simulate.py`` makes) on a
cluster in four speed tiers (1, 1.5, 2, 3 x ``base_time``), every push and pull
``payload_mb`` (default: ResNet-18 with its BatchNorm statistics), 10 Gb/s worker
links and a 10 Gb/s server interface by default. For each scheme it prints the
virtual time of ``pushes`` pushes with ``cluster.shared_server_links`` off (each
transfer alone, the model before issue 22) and on (transfers overlapping at a
server share its bandwidth, max-min fair), and their ratio. A second, with BSP
as the base, says how much faster each scheme is under either model. Seconds of
this machine's time: well under a minute.
"""

from absl import app
from absl import flags
import numpy as np

from gssp_jax import sync
from gssp_jax.sim import cluster as cluster_lib
from gssp_jax.sim import traffic

_PAYLOAD = flags.DEFINE_float("payload_mb", 44.7, "bytes of every push and pull, in MB")
_WORKERS = flags.DEFINE_integer("workers", 16, "workers, in four equal speed tiers")
_BASE = flags.DEFINE_float("base_time", 0.1, "seconds per iteration at speed 1")
_BANDWIDTH = flags.DEFINE_float("bandwidth", 1.25e9, "bytes/s of each worker's link")
_SERVER = flags.DEFINE_float("server_bandwidth", 1.25e9, "bytes/s of each server's interface")
_PUSHES = flags.DEFINE_integer("pushes", 1600, "pushes to simulate per run")
_SCHEMES = flags.DEFINE_list("schemes", ["bsp", "asp", "ssp", "gssp", "inhad", "dssync"],
                             "schemes to compare")


def run(scheme_name: str, shared: bool) -> float:
  """Virtual seconds for ``--pushes`` pushes of ``scheme_name``."""
  W = _WORKERS.value
  speeds = np.repeat([1.0, 1.5, 2.0, 3.0], W // 4)
  cluster = cluster_lib.Cluster(speeds=speeds, base_time=_BASE.value, bandwidth=_BANDWIDTH.value,
                                server_bandwidth=_SERVER.value)
  scheme = sync.build_scheme(scheme_name, W, worker_times=speeds, num_nodes=4, num_groups=4)
  payload = int(_PAYLOAD.value * 1e6)
  links = traffic.Traffic(scheme.legs, cluster, lambda w, k: payload, payload, payload,
                          shared=shared)
  engine = links.engine(scheme.make_protocol(), cluster.compute_time)
  while engine.num_pushes < _PUSHES.value:
    engine.step()
  return engine.now


def main(argv):
  del argv
  print(f"{_WORKERS.value} workers in tiers 1/1.5/2/3 x {_BASE.value} s; push and pull "
        f"{_PAYLOAD.value} MB; worker links {_BANDWIDTH.value:.3g} B/s, server "
        f"{_SERVER.value:.3g} B/s; {_PUSHES.value} pushes\n")
  times = {name: (run(name, False), run(name, True)) for name in _SCHEMES.value}
  print("| scheme | alone: virtual s | shared: virtual s | shared / alone | "
        "speedup vs BSP, alone | speedup vs BSP, shared |")
  print("|---|---|---|---|---|---|")
  base = times.get("bsp")
  for name, (alone, shared) in times.items():
    vs = (f"{base[0] / alone:.2f}x | {base[1] / shared:.2f}x" if base else "– | –")
    print(f"| {name} | {alone:.1f} | {shared:.1f} | {shared / alone:.2f} | {vs} |")


if __name__ == "__main__":
  app.run(main)
