"""Gradient-free timelines of every sync scheme on a tiered cluster: virtual time, blocked time, host cost.

    python -m benchmarks.sync_timelines

16 workers in four speed tiers (1, 1.5, 2, 3 s per iteration, no jitter),
server messages take 0.01 s, 200 pushes per worker. Schedule figures only:
accuracy against virtual time needs the simulator's executor.
"""

import time

import numpy as np

from gssp_jax import sync


def main():
  speeds = np.repeat([1.0, 1.5, 2.0, 3.0], 4)
  pushes_per_worker = 200
  print("| scheme | virtual time (s) | per 16 pushes (s) | mean blocked (s) | rounds | host events/s |")
  print("|---|---|---|---|---|---|")
  for name in sync.SCHEMES:
    scheme = sync.build_scheme(name, 16, worker_times=speeds, num_groups=4, staleness=3,
                               num_nodes=4, group_size=4)
    start = time.perf_counter()
    tl = sync.run_timeline(scheme.make_protocol(), lambda w, k: speeds[w],
                           max_pushes=16 * pushes_per_worker, message_delay=lambda m: 0.01)
    took = time.perf_counter() - start
    print(f"| {name} | {tl.end_time:.1f} | {tl.end_time / pushes_per_worker:.3f} | "
          f"{tl.blocked_time.mean():.1f} | {len(tl.rounds)} | {len(tl.events) / took:,.0f} |")


if __name__ == "__main__":
  main()
