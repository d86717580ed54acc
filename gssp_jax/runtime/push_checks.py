"""What a push must be before it changes anything: its header's fields, and its place in the run.

A ``Push`` is checked in two steps. :func:`parse` reads and bounds every field
of its header, without any lock (a malformed push raises ``wire.BadMessage``
and changes nothing). :func:`check_in_order` checks it against the mesh table
under the server's lock: the next push number of that mesh, of the iteration
its job was, not before its release, with a valid receipt from every other
shard for the digest the mesh computed of its slice there (that slice, and no
other caller's, was staged there). The body itself is checked by shard 0
(``ShardCore.check_push``: sizes, indices, finiteness).
"""

from __future__ import annotations

import dataclasses

from gssp_jax.runtime import wire


@dataclasses.dataclass(frozen=True)
class PushHeader:
  """A push's header, checked by :func:`parse` (``nonfinite``: the mesh's own refusal; then
  only ``mesh``, ``instance``, ``session`` and ``seq`` are read)."""
  mesh: int
  instance: str
  session: str
  seq: int
  nonfinite: str = ""
  iteration: int = 0
  loss: float = 0.0
  nbytes: int = 0
  wire_bytes: int = 0
  nnz: tuple = ()
  receipts: tuple = ()
  digests: tuple = ()   # the SHA-256 of each of the mesh's slices for shards 1..S-1


def mesh_of(header: dict, num_workers: int) -> tuple[int, str]:
  """``(mesh, instance)`` of a mesh's call."""
  return (wire.field(header, "mesh", int, 0, num_workers - 1),
          wire.field(header, "instance", str))


def parse(header: dict, *, num_workers: int, layout, pull_bytes: int) -> PushHeader:
  """Every field of a push's header, bounded (raises ``wire.BadMessage``)."""
  S = layout.num_shards
  w, instance = mesh_of(header, num_workers)
  session = wire.field(header, "session", str)
  seq = wire.field(header, "seq", int, 1)
  if header.get("nonfinite"):
    return PushHeader(w, instance, session, seq, nonfinite=wire.field(header, "nonfinite", str))
  iteration = wire.field(header, "iteration", int, 0)
  loss = wire.field(header, "loss", float)
  nbytes = wire.field(header, "bytes", int, 0, 2 * pull_bytes)
  wire_bytes = wire.field(header, "wire_bytes", int, 0, 2 * pull_bytes + 4 * S)
  nnz = tuple(bounded_int(x, f"nnz[{s}]", -1, layout.grad_size(s))
              for s, x in enumerate(_nnz(header, layout)))
  receipts = tuple(wire.field(header, "receipts", list))
  digests = tuple(wire.field(header, "digests", list))
  if len(digests) != S - 1 or not all(
      isinstance(d, bytes) and len(d) == wire.DIGEST_BYTES for d in digests):
    raise wire.BadMessage(f"digests are invalid; allowed: one per other shard ({S - 1}), each "
                          f"{wire.DIGEST_BYTES} bytes")
  return PushHeader(w, instance, session, seq, "", iteration, loss, nbytes, wire_bytes, nnz,
                    receipts, digests)


def body_limit(header: dict, layout) -> int:
  """The most bytes shard 0's slice of this push may have (read before its body)."""
  nnz = _nnz(header, layout)
  return layout.push_limit(0, bounded_int(nnz[0], "nnz[0]", -1, layout.grad_size(0)))


def _nnz(header: dict, layout) -> list:
  """The push's kept entries per shard (``-1``: dense), one per shard."""
  nnz = wire.field(header, "nnz", list)
  if len(nnz) != layout.num_shards:
    raise wire.BadMessage(f"nnz has {len(nnz)} entries; allowed: one per shard "
                          f"({layout.num_shards})")
  return nnz


def check_in_order(push: PushHeader, *, host: dict, waiting, layout, credentials,
                   session: str) -> None:
  """Everything about a new push that needs the mesh table (under the lock; raises
  ``wire.BadMessage``)."""
  w, seq = push.mesh, push.seq
  expected = int(host["seq"][w]) + 1
  if seq != expected:
    raise wire.BadMessage(f"push {seq} of mesh {w} is out of order; expected {expected}")
  if push.iteration != host["jobs"][w] - 1:
    raise wire.BadMessage(f"push {seq} of mesh {w} is of iteration {push.iteration}; its job "
                          f"is {host['jobs'][w] - 1}")
  if waiting[w]:
    raise wire.BadMessage(f"mesh {w} pushed again before its release")
  S = layout.num_shards
  if len(push.receipts) != S - 1:
    raise wire.BadMessage(f"{len(push.receipts)} receipts; allowed: one per other shard "
                          f"({S - 1})")
  for s, (receipt, digest) in enumerate(zip(push.receipts, push.digests), start=1):
    size = layout.push_limit(s, push.nnz[s])
    if not credentials.check_receipt(receipt, s, w, seq, session, size, digest):
      raise wire.BadMessage(f"the receipt of shard {s} for push {seq} of mesh {w} is "
                            "invalid (the mesh's slice was not staged there)")


def bounded_int(value, name: str, lo: int, hi: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
    raise wire.BadMessage(f"{name}={value!r:.40} is invalid; allowed: an int in {lo}..{hi}")
  return value
