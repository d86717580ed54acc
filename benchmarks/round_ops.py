r"""Operations per round and per piece in the level executor's compiled chunk.

    python -m benchmarks.round_ops [--schemes=bsp,ssp,gssp] [--workers=16] [--rounds=11] \
        [--jobs=4] [--list]

Compiles one chunk of one piece (``J`` job slots, one at a time as on a CPU, and ``Rr`` round
slots) for each scheme, 16 workers on the tiers speeds, GSSP in 4 groups, the near-free model
of ``benchmarks.serial_loop`` (``benchmarks/tiny_model.py:Linear`` on 1,024 inputs and 10
classes: one ``[P]`` weight vector) and the default optimizer (SGD with momentum, weight decay
by gradient mass), the round's slots as the scheme's protocol declares them
(``Protocol.round_bounds``, ``Protocol.round_fields``). It reads the compiled HLO and prints,
per scheme:

* **per round**: the top-level instructions of the round loop's body (each a kernel on a CPU:
  fusions, copies, gathers, loops; parameters, tuples, constants and bitcasts not counted), by
  kind; a nested loop (the replicas' write-back) counts as one;
* **per piece**: the same count over the rest of the program (the jobs, the piece's masks and
  counters), which runs once a piece.

On XLA:CPU a round slot's time is mostly these kernels' count (each a few microseconds,
whatever its size: ``docs/PERFORMANCE.md``). ``--list`` prints the round body's instructions.
"""

from __future__ import annotations

import collections
import re

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.base import optim
from gssp_jax.sim import chunk
from gssp_jax.sim import flat
from gssp_jax.sim import levels

from benchmarks import common



def _define_flags() -> None:
  """Flags of its own, defined only when run as a program (the tests import this module, beside
  other benchmarks whose flags share names)."""
  flags.DEFINE_list("schemes", ["bsp", "ssp", "gssp"], "schemes")
  flags.DEFINE_integer("workers", 16, "simulated workers")
  flags.DEFINE_integer("rounds", 11, "round slots per piece")
  flags.DEFINE_integer("jobs", 4, "job slots per piece")
  flags.DEFINE_bool("list", False, "print the round body's instructions")

_NOT_KERNELS = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast")


class _Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(x)


def compiled_chunk(scheme_name: str, num_workers: int, rounds: int, jobs: int,
                   every_field: bool = False) -> str:
  """The compiled HLO text of one chunk (one piece) of ``scheme_name`` on the near-free model.

  ``every_field``: the rounds carry every optional field as data, as if the protocol might set
  each (``rounds.OPTIONAL_FIELDS``), instead of its own ``round_fields``.
  """
  net = _Linear()
  params = net.init(jax.random.key(0), jnp.ones([4, 1024]))["params"]

  def loss_fn(p, model_state, batch, rng):
    del rng
    logits = net.apply({"params": p}, batch["x"])
    return jnp.mean((logits - batch["y"]) ** 2), model_state
  times = np.repeat([1.0, 1.5, 2.0, 3.0], -(-num_workers // 4))[:num_workers]
  scheme = sync.build_scheme(scheme_name, num_workers, num_groups=4, worker_times=times)
  protocol = scheme.make_protocol()
  tx = optim.make_sync_chain(config_lib.default_config().optimizer, scheme.transform,
                             scheme.num_replicas)
  arrivals, replicas = protocol.round_bounds()
  shape = chunk.Shape(pieces=1, jobs=jobs, rounds=rounds, arrivals=arrivals,
                      pulls=min(2, num_workers) if arrivals < num_workers else num_workers,
                      replicas=min(replicas, scheme.num_replicas))
  layout = flat.make_layout(params, {})
  W, R = num_workers, scheme.num_replicas
  state = jax.jit(lambda p, r: chunk.init_state(layout, p, {}, tx, None, W, R, r))(
      params, jax.random.key(1))
  run = levels.make_step_runner(layout, loss_fn, None, tx, 4, 0, W, R, protocol.num_groups,
                                shape, (8,), protocol.route, job_batch=1, unroll_pieces=True,
                                round_fields=(sync.rounds.OPTIONAL_FIELDS if every_field
                                              else protocol.round_fields),
                                one_exchange=protocol.one_exchange_per_round)
  planner = run.runner.planner
  workers = np.arange(W, dtype=np.int32)
  planner.add_jobs(workers, np.zeros([W, 8], np.int32), np.zeros([W], np.int32),
                   np.ones([W], np.float32), np.zeros([W], bool))
  planner.flush(jobs=True)
  plan = planner.take()[0]
  arrays = {"x": jnp.zeros([64, 1024]), "y": jnp.zeros([64, 10])}
  packed = chunk.pack(run.runner.packing, plan.device_tree())
  return run.runner.chunk_fn.lower(state, arrays, packed).compile().as_text()


def _computation(text: str, name: str) -> list[str]:
  """The instruction lines of the HLO computation ``name``."""
  match = re.search(r"\n(?:ENTRY )?%?" + re.escape(name) + r" [^\n]*\{\n(.*?)\n\}", text, re.S)
  if match is None:
    raise ValueError(f"no computation {name!r} in the compiled chunk")
  return match.group(1).splitlines()


def kernels(lines: list[str]) -> collections.Counter:
  """Top-level instructions by kind (those that run as kernels)."""
  out = collections.Counter()
  for line in lines:
    op = re.search(r"= \S+ ([\w-]+)\(", line)
    if op and op.group(1) not in _NOT_KERNELS:
      out[op.group(1)] += 1
  return out


def round_and_piece(text: str, rounds: int) -> tuple[collections.Counter, collections.Counter,
                                                     list[str]]:
  """``(per round, per piece, the round body's kernel lines)`` of a one-piece chunk."""
  # A scan over all the slots, or (the CPU's form) a loop to the piece's last used slot.
  loops = [line for line in text.splitlines() if " while(" in line and (
      f'"known_trip_count":{{"n":"{rounds}"}}' in line or '"known_trip_count"' not in line)]
  if len(loops) != 1:
    raise ValueError(f"expected one round loop of {rounds} slots, found {len(loops)}")
  body = re.search(r"body=%?([\w.\-]+)", loops[0]).group(1)
  entry = re.search(r"\nENTRY %?([\w.\-]+) ", text).group(1)
  round_lines = _computation(text, body)
  per_piece = kernels(_computation(text, entry))
  per_piece["while"] -= 1   # the round loop itself
  listed = [line.strip() for line in round_lines
            if (m := re.search(r"= \S+ ([\w-]+)\(", line)) and m.group(1) not in _NOT_KERNELS]
  return kernels(round_lines), +per_piece, listed


def main(argv):
  del argv
  f = flags.FLAGS
  print(common.describe_backend())
  print(f"{f.workers} workers, one piece of {f.jobs} job slots (one at a time) and "
        f"{f.rounds} round slots, benchmarks/tiny_model.py's near-free model\n")
  print("| scheme | per round | per round, by kind | per piece, outside the rounds |")
  print("|---|---|---|---|")
  listings = {}
  for name in f.schemes:
    text = compiled_chunk(name, f.workers, f.rounds, f.jobs)
    per_round, per_piece, listed = round_and_piece(text, f.rounds)
    kinds = ", ".join(f"{k} {n}" for k, n in per_round.most_common())
    print(f"| {name} | {sum(per_round.values())} | {kinds} | {sum(per_piece.values())} |")
    listings[name] = listed
  if f.list:
    for name, listed in listings.items():
      print(f"\n{name}: the round body")
      for line in listed:
        print("  " + re.sub(r", metadata=.*", "", line)[:200])


if __name__ == "__main__":
  _define_flags()
  app.run(main)
