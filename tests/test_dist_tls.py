"""The run's own mutual TLS (``dist.tls_mode='run'``, the default) closes every port to whoever
lacks the run's secret: a caller gets no byte of a call read, a listener in the run's place gets
nothing it can replay.

Every process derives the same key and certificate from the secret and the run id
(``auth.run_tls_pem``); a handshake completes only between holders of both. The token layer
behind it (``test_dist_hostile.py``, with ``tls_mode='none'``) still checks every call.
"""

from concurrent import futures
import hashlib
import os
import socket
import ssl
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

import dist_replay
from gssp_jax.runtime import auth
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import wire

CREDENTIALS = dist_replay.CREDENTIALS
RUN_TLS = {"data_plane": "flight", "tls_mode": "run"}   # config.dist's defaults
PLAIN = {"data_plane": "flight", "tls_mode": "none"}


def _echo_server(dist, calls: list):
  def echo(header, body, peer):
    calls.append(wire.body_bytes(body))
    return {"n": wire.body_bytes(body), "peer": peer}, None
  method = wire.Method("Echo", echo, lambda header: 64 << 20)
  return endpoints.make_server([method], "127.0.0.1:0", CREDENTIALS, max_workers=4,
                               **endpoints.server_settings(dist, CREDENTIALS))


def test_every_process_of_a_run_derives_the_same_tls_and_another_run_another():
  key, cert = CREDENTIALS.run_tls()
  code = ("import sys, hashlib; sys.path.insert(0, 'tests'); import dist_replay as d; "
          "print(hashlib.sha256(b''.join(d.CREDENTIALS.run_tls())).hexdigest())")
  other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=120, check=True, cwd=os.path.dirname(os.path.dirname(
                                     os.path.abspath(__file__)))).stdout.split()[-1]
  assert other_process == hashlib.sha256(key + cert).hexdigest()
  secret = bytes(range(32))
  pems = {auth.run_tls_pem(secret, "run-a"), auth.run_tls_pem(secret, "run-b"),
          auth.run_tls_pem(bytes(range(1, 33)), "run-a")}
  assert len(pems) == 3 and len({k for k, _ in pems}) == 3   # another run id or secret: another key
  assert b"PRIVATE KEY" not in cert and b"BEGIN CERTIFICATE" in cert


def test_the_run_calls_itself_on_both_planes_and_no_one_else_gets_a_byte_read():
  calls = []
  server, port = _echo_server(RUN_TLS, calls)
  address = f"127.0.0.1:{port}"
  big = np.ones([wire.CHUNK_BYTES + 1], np.uint8)   # over Flight
  try:
    client = endpoints.Client(address, CREDENTIALS, retry_seconds=10,
                              **endpoints.client_settings(RUN_TLS, CREDENTIALS))
    assert client.call("Echo", {})[0]["n"] == 0
    assert client.call("Echo", {}, big)[0]["n"] == big.size
    assert client._flight   # pylint: disable=protected-access  (Flight, under the run's TLS)
    client.close()
    assert calls == [0, big.size]
    # The run's token without its TLS (plain TCP), another run's TLS and token, a TLS client
    # without a certificate: no connection, so no call, not even a refusal by the token check.
    other = auth.Credentials(bytes(range(1, 33)), "another-run")
    strangers = [
        endpoints.Client(address, CREDENTIALS, retry_seconds=1),
        endpoints.Client(address, other, retry_seconds=1,
                         **endpoints.client_settings(RUN_TLS, other)),
        endpoints.Client(address, CREDENTIALS, retry_seconds=1, server_name=auth.RUN_TLS_NAME,
                         tls=grpc.ssl_channel_credentials(CREDENTIALS.run_tls()[1]))]
    for stranger in strangers:
      for body in (None, big):
        with pytest.raises(wire.ServerGone):
          stranger.call("Echo", {}, body, timeout=5)
      stranger.close()
    from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
    flight_tls = auth.flight_client_tls(RUN_TLS, CREDENTIALS)
    for tls in (None, {"tls_root_certs": flight_tls["tls_root_certs"]},
                auth.flight_client_tls(RUN_TLS, other)):
      link = flight.Link("127.0.0.1", server.flight.port, CREDENTIALS.token, tls,
                         auth.RUN_TLS_NAME)
      with pytest.raises(wire.StatusError) as raised:
        link.call("Echo", {"body_bytes": big.size}, big, 0, 5.0, False)
      assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
      link.close()
    assert calls == [0, big.size]
    assert server._check.refused == 0   # pylint: disable=protected-access  (none got that far)
  finally:
    server.stop(0)


# -- a squatter in the run's place --------------------------------------------------------------


class _Squatter:
  """A stranger's TLS server on a port the run's clients call: its own key, a certificate naming
  the run's server name (ALPN h2, as gRPC asks), recording every byte it receives, raw and, once
  a handshake completes, decrypted."""

  def __init__(self):
    key, cert = auth.run_tls_pem(os.urandom(32), "squatter")   # a key of its own, same names
    self.sock = socket.create_server(("127.0.0.1", 0))
    self.port = self.sock.getsockname()[1]
    self.raw, self.plain, self.handshakes = [], [], 0
    self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    self._context.set_alpn_protocols(["h2"])
    self._pems = (key, cert)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, daemon=True)

  def start(self, tmp_path):
    key_path, cert_path = tmp_path / "squatter.key", tmp_path / "squatter.pem"
    key_path.write_bytes(self._pems[0])
    cert_path.write_bytes(self._pems[1])
    self._context.load_cert_chain(str(cert_path), str(key_path))
    self._thread.start()
    return self

  def _serve(self):
    self.sock.settimeout(0.2)
    while not self._stop.is_set():
      try:
        conn, _ = self.sock.accept()
      except OSError:
        continue
      threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

  def _handle(self, conn):
    recorded = bytearray()
    self.raw.append(recorded)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = self._context.wrap_bio(incoming, outgoing, server_side=True)
    conn.settimeout(5.0)
    done = False
    try:
      while not self._stop.is_set():
        data = conn.recv(1 << 16)
        if not data:
          break
        recorded += data
        incoming.write(data)
        try:
          if not done:
            tls.do_handshake()
            done = True
            self.handshakes += 1
          self.plain.append(tls.read(1 << 16))
        except ssl.SSLWantReadError:
          pass
        finally:
          if outgoing.pending:
            conn.sendall(outgoing.read())
    except (OSError, ssl.SSLError):
      pass
    finally:
      conn.close()

  def stop(self):
    self._stop.set()
    self.sock.close()
    self._thread.join(5)


def test_a_squatter_on_the_runs_port_gets_nothing_it_can_replay(tmp_path):
  """A stranger listens where a run's client calls (a port it took first, or a crashed server's
  port): the client checks the squatter's certificate and gives up before sending anything but
  its TLS hello; all the squatter received, sent to the real server, is refused there."""
  squatter = _Squatter().start(tmp_path)
  try:
    client = endpoints.Client(f"127.0.0.1:{squatter.port}", CREDENTIALS, retry_seconds=3,
                              **endpoints.client_settings(RUN_TLS, CREDENTIALS))
    for body in (None, np.ones([wire.CHUNK_BYTES + 1], np.uint8)):
      with pytest.raises(wire.ServerGone):
        client.call("Echo", {"secret-looking": "x"}, body, timeout=5)
    client.close()
  finally:
    squatter.stop()
  received = b"".join(squatter.raw)
  assert received, "the client never called the squatter: the test tested nothing"
  assert squatter.handshakes == 0 and not any(squatter.plain)
  token = CREDENTIALS.token.encode()
  assert token not in received and bytes.fromhex(CREDENTIALS.token) not in received
  calls = []
  server, port = _echo_server(RUN_TLS, calls)
  try:
    for recorded in squatter.raw:   # each connection's bytes, replayed as they came
      with socket.create_connection(("127.0.0.1", port), timeout=5) as replay:
        replay.sendall(bytes(recorded))
        replay.shutdown(socket.SHUT_WR)
        while replay.recv(1 << 16):
          pass
    # The run's own client still gets through: the server was up and serving all along.
    client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=10,
                              **endpoints.client_settings(RUN_TLS, CREDENTIALS))
    assert client.call("Echo", {})[0]["n"] == 0
    client.close()
    assert calls == [0] and server._check.refused == 0   # pylint: disable=protected-access
  finally:
    server.stop(0)


def test_without_tls_a_squatter_takes_the_token_and_calls_the_run_with_it(tmp_path):
  """What the default closes (``dist.tls_mode='none'``, plain TCP): a squatter that answers as a
  gRPC server receives the run's token, and the real server takes calls made with it."""
  del tmp_path
  seen = []
  squatter = grpc.server(futures.ThreadPoolExecutor(2))

  class Record(grpc.GenericRpcHandler):
    def service(self, handler_call_details):
      seen.append(dict(handler_call_details.invocation_metadata))
      return None   # UNIMPLEMENTED

  squatter.add_generic_rpc_handlers((Record(),))
  squatter_port = squatter.add_insecure_port("127.0.0.1:0")
  squatter.start()
  try:
    client = endpoints.Client(f"127.0.0.1:{squatter_port}", CREDENTIALS, retry_seconds=3,
                              **endpoints.client_settings(PLAIN, CREDENTIALS))
    with pytest.raises(wire.CallError):
      client.call("Echo", {}, timeout=5)
    client.close()
  finally:
    squatter.stop(0)
  stolen = seen[0][auth.TOKEN_KEY]
  assert stolen == CREDENTIALS.token
  calls = []
  server, port = _echo_server(PLAIN, calls)
  try:
    thief = grpc.insecure_channel(f"127.0.0.1:{port}")
    thief.unary_unary(f"/{wire.SERVICE}/Echo")(wire.frame({"body_bytes": 0}, None),
                                               metadata=((auth.TOKEN_KEY, stolen),), timeout=10)
    thief.close()
    assert calls == [0]
  finally:
    server.stop(0)


# -- every Flight verb without a token is refused ------------------------------------------------

_FLIGHT_SERVICE = "/arrow.flight.protocol.FlightService/"
_FLIGHT_VERBS = {   # gRPC method -> (streaming request, streaming reply)
    "Handshake": (True, True), "ListFlights": (False, True), "GetFlightInfo": (False, False),
    "PollFlightInfo": (False, False), "GetSchema": (False, False), "DoGet": (False, True),
    "DoPut": (True, True), "DoExchange": (True, True), "DoAction": (False, True),
    "ListActions": (False, True)}


def test_every_flight_verb_without_the_token_is_refused_as_unauthenticated():
  """Below TLS, the token check (``tls_mode='none'``): each of Flight's gRPC methods refuses a
  caller without the token with ``UNAUTHENTICATED`` (pyarrow's own client reports ``GetSchema``'s
  refusal as an ``OSError``; the status on the wire is this one)."""
  calls = []
  server, _ = _echo_server(PLAIN, calls)
  channel = grpc.insecure_channel(f"127.0.0.1:{server.flight.port}")
  try:
    for verb, (stream_in, stream_out) in _FLIGHT_VERBS.items():
      path = _FLIGHT_SERVICE + verb
      kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
              (True, True): channel.stream_stream}[(stream_in, stream_out)]
      request = iter([b""]) if stream_in else b""
      with pytest.raises(grpc.RpcError) as raised:
        reply = kind(path)(request, timeout=10)
        if stream_out:
          list(reply)
      assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, (verb, raised.value)
  finally:
    channel.close()
    server.stop(0)
  assert calls == []
