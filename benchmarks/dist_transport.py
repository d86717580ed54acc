r"""Throughput of the real runtime's transport against the raw gRPC channel it runs on.

    python -m benchmarks.dist_transport [--sizes=lenet5,resnet18@0.3,resnet18] [--reps=0] \
        [--sparse_ratio=0.01] [--child_server]

Each size is a real model's weights (shapes from ``jax.eval_shape`` of its
init, values random float32): LeNet-5 (~0.25 MB), ResNet-18 at width 0.3
(~4 MB), ResNet-18 (~45 MB). Each exchange is what a ``Push`` of the runtime
is: the request carries a gradient of that size, the reply the weights (same
size); throughput counts both directions, ``2 x payload / round trip``.

* ``wire``: ``gssp_jax.dist.wire`` end to end: ``pack_leaves`` + msgpack
  ``encode`` on the client, gRPC, ``decode`` + ``unpack_leaves`` on the
  server, which answers with packed weights the client decodes and unpacks.
* ``raw``: a gRPC server with the same channel options and a bytes-in,
  bytes-out handler (no serialisation at all), request and reply of exactly
  the wire path's encoded sizes.
* ``topk``: the gradient with only its top ``--sparse_ratio`` entries of each
  leaf by magnitude (top-k), packed ``sparse=True`` (int32 indices + values);
  the reply is the weights as the runtime sends them, dense. Its raw row
  has the same byte counts; "dense-equivalent MB/s" is what a dense push and
  pull of the same model would need to match it.

Both servers run in a thread of this process (so client and server share the
two cores and the GIL); ``--child_server`` also measures the wire path with
the server in a child process. Printed per row: round trip (median of
``--reps``), MB/s, and the ratio wire/raw of throughputs, plus the
serialisation share measured alone (pack + encode + decode + unpack of the
request and the reply, no network).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from concurrent import futures

from absl import app
from absl import flags
import grpc
import jax
import numpy as np

from gssp_jax import models
from gssp_jax.dist import wire

from benchmarks import common

_SIZES = flags.DEFINE_list("sizes", ["lenet5", "resnet18@0.3", "resnet18"],
                           "payloads: a model name, optionally @width (resnet18, vgg19)")
_REPS = flags.DEFINE_integer("reps", 0, "round trips per row (0: 30 below 10 MB, else 10)")
_SPARSE = flags.DEFINE_float("sparse_ratio", 0.01, "top-k keep ratio of the sparse rows")
_CHILD = flags.DEFINE_bool("child_server", False,
                           "also measure the wire path with the server in a child process")

RAW_METHOD = "/gssp.RawBench/Echo"
MB = 1e6


def model_leaves(spec: str) -> list[np.ndarray]:
  """Random float32 leaves with the shapes of ``spec``'s parameters (``name`` or ``name@width``).

  Raises:
    ValueError: an unknown model, or a width the model does not have.
  """
  name, _, width = spec.partition("@")
  if name not in common.SHAPES:
    raise ValueError(f"--sizes entry {spec!r} is invalid; allowed: one of "
                     f"{', '.join(common.SHAPES)}, optionally @width")
  model = models.create_model(name, num_classes=10,
                              **common.model_kwargs(name, float(width or 1.0)))
  x = jax.ShapeDtypeStruct((1,) + common.SHAPES[name], np.float32)
  shapes = jax.eval_shape(lambda k, x: model.init(k, x, train=False)["params"],
                          jax.random.key(0), x)
  rng = np.random.default_rng(0)
  return [rng.standard_normal(s.shape).astype(np.float32) for s in jax.tree.leaves(shapes)]


def top_k(leaves: list[np.ndarray], ratio: float) -> list[np.ndarray]:
  """Each leaf with only its ``max(1, ratio * size)`` largest-magnitude entries kept."""
  out = []
  for leaf in leaves:
    flat = leaf.reshape(-1)
    k = max(1, int(ratio * flat.size))
    keep = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
    sparse = np.zeros_like(flat)
    sparse[keep] = flat[keep]
    out.append(sparse.reshape(leaf.shape))
  return out


# -- servers ----------------------------------------------------------------------------------


def serve_wire(reply_leaves: list[np.ndarray], sparse_reply: bool) -> tuple[grpc.Server, int]:
  """``wire.make_server`` whose ``Push`` unpacks the gradient and answers packed weights."""

  def push(request):
    wire.unpack_leaves(request["grad"])
    return {"params": wire.pack_leaves(reply_leaves, sparse=sparse_reply)}

  handlers = {name: (lambda request: {}) for name in wire.METHODS}
  handlers["Push"] = push
  return wire.make_server(handlers, "127.0.0.1:0", max_workers=4)


def serve_raw(reply: bytes) -> tuple[grpc.Server, int]:
  """A gRPC server of the same options answering every request with ``reply`` (bytes as is)."""
  handler = grpc.method_handlers_generic_handler(
      "gssp.RawBench", {"Echo": grpc.unary_unary_rpc_method_handler(lambda data, ctx: reply)})
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=wire.CHANNEL_OPTIONS)
  server.add_generic_rpc_handlers((handler,))
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  return server, port


def _child_main(spec: str, sparse_ratio: float, sparse_reply: bool, conn) -> None:
  """A child process: the wire server of ``spec``'s weights; sends its port, serves until told."""
  leaves = model_leaves(spec)
  if sparse_reply:
    leaves = top_k(leaves, sparse_ratio)
  server, port = serve_wire(leaves, sparse_reply)
  conn.send(port)
  conn.recv()   # any message: stop
  server.stop(grace=0).wait()


# -- timing -----------------------------------------------------------------------------------


def median_ms(fn, reps: int) -> float:
  fn()   # the first call opens the connection
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def wire_round_trip(port: int, grad: list[np.ndarray], sparse: bool, reps: int) -> float:
  client = wire.Client(f"127.0.0.1:{port}", retry_seconds=10)

  def once():
    reply = client.call("Push", {"grad": wire.pack_leaves(grad, sparse=sparse)})
    wire.unpack_leaves(reply["params"])

  try:
    return median_ms(once, reps)
  finally:
    client.close()


def raw_round_trip(request: bytes, reply: bytes, reps: int) -> float:
  server, port = serve_raw(reply)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS)
  echo = channel.unary_unary(RAW_METHOD)
  try:
    return median_ms(lambda: echo(request), reps)
  finally:
    channel.close()
    server.stop(grace=0).wait()


def serialisation_ms(grad, reply_leaves, sparse: bool, reps: int) -> float:
  """pack + encode + decode + unpack of the request and of the reply, no network."""

  def once():
    wire.unpack_leaves(wire.decode(wire.encode({"grad": wire.pack_leaves(grad, sparse)}))["grad"])
    wire.unpack_leaves(wire.decode(wire.encode({"params": wire.pack_leaves(reply_leaves)}))
                       ["params"])

  return median_ms(once, reps)


def measure(spec: str, leaves, sparse: bool, reps: int) -> dict:
  """One row: the wire path and the raw channel with the same byte counts."""
  grad = top_k(leaves, _SPARSE.value) if sparse else leaves
  request = wire.encode({"grad": wire.pack_leaves(grad, sparse=sparse)})
  reply = wire.encode({"params": wire.pack_leaves(leaves)})
  server, port = serve_wire(leaves, sparse_reply=False)
  try:
    wire_ms = wire_round_trip(port, grad, sparse, reps)
  finally:
    server.stop(grace=0).wait()
  raw_ms = raw_round_trip(request, reply, reps)
  dense = sum(x.nbytes for x in leaves)
  return {"spec": spec, "kind": f"top-k {_SPARSE.value:g} push" if sparse else "dense",
          "dense": dense, "request": len(request), "reply": len(reply), "wire_ms": wire_ms,
          "raw_ms": raw_ms, "serial_ms": serialisation_ms(grad, leaves, sparse, reps)}


def measure_child(spec: str, leaves, reps: int) -> float:
  """The dense wire round trip with the server in a child process (spawned: no fork of JAX)."""
  ctx = multiprocessing.get_context("spawn")
  parent, child = ctx.Pipe()
  proc = ctx.Process(target=_child_main, args=(spec, _SPARSE.value, False, child), daemon=True)
  proc.start()
  try:
    if not parent.poll(300):
      raise RuntimeError("the child server did not start within 300 s")
    return wire_round_trip(parent.recv(), leaves, False, reps)
  finally:
    try:
      parent.send("stop")
    except (BrokenPipeError, OSError):
      pass
    proc.join(10)
    if proc.is_alive():
      proc.kill()
      proc.join()


def main(argv):
  del argv
  try:
    payloads = {spec: model_leaves(spec) for spec in _SIZES.value}
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if not 0 < _SPARSE.value <= 1:
    raise app.UsageError(f"--sparse_ratio={_SPARSE.value} is invalid; allowed: 0 < r <= 1")
  print(common.describe_backend())
  print(f"grpcio {grpc.__version__}; loopback; server in a thread of this process (client and "
        "server share its cores and GIL); medians of the reps")
  print("round trip = request (gradient) + reply (weights, dense), as a runtime Push;"
        " MB/s = (request + reply bytes) / round trip")
  print("| payload | kind | dense MB | request MB | reply MB | reps | wire ms | raw ms |"
        " wire MB/s | raw MB/s | wire/raw | serialisation ms | dense-equivalent MB/s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for spec, leaves in payloads.items():
    dense = sum(x.nbytes for x in leaves)
    reps = _REPS.value or (30 if dense < 10 * MB else 10)
    for sparse in (False, True):
      r = measure(spec, leaves, sparse, reps)
      moved = (r["request"] + r["reply"]) / MB
      print(f"| {spec} | {r['kind']} | {dense / MB:.2f} | {r['request'] / MB:.3f} |"
            f" {r['reply'] / MB:.2f} | {reps} | {r['wire_ms']:.2f} | {r['raw_ms']:.2f} |"
            f" {moved / r['wire_ms'] * 1e3:,.0f} | {moved / r['raw_ms'] * 1e3:,.0f} |"
            f" {r['raw_ms'] / r['wire_ms']:.2f} | {r['serial_ms']:.2f} |"
            f" {2 * dense / MB / r['wire_ms'] * 1e3:,.0f} |", flush=True)
  if _CHILD.value:
    print("\nwire path, dense, server in a child process (spawned):")
    print("| payload | reps | wire ms | wire MB/s |")
    print("|---|---|---|---|")
    for spec, leaves in payloads.items():
      dense = sum(x.nbytes for x in leaves)
      reps = _REPS.value or (30 if dense < 10 * MB else 10)
      ms = measure_child(spec, leaves, reps)
      request = len(wire.encode({"grad": wire.pack_leaves(leaves)}))
      print(f"| {spec} | {reps} | {ms:.2f} | {2 * request / MB / ms * 1e3:,.0f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
