"""The data plane's large bodies on Arrow Flight: the same methods, no copy into ``bytes``.

grpcio's Python API takes and gives ``bytes``: a body sent through it is
copied once into its messages, and that copy alone kept the wire at 1.2-1.45x
the raw channel for a ResNet-18 push + pull (``docs/PERFORMANCE.md``). Arrow
Flight (``pyarrow.flight``, gRPC underneath) sends Arrow buffers that wrap
NumPy memory and hands received ones over as buffers NumPy views without a
copy (``benchmarks/flight_probe.py``: 0.84-0.92x the raw grpcio stream).

A server made with ``endpoints.make_server(..., flight=True)`` serves every one of
its :class:`wire.Method` s a second time here, as one ``DoExchange`` each call:

* the **command** (the descriptor) is ``{"m": method, "h": header}`` in
  msgpack, at most ``wire.MAX_HEADER_BYTES``, checked like a gRPC header;
* the **token** travels as the ``gssp-token`` call header and is checked by a
  server middleware (the same :class:`auth.TokenInterceptor`, constant time)
  before the method sees anything; TLS and mTLS use the run's PEM files;
* the **body** is a stream of record batches of one ``uint8`` column, cut as
  :func:`wire.messages` cuts it with ``alone_bytes=ALONE_BYTES``: every
  tensor of at least ``ALONE_BYTES`` travels in batches of its own that wrap
  its memory (no copy), smaller ones are joined (one copy, of small tensors);
* the receiver checks the declared size against the method's ``body_limit``
  before it reads any batch, the schema, and every batch's size as it comes;
  the reply's header is the first message's application metadata.

Errors keep their gRPC status codes: a handler's :class:`wire.BadMessage` or
:class:`wire.Refused` travels as a Flight server error whose extra info is the
code's name, and the client raises the same :class:`wire.CallError` (or
retries ``UNAVAILABLE``) as on the gRPC path. The client finds the Flight
port through the authenticated gRPC method ``wire.FLIGHT_PORT_METHOD`` and asks again after
the server has been unreachable (a restarted server has a new one).

Limits: gRPC under Flight bounds the messages a client sends (``write_size_limit_bytes``)
but its server-side receive limit is not settable from Python, so an
**authenticated** peer could send one oversized batch; the declared size is
checked before any batch is read and every batch after, and a caller without
the token is refused before its first message is read.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import grpc
import numpy as np

from gssp_jax.runtime import auth
from gssp_jax.runtime import wire

ALONE_BYTES = 256 << 10    # tensors of at least this many bytes travel without a copy
_CODES = {code.name: code for code in grpc.StatusCode}


def available() -> bool:
  """Whether ``pyarrow.flight`` can be imported here."""
  try:
    from pyarrow import flight  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def _modules():
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  return pa, flight


def _schema():
  pa, _ = _modules()
  return pa.schema([("body", pa.uint8())])


# -- commands and bodies --------------------------------------------------------------------------


def encode_command(name: str, header: dict[str, Any]) -> bytes:
  return wire.encode_header({"m": name, "h": header})


def decode_command(data: bytes) -> tuple[str, dict[str, Any]]:
  command = wire.decode_header(data)
  name, header = command.get("m"), command.get("h")
  if not isinstance(name, str) or not isinstance(header, dict):
    raise wire.BadMessage("a Flight command must be a map of a method name 'm' and a header 'h'")
  return name, header


def batches(body) -> Iterator[Any]:
  """A body's record batches (see the module's docstring): large tensors wrapped, not copied."""
  pa, _ = _modules()
  schema = _schema()
  for message in wire.messages(body, alone_bytes=ALONE_BYTES):
    data = message[0] if len(message) == 1 else b"".join(message)
    column = pa.Array.from_buffers(pa.uint8(), len(data), [None, pa.py_buffer(data)])
    yield pa.RecordBatch.from_arrays([column], schema=schema)


def _batch_view(batch) -> np.ndarray:
  if batch.num_columns != 1:
    raise wire.BadMessage(f"a body batch has {batch.num_columns} columns; allowed: 1 (uint8)")
  column = batch.column(0)
  if column.null_count:
    raise wire.BadMessage("a body batch has null entries")
  return column.to_numpy(zero_copy_only=True)   # a read-only view of the received buffer


def receive(reader, size: int, keep_parts: bool) -> Any:
  """The body of exactly ``size`` bytes from ``reader``'s batches, checked as they come.

  Returns:
    None for ``size`` 0 (the stream checked empty); else one uint8 buffer the
    batches are copied into, or with ``keep_parts`` the batches themselves as
    uint8 arrays (no copy).
  """
  parts = receive_views(reader, size)
  if not size:
    return None
  if keep_parts:
    return parts
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def receive_views(reader, size: int) -> list[np.ndarray]:
  """The batches of ``reader`` as uint8 views totalling exactly ``size`` bytes (else BadMessage)."""
  if reader.schema != _schema():
    raise wire.BadMessage(f"a body's schema is {reader.schema}; allowed: one uint8 column 'body'")
  parts, filled = [], 0
  for chunk in reader:
    if chunk.data is None:
      raise wire.BadMessage("a body message without data")
    view = _batch_view(chunk.data)
    if filled + view.size > size:
      raise wire.BadMessage(f"the body runs past the {size} bytes its header declared")
    parts.append(view)
    filled += view.size
  if filled != size:
    raise wire.BadMessage(f"the body has {filled} bytes; its header declared {size}")
  return parts


# -- the server -----------------------------------------------------------------------------------


def _raise(e: Exception):
  _, flight = _modules()
  code = grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, wire.BadMessage) else e.code
  raise flight.FlightServerError(str(e), extra_info=code.name.encode()) from None


def start_server(methods: list[wire.Method], host: str, check: auth.TokenInterceptor,
                 tls: dict[str, Any] | None) -> Any:
  """A started Flight server of ``methods`` on ``host`` (a free port: ``server.port``)."""
  pa, flight = _modules()
  del pa
  by_name = {m.name: m for m in methods}

  class TokenMiddleware(flight.ServerMiddlewareFactory):

    def start_call(self, info, headers):
      given = (headers.get(auth.TOKEN_KEY) or [b""])[0]
      if not check.check(given, f"flight:{info.method}"):
        raise flight.FlightUnauthenticatedError(auth.REFUSAL)
      return None

  class Server(flight.FlightServerBase):

    def do_exchange(self, context, descriptor, reader, writer):
      try:
        name, header = decode_command(descriptor.command or b"")
        method = by_name.get(name)
        if method is None:
          raise wire.Refused(grpc.StatusCode.UNIMPLEMENTED, f"no method {name!r}")
        size = wire.field(header, "body_bytes", int, 0, method.body_limit(header))
        body = receive(reader, size, method.parts)
        reply_header, reply_body = method.handler(header, body, context.peer())
      except (wire.BadMessage, wire.Refused) as e:
        _raise(e)
      size = wire.body_bytes(reply_body)
      writer.begin(_schema())
      writer.write_metadata(wire.encode_header({**reply_header, "body_bytes": size}))
      if size:
        for batch in batches(reply_body):
          writer.write_batch(batch)

  scheme = "grpc+tls" if tls else "grpc"
  location = f"{scheme}://{'[' + host + ']' if ':' in host else host}:0"
  return Server(location, middleware={"token": TokenMiddleware()}, **(tls or {}))


def stop_server(server) -> threading.Event:
  """Shuts ``server`` down in the background; the event is set once it is down.

  Flight's shutdown waits for the calls in progress (a handler that waits, a
  pull at a watermark, ends within its own timeout), so callers bound their wait.
  """
  done = threading.Event()
  threading.Thread(target=lambda: (server.shutdown(), done.set()), daemon=True,
                   name="flight-shutdown").start()
  return done


# -- the client -----------------------------------------------------------------------------------


class Link:
  """A client's Flight connection to one server: :meth:`call` as ``endpoints.Client`` calls it."""

  def __init__(self, host: str, port: int, token: str, tls: dict[str, Any] | None,
               server_name: str = ""):
    _, flight = _modules()
    self._flight = flight
    scheme = "grpc+tls" if tls else "grpc"
    kwargs = dict(tls or {})
    if tls and server_name:
      kwargs["override_hostname"] = server_name
    host = f"[{host}]" if ":" in host else host
    # The wire's reconnect backoff (a restarted server is found within ~0.5 s), but not its
    # keepalive pings: Flight's server keeps gRPC's default ping policy (a minimum interval of
    # 5 min between pings without data, not settable from Python), which the wire's 5 s pings
    # would break during a long wait. A peer that vanishes without a reset is noticed by TCP
    # here, and by the heartbeats on the gRPC channel.
    options = [(k, v) for k, v in wire.CHANNEL_OPTIONS
               if k.startswith(("grpc.initial_reconnect", "grpc.min_reconnect",
                                "grpc.max_reconnect"))]
    self.client = flight.FlightClient(f"{scheme}://{host}:{port}", generic_options=options,
                                      write_size_limit_bytes=wire.MAX_MESSAGE_BYTES, **kwargs)
    self._headers = [(auth.TOKEN_KEY.encode(), token.encode())]

  def call(self, name: str, header: dict[str, Any], body, reply_limit: int,
           timeout: float | None, reply_parts: bool) -> tuple[dict[str, Any], Any]:
    """One exchange; raises ``grpc.RpcError``-like :class:`Failed` on a status, BadMessage on a
    reply that does not fit ``reply_limit``."""
    flight = self._flight
    options = flight.FlightCallOptions(headers=self._headers, timeout=timeout)
    descriptor = flight.FlightDescriptor.for_command(encode_command(name, header))
    try:
      writer, reader = self.client.do_exchange(descriptor, options)
      try:
        return self._exchange(name, writer, reader, body, reply_limit, reply_parts)
      finally:
        try:
          writer.close()
        except flight.FlightError:
          pass   # the call's own outcome is already raised or returned
    except flight.FlightError as e:
      raise Failed.of(e) from None

  def _exchange(self, name, writer, reader, body, reply_limit, reply_parts):
    writer.begin(_schema())
    try:
      if body is not None:
        for batch in batches(body):
          writer.write_batch(batch)
      writer.done_writing()
    except self._flight.FlightError:
      pass   # the server ended the call early (a refusal): its status is read below
    first = reader.read_chunk()
    if first.data is not None or first.app_metadata is None:
      raise wire.BadMessage(f"{name}: the reply did not start with its header")
    reply_header = wire.decode_header(first.app_metadata.to_pybytes())
    size = wire.field(reply_header, "body_bytes", int, 0, max(reply_limit, 0))
    return reply_header, receive(reader, size, reply_parts)

  def close(self) -> None:
    self.client.close()


class Failed(wire.StatusError):
  """A Flight call that ended with a status: its gRPC ``code`` and the server's message."""

  @classmethod
  def of(cls, e: Exception) -> "Failed":
    _, flight = _modules()
    details = str(e).split(". Detail:")[0].split(". gRPC client debug context")[0]
    extra = (getattr(e, "extra_info", b"") or b"").decode(errors="replace")
    if extra in _CODES:
      return cls(_CODES[extra], details)
    for kind, code in ((flight.FlightUnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
                       (flight.FlightUnauthorizedError, grpc.StatusCode.PERMISSION_DENIED),
                       (flight.FlightUnavailableError, grpc.StatusCode.UNAVAILABLE),
                       (flight.FlightTimedOutError, grpc.StatusCode.DEADLINE_EXCEEDED),
                       (flight.FlightCancelledError, grpc.StatusCode.CANCELLED)):
      if isinstance(e, kind):
        return cls(code, details)
    return cls(grpc.StatusCode.UNKNOWN, details)
