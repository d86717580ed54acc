"""The transport of the real runtime: gRPC unary calls carrying msgpack-encoded NumPy trees.

No protocol is written by hand: gRPC (``grpcio``) frames, routes and retries
the calls; a message is a dict of plain values and NumPy arrays encoded with
``flax.serialization``'s msgpack (no code generation, no pickle: a message
from the network never runs code). A gradient travels as its leaves, dense, or
as (indices, values) when a compressor left it mostly zero, so the bytes on the
wire are what a sparse push costs.

Methods of the service ``gssp.ParameterServer`` (all unary, bytes -> bytes):

* ``Join``: a mesh starts or restarts; the reply holds the weights it starts
  from and its next iteration.
* ``Push``: a mesh's gradient; the reply comes when the protocol releases the
  mesh (its pull) and holds the weights it pulled and its next job.
* ``Heartbeat``: the mesh is alive; the reply says whether to stop.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from flax import serialization
import grpc
import numpy as np

SERVICE = "gssp.ParameterServer"
METHODS = ("Join", "Push", "Heartbeat")
MAX_MESSAGE_BYTES = (1 << 31) - 1  # a ResNet-18's weights are ~45 MB; gRPC's default cap is 4 MB
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def encode(message: dict[str, Any]) -> bytes:
  return serialization.msgpack_serialize(message)


def decode(data: bytes) -> dict[str, Any]:
  return serialization.msgpack_restore(data)


def pack_leaves(leaves, sparse: bool = False) -> list[dict[str, Any]]:
  """Leaves as ``{"v": dense}``, or ``{"i": indices, "v": values, "s": shape}`` where sparser.

  With ``sparse``, a leaf whose non-zeros are fewer than a third of its entries
  goes as int32 indices and values (4 + 4 bytes per entry against 4 dense).
  """
  out = []
  for leaf in leaves:
    leaf = np.asarray(leaf)
    if sparse:
      flat = leaf.reshape(-1)
      idx = np.flatnonzero(flat)
      if 3 * idx.size < flat.size:
        out.append({"i": idx.astype(np.int32), "v": flat[idx], "s": list(leaf.shape)})
        continue
    out.append({"v": leaf})
  return out


def unpack_leaves(packed: list[dict[str, Any]]) -> list[np.ndarray]:
  out = []
  for leaf in packed:
    if "i" in leaf:
      dense = np.zeros(int(np.prod(leaf["s"])), leaf["v"].dtype)
      dense[leaf["i"]] = leaf["v"]
      out.append(dense.reshape(leaf["s"]))
    else:
      out.append(np.asarray(leaf["v"]))
  return out


def make_server(handlers: dict[str, Callable[[dict], dict]], address: str,
                max_workers: int) -> tuple[grpc.Server, int]:
  """A started gRPC server whose methods call ``handlers[name](request) -> reply``.

  Args:
    handlers: one callable per name in ``METHODS`` (messages as dicts).
    address: ``host:port`` to bind (port 0: a free one).
    max_workers: threads serving calls; a ``Push`` holds one while its mesh
      waits, so at least one per mesh plus a few.

  Returns:
    ``(server, port)``.

  Raises:
    ValueError: the address cannot be bound (in use, or not an address here).
  """
  from concurrent import futures  # pylint: disable=g-import-not-at-top

  def wrap(fn):
    return grpc.unary_unary_rpc_method_handler(
        lambda data, context: encode(fn(decode(data))))

  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)])
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
      SERVICE, {name: wrap(handlers[name]) for name in METHODS}),))
  try:
    port = server.add_insecure_port(address)
  except RuntimeError as e:
    raise ValueError(f"server address {address!r} cannot be bound ({e}); allowed: a free "
                     "host:port of this machine (port 0 picks a free one)") from None
  if port == 0:
    raise ValueError(f"server address {address!r} cannot be bound (in use, or not an "
                     "address of this machine); allowed: a free host:port (0 picks one)")
  server.start()
  return server, port


class ServerGone(ConnectionError):
  """The server stayed unreachable for the whole retry window."""


class Client:
  """Calls the parameter server; retries while it is unreachable, up to ``retry_seconds``.

  Only ``UNAVAILABLE`` (not connected, connection lost before the call was
  taken) is retried, with exponential backoff: such a call never reached the
  server, so repeating it cannot apply a push twice.
  """

  def __init__(self, address: str, retry_seconds: float = 60.0):
    self.address, self.retry_seconds = address, float(retry_seconds)
    self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    self._calls = {name: self._channel.unary_unary(f"/{SERVICE}/{name}") for name in METHODS}
    self.bytes_sent = 0
    self.bytes_received = 0

  def call(self, name: str, message: dict, timeout: float | None = None) -> dict:
    data = encode(message)
    deadline = time.monotonic() + self.retry_seconds
    delay = 0.05
    while True:
      try:
        reply = self._calls[name](data, timeout=timeout)
        break
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
          if e.code() == grpc.StatusCode.UNAVAILABLE:
            raise ServerGone(f"the parameter server at {self.address} stayed unreachable for "
                             f"{self.retry_seconds:.0f} s (dist.retry_seconds); is it running?"
                             ) from None
          raise
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    self.bytes_sent += len(data)
    self.bytes_received += len(reply)
    return decode(reply)

  def close(self) -> None:
    self._channel.close()


def check_address(name: str, address: str) -> tuple[str, int]:
  """``host:port`` -> ``(host, port)``; raises ValueError naming ``name`` and the value."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ValueError(f"{name}={address!r} is invalid; allowed: host:port, e.g. "
                     "127.0.0.1:5000 or node17:5000 (port 0..65535)")
  return host.strip("[]"), int(port)
