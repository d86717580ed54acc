"""The real runtime treats the network as hostile: strangers, malformed, duplicated and
non-finite pushes, impostor meshes, oversized messages, and bad secrets.

Each case below was possible against the runtime before the sharded rewrite
(one unauthenticated server; see issue 21's measurements). The server here is
the real control plane (``DistServer``, shard 0 in process), its handlers
called directly or through gRPC on loopback; a case passes only if what
arrives is refused *before* anything changes.
"""

import contextlib
from concurrent import futures
import copy
import inspect
import os
import stat
import struct
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest

import dist_replay
import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.runtime import auth
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import server as server_lib
from gssp_jax.runtime import wire
from gssp_jax.base import run as run_lib

CREDENTIALS = dist_replay.CREDENTIALS


def _server(tmp_path, data_dir, scheme="bsp", num_workers=2, num_servers=1, **changes):
  """A control plane without TLS (``dist.tls_mode='none'``) unless ``changes`` say otherwise:
  the token and the checks behind it are under test here, which the default, the run's own
  mutual TLS, keeps strangers from reaching (``test_dist_tls.py``)."""
  config = helpers.mnist_smoke(data_dir, num_workers=num_workers, executor="dist",
                               **{"sync.scheme": scheme, "dist.tls_mode": "none", **changes})
  config_lib.validate_config(config)
  srv = server_lib.DistServer(config, run_lib.prepare_run(config, str(tmp_path)), str(tmp_path),
                              num_servers=num_servers, credentials=CREDENTIALS)
  srv.restore()
  srv.membership.join_by = 0.0   # no start barrier
  return srv


def _join(srv, w, instance="mesh-process"):
  return srv.calls.on_join({"mesh": w, "instance": instance,
                      "config": server_lib.config_id(srv.config)}, None, "test")


def _push_header(srv, w, seq, nnz=-1, instance="mesh-process", **changes):
  return {"mesh": w, "instance": instance, "session": srv.shard_links.session, "seq": seq,
          "iteration": seq - 1, "loss": 1.0, "bytes": srv.pull_bytes, "wire_bytes": 4,
          "nnz": [nnz] * srv.S, "receipts": [], "digests": [b"d" * 32] * (srv.S - 1),
          **changes}


def _gradient(srv, value=0.5):
  leaves = [np.full(shape, value, np.float32) for shape in srv.layout.shapes]
  body, _ = srv.layout.pack_push(0, leaves, [], False)
  return body


def _state_leaves(srv):
  with srv.core0.cond:
    return [np.array(x) for x in jax.tree.leaves(srv.core0.state)]


def _unchanged(srv, before, ops):
  assert srv.core.book.host["pushes"] == 0 and srv.shard_links.ops == ops
  after = _state_leaves(srv)
  assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.fixture
def server(tmp_path, data_dir):
  srv = _server(tmp_path, data_dir)
  yield srv
  srv.close()


# -- strangers ------------------------------------------------------------------------------------


def test_a_stranger_and_a_wrong_secret_are_refused_before_any_handler_runs(server):
  address = server.bind("127.0.0.1:0")
  seen = server.membership.last_seen.copy()
  channel = grpc.insecure_channel(address)
  header = wire.encode_header({"mesh": 0, "instance": "x", "config": "{}", "body_bytes": 0})
  for method in ("Join", "Heartbeat", "Push", "Pull", "Register"):
    with pytest.raises(grpc.RpcError) as raised:   # no token at all
      channel.unary_unary(f"/{wire.SERVICE}/{method}")(
          b"", metadata=((wire.HEADER_KEY, header),), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
  channel.close()
  other = endpoints.Client(address, auth.Credentials(os.urandom(32), "replay-run"), retry_seconds=1)
  with pytest.raises(wire.CallError) as raised:   # another run's secret
    other.call("Join", {"mesh": 0, "instance": "x", "config": server_lib.config_id(
        server.config)}, reply_limit=1 << 20)
  assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED
  other.close()
  # Nothing reached a handler: no mesh joined or counted as alive, nothing refused as a push.
  assert server.membership.instance == [""] * server.W and not server.core.book.host["started"].any()
  np.testing.assert_array_equal(server.membership.last_seen, seen)
  assert server.core.book.host["refused"] == {"nonfinite": 0, "malformed": 0, "duplicate": 0}


def test_heartbeats_of_meshes_that_never_joined_and_refused_joins_are_no_sign_of_life(server):
  before = server.membership.last_seen.copy()
  reply, _ = server.calls.on_heartbeat({"mesh": 1, "instance": "never-joined",
                                  "session": server.shard_links.session}, None, "test")
  assert reply["rejoin"] and not reply["stop"]
  with pytest.raises(wire.Refused, match="config differs"):
    server.calls.on_join({"mesh": 1, "instance": "x", "config": "{}"}, None, "test")
  np.testing.assert_array_equal(server.membership.last_seen, before)


def test_a_second_process_with_the_same_mesh_is_refused_with_a_message(server):
  _join(server, 0, "first")
  _join(server, 1, "other")
  with pytest.raises(wire.Refused, match=r"mesh 0 is held by another process.*each --mesh runs once"
                     ) as raised:
    _join(server, 0, "second")
  assert raised.value.code == grpc.StatusCode.ALREADY_EXISTS
  # ... and its pushes are refused too.
  with pytest.raises(wire.Refused, match="held by another process"):
    server.calls.accept_push(_push_header(server, 0, 1, instance="second"), _gradient(server))


# -- malformed pushes -----------------------------------------------------------------------------


def test_scalars_float64_and_oversized_declarations_are_refused_and_change_nothing(server):
  for w in range(server.W):
    _join(server, w)
  before, ops = _state_leaves(server), server.shard_links.ops
  grad = _gradient(server)
  n = server.layout.grad_size(0)
  bad = {
      "a scalar": np.float32(12.5).reshape(1).view(np.uint8),
      "float64": np.full([n], 0.5, np.float64).view(np.uint8),
      "one value short": grad[:-4],
  }
  for what, body in bad.items():
    with pytest.raises(wire.BadMessage, match="expected"):
      server.calls.accept_push(_push_header(server, 0, 1), body)
  # A 100-byte body that declares every entry as a sparse one: checked against its own size,
  # nothing is allocated for the declared shape.
  with pytest.raises(wire.BadMessage, match="expected"):
    server.calls.accept_push(_push_header(server, 0, 1, nnz=n), np.zeros([100], np.uint8))
  with pytest.raises(wire.BadMessage, match="nnz"):
    server.calls.accept_push(_push_header(server, 0, 1, nnz=n + 1), np.zeros([100], np.uint8))
  # Sparse indices out of range or repeated.
  idx = np.array([3, 3], np.int32).view(np.float32)
  body = np.concatenate([idx, np.ones(2, np.float32)]).view(np.uint8)
  with pytest.raises(wire.BadMessage, match="strictly increasing"):
    server.calls.accept_push(_push_header(server, 0, 1, nnz=2), body)
  for header in (_push_header(server, 0, 3), _push_header(server, 0, 1, iteration=5),
                 _push_header(server, 0, 1, bytes=-1), _push_header(server, 7, 1),
                 _push_header(server, 0, 1, loss="1.0"), _push_header(server, 0, 1, nnz=[-1, -1])):
    with pytest.raises(wire.BadMessage):
      server.calls.accept_push(header, grad)
  _unchanged(server, before, ops)
  assert server.core.book.host["refused"]["malformed"] >= 8


def test_a_nan_gradient_with_a_zero_loss_is_refused_and_the_run_stops_as_diverged(server):
  for w in range(server.W):
    _join(server, w)
  before, ops = _state_leaves(server), server.shard_links.ops
  leaves = [np.full(shape, 0.5, np.float32) for shape in server.layout.shapes]
  leaves[-1].reshape(-1)[0] = np.nan
  body = server.layout.pack_push(0, leaves, [], False)[0]
  _, _, reply = server.calls.accept_push(_push_header(server, 0, 1, loss=0.0), body)
  assert reply["stop"] and "non-finite" in reply["refused"]
  _, _, reply = server.calls.accept_push(_push_header(server, 1, 1, loss=float("inf")), _gradient(server))
  assert reply["stop"] and "non-finite loss" in reply["refused"]
  _unchanged(server, before, ops)
  assert server.core.book.host["refused"]["nonfinite"] == 2
  with pytest.raises(FloatingPointError, match="mesh 0 pushed a non-finite gradient"):
    server.advance()


def test_the_same_push_twice_is_applied_once_and_answered_both_times(server):
  for w in range(server.W):
    _join(server, w)
  first = _gradient(server, 1.0)
  server.calls.accept_push(_push_header(server, 0, 1), first)
  # The retry (a connection that dropped mid-call) carries other bytes: they are not applied.
  _, _, immediate = server.calls.accept_push(_push_header(server, 0, 1), _gradient(server, 7.0))
  assert immediate is None and server.core.book.host["refused"]["duplicate"] == 1
  assert server.core.book.host["pushes"] == 1
  server.calls.accept_push(_push_header(server, 1, 1), _gradient(server, 1.0))   # BSP's barrier
  reply_a, body_a = server.calls.await_release(0, 1, timeout=30)
  reply_b, body_b = server.calls.await_release(0, 1, timeout=30)   # the retry's answer: the same
  assert reply_a == reply_b and wire.join(body_a) == wire.join(body_b)
  assert server.core.book.host["pushes"] == 2 and reply_a["iteration"] == 1
  # BSP averaged two gradients of 1.0, not 1.0 and 7.0: the replica moved by lr * 1.0.
  weights = server.layout.unpack_pull(0, body_a)[0]
  start = server.init_leaves
  lr = float(server.schedule(server.core.book.host["pushes"] // server.W))   # the round's learning rate
  step = weights[0] - start[0]
  assert np.allclose(step, -lr * 1.0 - lr * server.config.optimizer.weight_decay * start[0],
                     rtol=1e-4, atol=1e-6), float(np.abs(step).max())


def test_a_join_refused_for_missing_shards_changes_nothing(tmp_path, data_dir):
  """Past the start barrier with a shard missing, a Join is refused (UNAVAILABLE, retried) and
  the mesh stays unstarted: its retry is a first join again, never a "restarted" mesh."""
  srv = _server(tmp_path, data_dir, num_servers=2)   # shard 1 never registers; no barrier
  try:
    for _ in range(2):   # the first Join and its retry
      with pytest.raises(wire.Refused, match="parameter shards did not all start") as raised:
        _join(srv, 0)
      assert raised.value.code == grpc.StatusCode.UNAVAILABLE
      assert not srv.core.book.host["started"][0] and srv.core.book.host["lost"] == [] and srv.core.book.host["rejoined"] == []
  finally:
    srv.close()


def test_a_push_needs_a_valid_receipt_from_every_other_shard(tmp_path, data_dir):
  srv = _server(tmp_path, data_dir, num_servers=2)

  class Link:   # stands for shard 1's process: records the op stream
    index, address, ready = 1, "shard1", True
    sent = []
    send = lambda self, i, op: self.sent.append(i)
    failure = lambda self: None
    close = lambda self: None
    saved = lambda self, step, timeout: None   # (its checkpoint: not part of this test)

  srv.shard_links.links[1] = Link()
  srv.shard_links._op_log = None   # pylint: disable=protected-access
  try:
    for w in range(srv.W):
      _join(srv, w)
    grad = _gradient(srv)
    size = srv.layout.push_limit(1, -1)
    mine, theirs = [b"m" * 32], [b"t" * 32]   # the mesh's digest of its slice; another's
    forged = auth.Credentials(os.urandom(32), "replay-run").receipt(1, 0, 1, srv.shard_links.session, size,
                                                                      mine[0])
    for receipts in ([], [forged], [CREDENTIALS.receipt(1, 0, 2, srv.shard_links.session, size, mine[0])],
                     [CREDENTIALS.receipt(1, 0, 1, srv.shard_links.session, size + 4, mine[0])],
                     [CREDENTIALS.receipt(1, 0, 1, srv.shard_links.session, size, theirs[0])]):
      with pytest.raises(wire.BadMessage, match="receipt"):
        srv.calls.accept_push(_push_header(srv, 0, 1, receipts=receipts, digests=mine), grad)
    assert srv.core.book.host["pushes"] == 0
    good = [CREDENTIALS.receipt(1, 0, 1, srv.shard_links.session, size, mine[0])]
    srv.calls.accept_push(_push_header(srv, 0, 1, receipts=good, digests=mine), grad)
    assert srv.core.book.host["pushes"] == 1
  finally:
    srv.close()


def _flood(address: str, in_flight: int, stop: threading.Event, codes: list) -> None:
  """A stranger (no token) keeping ``in_flight`` unary calls in flight on ``address`` until
  ``stop``: each that ends is sent again; their status codes go to ``codes``."""
  channel = grpc.insecure_channel(address)
  call = channel.unary_unary(f"/{wire.SERVICE}/Push")
  header = ((wire.HEADER_KEY, wire.encode_header({"mesh": 0, "body_bytes": 0})),)
  pending = set()
  try:
    while not stop.is_set():
      while len(pending) < in_flight:
        pending.add(call.future(b"x" * 64, metadata=header, timeout=30))
      done = [f for f in pending if f.done()]
      for f in done:
        pending.discard(f)
        codes.append(f.code())
      if not done:
        time.sleep(0.001)
  finally:
    for f in pending:
      f.cancel()
    channel.close()


def test_a_flood_of_refused_calls_never_takes_the_place_of_the_runs_own_calls():
  """300 unauthenticated calls kept in flight while the run's own calls keep most of the pool
  busy: every refusal is UNAUTHENTICATED, and every call of the run is answered (a server with
  grpcio's call limit refused them with RESOURCE_EXHAUSTED: refusals counted against it)."""
  busy = threading.Semaphore(0)

  def slow(header, body, peer):
    del body, peer
    busy.release()
    time.sleep(header["seconds"])
    return {}, None
  methods = [wire.Method("Slow", slow), wire.Method("Echo", lambda h, b, p: ({"n": h["n"]}, None))]
  grpc_server, port = endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=4)
  address = f"127.0.0.1:{port}"
  client = endpoints.Client(address, CREDENTIALS, retry_seconds=0.5)
  stop, codes, answered = threading.Event(), [], []
  stranger = threading.Thread(target=_flood, args=(address, 300, stop, codes), daemon=True)
  sleepers = [threading.Thread(target=client.call, args=("Slow", {"seconds": 3.0}), daemon=True)
              for _ in range(3)]   # 3 of the 4 pool threads held by the run's own calls
  try:
    for t in sleepers:
      t.start()
    for _ in sleepers:
      assert busy.acquire(timeout=10)
    stranger.start()
    assert _until(lambda: len(codes) >= 1000, 20), len(codes)
    for n in range(50):   # retry_seconds 0.5: a refusal by a call limit would not be waited out
      answered.append(client.call("Echo", {"n": n})[0]["n"])
  finally:
    stop.set()
    stranger.join(timeout=30)
    for t in sleepers:
      t.join(timeout=10)
    client.close()
    grpc_server.stop(0)
  assert answered == list(range(50))
  assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.CANCELLED}, set(codes)
  assert codes.count(grpc.StatusCode.UNAUTHENTICATED) >= 1000


def test_a_client_waits_out_a_servers_call_limit_within_its_retry_time():
  """A server with grpcio's call limit (maximum_concurrent_rpcs=1) refuses a second call at once
  with RESOURCE_EXHAUSTED: the run's client sends it again until it is served, and gives up
  with the code once its retry time has passed (or at once, without retries)."""
  entered, release = threading.Event(), threading.Event()

  def hold(header, body, peer):
    del header, body, peer
    entered.set()
    release.wait(10)
    return {"held": True}, None
  methods = [wire.Method("Hold", hold), wire.Method("Echo", lambda h, b, p: ({"n": h["n"]}, None))]
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), maximum_concurrent_rpcs=1,
                       interceptors=[auth.TokenInterceptor(CREDENTIALS)])
  server.add_generic_rpc_handlers((wire.generic_handler(methods),))
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  address = f"127.0.0.1:{port}"
  patient = endpoints.Client(address, CREDENTIALS, retry_seconds=20)
  hasty = endpoints.Client(address, CREDENTIALS, retry_seconds=0.3)
  holder = threading.Thread(target=patient.call, args=("Hold", {}), daemon=True)
  try:
    holder.start()
    assert entered.wait(10)
    with pytest.raises(wire.CallError) as raised:
      hasty.call("Echo", {"n": 1}, retry=False)
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(wire.CallError) as raised:   # retried for 0.3 s, still held
      hasty.call("Echo", {"n": 2})
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    threading.Timer(0.5, release.set).start()
    assert patient.call("Echo", {"n": 3})[0]["n"] == 3   # served once the limit frees
  finally:
    release.set()
    holder.join(timeout=10)
    patient.close()
    hasty.close()
    server.stop(0)


# -- the wire's limits ----------------------------------------------------------------------------


def _echo_server(flight=False, calls=None, max_workers=4):
  def echo(header, body, peer):
    del peer
    if calls is not None:
      calls.append(header)
    return {"n": wire.body_bytes(body), "parts": isinstance(body, list)}, body
  methods = [wire.Method("Echo", echo, lambda header: 40 << 20),
             wire.Method("EchoParts", echo, lambda header: 40 << 20, parts=True)]
  return endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=max_workers,
                               flight=flight)


@pytest.mark.parametrize("flight", [False, True], ids=["grpc", "flight"])
def test_bodies_travel_exactly_as_one_message_or_in_chunks(flight):
  grpc_server, port = _echo_server(flight)
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=5)
  try:
    for size in (0, 1, 1000, wire.CHUNK_BYTES, wire.CHUNK_BYTES + 1, 3 * wire.CHUNK_BYTES + 7):
      body = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
      header, reply = client.call("Echo", {}, body if size else None, reply_limit=16 << 20)
      assert header["n"] == size
      np.testing.assert_array_equal(reply if size else np.zeros([0], np.uint8),
                                    body if size else np.zeros([0], np.uint8))
    # A body sent as segments, taken and answered as the messages it came in, both ways.
    for size in (1000, wire.CHUNK_BYTES + 1, wire.SEGMENT_BYTES + 3 * wire.CHUNK_BYTES + 7):
      body = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
      segments = [body[:size // 3], body[size // 3:size // 3], body[size // 3:]]
      header, reply = client.call("EchoParts", {}, segments, reply_limit=40 << 20,
                                  reply_parts=True)
      assert header == {"n": size, "parts": True, "body_bytes": size}
      assert isinstance(reply, list) and all(len(m) <= wire.MAX_MESSAGE_BYTES for m in reply)
      np.testing.assert_array_equal(np.concatenate(reply), body)
    # Large bodies went over Flight exactly where the server offers it (dist.data_plane).
    assert (client._flight is not None and client._flight is not False) == flight  # pylint: disable=protected-access
  finally:
    client.close()
    grpc_server.stop(0)


def test_a_unary_message_carries_its_header_and_an_aligned_body_both_ways():
  header = {"mesh": 3, "loss": 0.5, "receipts": [b"r" * 32], "name": "x" * 13}
  tensors = [np.arange(7, dtype=np.float32), np.ones([2, 3], np.float32)]
  strided = np.arange(20, dtype=np.float32)[::2]
  for body, want in ((None, None), (b"abc", b"abc"), (tensors, wire.join(tensors)),
                     (strided, np.ascontiguousarray(strided).tobytes())):
    message = wire.frame(header, body)
    got_header, got = wire.unframe(message)
    assert got_header == header
    if want is None:
      assert got is None
      continue
    assert got.tobytes() == want
    offset = got.ctypes.data - np.frombuffer(message, np.uint8).ctypes.data
    assert offset % wire.FRAME_ALIGN == 0 and np.shares_memory(got, np.frombuffer(message, np.uint8))
  with pytest.raises(wire.BadMessage, match="must be a map"):
    wire.unframe(struct.pack("<I", 1) + b"\x07" + bytes(64))


def test_declared_and_real_sizes_past_the_limits_are_refused_before_they_are_received():
  calls = []
  grpc_server, port = _echo_server(calls=calls)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.CHANNEL_OPTIONS[:1] + [
      ("grpc.max_send_message_length", 64 << 20)])
  token = CREDENTIALS.metadata
  try:
    # A stream that declares 2 GiB: refused on the declaration, nothing allocated.
    header = wire.encode_header({"body_bytes": 2 << 30})
    call = channel.stream_stream(f"/{wire.SERVICE}/Echo~")
    with pytest.raises(grpc.RpcError) as raised:
      list(call(iter([b"x" * 100]), metadata=token + ((wire.HEADER_KEY, header),), timeout=10))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # One message above the run's cap: refused by gRPC itself.
    header = wire.encode_header({"body_bytes": 0})
    with pytest.raises(grpc.RpcError) as raised:
      channel.unary_unary(f"/{wire.SERVICE}/Echo")(
          b"x" * (wire.MAX_MESSAGE_BYTES + 1), metadata=token + ((wire.HEADER_KEY, header),),
          timeout=10)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Unary messages whose header is not msgpack, not a map, longer than allowed or than the
    # message, or missing: refused as they are, no handler runs.
    for message in (struct.pack("<I", 8) + b"\xc1garbage", struct.pack("<I", 1) + b"\x07",
                    struct.pack("<I", wire.MAX_HEADER_BYTES + 1) + bytes(wire.MAX_HEADER_BYTES + 1),
                    struct.pack("<I", 1 << 31) + bytes(100), b"\x05\x00", b""):
      with pytest.raises(grpc.RpcError) as raised:
        channel.unary_unary(f"/{wire.SERVICE}/Echo")(message, metadata=token, timeout=10)
      assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message[:12]
  finally:
    channel.close()
    grpc_server.stop(0)
  assert not calls   # no handler ran
  assert wire.MAX_MESSAGE_BYTES <= 17 << 20   # every message of a run, both ways


def _raw_exchange(port, token, command, batches=(), schema=None):
  """One bare Flight ``DoExchange`` (no wire code): returns the reply's metadata, or raises."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  client = flight.FlightClient(f"grpc://127.0.0.1:{port}")
  headers = [(auth.TOKEN_KEY.encode(), token.encode())] if token is not None else []
  try:
    writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command),
                                        flight.FlightCallOptions(headers=headers, timeout=10))
    writer.begin(schema or pa.schema([("body", pa.uint8())]))
    try:
      for batch in batches:
        writer.write_batch(batch)
      writer.done_writing()
    except flight.FlightError:
      pass
    return reader.read_chunk().app_metadata.to_pybytes()
  finally:
    client.close()


def test_the_flight_data_plane_refuses_strangers_and_bad_bodies_before_any_handler_runs():
  """The Flight endpoint (``dist.data_plane='flight'``) is as closed as the gRPC one: no token
  or a wrong one, a bad command, an unknown method, an oversized declaration, a body longer or
  shorter than declared, a foreign schema and nulls are all refused, and no handler runs."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  from pyarrow import flight  # pylint: disable=g-import-not-at-top
  calls = []
  server, port = _echo_server(flight=True, calls=calls)
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=5)
  try:
    client.call("Echo", {}, np.zeros([wire.CHUNK_BYTES + 1], np.uint8), reply_limit=40 << 20)
    assert len(calls) == 1
    fport = client._flight.client and server.flight.port   # pylint: disable=protected-access
    command = lambda header, name="Echo": wire.encode_header({"m": name, "h": header})
    batch = lambda array: pa.RecordBatch.from_arrays([pa.array(array)], ["body"])
    ok = _raw_exchange(fport, CREDENTIALS.token, command({"body_bytes": 3}),
                       [batch(np.arange(3, dtype=np.uint8))])
    assert wire.decode_header(ok) == {"n": 3, "parts": False, "body_bytes": 3}
    assert len(calls) == 2
    token = CREDENTIALS.token
    cases = [
        (None, command({"body_bytes": 0}), [], None, flight.FlightUnauthenticatedError),
        ("0" * 64, command({"body_bytes": 0}), [], None, flight.FlightUnauthenticatedError),
        (token, b"\xc1garbage", [], None, "INVALID_ARGUMENT"),
        (token, command({"body_bytes": 0}, "Nope"), [], None, "UNIMPLEMENTED"),
        (token, command({"body_bytes": 2 << 30}), [batch(np.zeros(100, np.uint8))], None,
         "INVALID_ARGUMENT"),
        (token, command({"body_bytes": 4}), [batch(np.zeros(100, np.uint8))], None,
         "INVALID_ARGUMENT"),
        (token, command({"body_bytes": 400}), [batch(np.zeros(100, np.uint8))], None,
         "INVALID_ARGUMENT"),
        (token, command({"body_bytes": 800}), [pa.RecordBatch.from_arrays(
            [pa.array(np.zeros(100, np.float64))], ["body"])],
         pa.schema([("body", pa.float64())]), "INVALID_ARGUMENT"),
        (token, command({"body_bytes": 3}), [batch(pa.array([1, None, 3], pa.uint8()))], None,
         "INVALID_ARGUMENT"),
    ]
    for i, (tok, cmd, batches, schema, expected) in enumerate(cases):
      with pytest.raises(flight.FlightError) as raised:
        _raw_exchange(fport, tok, cmd, batches, schema)
      if isinstance(expected, str):
        assert getattr(raised.value, "extra_info", b"") == expected.encode(), (i, raised.value)
      else:
        assert isinstance(raised.value, expected), (i, raised.value)
    assert len(calls) == 2   # none of them reached the handler
  finally:
    client.close()
    server.stop(0)


# A peer that sends the first MiB of a 3 MiB body, says SENT and waits to be killed.
_VANISHING_UPLOAD = {
    "grpc": """
import sys, time, grpc
from gssp_jax.runtime import wire
def parts():
  yield bytes(1 << 20)
  print("SENT", flush=True)
  time.sleep(120)
channel = grpc.insecure_channel(sys.argv[1], options=wire.CHANNEL_OPTIONS)
metadata = ((sys.argv[2], sys.argv[3]), (wire.HEADER_KEY, wire.encode_header(
    {"body_bytes": 3 << 20})))
for _ in channel.stream_stream(f"/{wire.SERVICE}/EchoParts~")(parts(), metadata=metadata):
  pass
""",
    "flight": """
import sys, time
import pyarrow as pa
from pyarrow import flight
from gssp_jax.runtime import wire
client = flight.FlightClient("grpc://" + sys.argv[1])
options = flight.FlightCallOptions(headers=[(sys.argv[2].encode(), sys.argv[3].encode())])
command = wire.encode_header({"m": "EchoParts", "h": {"body_bytes": 3 << 20}})
writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), options)
writer.begin(pa.schema([("body", pa.uint8())]))
writer.write_batch(pa.RecordBatch.from_arrays([pa.array(bytes(1 << 20), pa.uint8())], ["body"]))
print("SENT", flush=True)
time.sleep(120)
""",
}


# A peer that sends a 20 MiB body whole, never reads the echoed reply, says SENT and waits.
_VANISHING_DOWNLOAD = {
    "grpc": """
import sys, time, grpc
from gssp_jax.runtime import wire
body = bytes(20 << 20)
channel = grpc.insecure_channel(sys.argv[1], options=wire.CHANNEL_OPTIONS)
metadata = ((sys.argv[2], sys.argv[3]), (wire.HEADER_KEY, wire.encode_header(
    {"body_bytes": len(body)})))
call = channel.stream_stream(f"/{wire.SERVICE}/EchoParts~")(wire.chunks([body]),
                                                            metadata=metadata)
call.initial_metadata()   # the server has taken the body and started its reply
print("SENT", flush=True)
time.sleep(120)
""",
    "flight": """
import sys, time
import numpy as np
import pyarrow as pa
from pyarrow import flight
from gssp_jax.runtime import flight as flight_lib, wire
client = flight.FlightClient("grpc://" + sys.argv[1])
options = flight.FlightCallOptions(headers=[(sys.argv[2].encode(), sys.argv[3].encode())])
body = np.zeros([20 << 20], np.uint8)
command = wire.encode_header({"m": "EchoParts", "h": {"body_bytes": body.size}})
writer, reader = client.do_exchange(flight.FlightDescriptor.for_command(command), options)
writer.begin(pa.schema([("body", pa.uint8())]))
for batch in flight_lib.batches([body]):
  writer.write_batch(batch)
writer.done_writing()
reader.read_chunk()   # the reply's header: the server is sending
print("SENT", flush=True)
time.sleep(120)
""",
}


def _until(condition, seconds: float) -> bool:
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)
  return condition()


def _tracked(active: list, fn):
  """``fn`` (a function or a generator function) keeping an entry in ``active`` while it runs."""
  if inspect.isgeneratorfunction(fn):
    def run_generator(*args, **kwargs):
      active.append(fn)
      try:
        yield from fn(*args, **kwargs)
      finally:
        active.pop()
    return run_generator

  def run(*args, **kwargs):
    active.append(fn)
    try:
      return fn(*args, **kwargs)
    finally:
      active.pop()
  return run


@contextlib.contextmanager
def _vanishing_peer(plane: str, script: str, calls: list):
  """A one-worker echo server (Flight too for ``plane='flight'``), a client of it, and a peer
  process running ``script`` against the plane's port, once it has said SENT: ``(client,
  peer)``. Afterwards the peer is killed and waited for, the client closed, the server stopped."""
  server, port = _echo_server(flight=plane == "flight", calls=calls, max_workers=1)
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=5)
  address = f"127.0.0.1:{server.flight.port if plane == 'flight' else port}"
  peer = subprocess.Popen([sys.executable, "-c", script, address, auth.TOKEN_KEY,
                           CREDENTIALS.token], stdout=subprocess.PIPE, text=True)
  try:
    assert peer.stdout.readline().strip() == "SENT"
    yield client, peer
  finally:
    peer.kill()
    peer.wait(10)
    client.close()
    server.stop(0).wait(10)


@pytest.mark.parametrize("plane", ["grpc", "flight"])
def test_a_peer_that_vanishes_mid_upload_leaves_nothing_behind(plane, monkeypatch):
  """Killed after a third of its body: the server stops receiving it at once, no handler runs,
  and it goes on serving (the gRPC server has one worker: the next call needs it back)."""
  from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
  receiving = []   # bodies being received now
  monkeypatch.setattr(wire, "receive", _tracked(receiving, wire.receive))
  monkeypatch.setattr(flight, "receive_views", _tracked(receiving, flight.receive_views))
  calls = []
  with _vanishing_peer(plane, _VANISHING_UPLOAD[plane], calls) as (client, peer):
    assert _until(lambda: receiving, 10), "the upload never reached the server"
    peer.kill()
    peer.wait(10)
    assert _until(lambda: not receiving, 15), "the server still waits for the vanished peer"
    body = np.arange(wire.CHUNK_BYTES + 5, dtype=np.uint8) if plane == "flight" else b"x" * 100
    header, _ = client.call("EchoParts", {}, body, reply_limit=40 << 20, timeout=10)
    assert header["n"] == len(body) and len(calls) == 1   # only this call reached the handler


@pytest.mark.parametrize("plane", ["grpc", "flight"])
def test_a_peer_that_vanishes_while_its_reply_is_sent_leaves_nothing_behind(plane, monkeypatch):
  """A peer that stops reading a 20 MiB reply and is killed: the server stops sending it at
  once and goes on serving (the gRPC server has one worker: the next call needs it back)."""
  from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
  sending = []   # replies being sent now
  monkeypatch.setattr(wire, "chunks", _tracked(sending, wire.chunks))
  monkeypatch.setattr(flight, "batches", _tracked(sending, flight.batches))
  calls = []
  with _vanishing_peer(plane, _VANISHING_DOWNLOAD[plane], calls) as (client, peer):
    assert _until(lambda: sending, 30), "the server is not blocked on the unread reply"
    peer.kill()
    peer.wait(10)
    assert _until(lambda: not sending, 15), "the server still sends to the vanished peer"
    header, _ = client.call("EchoParts", {}, b"x" * 100, reply_limit=1 << 20, timeout=10)
    assert header["n"] == 100 and len(calls) == 2   # the vanished call's and this one


def test_flight_keeps_status_codes_and_retries_unavailable():
  """A handler's refusal reaches the client with its gRPC code over Flight; ``UNAVAILABLE`` is
  retried until it passes; a restarted server's new Flight port is found again."""
  state = {"busy": 2}

  def handler(header, body, peer):
    del peer
    if header.get("refuse"):
      raise wire.Refused(grpc.StatusCode.FAILED_PRECONDITION, "not in this session")
    if state["busy"]:
      state["busy"] -= 1
      raise wire.Refused(grpc.StatusCode.UNAVAILABLE, "starting")
    return {"n": wire.body_bytes(body)}, body
  methods = [wire.Method("Echo", handler, lambda header: 40 << 20)]
  server, port = endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=4,
                                       flight=True)
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=10)
  body = np.arange(wire.CHUNK_BYTES + 8, dtype=np.uint8)
  try:
    header, reply = client.call("Echo", {}, body, reply_limit=40 << 20)
    assert header["n"] == body.size and state["busy"] == 0
    np.testing.assert_array_equal(reply, body)
    with pytest.raises(wire.CallError) as raised:
      client.call("Echo", {"refuse": True}, body, reply_limit=40 << 20)
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "not in this session" in raised.value.details
    with pytest.raises(wire.BadMessage, match="allowed: 0..100"):   # a reply over its limit
      client.call("Echo", {}, body, reply_limit=100)
    server.stop(0).wait(10)
    server, _ = endpoints.make_server(methods, f"127.0.0.1:{port}", CREDENTIALS, max_workers=4,
                                      flight=True)
    header, _ = client.call("Echo", {}, body, reply_limit=40 << 20)
    assert header["n"] == body.size
  finally:
    client.close()
    server.stop(0)


@pytest.mark.parametrize("flight", [False, True], ids=["grpc", "flight"])
def test_a_call_waits_for_a_server_that_is_bound_but_not_serving_and_holds_its_port(flight):
  """``endpoints.bind_server`` holds the port and answers nothing until ``serve``: a call made
  meanwhile waits (no "not ready" answer to poll) and is answered once the server serves; a
  stranger cannot bind the port in between. A large body goes over Flight once served."""
  server = endpoints.bind_server("127.0.0.1:0", CREDENTIALS, max_workers=4, flight=flight)
  client = endpoints.Client(f"127.0.0.1:{server.port}", CREDENTIALS, retry_seconds=30)
  body = np.arange(wire.CHUNK_BYTES + 8, dtype=np.uint8) if flight else np.arange(100, dtype=np.uint8)
  replies = []
  caller = threading.Thread(target=lambda: replies.append(
      client.call("Echo", {}, body, reply_limit=40 << 20)))
  try:
    with pytest.raises(ValueError, match="cannot be bound"):
      endpoints.bind_server(f"127.0.0.1:{server.port}", CREDENTIALS, max_workers=2)
    caller.start()
    caller.join(1.0)
    assert caller.is_alive() and not replies, "answered before the server served"
    server.serve([wire.Method("Echo", lambda header, b, peer: ({"n": wire.body_bytes(b)}, b),
                              lambda header: 40 << 20)])
    caller.join(30)
    assert not caller.is_alive(), "the waiting call was never answered"
    assert replies[0][0]["n"] == body.size
    np.testing.assert_array_equal(replies[0][1], body)
  finally:
    client.close()
    server.stop(0).wait(10)
    caller.join(30)


# -- secrets and TLS ------------------------------------------------------------------------------


def test_secrets_are_checked_and_never_readable_by_others(tmp_path):
  path = str(tmp_path / "secret")
  auth.write_secret_file(path, auth.new_secret())
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
  assert len(auth.load_secret({auth.SECRET_FILE_ENV: path})) == 32
  os.chmod(path, 0o644)
  with pytest.raises(auth.SecretError, match="mode 0644; allowed: readable by its owner only"):
    auth.load_secret({auth.SECRET_FILE_ENV: path})
  with pytest.raises(auth.SecretError, match="64 hexadecimal characters"):
    auth.load_secret({auth.SECRET_ENV: "abc123"})
  with pytest.raises(auth.SecretError, match="no run secret: set GSSP_SECRET_FILE"):
    auth.load_secret({})
  with pytest.raises(FileExistsError):   # never overwrites a file
    auth.write_secret_file(path, auth.new_secret())


def _openssl(*args, cwd):
  subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(tmp_path):
  """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
  d = str(tmp_path)
  _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
           "-days", "1", "-subj", "/CN=gssp test CA", cwd=d)
  for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
      f.write(ext + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
             cwd=d)
  return lambda name: os.path.join(d, name)


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="no openssl to make test certificates")
def test_tls_and_mutual_tls(tmp_path):
  path = _certificates(tmp_path)
  method = wire.Method("Echo", lambda header, body, peer: (
      {"peer": peer, "n": wire.body_bytes(body)}, None), lambda header: 40 << 20)
  big = np.ones([wire.CHUNK_BYTES + 1], np.uint8)   # over Flight (dist.data_plane='flight')
  for client_auth in (False, True):
    server_dist = {"tls_mode": "files", "tls_cert": path("server.pem"), "tls_key": path("server.key"),
                   "tls_ca": path("ca.pem"), "tls_client_auth": client_auth,
                   "data_plane": "flight"}
    grpc_server, port = endpoints.make_server([method], "127.0.0.1:0", CREDENTIALS, max_workers=2,
                                              **endpoints.server_settings(server_dist, CREDENTIALS))
    address = f"127.0.0.1:{port}"
    try:
      client_dist = {"tls_mode": "files", "tls_cert": path("client.pem"), "tls_key": path("client.key"),
                     "tls_ca": path("ca.pem"), "tls_client_auth": client_auth}
      client = endpoints.Client(address, CREDENTIALS, retry_seconds=5,
                                **endpoints.client_settings(client_dist, CREDENTIALS))
      assert "peer" in client.call("Echo", {})[0]
      assert client.call("Echo", {}, big)[0]["n"] == big.size
      assert client._flight   # pylint: disable=protected-access  (it went over Flight, with TLS)
      client.close()
      plain = endpoints.Client(address, CREDENTIALS, retry_seconds=1)   # no TLS: no connection
      with pytest.raises((wire.ServerGone, wire.CallError)):
        plain.call("Echo", {}, timeout=5)
      plain.close()
      # Nor straight to the Flight port without TLS.
      from gssp_jax.runtime import flight  # pylint: disable=g-import-not-at-top
      link = flight.Link("127.0.0.1", grpc_server.flight.port, CREDENTIALS.token, None)
      with pytest.raises(wire.StatusError):
        link.call("Echo", {"body_bytes": 0}, None, 0, 5.0, False)
      link.close()
      if client_auth:   # mTLS: a client without a certificate is turned away
        bare_dist = {"tls_mode": "files", "tls_cert": path("client.pem"), "tls_key": "", "tls_ca": path("ca.pem"),
                     "tls_client_auth": False}
        bare = endpoints.Client(address, CREDENTIALS, retry_seconds=1,
                                **endpoints.client_settings(bare_dist, CREDENTIALS))
        with pytest.raises((wire.ServerGone, wire.CallError)):
          bare.call("Echo", {}, timeout=5)
        bare.close()
        link = flight.Link("127.0.0.1", grpc_server.flight.port, CREDENTIALS.token,
                           auth.flight_client_tls(bare_dist, CREDENTIALS))
        with pytest.raises(wire.StatusError):
          link.call("Echo", {"body_bytes": 0}, None, 0, 5.0, False)
        link.close()
    finally:
      grpc_server.stop(0)


@pytest.mark.parametrize("changes, match", [
    ({"dist.tls_mode": "files", "dist.tls_cert": "x.pem"},
     r"dist.tls_key='' is invalid.*together"),
    ({"dist.tls_cert": "x.pem"}, r"dist.tls_cert='x.pem' is invalid.*dist.tls_mode='run'"),
    ({"dist.tls_client_auth": True}, r"dist.tls_client_auth=True is invalid.*only with"),
    ({"dist.tls_mode": "mtls"}, r"dist.tls_mode='mtls' is invalid; allowed: 'run' or 'files'"),
    ({"dist.all_lost_timeout": 0.0}, r"dist.all_lost_timeout=0.0 is invalid"),
    ({"dist.num_servers": 0}, r"dist.num_servers=0 is invalid"),
    ({"dist.data_plane": "tcp"}, r"dist.data_plane='tcp' is invalid; allowed: 'flight' or 'grpc'"),
])
def test_bad_dist_settings_are_refused_with_the_reason(changes, match):
  config = helpers.mnist_smoke(None, executor="dist", **changes)
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config)


def test_a_layout_of_more_shards_than_tensors_is_refused():
  params = {"a": np.zeros([3], np.float32), "b": np.zeros([5], np.float32)}
  with pytest.raises(ValueError, match=r"config.dist.num_servers=3 is invalid.*1\.\.2"):
    layout_lib.ShardLayout.balanced(params, {}, 3)
  layout = layout_lib.ShardLayout.balanced(params, {}, 2)
  assert layout.bounds == ((0, 1), (1, 2))
  with pytest.raises(ValueError, match="float32"):
    layout_lib.ShardLayout.balanced({"a": np.zeros([3], np.float64)}, {}, 1)


def test_a_mesh_that_hung_stops_beating_and_beats_again_once_it_rejoins():
  """After ``dist.hang_timeout`` without progress the heartbeat thread stops (so the server
  drops the hung mesh); the rejoin that follows its recovery starts it again."""
  from gssp_jax.runtime import worker  # pylint: disable=g-import-not-at-top
  beats = []
  method = wire.Method("Heartbeat", lambda header, body, peer: (
      beats.append(header["session"]) or {"stop": False, "rejoin": False}, None))
  grpc_server, port = endpoints.make_server([method], "127.0.0.1:0", CREDENTIALS, max_workers=2)
  config = helpers.mnist_smoke(None, **{"dist.heartbeat_timeout": 0.4, "dist.hang_timeout": 0.5})
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=5)
  heart = worker._Heartbeat(client, 0, "i", config)   # pylint: disable=protected-access
  try:
    deadline = time.monotonic() + 30
    while heart._thread.is_alive() and time.monotonic() < deadline:   # pylint: disable=protected-access
      time.sleep(0.05)
    assert not heart._thread.is_alive() and beats   # pylint: disable=protected-access
    count = len(beats)
    time.sleep(0.5)
    assert len(beats) == count   # silent while hung
    heart.session = "after-rejoin"
    heart.ensure_running()
    while "after-rejoin" not in beats and time.monotonic() < deadline:
      time.sleep(0.05)
    assert "after-rejoin" in beats
  finally:
    heart.close()
    client.close()
    grpc_server.stop(0)


def test_a_round_op_is_checked_field_by_field_the_merge_weight_included():
  """A shard applies a ``round`` op only if every field has its dtype, length and range; HALoS's
  merge weight (``adopt_weight``, [R] float32 in [0, 1]) travels and is checked like the rest."""
  from gssp_jax.runtime import shard as shard_lib  # pylint: disable=g-import-not-at-top
  from gssp_jax.sync import rounds  # pylint: disable=g-import-not-at-top
  W, R, G = 4, 5, 2
  rnd = rounds.empty_round(0.0, W, R, G, np.zeros([W], np.int32))
  rnd.adopt_weight[0] = 0.25
  args = shard_lib.encode_round(rounds.round_args(rnd))
  decoded = shard_lib.decode_round(args, W, R, G)
  assert decoded["adopt_weight"].dtype == np.float32 and decoded["adopt_weight"][0] == 0.25
  for value in ([1.5] + [1.0] * (R - 1), [float("nan")] * R, [1] * R, [1.0] * (R - 1), None):
    with pytest.raises(wire.BadMessage, match="round field adopt_weight"):
      shard_lib.decode_round({**args, "adopt_weight": value}, W, R, G)


# -- a hostile user of the same host (issue 34): the coordinator's address, files ------------


_LISTEN_SCRIPT = r"""
import sys, jax
from gssp_jax import config as config_lib
from gssp_jax.runtime import launch
port = int(sys.argv[1])
topo = launch.Topology(role="worker", processes_per_mesh=1, mesh=0,
                       coordinator_address=f"127.0.0.1:{port}")
jax.distributed.initialize(**launch.distributed_kwargs(config_lib.default_config(), topo, 0))
listening = []
for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
  try:
    lines = open(table).read().splitlines()[1:]
  except OSError:
    continue
  for line in lines:
    local, state = line.split()[1], line.split()[3]
    address, hexport = local.rsplit(":", 1)
    if state == "0A" and int(hexport, 16) == port:
      listening.append(f"{family}:{address}")
print("LISTEN", ",".join(sorted(listening)), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_a_mesh_coordinator_listens_only_on_the_address_it_advertises(tmp_path):
  """jax's coordination service has no authentication: with ``--coordinator_address`` it
  must not listen on every interface (jax's default ``[::]``) but on that address only."""
  from gssp_jax.runtime import launch  # pylint: disable=g-import-not-at-top
  port = launch.free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", _LISTEN_SCRIPT, str(port)], env=env,
                       capture_output=True, text=True, timeout=120)
  lines = [l for l in out.stdout.splitlines() if l.startswith("LISTEN")]
  assert lines, out.stdout[-2000:] + out.stderr[-3000:]
  listeners = lines[0].split(" ", 1)[1].split(",")
  # 127.0.0.1 in /proc/net/tcp's little-endian hex, or as tcp6's IPv4-mapped ::ffff:127.0.0.1;
  # jax's default was tcp6's any-address (::, all zeros): every interface.
  loopback = {"4:0100007F", "6:0000000000000000FFFF00000100007F"}
  assert listeners and set(listeners) <= loopback, listeners


def test_distributed_kwargs_bind_the_advertised_coordinator_address():
  from gssp_jax.runtime import launch  # pylint: disable=g-import-not-at-top
  topo = launch.Topology(role="worker", processes_per_mesh=2, mesh=0,
                         coordinator_address="127.0.0.1:4567")
  kwargs = launch.distributed_kwargs(config_lib.default_config(), topo, 1)
  assert kwargs["coordinator_bind_address"] == kwargs["coordinator_address"] == "127.0.0.1:4567"
  assert (kwargs["num_processes"], kwargs["process_id"]) == (2, 1)
  detected = launch.distributed_kwargs(config_lib.default_config(),
                                       launch.Topology(role="worker", processes_per_mesh=2), 0)
  assert "coordinator_bind_address" not in detected   # jax detects the cluster and chooses


def _secret_file(path, mode=0o600):
  auth.write_secret_file(str(path), auth.new_secret())
  os.chmod(path, mode)
  return str(path)


def test_a_secret_file_of_another_user_or_behind_a_symlink_is_refused(tmp_path, monkeypatch):
  good = _secret_file(tmp_path / "secret")
  assert len(auth.read_secret_file(good)) == 32
  link = tmp_path / "link"
  os.symlink(good, link)
  with pytest.raises(auth.SecretError, match="symbolic link"):
    auth.read_secret_file(str(link))
  # A file of another user, even of mode 0600 (a stranger who made the workdir's file first).
  monkeypatch.setattr(os, "geteuid", lambda: os.stat(good).st_uid + 1)
  with pytest.raises(auth.SecretError, match="belongs to user id .* not to you"):
    auth.read_secret_file(good)


def test_the_launcher_refuses_a_workdir_others_may_write_or_that_is_not_the_users(
    tmp_path, monkeypatch):
  from gssp_jax.runtime import launch  # pylint: disable=g-import-not-at-top
  config = helpers.mnist_smoke(None, num_workers=2)
  topo = launch.Topology(role="local", num_meshes=2)
  monkeypatch.delenv(auth.SECRET_ENV, raising=False)
  monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
  shared = tmp_path / "shared"
  shared.mkdir()
  os.chmod(shared, 0o777)   # e.g. a workdir a stranger pre-created under /tmp for everyone
  with pytest.raises(auth.SecretError, match="others may replace its files"):
    launch.LocalLauncher([], str(shared), topo, config)
  assert not (shared / launch.SECRET_FILE).exists()
  other = tmp_path / "other"
  other.mkdir()
  uid = os.stat(other).st_uid
  monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
  with pytest.raises(auth.SecretError, match="someone else made it"):
    launch.LocalLauncher([], str(other), topo, config)
  monkeypatch.undo()
  fresh = tmp_path / "fresh" / "run"
  launcher = launch.LocalLauncher([], str(fresh), topo, config)
  assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
  secret = launcher.secret_env[auth.SECRET_FILE_ENV]
  assert len(auth.read_secret_file(secret)) == 32
  launcher._remove_secret()   # pylint: disable=protected-access


def test_a_log_file_replaced_by_a_symlink_is_refused(tmp_path):
  target = tmp_path / "elsewhere.txt"
  target.write_text("")
  log = tmp_path / "server.txt"
  os.symlink(target, log)
  with pytest.raises(auth.SecretError, match="symbolic link"):
    auth.open_private_append(str(log))
  with auth.open_private_append(str(tmp_path / "mesh0.txt")) as f:
    f.write(b"ok\n")
  assert stat.S_IMODE(os.stat(tmp_path / "mesh0.txt").st_mode) == 0o600


@pytest.mark.parametrize("flight", [False, True], ids=["grpc", "flight"])
def test_a_token_of_another_run_with_the_same_secret_is_refused(flight):
  """The documented setup shares one secret file between runs: a token (or a receipt) seen in
  one run must open no other. Both are HMACs of the secret over the run id."""
  secret = bytes(range(32))
  this, earlier = auth.Credentials(secret, "replay-run"), auth.Credentials(secret, "last-week")
  assert this.token != earlier.token
  assert not this.check_receipt(earlier.receipt(1, 0, 1, "s", 8, b"d" * 32), 1, 0, 1, "s", 8,
                                b"d" * 32)
  grpc_server, port = _echo_server(flight)   # this run's (dist_replay.RUN_ID)
  replay = endpoints.Client(f"127.0.0.1:{port}", earlier, retry_seconds=1)
  body = np.arange(wire.CHUNK_BYTES + 5, dtype=np.uint8)   # large: Flight's path where offered
  try:
    with pytest.raises(wire.CallError) as raised:
      replay.call("Echo", {}, body, reply_limit=16 << 20)
    assert raised.value.code == grpc.StatusCode.UNAUTHENTICATED
  finally:
    replay.close()
  ours = endpoints.Client(f"127.0.0.1:{port}", this, retry_seconds=5)
  try:
    assert ours.call("Echo", {}, body, reply_limit=16 << 20)[0]["n"] == body.size
  finally:
    ours.close()
    grpc_server.stop(0)


def test_a_run_needs_a_run_id_and_refuses_a_malformed_one():
  env = {auth.SECRET_ENV: "ab" * 32}
  with pytest.raises(auth.SecretError, match="no run id: set GSSP_RUN_ID"):
    auth.load_credentials(env)
  with pytest.raises(auth.SecretError, match="GSSP_RUN_ID='a b' is invalid"):
    auth.load_credentials({**env, auth.RUN_ID_ENV: "a b"})
  credentials = auth.load_credentials({**env, auth.RUN_ID_ENV: "run-7"})
  assert credentials.run_id == "run-7"


def test_callers_without_the_token_that_never_send_their_message_hold_no_thread():
  """A refusal must not wait for the request: grpcio reads a unary request whole before a unary
  handler runs, so a refusal written as one held a pool thread per silent stranger. Here
  more strangers than the pool has threads open unary calls and never send their message; a
  call of the run is still answered (a deadline, generous for a loaded machine, detects the
  stall: without the fix it is never answered)."""
  grpc_server, port = _echo_server(max_workers=2)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}")
  never = threading.Event()

  def silent():   # a request stream that never yields: no message is ever sent
    never.wait()
    yield b""
  strangers = [channel.stream_unary(f"/{wire.SERVICE}/Echo").future(silent(), timeout=120)
               for _ in range(6)]
  client = endpoints.Client(f"127.0.0.1:{port}", CREDENTIALS, retry_seconds=1)
  try:
    for stranger in strangers:   # each refused at once, without its message
      with pytest.raises(grpc.RpcError) as raised:
        stranger.result(timeout=60)
      assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    header, _ = client.call("Echo", {}, np.arange(10, dtype=np.uint8), reply_limit=1 << 20,
                            timeout=30)
    assert header["n"] == 10
  finally:
    never.set()
    for stranger in strangers:
      stranger.cancel()
    client.close()
    channel.close()
    grpc_server.stop(0)


def _bind_as(uid: int, port: int) -> str:
  """Tries to bind 127.0.0.1:``port`` (with SO_REUSEPORT, as a squatter would) as user ``uid``
  in a forked child (a new interpreter as another user could not read this one's files);
  returns 'bound' or the error."""
  import socket  # pylint: disable=g-import-not-at-top
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:   # the child: drop to ``uid``, try, report, exit at once (no Python cleanup)
    try:
      os.setgid(uid)
      os.setuid(uid)
      s = socket.socket()
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      s.bind(("127.0.0.1", port))
      answer = b"bound"
    except OSError as e:
      answer = str(e.strerror).encode()
    os.write(write, answer)
    os._exit(0)   # pylint: disable=protected-access
  os.close(write)
  os.waitpid(pid, 0)
  with os.fdopen(read, "rb") as f:
    return f.read().decode()


@pytest.mark.filterwarnings("ignore:.*multi-threaded.*fork:DeprecationWarning")
@pytest.mark.skipif(os.geteuid() != 0 or not hasattr(os, "fork"),
                    reason="binds as another user (needs root to switch users)")
def test_no_other_user_can_take_a_port_the_launcher_hands_a_child(tmp_path, monkeypatch):
  """A port number on a child's command line is readable by anyone on the host: the launcher
  holds each port it hands out until the run ends, so a squatter of another user cannot bind
  it first; the shards bind their own (port 0) and report it."""
  from gssp_jax.runtime import launch  # pylint: disable=g-import-not-at-top
  config = helpers.mnist_smoke(None, num_workers=2)
  topo = launch.Topology(role="local", num_meshes=2, processes_per_mesh=2, num_servers=2)
  monkeypatch.delenv(auth.SECRET_ENV, raising=False)
  monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
  launcher = launch.LocalLauncher([], str(tmp_path / "run"), topo, config)
  spawned = []
  monkeypatch.setattr(launcher, "_spawn", lambda name, flags, gpu=None, extra_env=None:
                      spawned.append((name, flags, extra_env or {})))
  try:
    address = launcher.start_server()
    launcher.start_shard(1, address)
    launcher.start_mesh(0, address)
    port = lambda flag: int(flag.rsplit(":", 1)[1])
    server_port = port(address)
    coordinator = [f for _, flags, _ in spawned for f in flags
                   if f.startswith("--coordinator_address=")]
    shard = [f for _, flags, _ in spawned for f in flags if f.startswith("--shard_address=")]
    assert shard == ["--shard_address=127.0.0.1:0"]
    assert len(set(coordinator)) == 1 and len(coordinator) == 2   # both ranks, one address
    # The server is told its port is the launcher's to share; nobody else is.
    assert spawned[0][2] == {wire.RESERVED_PORT_ENV: str(server_port)}
    for p in (server_port, port(coordinator[0])):
      assert _bind_as(65534, p) != "bound", p
  finally:
    launcher._release_ports()   # pylint: disable=protected-access
    launcher._remove_secret()   # pylint: disable=protected-access
  # A port the user gives (config.dist.server_address=HOST:PORT) is held the same way, from the launcher's
  # check to the end: a squatter cannot bind it before the server does and take the calls (and
  # the token) of the shards and meshes that start meanwhile.
  given = launch.free_port()
  topo = launch.Topology(role="local", num_meshes=2, server_address=f"127.0.0.1:{given}")
  launcher = launch.LocalLauncher([], str(tmp_path / "given"), topo, config)
  spawned.clear()
  monkeypatch.setattr(launcher, "_spawn", lambda name, flags, gpu=None, extra_env=None:
                      spawned.append((name, flags, extra_env or {})))
  try:
    assert launcher.start_server() == f"127.0.0.1:{given}"
    assert spawned[0][2] == {wire.RESERVED_PORT_ENV: str(given)}
    assert _bind_as(65534, given) != "bound"
  finally:
    launcher._release_ports()   # pylint: disable=protected-access
    launcher._remove_secret()   # pylint: disable=protected-access
  assert _bind_as(65534, given) == "bound"   # released with the run


def test_the_control_plane_lock_is_plain_and_its_helpers_need_it(server):
  """``server.lock`` is a plain lock: a helper that must run under it refuses to run without
  it, and taking it twice on one thread is reported, not nested."""
  from gssp_jax.runtime import locks  # pylint: disable=g-import-not-at-top
  core, links = server.core, server.shard_links
  for call, name in ((lambda: links.emit({"k": "noop"}), "ShardLinks.emit"),
                     (links.snap, "ShardLinks.snap"),
                     (lambda: core.count_refused("malformed", 0, "a test"),
                      "ProtocolCore.count_refused"),
                     (lambda: core.accept(0, 1, 0.5, 8, 8), "ProtocolCore.accept"),
                     (lambda: core.react(sync.Reaction(), 0.0), "ProtocolCore.react"),
                     (lambda: core.lose(0, 0.0, "a test"), "ProtocolCore.lose"),
                     (core.finish, "ProtocolCore.finish")):
    ops, snaps, host = links.ops, links.snaps, copy.deepcopy(core.book.host)
    with pytest.raises(locks.LockNotHeld, match=f"{name} runs under server.lock"):
      call()
    # Refused before it changed anything.
    assert links.ops == ops and links.snaps == snaps and not core.done
    assert core.book.host["refused"] == host["refused"] and core.book.host["lost"] == host["lost"]
    assert core.book.host["pushes"] == host["pushes"] and core.protocol.alive.all()
  with server.lock:
    with pytest.raises(RuntimeError, match="taken again by the thread that holds it"):
      server.lock.acquire()
    assert server.lock.held()
  assert not server.lock.held()
  with server.changed:   # a Condition over it: wait releases and takes it back
    server.changed.wait(timeout=0.01)
    assert server.lock.held()


def test_a_slice_staged_under_a_meshs_number_by_another_caller_is_never_applied(server):
  """A token holder stages a slice under mesh 0's next push number before the mesh does, and
  tries numbers out of order: a shard takes only the next number, keeps every candidate under
  its digest (none displaces another), refuses past its bound, and applies the one whose digest
  the mesh sent (the ``put`` op names it); the others go."""
  core = server.core0

  def slice_of(value):
    body = _gradient(server, value)
    grads, stats = core.check_push(0, 1, body, -1)
    return grads, stats, wire.digest(body)
  theirs, mine, other, more = slice_of(9.0), slice_of(0.5), slice_of(7.0), slice_of(3.0)
  for seq in (2, 0, 5):   # only push 1 of mesh 0 may be staged now
    with pytest.raises(wire.BadMessage, match=f"push {seq} of mesh 0 is out of order; expected 1"):
      core.stage(0, seq, *theirs)
  assert core.staged == {}
  core.stage(0, 1, *theirs)   # first, as the attacker was
  core.stage(0, 1, *mine)
  core.stage(0, 1, *mine)     # a retry: nothing new
  core.stage(0, 1, *other)
  with pytest.raises(wire.Refused) as refused:
    core.stage(0, 1, *more)
  assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
  with pytest.raises(wire.BadMessage, match="out of order"):
    core.stage(0, 2, *more)
  assert set(core.staged[0]) == {theirs[2], mine[2], other[2]}   # untouched by the refusals
  with server.lock:
    server.shard_links.emit({"k": "put", "w": 0, "seq": 1, "loss": 1.0, "bytes": 4,
                             "d": [mine[2]]})
    server.shard_links.emit({"k": "save", "step": 1})
  core.saved(1, timeout=120)
  assert core.error is None and core.consumed[0] == 1 and core.staged == {}
  with core.cond:
    row = np.concatenate([np.asarray(x)[0].reshape(-1)
                          for x in jax.tree.leaves(core.state.grad_buf)])
  np.testing.assert_array_equal(row, 0.5)   # the mesh's slice, not the 9.0 staged first
  core.stage(0, 1, *mine)   # a retry of the applied push: answered, nothing staged
  with pytest.raises(wire.BadMessage, match="expected 2"):
    core.stage(0, 1, *theirs)
  assert core.staged == {}


def test_a_put_naming_a_slice_that_was_not_staged_stops_the_shard_with_the_reason(server):
  core = server.core0
  body = _gradient(server)
  core.stage(0, 1, *core.check_push(0, 1, body, -1), wire.digest(body))
  with server.lock:
    server.shard_links.emit({"k": "put", "w": 0, "seq": 1, "loss": 1.0, "bytes": 4,
                             "d": [b"x" * 32]})
  assert _until(lambda: core.error is not None, 60)
  assert "push 1 of mesh 0 was never staged here with the digest the mesh sent" in str(
      core.error)


def test_ops_with_malformed_digests_are_refused_before_they_are_queued(server):
  core = server.core0
  good = {"k": "put", "w": 0, "seq": 1, "loss": 1.0, "bytes": 4, "d": [b"d" * 32]}
  assert core._check_op(good)["d"] == [b"d" * 32]   # pylint: disable=protected-access
  for digests in ([], [b"d" * 31], ["d" * 32], [b"d" * 32, b"e" * 32]):
    with pytest.raises(wire.BadMessage, match="digests are invalid"):
      core._check_op({**good, "d": digests})   # pylint: disable=protected-access


def test_a_shards_checkpoint_copy_does_not_hold_up_the_pushes_staged_meanwhile(server,
                                                                               monkeypatch):
  """Shard 0 takes a checkpoint's host copy outside its lock: a push staged meanwhile (what the
  control plane does under ``server.lock``) does not wait for it."""
  core = server.core0
  copying, release = threading.Event(), threading.Event()
  host_copy = type(core)._copy

  def slow_copy(self, op, state):   # a checkpoint's copy that takes as long as the test says
    copying.set()
    release.wait(120)
    return host_copy(self, op, state)
  monkeypatch.setattr(type(core), "_copy", slow_copy)
  with server.lock:
    server.shard_links.emit({"k": "save", "step": 7})
  assert copying.wait(60)
  staged = threading.Event()
  stager = threading.Thread(target=lambda: (core.stage(0, 1, [], [], b"d"), staged.set()),
                            daemon=True)
  stager.start()
  try:
    assert staged.wait(60), "staging a push waited for the checkpoint's host copy"
    with core.cond:
      assert list(core.staged[0]) == [b"d"] and core.applied == 0   # the save: not applied yet
  finally:
    release.set()
  core.saved(7, timeout=120)
  assert core.applied == 1 and core.error is None
