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

This module is the format and the gRPC handlers; ``runtime/endpoints.py``
holds the servers and clients that join it with ``runtime/flight.py``.

The client retries a call that failed with ``UNAVAILABLE`` (not connected, or
the connection dropped mid-call) for up to ``retry_seconds``: every call is
idempotent by design (pushes carry their number, ``runtime/server.py``), so a
retried push is acknowledged, never applied twice. Between attempts it waits
on gRPC's own connection (``grpc.channel_ready_future``), not a timer. Readiness
is the same wait: a process binds its port first and serves once it is ready
(``endpoints.Server.serve``), so no health service is polled. gRPC's built-in
retries stay off: its retry policy allows at most 5 attempts and replays at
most its retry buffer (a large body is not replayed), so it cannot span a
window of a minute; ``wait_for_ready`` with a deadline on every call would
bound the server's time on the call as well, and a push waits for its release
as long as the protocol needs.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, Callable, Iterator, NamedTuple

import grpc
import msgpack
import numpy as np


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


FAILURES = (grpc.RpcError, StatusError)   # what a failed call raises, on either plane


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


def metadata_header(metadata) -> dict[str, Any]:
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


DIGEST_BYTES = 32   # SHA-256


def digest(body) -> bytes:
  """SHA-256 of a body's bytes (a buffer, segments, or None: the empty body), no copy: what a
  shard's receipt for a staged slice names, so that the slice applied is the mesh's own."""
  h = hashlib.sha256()
  if body is not None:
    for segment in segments(body):
      h.update(segment)
  return h.digest()


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
      header = metadata_header(context.invocation_metadata())
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


def generic_handler(methods: list[Method]) -> grpc.GenericRpcHandler:
  """The gRPC handler of ``methods``: each as ``Name`` (unary) and ``Name~`` (a stream)."""
  handlers = {}
  for method in methods:
    handlers[method.name] = _unary(method)
    handlers[method.name + "~"] = _stream(method)
  return grpc.method_handlers_generic_handler(SERVICE, handlers)


def check_address(name: str, address: str) -> tuple[str, int]:
  """``host:port`` -> ``(host, port)``; raises ValueError naming ``name`` and the value."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
    raise ValueError(f"{name}={address!r} is invalid; allowed: host:port, e.g. "
                     "127.0.0.1:5000 or node17:5000 (port 0..65535)")
  return host.strip("[]"), int(port)
