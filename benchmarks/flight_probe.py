r"""Would Arrow Flight carry the data plane closer to the wire? A push + pull round trip, measured.

    python -m benchmarks.flight_probe [--mb=44.73] [--rounds=5] [--reps=0]

The real runtime's wire (``gssp_jax/runtime/wire.py``) moves a body through
grpcio's Python API, which takes and gives ``bytes``: a sender copies its
tensors into messages once, which the raw-channel baseline of
``benchmarks.dist_transport --parts=ratio`` (prebuilt ``bytes``) does not.
Arrow Flight (``pyarrow.flight``, gRPC underneath) sends Arrow buffers that
wrap NumPy memory without a copy and hands received ones over without one.
This probe moves the same bytes three ways, each against a server in a child
process, the variants alternating: ``raw stream`` (bare grpcio, prebuilt
``bytes`` chunks each way, the ratio part's baseline), ``grpc copy`` (the same
channel, but each chunk copied from a float32 array as the wire does), and
``flight`` (``DoExchange``: one float32 column, sent in record batches of the
wire's ``CHUNK_BYTES`` each way, zero-copy slices of the arrays). ``--rounds``
and ``--reps`` are ``benchmarks.dist_transport``'s (``--reps=0``: 20 below 10
MB, else 4). Wall figures are medians over every exchange. No token, no
header, no checks: transport only.
"""

from __future__ import annotations

import contextlib
import statistics

from absl import app
from absl import flags
import grpc
import numpy as np

from benchmarks import common
from benchmarks import dist_transport
from gssp_jax.runtime import wire

_MB = flags.DEFINE_float("mb", 44.73, "megabytes each way (44.73: ResNet-18's push and pull)")

_UNLIMITED = dist_transport._UNLIMITED  # pylint: disable=protected-access


def _arrays(num_bytes: int) -> tuple[np.ndarray, np.ndarray]:
  n = num_bytes // 4
  rng = np.random.default_rng(0)
  return (rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32))


def _servers(num_bytes: int, chunk_bytes: int, conn) -> None:
  """A child: a bare grpc server and a Flight server answering ``num_bytes``; sends their ports."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  _, reply = _arrays(num_bytes)
  _raw, raw_port = dist_transport.start_raw_server(reply.tobytes(), chunk_bytes)
  column = pa.Array.from_buffers(pa.float32(), reply.size, [None, pa.py_buffer(reply)])
  batch = pa.RecordBatch.from_arrays([column], ["v"])
  rows = chunk_bytes // 4

  class Server(flight.FlightServerBase):

    def do_exchange(self, context, descriptor, reader, writer):
      del context, descriptor
      for _ in reader:   # the push: record batches whose buffers are the received messages
        pass
      writer.begin(batch.schema)
      for start in range(0, batch.num_rows, rows):
        writer.write_batch(batch.slice(start, rows))

  server = Server("grpc://127.0.0.1:0")
  # Never returns: _raw and server live while it serves.
  serve = dist_transport._serve_until_told  # pylint: disable=protected-access
  serve(conn, (raw_port, server.port))


class _Clients:
  """The three ways to move one push + pull; each a no-argument function."""

  def __init__(self, num_bytes: int, chunk_bytes: int, ports: tuple[int, int]):
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    from pyarrow import flight  # pylint: disable=g-import-not-at-top
    self.pa, self.flight = pa, flight
    self.push, _ = _arrays(num_bytes)
    self.num_bytes, self.chunk_bytes = num_bytes - num_bytes % 4, chunk_bytes
    self.request_chunks = dist_transport.split(self.push.tobytes(), chunk_bytes)
    self.channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}", options=_UNLIMITED)
    self._stream = self.channel.stream_stream(f"/{dist_transport.RAW_SERVICE}/Stream")
    self.client = flight.FlightClient(f"grpc://127.0.0.1:{ports[1]}")
    column = pa.Array.from_buffers(pa.float32(), self.push.size, [None, pa.py_buffer(self.push)])
    self.batch = pa.RecordBatch.from_arrays([column], ["v"])
    self.descriptor = flight.FlightDescriptor.for_command(b"push")

  def raw_stream(self) -> None:
    size = sum(len(part) for part in self._stream(iter(self.request_chunks)))
    assert size == self.num_bytes

  def grpc_copy(self) -> None:
    """The wire's one copy: each message's ``bytes`` made from the array as it is sent."""
    view = memoryview(self.push).cast("B")
    parts = (bytes(view[i:i + self.chunk_bytes]) for i in range(0, len(view), self.chunk_bytes))
    got = [np.frombuffer(part, np.uint8) for part in self._stream(parts)]
    assert sum(p.size for p in got) == self.num_bytes

  def flight_exchange(self) -> None:
    writer, reader = self.client.do_exchange(self.descriptor)
    with writer:
      writer.begin(self.batch.schema)
      rows = self.chunk_bytes // 4
      for start in range(0, self.batch.num_rows, rows):
        writer.write_batch(self.batch.slice(start, rows))
      writer.done_writing()
      got = [chunk.data.column(0) for chunk in reader]
    # The reply's values as NumPy views of the received buffers: no copy.
    views = [c.to_numpy(zero_copy_only=True) for c in got]
    assert 4 * sum(v.size for v in views) == self.num_bytes

  def close(self) -> None:
    self.client.close()
    self.channel.close()


def main(argv):
  del argv
  common.run_with_allocator("benchmarks.flight_probe",
                            dist_transport._ALLOCATOR.value)  # pylint: disable=protected-access
  try:
    import pyarrow  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
    from pyarrow import flight  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    raise SystemExit(f"this probe needs pyarrow with Flight ({e}); pip install pyarrow") from None
  num_bytes = int(_MB.value * 1e6) // 4 * 4
  chunk_bytes = wire.CHUNK_BYTES
  rounds = dist_transport._ROUNDS.value  # pylint: disable=protected-access
  reps = (dist_transport._REPS.value  # pylint: disable=protected-access
          or (20 if num_bytes < 10e6 else 4))
  with contextlib.ExitStack() as stack:
    proc, conn = dist_transport.spawn(stack, _servers, num_bytes, chunk_bytes)
    ports = dist_transport.first_message(proc, conn)
    clients = _Clients(num_bytes, chunk_bytes, ports)
    stack.callback(clients.close)
    variants = {"raw stream": clients.raw_stream, "grpc copy": clients.grpc_copy,
                "flight": clients.flight_exchange}
    times, _ = dist_transport.interleaved(variants, rounds, reps,
                                          lambda: np.zeros(1))
  ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  raw = ms["raw stream"]
  print(f"push + pull of {num_bytes / 1e6:.2f} MB each way, {chunk_bytes >> 20} MiB messages, "
        f"{rounds} x {reps} exchanges per variant; medians")
  print("| variant | ms | MB/s (both ways) | / raw stream |")
  print("|---|---|---|---|")
  for name, value in ms.items():
    print(f"| {name} | {value:.1f} | {2 * num_bytes / 1e3 / value:,.0f} | {value / raw:.2f} |")


if __name__ == "__main__":
  app.run(main)
