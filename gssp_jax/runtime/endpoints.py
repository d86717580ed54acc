"""The real runtime's servers and clients, on both data planes: gRPC (``wire``) and Arrow Flight.

``wire`` is the format (headers, frames, bodies, errors, the methods' gRPC
handlers); ``flight`` serves and calls the same methods on Flight. This module
joins them: :func:`bind_server` and :meth:`Server.serve` start a run's server
with its Flight twin, and :class:`Client` sends each call on the plane its
size picks, retrying as ``wire``'s docstring says.
"""

from __future__ import annotations

from concurrent import futures
import threading
import time
from typing import Any

import grpc

from gssp_jax.runtime import auth
from gssp_jax.runtime import flight as flight_lib
from gssp_jax.runtime import wire


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

  def serve(self, methods: list[wire.Method]) -> "Server":
    """Starts serving ``methods`` (and their Flight twins); returns itself.

    Raises:
      ValueError: the Flight data plane cannot be bound (the server is stopped).
    """
    flight_port = {}   # filled once the Flight server is up, before the gRPC server starts
    served = list(methods)
    if self._flight_wanted:
      served.append(wire.Method(wire.FLIGHT_PORT_METHOD, lambda h, b, p: (flight_port, None)))
    self.grpc.add_generic_rpc_handlers((wire.generic_handler(served),))
    if self._flight_wanted:
      host, _ = wire.check_address("server address", self._address)
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
    flight_done = flight_lib.stop_server(self.flight)
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
  wire.check_address("server address", address)
  options = [(k, int(wire.port_reserved_for_us(address)) if k == "grpc.so_reuseport" else v)
             for k, v in wire.SERVER_OPTIONS]
  check = auth.TokenInterceptor(credentials)
  # No maximum_concurrent_rpcs: grpcio counts every call against it, refused ones too (their
  # refusal runs in the pool), so strangers who kept a few hundred refused calls in flight took
  # the run's own calls' places (RESOURCE_EXHAUSTED failed a run). A refusal aborts at once and
  # reads nothing (``auth.TokenInterceptor``), so it holds a pool thread for microseconds; the
  # run's own calls are bounded by the run itself (each mesh and shard has a few in flight).
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                       interceptors=[check], options=options)
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


def make_server(methods: list[wire.Method], address: str, credentials: auth.Credentials,
                **settings) -> tuple[Server, int]:
  """A server of ``methods`` at ``address``, serving: :func:`bind_server`, then ``serve``.

  Returns:
    ``(server, port)`` (port 0 in ``address`` picks a free one).
  """
  server = bind_server(address, credentials, **settings)
  return server.serve(methods), server.port


# -- clients ------------------------------------------------------------------------------------


class Client:
  """Calls one server of the run with its token; retries ``UNAVAILABLE`` and a server's call
  limit for ``retry_seconds``.

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
    options = list(wire.CHANNEL_OPTIONS)
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
        header, _ = self._attempt(wire.FLIGHT_PORT_METHOD, False, {"body_bytes": 0}, None, 0,
                                  10.0, False)
        port = wire.field(header, "port", int, 1, 65535)
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
          raise
        flight = False
      else:
        host, _ = wire.check_address("server address", self.address)
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
      path = f"/{wire.SERVICE}/{key}"
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
      retry: retry ``UNAVAILABLE`` (the server unreachable) and a refusal by the server's call
        limit (``RESOURCE_EXHAUSTED``, :data:`CALL_LIMIT_DETAILS`) until ``retry_seconds`` have
        passed, with a backoff of 50 ms doubling to 250 ms (1 s for the limit).

    Raises:
      wire.ServerGone: unreachable for ``retry_seconds``.
      wire.CallError: the server answered with an error status.
    """
    size = wire.body_bytes(body)
    stream = size > wire.CHUNK_BYTES or reply_limit > wire.CHUNK_BYTES
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
      except wire.FAILURES as e:
        code = e.code()
        if _busy(code, e.details()):   # the server's call limit: it ran nothing of this call
          if not retry or time.monotonic() + delay >= deadline:
            raise wire.CallError(name, code, e.details() or "") from None
          time.sleep(delay)
          delay = min(2 * delay, 1.0)
          continue
        if code != grpc.StatusCode.UNAVAILABLE:
          raise wire.CallError(name, code, e.details() or "") from None
        self._forget_flight()
        if not retry or not self._await_server(deadline, delay):
          raise wire.ServerGone(
              f"the server at {self.address} stayed unreachable for {self.retry_seconds:.0f} s "
              "(dist.retry_seconds); is it running, and with this run's secret, GSSP_RUN_ID and "
              "dist.tls_mode? (a TLS handshake that fails reads as unreachable)") from None
        delay = min(2 * delay, 0.25)
    self.bytes_sent += size
    self.bytes_received += wire.body_bytes(reply)
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
      reply = self._method(name, False)(wire.frame(header, body), metadata=self._metadata,
                                        timeout=timeout)
      reply_header, reply = wire.unframe(reply)
      if reply is not None and reply.size > max(reply_limit, 0):
        raise wire.BadMessage(f"{name}: a reply of {reply.size} bytes; expected at most "
                         f"{reply_limit}")
      return reply_header, ([reply] if reply_parts and reply is not None else reply)
    metadata = self._metadata + ((wire.HEADER_KEY, wire.encode_header(header)),)
    parts = wire.chunks(body) if body is not None else iter(())
    responses = self._method(name, True)(parts, metadata=metadata, timeout=timeout)
    metadata_in = responses.initial_metadata()
    if not any(key == wire.HEADER_KEY for key, _ in metadata_in or ()):
      for _ in responses:   # no header: the call failed; iterating raises its status
        pass
    reply_header = wire.metadata_header(metadata_in)
    size = wire.field(reply_header, "body_bytes", int, 0, max(reply_limit, 0))
    return reply_header, (wire.receive(responses, size, reply_parts) if size else None)

  def close(self) -> None:
    self._forget_flight()
    self._channel.close()


# grpcio's refusal of a call past a server's maximum_concurrent_rpcs: the call never reached a
# handler, so it is safe to send again (every push is numbered besides: a retry applies once).
CALL_LIMIT_DETAILS = "Concurrent RPC limit exceeded!"


def _busy(code, details) -> bool:
  """Whether a failed call was turned away by its server's call limit, and may be retried."""
  return code == grpc.StatusCode.RESOURCE_EXHAUSTED and details == CALL_LIMIT_DETAILS


def server_settings(dist, credentials: auth.Credentials) -> dict[str, Any]:
  """:func:`make_server`'s TLS and data-plane arguments from ``config.dist`` (``dist.tls_mode``:
  the run's own mutual TLS, the user's files, or none)."""
  flight = dist.get("data_plane", "grpc") == "flight"
  return {"tls": auth.server_credentials(dist, credentials), "flight": flight,
          "flight_tls": auth.flight_server_tls(dist, credentials) if flight else None}


def client_settings(dist, credentials: auth.Credentials) -> dict[str, Any]:
  """:class:`Client`'s TLS arguments (gRPC's and Flight's) from ``config.dist``."""
  return {"tls": auth.channel_credentials(dist, credentials),
          "server_name": auth.server_name(dist),
          "flight_tls": auth.flight_client_tls(dist, credentials)}
