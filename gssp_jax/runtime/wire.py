"""The transport of the real runtime: gRPC calls whose header is metadata and whose body is raw bytes.

No protocol is written by hand: gRPC (``grpcio``) frames, authenticates (the
run's token, ``auth.TokenInterceptor``; TLS optional), routes and limits the
calls. A call has two parts:

* a **header**: a small dict of plain values (ints, floats, strings, bytes,
  lists), msgpack-encoded with size limits. A unary call carries it inside
  its one message, before the body (:func:`frame`: the cheaper way for small
  calls); a stream in metadata (the request's invocation metadata, the
  reply's initial metadata, which precedes the body);
* a **body**: raw array bytes (a shard's gradient slice, a worker's
  weights), never encoded leaf by leaf. A sender gives it as one buffer or as
  a list of **segments** (its tensors, in order), which it never concatenates:
  :func:`chunks` copies segments once, straight into the messages. A body of
  up to ``CHUNK_BYTES`` travels as one unary message; a larger one as a
  stream of messages that end on segment boundaries: whole segments fill a
  message up to ``CHUNK_BYTES``, and a segment larger than that travels in
  messages of its own, cut every ``SEGMENT_BYTES``. The receiver checks the
  declared size against the model before it takes any message, then either
  copies the messages into one buffer (:func:`receive`) or, for a method that
  takes **parts** (pushes and pulls), keeps them as they came, so a tensor
  that lies within one message is used in place (``layout.leaf_views``): a
  45 MB ResNet-18 push + pull is copied once each way instead of three times.
  No gRPC message is larger than ``MAX_MESSAGE_BYTES``. Processes that move
  bodies run with glibc's allocator tuned by their environment
  (``launch.ALLOCATOR_ENV``, which the launcher sets): without it, a body's
  buffers fault in fresh pages on every call.

Every method therefore exists twice: ``Name`` (unary) and ``Name~`` (a stream
both ways); the caller picks by size, the handler is the same. A server made
with ``flight=True`` (``config.dist.data_plane='flight'``, the default) serves
its methods a third time on Arrow Flight (``runtime/flight.py``), and a client
sends there every call it would stream: Flight wraps the tensors' memory
instead of copying it into ``bytes``, which grpcio's Python API cannot avoid
(``docs/PERFORMANCE.md``: a ResNet-18 push + pull at the raw channel's speed). Every gRPC
message of a run is at most ``MAX_MESSAGE_BYTES`` (a chunk plus a margin),
both ways. Errors a handler raises map to status codes: :class:`BadMessage`
(``INVALID_ARGUMENT``: nothing was changed) and :class:`Refused` (a code of
its own, e.g. ``FAILED_PRECONDITION``).

The client retries a call that failed with ``UNAVAILABLE`` (not connected, or
the connection dropped mid-call) for up to ``retry_seconds``: every call is
idempotent by design (pushes carry their number, ``runtime/server.py``), so a
retried push is acknowledged, never applied twice. Between attempts it waits
on gRPC's own connection (``grpc.channel_ready_future``), not a timer. Readiness
is the same wait: a process binds its port first and serves once it is ready
(:meth:`Server.serve`), so no health service is polled. gRPC's built-in
retries stay off: its retry policy allows at most 5 attempts and replays at
most its retry buffer (a large body is not replayed), so it cannot span a
window of a minute; ``wait_for_ready`` with a deadline on every call would
bound the server's time on the call as well, and a push waits for its release
as long as the protocol needs.
"""

from __future__ import annotations

from concurrent import futures
import os
import struct
import threading
import time
from typing import Any, Callable, Iterator, NamedTuple

import grpc
import msgpack
import numpy as np

from gssp_jax.runtime import auth

SERVICE = "gssp.Run"
HEADER_KEY = "gssp-header-bin"
CHUNK_BYTES = 4 << 20      # whole segments fill a message up to this
SEGMENT_BYTES = 16 << 20   # a larger segment travels alone, cut every this many bytes
MAX_HEADER_BYTES = 32 << 10
FLIGHT_PORT_METHOD = "FlightPort"   # the method that tells a client its server's Flight port
MAX_MESSAGE_BYTES = max(CHUNK_BYTES, SEGMENT_BYTES) + (64 << 10)
_RECONNECT_MS = 250   # a restarted server is found within ~0.5 s (gRPC's default backoff: up to 120 s)
# The one-host launcher holds the ports it hands its children (``launch.reserve_port``: bound
# with SO_REUSEPORT, which Linux shares only between sockets of one user); a child told so by
# this variable binds its port with SO_REUSEPORT too, and no other user can take the port in
# between. Every other bind keeps SO_REUSEPORT off, so a port in use fails loudly.
RESERVED_PORT_ENV = "GSSP_RESERVED_PORT"


def port_reserved_for_us(address: str) -> bool:
  """Whether the launcher reserved ``address``'s port for this process (``RESERVED_PORT_ENV``)."""
  _, port = check_address("address", address)
  return bool(port) and os.environ.get(RESERVED_PORT_ENV, "") == str(port)


SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_metadata_size", 2 * MAX_HEADER_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_metadata_size", 2 * MAX_HEADER_BYTES),
    ("grpc.initial_reconnect_backoff_ms", _RECONNECT_MS),
    ("grpc.min_reconnect_backoff_ms", _RECONNECT_MS),
    ("grpc.max_reconnect_backoff_ms", 2 * _RECONNECT_MS),
    ("grpc.enable_retries", 0),            # this module retries, knowing what is idempotent
    ("grpc.keepalive_time_ms", 5000),      # a peer that vanished mid-call is noticed in ~10 s
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class BadMessage(ValueError):
  """A message that is malformed or does not fit the run; refused before anything changed."""


class Refused(Exception):
  """A well-formed call the receiver will not serve now; ``code`` says why (a ``grpc.StatusCode``)."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


class CallError(ConnectionError):
  """A call failed with a status other than ``UNAVAILABLE``; ``code`` and the server's details."""

  def __init__(self, method: str, code: grpc.StatusCode, details: str):
    super().__init__(f"{method}: {code.name}: {details}")
    self.code, self.details = code, details


class StatusError(Exception):
  """A Flight data-plane call that ended with a status: ``code()`` and ``details()`` as a
  ``grpc.RpcError`` has them (``runtime/flight.py``)."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(f"{code.name}: {details}")
    self._code, self._details = code, details

  def code(self) -> grpc.StatusCode:
    return self._code

  def details(self) -> str:
    return self._details


_FAILURES = (grpc.RpcError, StatusError)


class ServerGone(ConnectionError):
  """The server stayed unreachable for the whole retry window."""


# -- headers ----------------------------------------------------------------------------------


def encode_header(header: dict[str, Any]) -> bytes:
  data = msgpack.packb(header, use_bin_type=True)
  if len(data) > MAX_HEADER_BYTES:
    raise ValueError(f"a header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
  return data


def decode_header(data: bytes) -> dict[str, Any]:
  """The header dict; BadMessage for anything but a small msgpack map with string keys."""
  if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_HEADER_BYTES:
    raise BadMessage(f"a header must be at most {MAX_HEADER_BYTES} bytes of msgpack")
  return _unpack_map(data)


def _unpack_map(data: bytes) -> dict[str, Any]:
  try:
    header = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
  except Exception as e:  # pylint: disable=broad-except  (any decoding failure is a bad message)
    raise BadMessage(f"a header is not valid msgpack ({type(e).__name__})") from None
  if not isinstance(header, dict):
    raise BadMessage(f"a header must be a map, not {type(header).__name__}")
  return header


_FRAME_PREFIX = struct.Struct("<I")   # a unary message starts with its header's length
FRAME_ALIGN = 16                       # its body starts at a multiple of this (float32 views)
_PADS = [bytes(-k % FRAME_ALIGN) for k in range(FRAME_ALIGN)]   # the padding after k bytes
_FRAME_MARGIN = _FRAME_PREFIX.size + MAX_HEADER_BYTES + FRAME_ALIGN   # all but a body's bytes


def frame(header: dict[str, Any], body=None) -> bytes:
  """A unary message: its header's length, the header, zero padding, the body (one copy).

  The padding puts the body at a multiple of ``FRAME_ALIGN`` bytes, so every
  tensor of it is used in place (``layout.leaf_views``). A stream carries its
  header in metadata; a small call spares that per-call cost (binary metadata
  each way made the bare channel 0.05 to 0.07 ms slower per LeNet-5 push + pull
  on a 2-core CPU: ``benchmarks/dist_transport.py``, *raw unary + header*).
  """
  data = encode_header(header)
  head = [_FRAME_PREFIX.pack(len(data)), data, _PADS[(_FRAME_PREFIX.size + len(data)) % FRAME_ALIGN]]
  items = () if body is None else body if isinstance(body, (list, tuple)) else (body,)
  try:   # contiguous arrays and buffers join as they are: one copy, no views made
    return b"".join([*head, *items])
  except TypeError:   # a strided array: its contiguous copy
    return b"".join([*head, *segments(body)])


def unframe(message: bytes) -> tuple[dict[str, Any], np.ndarray | None]:
  """A unary message's ``(header, body)``: the body a uint8 view of it, or None; BadMessage."""
  if len(message) < _FRAME_PREFIX.size:
    raise BadMessage(f"a message of {len(message)} bytes has no header; allowed: "
                     f"at least {_FRAME_PREFIX.size}")
  (n,) = _FRAME_PREFIX.unpack_from(message)
  start = _FRAME_PREFIX.size + n
  if n > MAX_HEADER_BYTES or start > len(message):
    raise BadMessage(f"a message declares a header of {n} bytes in {len(message)}; allowed: "
                     f"at most {min(MAX_HEADER_BYTES, len(message) - _FRAME_PREFIX.size)}")
  header = _unpack_map(message[_FRAME_PREFIX.size:start])   # its size is checked above
  start += -start % FRAME_ALIGN
  if start >= len(message):
    return header, None
  return header, np.frombuffer(message, np.uint8, offset=start)


def _metadata_header(metadata) -> dict[str, Any]:
  for key, value in metadata or ():
    if key == HEADER_KEY:
      return decode_header(value)
  raise BadMessage(f"the call has no {HEADER_KEY} metadata")


def field(header: dict, name: str, kind, lo=None, hi=None):
  """``header[name]``, checked to be of ``kind`` (int, float, str, bytes, bool) and in [lo, hi]."""
  if name not in header:
    raise BadMessage(f"the header lacks {name!r}")
  value = header[name]
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if kind is int and isinstance(value, bool) or not isinstance(value, kind):
    raise BadMessage(f"{name}={value!r:.40} is invalid; allowed: {kind.__name__}")
  if (lo is not None and value < lo) or (hi is not None and value > hi):
    raise BadMessage(f"{name}={value!r} is invalid; allowed: {lo}..{hi}")
  return value


# -- bodies -------------------------------------------------------------------------------------


def as_bytes_view(body) -> memoryview:
  """A flat byte view of ``body`` (bytes, a memoryview or a contiguous NumPy array), no copy."""
  if isinstance(body, np.ndarray) and not body.flags.c_contiguous:
    body = np.ascontiguousarray(body)
  view = memoryview(body)
  return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def segments(body) -> list[memoryview]:
  """A body's byte views, no copy: one for a buffer, one per segment for a list or tuple."""
  if isinstance(body, (list, tuple)):
    return [as_bytes_view(x) for x in body]
  return [as_bytes_view(body)]


def body_bytes(body) -> int:
  """The bytes of a body as :func:`segments` or :func:`receive` give it (None: 0)."""
  if body is None:
    return 0
  return sum(x.nbytes if isinstance(x, np.ndarray) else memoryview(x).nbytes
             for x in (body if isinstance(body, (list, tuple)) else (body,)))


def join(body) -> bytes:
  """A body as one ``bytes`` (one copy of every segment)."""
  return b"".join(segments(body))


def messages(body, alone_bytes: int | None = None) -> Iterator[list[memoryview]]:
  """A body's messages, each a list of byte views (no copy): see the module's docstring.

  Segments of fewer than ``alone_bytes`` fill a message up to ``CHUNK_BYTES``;
  a segment of at least ``alone_bytes`` travels alone, cut every
  ``SEGMENT_BYTES``. Every segment shorter than ``SEGMENT_BYTES`` lies within
  one message, so the receiver uses it in place. ``alone_bytes`` defaults to
  ``CHUNK_BYTES + 1`` (the gRPC path's rule).
  """
  alone_bytes = CHUNK_BYTES + 1 if alone_bytes is None else alone_bytes
  batch, filled = [], 0
  for view in segments(body):
    if filled and (len(view) >= alone_bytes or filled + len(view) > CHUNK_BYTES):
      yield batch
      batch, filled = [], 0
    if len(view) >= alone_bytes:
      for start in range(0, len(view), SEGMENT_BYTES):
        yield [view[start:start + SEGMENT_BYTES]]
      continue
    batch.append(view)
    filled += len(view)
  if batch:
    yield batch


def chunks(body) -> Iterator[bytes]:
  """A body's gRPC messages as ``bytes`` (:func:`messages`; one copy)."""
  for message in messages(body):
    yield b"".join(message)


def receive(parts: Iterator[bytes], size: int, keep_parts: bool = False):
  """A stream of messages as a body of exactly ``size`` bytes (checked as they come).

  Returns:
    one uint8 buffer the messages are copied into, or with ``keep_parts`` the
    messages themselves as uint8 arrays (no copy).
  """
  kept = [] if keep_parts else None
  buf = None if keep_parts else np.empty([size], np.uint8)
  filled = 0
  for part in parts:
    if filled + len(part) > size:
      raise BadMessage(f"the body runs past the {size} bytes its header declared")
    if keep_parts:
      kept.append(np.frombuffer(part, np.uint8))
    else:
      buf[filled:filled + len(part)] = np.frombuffer(part, np.uint8)
    filled += len(part)
  if filled != size:
    raise BadMessage(f"the body has {filled} bytes; its header declared {size}")
  return kept if keep_parts else buf


# -- servers ------------------------------------------------------------------------------------


class Method(NamedTuple):
  """A method of a server.

  Attributes:
    name: the method's name (the stream variant is ``name + "~"``).
    handler: ``(header, body, peer) -> (reply_header, reply_body)``; ``body``
      is a uint8 array or None; ``reply_body`` anything :func:`segments`
      takes, or None. It may raise BadMessage or Refused.
    body_limit: ``header -> int``, the most body bytes this header may bring
      (0: none); checked before any body is received into memory.
    parts: the handler takes the body as the list of messages it came in
      (uint8 arrays, no copy) instead of one buffer.
  """
  name: str
  handler: Callable[[dict, Any, str], tuple[dict, Any]]
  body_limit: Callable[[dict], int] = lambda header: 0
  parts: bool = False


def _abort(context, e: Exception):
  if isinstance(e, BadMessage):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
  context.abort(e.code, str(e))


def _unary(method: Method):
  def handle(request: bytes, context):
    try:
      header, body = unframe(request)
      limit, size = method.body_limit(header), 0 if body is None else body.size
      if size > limit:
        raise BadMessage(f"{method.name}: a body of {size} bytes; allowed: at most "
                         f"{limit} for this header")
      if body is not None and method.parts:
        body = [body]
      reply_header, reply_body = method.handler(header, body, context.peer())
    except (BadMessage, Refused) as e:
      _abort(context, e)
    size = body_bytes(reply_body)
    if size > MAX_MESSAGE_BYTES - _FRAME_MARGIN:
      context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method.name}: a reply of {size} bytes must be streamed ({method.name}~)")
    return frame({**reply_header, "body_bytes": size}, reply_body if size else None)
  return grpc.unary_unary_rpc_method_handler(handle)


def _stream(method: Method):
  def handle(request_iterator, context):
    try:
      header = _metadata_header(context.invocation_metadata())
      size = field(header, "body_bytes", int, 0, method.body_limit(header))
      body = receive(request_iterator, size, method.parts) if size else None
      if not size:
        for _ in request_iterator:
          raise BadMessage(f"{method.name}: a body was sent after declaring none")
      reply_header, reply_body = method.handler(header, body, context.peer())
    except (BadMessage, Refused) as e:
      _abort(context, e)
    size = body_bytes(reply_body)
    context.send_initial_metadata(((HEADER_KEY, encode_header(
        {**reply_header, "body_bytes": size})),))
    if size:
      yield from chunks(reply_body)
  return grpc.stream_stream_rpc_method_handler(handle)


class Server:
  """A run's server: the gRPC server of its methods and, with ``flight``, their Flight twin.

  Made by :func:`bind_server`, it holds its port and answers no call until
  :meth:`serve`: a client's call waits meanwhile (``Client``: gRPC's
  connection wait), so a process binds first (a bad address fails at once)
  and serves once it is ready, with no "not ready yet" answer to poll.

  Attributes:
    grpc: the ``grpc.Server``.
    flight: the Flight server (``runtime/flight.py``) once serving, or None.
    port: the gRPC port.
  """

  def __init__(self, grpc_server: grpc.Server, port: int, address: str,
               check: auth.TokenInterceptor, flight: bool, flight_tls: dict | None):
    self.grpc, self.port, self.flight = grpc_server, port, None
    self._address, self._check = address, check
    self._flight_wanted, self._flight_tls = flight, flight_tls

  def serve(self, methods: list[Method]) -> "Server":
    """Starts serving ``methods`` (and their Flight twins); returns itself.

    Raises:
      ValueError: the Flight data plane cannot be bound (the server is stopped).
    """
    flight_port = {}   # filled once the Flight server is up, before the gRPC server starts
    served = list(methods)
    if self._flight_wanted:
      served.append(Method(FLIGHT_PORT_METHOD, lambda h, b, p: (flight_port, None)))
    handlers = {}
    for method in served:
      handlers[method.name] = _unary(method)
      handlers[method.name + "~"] = _stream(method)
    self.grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if self._flight_wanted:
      from gssp_jax.runtime import flight as flight_lib  # pylint: disable=g-import-not-at-top
      host, _ = check_address("server address", self._address)
      try:
        self.flight = flight_lib.start_server(methods, host, self._check, self._flight_tls)
      except Exception as e:  # pylint: disable=broad-except  (pyarrow's errors: ArrowException...)
        self.grpc.stop(0)
        raise ValueError(f"server address {self._address!r}: its Flight data plane cannot be "
                         f"bound on {host} ({type(e).__name__}: {e}); allowed: an address of "
                         "this machine, or config.dist.data_plane='grpc'") from None
      flight_port["port"] = int(self.flight.port)
    self.grpc.start()
    return self

  def stop(self, grace: float | None) -> threading.Event:
    """Stops both; the event is set once both are down (Flight: at most ``grace`` + 1 s)."""
    grpc_done = self.grpc.stop(grace)
    if self.flight is None:
      return grpc_done
    from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
    flight_done = flight.stop_server(self.flight)
    done = threading.Event()
    threading.Thread(target=lambda: (grpc_done.wait(), flight_done.wait((grace or 0.0) + 1.0),
                                     done.set()), daemon=True).start()
    return done


def bind_server(address: str, credentials: auth.Credentials, *, max_workers: int,
                tls: grpc.ServerCredentials | None = None, flight: bool = False,
                flight_tls: dict | None = None) -> Server:
  """A server bound to ``address``, closed to callers without the token, not serving yet.

  A port the launcher reserved for this process (:func:`port_reserved_for_us`)
  is bound with SO_REUSEPORT beside the launcher's reservation; any other with
  it off. ``Server.serve`` starts it.

  Args:
    flight: serve the methods on Arrow Flight too (``runtime/flight.py``), at a
      free port of the same host that clients ask for (``FlightPort``); they
      carry large bodies there.
    flight_tls: the Flight server's TLS (``auth.flight_server_tls``), given
      exactly when ``tls`` is.

  Raises:
    ValueError: the address cannot be bound (in use, or not an address here).
  """
  check_address("server address", address)
  options = [(k, int(port_reserved_for_us(address)) if k == "grpc.so_reuseport" else v)
             for k, v in SERVER_OPTIONS]
  check = auth.TokenInterceptor(credentials)
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=[check],
                       options=options, maximum_concurrent_rpcs=4 * max_workers)
  try:
    port = (server.add_secure_port(address, tls) if tls is not None
            else server.add_insecure_port(address))
  except RuntimeError as e:
    port, error = 0, f" ({e})"
  else:
    error = " (in use, or not an address of this machine)"
  if port == 0:
    raise ValueError(f"server address {address!r} cannot be bound{error}; allowed: a free "
                     "host:port of this machine (port 0 picks a free one)")
  return Server(server, port, address, check, flight, flight_tls)


def make_server(methods: list[Method], address: str, credentials: auth.Credentials,
                **settings) -> tuple[Server, int]:
  """A server of ``methods`` at ``address``, serving: :func:`bind_server`, then ``serve``.

  Returns:
    ``(server, port)`` (port 0 in ``address`` picks a free one).
  """
  server = bind_server(address, credentials, **settings)
  return server.serve(methods), server.port


# -- clients ------------------------------------------------------------------------------------


class Client:
  """Calls one server of the run with the run's token; retries ``UNAVAILABLE`` for ``retry_seconds``.

  Args:
    address: the server's ``host:port``.
    credentials: the run's credentials (``auth.Credentials``).
    retry_seconds: how long a call retries while the server is unreachable.
    tls: channel credentials (``auth.channel_credentials``), or None.
    server_name: the name the server's certificate must carry, when it is not
      the address's host (TLS only).
  """

  def __init__(self, address: str, credentials: auth.Credentials, *,
               retry_seconds: float = 60.0, tls: grpc.ChannelCredentials | None = None,
               server_name: str = "", flight_tls: dict | None = None):
    self.address, self.retry_seconds = address, float(retry_seconds)
    self._metadata = credentials.metadata
    self._token = credentials.token
    self._tls, self._flight_tls, self._server_name = tls, flight_tls, server_name
    options = list(CHANNEL_OPTIONS)
    if tls is not None:
      if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
      self._channel = grpc.secure_channel(address, tls, options=options)
    else:
      self._channel = grpc.insecure_channel(address, options=options)
    self._methods: dict[str, Any] = {}
    self._lock = threading.Lock()
    self._flight = None        # the server's Flight link once asked (False: it has none)
    self.bytes_sent = 0
    self.bytes_received = 0

  def _flight_link(self):
    """The Flight link of the server (``runtime/flight.py``), or None where it serves none."""
    with self._lock:
      flight = self._flight
    if flight is None:
      try:
        header, _ = self._attempt(FLIGHT_PORT_METHOD, False, {"body_bytes": 0}, None, 0, 10.0,
                                  False)
        port = field(header, "port", int, 1, 65535)
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
          raise
        flight = False
      else:
        from gssp_jax.runtime import flight as flight_lib  # pylint: disable=g-import-not-at-top
        host, _ = check_address("server address", self.address)
        flight = flight_lib.Link(host, port, self._token, self._flight_tls, self._server_name)
      with self._lock:   # another thread may have asked meanwhile: keep one link
        mine, flight = flight, (flight if self._flight is None else self._flight)
        self._flight = flight
      if mine and mine is not flight:
        mine.close()
    return flight or None

  def _forget_flight(self) -> None:
    """Asks for the Flight port again on the next call (the server may have restarted)."""
    with self._lock:
      flight, self._flight = self._flight, None
    if flight:
      flight.close()

  def _method(self, name: str, stream: bool):
    key = name + ("~" if stream else "")
    if key not in self._methods:
      path = f"/{SERVICE}/{key}"
      self._methods[key] = (self._channel.stream_stream(path) if stream
                            else self._channel.unary_unary(path))
    return self._methods[key]

  def call(self, name: str, header: dict[str, Any], body=None, *, reply_limit: int = 0,
           timeout: float | None = None, retry: bool = True, reply_parts: bool = False
           ) -> tuple[dict[str, Any], Any]:
    """One call: ``(reply header, reply body)``; the body is a uint8 array or None.

    Args:
      name: the method.
      header: the request's header (plain values).
      body: the request's body (a buffer or a list of segments), or None.
      reply_limit: the most reply body bytes expected; a larger reply is refused.
      reply_parts: the reply body as the list of messages it came in (uint8
        arrays, no copy) instead of one buffer.
      timeout: seconds for one attempt (None: no deadline).
      retry: retry ``UNAVAILABLE`` until ``retry_seconds`` have passed.

    Raises:
      ServerGone: unreachable for ``retry_seconds``.
      CallError: the server answered with an error status.
    """
    size = body_bytes(body)
    stream = size > CHUNK_BYTES or reply_limit > CHUNK_BYTES
    header = {**header, "body_bytes": size}
    deadline = time.monotonic() + self.retry_seconds
    delay = 0.05
    while True:
      try:
        link = self._flight_link() if stream else None
        if link is not None:
          reply_header, reply = link.call(name, header, body if size else None, reply_limit,
                                          timeout, reply_parts)
        else:
          reply_header, reply = self._attempt(name, stream, header, body if size else None,
                                              reply_limit, timeout, reply_parts)
        break
      except _FAILURES as e:
        code = e.code()
        if code != grpc.StatusCode.UNAVAILABLE:
          raise CallError(name, code, e.details() or "") from None
        self._forget_flight()
        if not retry or not self._await_server(deadline, delay):
          raise ServerGone(f"the server at {self.address} stayed unreachable for "
                           f"{self.retry_seconds:.0f} s (dist.retry_seconds); is it running?"
                           ) from None
        delay = min(2 * delay, 0.25)
    self.bytes_sent += size
    self.bytes_received += body_bytes(reply)
    return reply_header, reply

  def _await_server(self, deadline: float, pause: float) -> bool:
    """After ``pause``, waits until ``deadline`` for a connection; whether there is one.

    gRPC's connection management does the waiting (it reconnects with the
    backoff of ``CHANNEL_OPTIONS``) and returns as soon as the server serves:
    a process that binds before it is ready (``Server.serve``) is called the
    moment it is. The pause spaces out the calls to a server that is connected
    but answered ``UNAVAILABLE`` itself (not yet: e.g. the start barrier).
    """
    time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
    ready = grpc.channel_ready_future(self._channel)
    try:
      ready.result(timeout=max(0.0, deadline - time.monotonic()))
    except grpc.FutureTimeoutError:
      ready.cancel()   # ends its subscription to the channel's state
      return False
    return time.monotonic() < deadline

  def _attempt(self, name, stream, header, body, reply_limit, timeout, reply_parts):
    if not stream:   # the header travels inside the message both ways (:func:`frame`)
      reply = self._method(name, False)(frame(header, body), metadata=self._metadata,
                                        timeout=timeout)
      reply_header, reply = unframe(reply)
      if reply is not None and reply.size > max(reply_limit, 0):
        raise BadMessage(f"{name}: a reply of {reply.size} bytes; expected at most "
                         f"{reply_limit}")
      return reply_header, ([reply] if reply_parts and reply is not None else reply)
    metadata = self._metadata + ((HEADER_KEY, encode_header(header)),)
    parts = chunks(body) if body is not None else iter(())
    responses = self._method(name, True)(parts, metadata=metadata, timeout=timeout)
    metadata_in = responses.initial_metadata()
    if not any(key == HEADER_KEY for key, _ in metadata_in or ()):
      for _ in responses:   # no header: the call failed; iterating raises its status
        pass
    reply_header = _metadata_header(metadata_in)
    size = field(reply_header, "body_bytes", int, 0, max(reply_limit, 0))
    return reply_header, (receive(responses, size, reply_parts) if size else None)

  def close(self) -> None:
    self._forget_flight()
    self._channel.close()


def server_settings(dist) -> dict[str, Any]:
  """:func:`make_server`'s TLS and data-plane arguments from ``config.dist``."""
  flight = dist.get("data_plane", "grpc") == "flight"
  return {"tls": auth.server_credentials(dist), "flight": flight,
          "flight_tls": auth.flight_server_tls(dist) if flight else None}


def client_settings(dist) -> dict[str, Any]:
  """:class:`Client`'s TLS arguments (gRPC's and Flight's) from ``config.dist``."""
  return {"tls": auth.channel_credentials(dist), "server_name": dist.get("tls_server_name", ""),
          "flight_tls": auth.flight_client_tls(dist)}


def check_address(name: str, address: str) -> tuple[str, int]:
  """``host:port`` -> ``(host, port)``; raises ValueError naming ``name`` and the value."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ValueError(f"{name}={address!r} is invalid; allowed: host:port, e.g. "
                     "127.0.0.1:5000 or node17:5000 (port 0..65535)")
  return host.strip("[]"), int(port)
