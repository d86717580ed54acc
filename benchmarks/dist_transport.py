r"""The real runtime's data plane: push + pull against the raw gRPC channel; pushes/s against S.

    python -m benchmarks.dist_transport [--models=lenet5,resnet18] \
        [--parts=ratio,chunks,server,shards] [--rounds=5] [--reps=0] [--chunk_mib=1,2,4,8] \
        [--num_servers=1,2,4] [--clients=4] [--seconds=12] [--repeats=2] [--quick] \
        [--allocator=launcher|glibc]

About 13 minutes with the defaults on a 2-core CPU; ``--quick`` (LeNet-5 only,
few repetitions, S = 2 with 2 meshes, 1.5 s runs) in under a minute. Every
server runs in a child process (``multiprocessing`` spawn), so client and
server do not share a GIL; on a small machine they still share its cores.
Payloads are a real model's tensors (shapes from ``jax.eval_shape`` of its
init, values random float32): LeNet-5 (0.25 MB), ResNet-18 (44.7 MB with its
BatchNorm statistics). Every process runs with the malloc settings that the
launcher gives a real run's processes (``launch.ALLOCATOR_ENV``; the
benchmark starts itself again with them), or glibc's defaults with
``--allocator=glibc``. Parts:

* ``ratio``: one push + pull as the runtime moves it with one shard (S = 1)
  against the bare gRPC channel moving the same bytes: ``raw unary`` and
  ``raw stream`` are a bare ``grpc.server`` (no interceptor, no copies)
  answering a prebuilt body of the same size, in one message each way or in
  ``wire.CHUNK_BYTES`` chunks (the faster is the baseline); ``raw unary +
  header`` adds the wire's metadata (the token, a header each way). ``wire``
  is what a mesh and the control plane do around the gradient:
  ``layout.pack_push``, ``endpoints.Client.call`` of a ``endpoints.make_server`` method
  (the token checked) whose handler runs ``layout.unpack_push`` (size,
  finiteness, views) and answers a weights body from a flat float32 array
  (``np.asarray`` of a jax array, as a shard's pull), then
  ``layout.unpack_pull``. No optimizer. The variants alternate within each of
  ``--rounds`` rounds of ``--reps`` exchanges; wall figures are medians over
  every exchange, CPU figures (client + server, both processes' every thread)
  means. A second table times each local step of the wire path alone.
* ``chunks``: the raw stream and the wire path of the largest model for each
  chunk size of ``--chunk_mib`` (client and server set to it).
* ``server``: the full real path, S = 1: a ``DistServer`` (ASP, one mesh, so
  every push is released at once) in a child process, and one mesh running the
  runtime's own mesh code (``MeshWorker._request_push``, ``_accept``,
  ``_fetch_weights``, its finiteness check included) without a model: every
  push goes through gRPC ``Push``, is checked, staged, ``put`` and applied as a
  round on shard 0's device state, and its reply carries the pulled weights.
  Prints ms per push and the share of it that the ``ratio`` part's wire
  exchange accounts for.
* ``shards``: aggregate pushes/s of ``--clients`` meshes (one process each,
  ASP) against S parameter shards (``--num_servers``): the control plane
  (holding shard 0) and S - 1 shard processes started by the shard role's own
  ``shard_process.start``. ``--repeats`` runs per S, the order of S
  alternating; medians. Prints pushes/s, MB/s (push + pull), latency and the
  CPU seconds per push of every process (``/proc/PID/stat``), then a
  projection, labelled as such, for 16 GPU workers pushing at 300-500/s:
  server cores at the measured CPU per push, shard hosts by NIC, and the
  busiest shard's bound (a shard holds whole tensors).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from concurrent import futures

from absl import app
from absl import flags
import grpc
import jax
import jax.numpy as jnp
import numpy as np

from gssp_jax import config as config_lib
from gssp_jax import models
from gssp_jax.runtime import auth
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import server as server_lib
from gssp_jax.runtime import shard_process
from gssp_jax.runtime import wire
from gssp_jax.runtime import worker as worker_lib
from gssp_jax.base import step as step_lib

from benchmarks import common

PARTS = ("ratio", "chunks", "server", "shards")
CONFIGS = {"lenet5": "mnist_lenet5", "resnet18": "cifar10_resnet18"}   # configs/<name>.py

_MODELS = flags.DEFINE_list("models", ["lenet5", "resnet18"], "models: lenet5, resnet18")
_PARTS = flags.DEFINE_list("parts", list(PARTS), "what to measure: " + ", ".join(PARTS))
_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds of the ratio part (variants alternate)")
_REPS = flags.DEFINE_integer("reps", 0, "exchanges per variant and round (0: 20 below 10 MB, "
                             "else 4)")
_CHUNK_MIB = flags.DEFINE_list("chunk_mib", ["1", "2", "4", "8"], "chunk sizes (MiB) of chunks")
_NUM_SERVERS = flags.DEFINE_list("num_servers", ["1", "2", "4"], "S values of the shards part")
_CLIENTS = flags.DEFINE_integer("clients", 4, "concurrent meshes (processes) of the shards part")
_SECONDS = flags.DEFINE_float("seconds", 12.0, "timed seconds per run of server and shards")
_REPEATS = flags.DEFINE_integer("repeats", 2, "runs per setting of server and shards (medians)")
_SHARD_MODEL = flags.DEFINE_string("shard_model", "resnet18", "the model of server and shards")
_ALLOCATOR = flags.DEFINE_enum("allocator", "launcher", list(common.ALLOCATORS),
                               "malloc settings: the launcher's (launch.ALLOCATOR_ENV, as a "
                               "real run's processes have them) or glibc's defaults")
_QUICK = flags.DEFINE_bool("quick", False, "a smoke test in under a minute: lenet5 only, few "
                           "repetitions, S = 1, 2, 2 clients, 2 s runs")

CREDENTIALS = auth.Credentials(bytes(range(32)), "dist-transport")   # fixed: loopback only
RUN_TLS = {"data_plane": "flight", "tls_mode": "run"}   # config.dist of the runtime's default
RAW_SERVICE = "gssp.RawBench"
MB = 1e6
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


# -- payloads ---------------------------------------------------------------------------------


def model_shapes(name: str) -> tuple[list, list]:
  """The parameter and model-state leaves of ``name`` as ``jax.ShapeDtypeStruct`` (no compute)."""
  if name not in CONFIGS:
    raise ValueError(f"model {name!r} is invalid; allowed: {', '.join(CONFIGS)}")
  model = models.create_model(name, num_classes=10)
  x = jax.ShapeDtypeStruct((1,) + common.SHAPES[name], np.float32)
  variables = jax.eval_shape(lambda k, x: model.init(k, x, train=False), jax.random.key(0), x)
  state = {k: v for k, v in variables.items() if k != "params"}
  return jax.tree.leaves(variables["params"]), jax.tree.leaves(state)


def random_leaves(shapes, scale: float = 1.0, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [(scale * rng.standard_normal(s.shape)).astype(np.float32) for s in shapes]


class Payload:
  """A model's push (gradient + statistics) and pull (weights + statistics) with S = 1."""

  def __init__(self, name: str, shapes=None):
    self.name = name
    params, stats = shapes if shapes is not None else model_shapes(name)
    self.grads = random_leaves(params, 1e-3)
    self.stats = random_leaves(stats, 1.0, seed=1)
    self.layout = layout_lib.ShardLayout(
        tuple(tuple(x.shape) for x in params), tuple(tuple(x.shape) for x in stats),
        ((0, len(params)),))
    self.push_bytes = self.layout.push_limit(0, -1)
    self.pull_bytes = self.layout.pull_bytes(0)
    self.header = {"mesh": 0, "instance": "bench", "session": "bench", "seq": 1,
                   "iteration": 0, "loss": 1.0, "bytes": self.push_bytes,
                   "wire_bytes": self.push_bytes, "receipts": []}


def set_chunk_bytes(n: int) -> None:
  """Sets the wire's chunk size in this process (a client's and its server's must agree)."""
  wire.CHUNK_BYTES = n
  wire.MAX_MESSAGE_BYTES = max(n, wire.SEGMENT_BYTES) + (64 << 10)
  limits = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
  for options in (wire.SERVER_OPTIONS, wire.CHANNEL_OPTIONS):
    options[:] = [(k, wire.MAX_MESSAGE_BYTES if k in limits else v) for k, v in options]


def split(data: bytes, size: int) -> list[bytes]:
  return [data[i:i + size] for i in range(0, len(data), size)]


# -- child processes --------------------------------------------------------------------------


def spawn(stack: contextlib.ExitStack, target, *args):
  """Starts ``target(*args, conn)`` in a spawned process, ended when ``stack`` closes; its pipe."""
  ctx = multiprocessing.get_context("spawn")
  parent, conn = ctx.Pipe()
  proc = ctx.Process(target=target, args=(*args, conn), daemon=True)
  proc.start()

  def end():
    with contextlib.suppress(BrokenPipeError, OSError):
      parent.send("stop")
    proc.join(10)
    if proc.is_alive():
      proc.kill()
      proc.join()
  stack.callback(end)
  return proc, parent


def first_message(proc, conn, timeout: float = 300.0):
  """What a started child sends first (its port or address, or that it is ready)."""
  if not conn.poll(timeout):
    raise RuntimeError(f"{proc.name} sent nothing within {timeout:g} s")
  return conn.recv()


def _serve_until_told(conn, message) -> None:
  """Sends ``message``; then answers "cpu" with this process's CPU seconds until anything else."""
  conn.send(message)
  with contextlib.suppress(EOFError):
    while conn.recv() == "cpu":
      conn.send(time.process_time())   # every thread's, ended ones too; ns resolution
  os._exit(0)   # no teardown: nothing of a benchmark's servers needs saving


def child_cpu(conn) -> float:
  conn.send("cpu")
  return conn.recv()


def cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of process ``pid`` (all its threads), from ``/proc/PID/stat``."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rpartition(")")[2].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the ratio part: servers ------------------------------------------------------------------


def start_raw_server(reply: bytes, chunk_bytes: int, tls=None) -> tuple[grpc.Server, int]:
  """A started bare ``grpc.server`` (no interceptor, no copies) answering ``reply``, and its port.

  Keep the server: grpc stops a server that is garbage-collected.

  Methods of ``RAW_SERVICE``: ``Unary`` (one message each way), ``UnaryHeader``
  (the same with the wire's metadata: a header each way) and ``Stream``
  (``reply`` in prebuilt ``chunk_bytes`` messages; the request's are read and
  dropped).
  """
  reply_chunks = split(reply, chunk_bytes)

  def unary(request, context):
    del request, context
    return reply

  def unary_header(request, context):   # the header in metadata both ways (the wire's old way)
    del request
    wire.decode_header(dict(context.invocation_metadata())[wire.HEADER_KEY])
    context.set_trailing_metadata(((wire.HEADER_KEY, wire.encode_header(
        {"seq": 1, "body_bytes": len(reply)})),))
    return reply

  def stream(requests, context):
    del context
    for _ in requests:
      pass
    yield from reply_chunks

  raw = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_UNLIMITED)
  raw.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RAW_SERVICE, {
      "Unary": grpc.unary_unary_rpc_method_handler(unary),
      "UnaryHeader": grpc.unary_unary_rpc_method_handler(unary_header),
      "Stream": grpc.stream_stream_rpc_method_handler(stream)}),))
  port = (raw.add_secure_port("127.0.0.1:0", tls) if tls is not None
          else raw.add_insecure_port("127.0.0.1:0"))
  raw.start()
  return raw, port


def _exchange_servers(name: str, chunk_bytes: int, shapes, conn) -> None:
  """A child: the raw and the wire servers of ``name``'s payload; sends their ports."""
  set_chunk_bytes(chunk_bytes)
  payload = Payload(name, shapes)
  layout = payload.layout
  # The raw servers answer prebuilt bodies, as they are.
  _raw, raw_port = start_raw_server(bytes(payload.pull_bytes), chunk_bytes)
  _raw_tls, raw_tls_port = start_raw_server(bytes(payload.pull_bytes), chunk_bytes,
                                            auth.server_credentials(RUN_TLS, CREDENTIALS))
  weights = jnp.asarray(np.random.default_rng(2).standard_normal(
      payload.pull_bytes // 4).astype(np.float32))

  def push(header, body, peer):
    del peer
    layout.unpack_push(0, body, wire.field(header, "nnz", list)[0])
    return {"seq": header["seq"]}, layout.segments(0, np.asarray(weights))

  limit = lambda header: layout.push_limit(0, wire.field(header, "nnz", list)[0])
  methods = [wire.Method("Push", push, limit, parts=True)]
  _wire, wire_port = endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=4)
  _flight, flight_port = endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=4,
                                               flight=True)
  # The runtime's default: Flight under the run's own mutual TLS (dist.tls_mode='run').
  _tls, tls_port = endpoints.make_server(methods, "127.0.0.1:0", CREDENTIALS, max_workers=4,
                                         **endpoints.server_settings(RUN_TLS, CREDENTIALS))
  # Never returns: the servers live while it serves.
  _serve_until_told(conn, (raw_port, wire_port, flight_port, tls_port, raw_tls_port))


# -- the ratio part: clients ------------------------------------------------------------------


class Exchanges:
  """The three ways to move one push + pull of ``payload``; each a no-argument function."""

  def __init__(self, payload: Payload, ports: tuple[int, int], chunk_bytes: int):
    self.payload = payload
    raw = grpc.insecure_channel(f"127.0.0.1:{ports[0]}", options=_UNLIMITED)
    self.channels = [raw]
    self._unary = raw.unary_unary(f"/{RAW_SERVICE}/Unary")
    self._unary_header = raw.unary_unary(f"/{RAW_SERVICE}/UnaryHeader")
    self._stream = raw.stream_stream(f"/{RAW_SERVICE}/Stream")
    self.request = bytes(payload.push_bytes)
    self.metadata = CREDENTIALS.metadata + ((wire.HEADER_KEY, wire.encode_header(
        {**payload.header, "nnz": [-1], "body_bytes": payload.push_bytes})),)
    self.request_chunks = split(self.request, chunk_bytes)
    raw_tls = grpc.secure_channel(
        f"127.0.0.1:{ports[4]}", auth.channel_credentials(RUN_TLS, CREDENTIALS),
        options=_UNLIMITED + [("grpc.ssl_target_name_override", auth.server_name(RUN_TLS))])
    self.channels.append(raw_tls)
    self._stream_tls = raw_tls.stream_stream(f"/{RAW_SERVICE}/Stream")
    self.client = endpoints.Client(f"127.0.0.1:{ports[1]}", CREDENTIALS, retry_seconds=30)
    # The same client code against a server with the Flight data plane (dist.data_plane).
    self.flight_client = endpoints.Client(f"127.0.0.1:{ports[2]}", CREDENTIALS, retry_seconds=30)
    self.tls_client = endpoints.Client(f"127.0.0.1:{ports[3]}", CREDENTIALS, retry_seconds=30,
                                       **endpoints.client_settings(RUN_TLS, CREDENTIALS))

  def raw_unary(self) -> None:
    reply = self._unary(self.request)
    assert len(reply) == self.payload.pull_bytes

  def raw_unary_header(self) -> None:
    """One message each way, with the wire's metadata: the token, a header each way."""
    reply, call = self._unary_header.with_call(self.request, metadata=self.metadata)
    wire.decode_header(dict(call.trailing_metadata())[wire.HEADER_KEY])
    assert len(reply) == self.payload.pull_bytes

  def raw_stream(self) -> None:
    size = sum(len(part) for part in self._stream(iter(self.request_chunks)))
    assert size == self.payload.pull_bytes

  def raw_stream_tls(self) -> None:
    """The raw stream under the run's mutual TLS: what TLS alone costs."""
    size = sum(len(part) for part in self._stream_tls(iter(self.request_chunks)))
    assert size == self.payload.pull_bytes

  def wire(self, client=None) -> None:
    p = self.payload
    body, nnz = p.layout.pack_push(0, p.grads, p.stats, sparse=False)
    _, reply = (client or self.client).call("Push", {**p.header, "nnz": [nnz]}, body,
                                            reply_limit=p.pull_bytes, reply_parts=True)
    p.layout.unpack_pull(0, reply)

  def wire_flight(self) -> None:
    self.wire(self.flight_client)

  def wire_flight_tls(self) -> None:
    self.wire(self.tls_client)

  def close(self) -> None:
    self.client.close()
    self.flight_client.close()
    self.tls_client.close()
    for channel in self.channels:
      channel.close()


def interleaved(variants: dict, rounds: int, reps: int, cpu) -> tuple[dict, dict]:
  """Wall seconds of every call and CPU seconds per call of every variant.

  Variants alternate, their order rotating per round. ``cpu()`` is the CPU
  seconds used so far, an array (client, server); CPU per call is the total
  over a variant's blocks of calls over their number (it is far less sensitive
  than wall time to other jobs on the machine).
  """
  names = list(variants)
  for fn in variants.values():
    fn()   # connects, and the first call's allocations
  times = {name: [] for name in names}
  used = {name: 0.0 for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      before = cpu()
      for _ in range(reps):
        start = time.perf_counter()
        variants[name]()
        times[name].append(time.perf_counter() - start)
      used[name] += cpu() - before
  return times, {name: used[name] / (rounds * reps) for name in names}


def measure_exchanges(name: str, rounds: int, reps: int, chunk_bytes: int = wire.CHUNK_BYTES,
                      shapes=None,
                      variants=("raw unary", "raw unary + header", "raw stream", "wire",
                                "wire flight", "raw stream tls", "flight run tls")) -> dict:
  """Median wall ms and mean CPU ms (client + server; server alone) per exchange of each variant.

  The server runs in a child process; ``chunk_bytes`` is set in both.
  """
  saved = wire.CHUNK_BYTES
  set_chunk_bytes(chunk_bytes)
  payload = Payload(name, shapes)
  try:
    with contextlib.ExitStack() as stack:
      proc, conn = spawn(stack, _exchange_servers, name, chunk_bytes, shapes)
      ex = Exchanges(payload, first_message(proc, conn), chunk_bytes)
      cpu = lambda: np.array([time.process_time(), child_cpu(conn)])
      try:
        fns = {"raw unary": ex.raw_unary, "raw unary + header": ex.raw_unary_header,
               "raw stream": ex.raw_stream, "wire": ex.wire, "wire flight": ex.wire_flight,
               "raw stream tls": ex.raw_stream_tls, "flight run tls": ex.wire_flight_tls}
        times, used = interleaved({v: fns[v] for v in variants}, rounds, reps, cpu)
      finally:
        ex.close()
  finally:
    set_chunk_bytes(saved)
  return {"payload": payload, "n": rounds * reps,
          **{v: 1e3 * statistics.median(t) for v, t in times.items()},
          "cpu": {v: 1e3 * c.sum() for v, c in used.items()},
          "server_cpu": {v: 1e3 * c[1] for v, c in used.items()}}


def local_steps_ms(payload: Payload, reps: int) -> dict[str, float]:
  """Each local step of the wire path alone, no network (median ms)."""
  p, layout = payload, payload.layout
  body, nnz = layout.pack_push(0, p.grads, p.stats, sparse=False)
  weights = jnp.asarray(np.zeros([p.pull_bytes // 4], np.float32))
  parts = list(wire.chunks(body))
  size = wire.body_bytes(body)
  received = wire.receive(iter(parts), size, keep_parts=True)
  message = wire.frame(p.header, body)
  steps = {
      "pack_push (leaf views)": lambda: layout.pack_push(0, p.grads, p.stats, sparse=False),
      "wire.frame (unary: the one copy)": lambda: wire.frame(p.header, body),
      "wire.unframe (unary: a view)": lambda: wire.unframe(message),
      "wire.chunks (stream: the one copy)": lambda: list(wire.chunks(body)),
      "wire.receive (parts kept)": lambda: wire.receive(iter(parts), size, keep_parts=True),
      "unpack_push (size, finite, views)": lambda: layout.unpack_push(0, received, nnz),
      "np.asarray(jax array)": lambda: np.asarray(weights),
      "layout.segments (views)": lambda: layout.segments(0, np.asarray(weights)),
      "unpack_pull (views)": lambda: layout.unpack_pull(0, received),
  }
  out = {}
  for step, fn in steps.items():
    fn()
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    out[step] = 1e3 * statistics.median(times)
  return out


# -- the server and shards parts: a real control plane, shards and meshes ---------------------


class ShapeTask:
  """What a ``DistServer`` reads of a task, without data: the model's init, a training-set size."""

  def __init__(self, name: str, num_train: int = 50_000):
    self.name, self.num_train = name, num_train
    self.model = models.create_model(name, num_classes=10)

  def init(self, rng):
    variables = self.model.init(rng, jnp.zeros((1,) + common.SHAPES[self.name]), train=False)
    return variables["params"], {k: v for k, v in variables.items() if k != "params"}

  def evaluate(self, params, model_state):
    raise NotImplementedError("the benchmark never evaluates")


def bench_config(name: str, num_meshes: int, num_servers: int):
  """``configs/<model's config>.py`` with ASP on ``num_meshes`` meshes and S shards, long."""
  config = importlib.import_module(f"configs.{CONFIGS[name]}").get_config()
  return config_lib.override(config, {
      "executor": "dist", "sync.scheme": "asp", "num_workers": num_meshes,
      "train.num_epochs": 10_000.0, "dist.num_servers": num_servers})


class BenchMesh(worker_lib.MeshWorker):
  """A one-process mesh without a model: the runtime's own mesh code pushes a fixed gradient.

  Each :meth:`iterate` is a real mesh's iteration minus its compute: fetch the
  weights from every shard (shard 0's came with the last reply), pack and
  check the push, ``PutGrad`` to shards 1..S-1, ``Push`` to the control plane.
  """

  def __init__(self, config, mesh: int, server_address: str, shapes):   # pylint: disable=super-init-not-called
    self.config, self.w, self.rank, self.P = config, mesh, 0, 1
    self.credentials = CREDENTIALS
    self.instance = uuid.uuid4().hex
    params, stats = shapes
    self.grads = random_leaves(params, 1e-3)
    model_stats = random_leaves(stats, 1.0, seed=1)
    self.templates = (self.grads, model_stats)
    self.treedefs = (jax.tree.structure(self.grads), jax.tree.structure(model_stats))
    self.stats_bytes = step_lib.tree_bytes(model_stats)
    self.layout, self.shards, self.seq, self.session = None, [], 0, ""
    self._calls = None
    self.server = endpoints.Client(server_address, CREDENTIALS, retry_seconds=120,
                                   **endpoints.client_settings(config.dist, CREDENTIALS))
    self.job = self._accept(*self._join())

  def iterate(self) -> None:
    _, model_state, _ = self._fetch_weights(self.job, self._shard0)
    header, body = self._request_push(self.job, np.float32(1.0), self.grads, model_state, 0)
    self.job = self._accept(header, body)
    if self.job["stop"]:
      raise RuntimeError(f"the server stopped mesh {self.w}: {header}")

  def close(self) -> None:
    for client in [self.server, *self.shards]:
      client.close()


def _control_plane(name: str, num_meshes: int, num_servers: int, workdir: str, conn) -> None:
  """A child: the ``DistServer`` (shard 0 inside); sends its address."""
  config = bench_config(name, num_meshes, num_servers)
  srv = server_lib.DistServer(config, ShapeTask(name), workdir, num_servers=num_servers,
                              credentials=CREDENTIALS)
  srv.restore()
  address = srv.bind("127.0.0.1:0")
  srv.membership.join_by = 0.0   # no start barrier: meshes retry
  _serve_until_told(conn, address)


def _shard(name: str, num_meshes: int, num_servers: int, index: int, server_address: str,
           workdir: str, conn) -> None:
  """A child: shard ``index``, started as the shard role starts it; sends its address."""
  config = bench_config(name, num_meshes, num_servers)
  handle = shard_process.start(config, workdir, index, num_servers, server_address,
                               "127.0.0.1:0", CREDENTIALS)
  _serve_until_told(conn, handle.address)


def _mesh(name: str, num_meshes: int, num_servers: int, w: int, server_address: str, shapes,
          conn) -> None:
  """A child: mesh ``w`` iterating until told to stop; sends then each iteration's (start, end)."""
  mesh = BenchMesh(bench_config(name, num_meshes, num_servers), w, server_address, shapes)
  mesh.iterate()   # the first pull from every shard
  conn.send("ready")
  spans = []
  while not conn.poll():
    start = time.monotonic()
    mesh.iterate()
    spans.append((start, time.monotonic()))
  conn.recv()
  conn.send(spans)
  mesh.close()
  os._exit(0)


def measure_run(name: str, num_servers: int, num_meshes: int, seconds: float,
                warmup: float = 1.0, shapes=None) -> dict:
  """Pushes/s, latency and CPU per push of a control plane, S - 1 shards and the meshes."""
  shapes = shapes if shapes is not None else model_shapes(name)
  payload = Payload(name, shapes)
  with tempfile.TemporaryDirectory(prefix="gssp_bench_") as workdir, contextlib.ExitStack() as st:
    server = spawn(st, _control_plane, name, num_meshes, num_servers, workdir)
    address = first_message(*server)
    shards = [spawn(st, _shard, name, num_meshes, num_servers, s, address, workdir)
              for s in range(1, num_servers)]
    meshes = [spawn(st, _mesh, name, num_meshes, num_servers, w, address, shapes)
              for w in range(num_meshes)]
    for proc, conn in shards + meshes:   # started together: they import and compile at once
      first_message(proc, conn)
    time.sleep(warmup)
    procs = {"control plane + shard 0": [server[0]],
             **({"shards 1..S-1": [proc for proc, _ in shards]} if shards else {}),
             "meshes": [proc for proc, _ in meshes]}
    cpu0 = {k: sum(cpu_seconds(p.pid) for p in ps) for k, ps in procs.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    cpu1 = {k: sum(cpu_seconds(p.pid) for p in ps) for k, ps in procs.items()}
    spans = []
    for _, conn in meshes:
      conn.send("stop")
    for _, conn in meshes:
      spans += conn.recv()
  done = [end for start, end in spans if t0 <= end <= t1]
  inside = [end - start for start, end in spans if t0 <= start and end <= t1]
  pushes = len(done)
  return {"S": num_servers, "meshes": num_meshes, "seconds": t1 - t0, "pushes": pushes,
          "rate": pushes / (t1 - t0),
          "MB/s": pushes * (payload.push_bytes + payload.pull_bytes) / MB / (t1 - t0),
          "latency_ms": 1e3 * statistics.median(inside) if inside else math.nan,
          "cpu_per_push": {k: (cpu1[k] - cpu0[k]) / max(pushes, 1) for k in procs},
          "push_bytes": payload.push_bytes, "pull_bytes": payload.pull_bytes,
          "shard_bytes": layout_lib.ShardLayout.balanced(*shapes, num_servers).shard_bytes(),
          "largest_tensor": 4 * max(math.prod(x.shape) for x in shapes[0])}


# -- printing ---------------------------------------------------------------------------------


def _mbps(bytes_moved: int, ms: float) -> float:
  return bytes_moved / MB / ms * 1e3


def print_ratio(rows: list[dict]) -> None:
  print("\nPush + pull round trip, S = 1, server in a child process; MB/s counts both directions "
        "(push + pull bytes / round trip); wall ms: medians; CPU ms: client + server, means;"
        " raw = the faster of raw unary and raw stream")
  print("*wire*: dist.data_plane='grpc'; *flight*: 'flight' (the default; bodies over "
        f"{wire.CHUNK_BYTES >> 20} MiB on Arrow Flight, smaller ones as *wire*)")
  print("*flight tls*, *raw tls*: flight and the raw stream under the run's own mutual TLS "
        "(dist.tls_mode='run', the default); the others are plain TCP (dist.tls_mode='none')")
  print("| model | push MB | pull MB | exchanges | raw unary ms | raw unary + header ms |"
        " raw stream ms | wire ms | flight ms | raw tls ms | flight tls ms | raw MB/s |"
        " flight MB/s | wire / raw (wall) | **flight / raw** (wall) |"
        " **flight tls / raw tls** (wall) | flight tls / raw (wall) |"
        " CPU ms raw unary / + header / stream / wire / flight / raw tls / flight tls |"
        " flight / raw (CPU) | flight tls / raw tls (CPU) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    p, cpu = r["payload"], r["cpu"]
    moved = p.push_bytes + p.pull_bytes
    raw = min(r["raw unary"], r["raw stream"])
    raw_cpu = min(cpu["raw unary"], cpu["raw stream"])
    flight, tls, raw_tls = r["wire flight"], r["flight run tls"], r["raw stream tls"]
    print(f"| {p.name} | {p.push_bytes / MB:.2f} | {p.pull_bytes / MB:.2f} | {r['n']} |"
          f" {r['raw unary']:.2f} | {r['raw unary + header']:.2f} | {r['raw stream']:.2f} |"
          f" {r['wire']:.2f} | {flight:.2f} | {raw_tls:.2f} | {tls:.2f} |"
          f" {_mbps(moved, raw):,.0f} | {_mbps(moved, flight):,.0f} | {r['wire'] / raw:.2f} |"
          f" **{flight / raw:.2f}** | **{tls / raw_tls:.2f}** | {tls / raw:.2f} |"
          f" {cpu['raw unary']:.2f} / {cpu['raw unary + header']:.2f} / {cpu['raw stream']:.2f}"
          f" / {cpu['wire']:.2f} / {cpu['wire flight']:.2f} / {cpu['raw stream tls']:.2f}"
          f" / {cpu['flight run tls']:.2f} | {cpu['wire flight'] / raw_cpu:.2f} |"
          f" {cpu['flight run tls'] / cpu['raw stream tls']:.2f} |", flush=True)


def print_local(rows: dict[str, dict]) -> None:
  print("\nThe wire path's local steps alone (no network; median ms)")
  names = list(next(iter(rows.values())))
  print("| step | " + " | ".join(rows) + " |")
  print("|---|" + "---|" * len(rows))
  for step in names:
    print(f"| {step} | " + " | ".join(f"{rows[m][step]:.2f}" for m in rows) + " |")


def print_chunks(name: str, rows: list[tuple[int, dict]]) -> None:
  print(f"\nChunk size, {name} (client and server set to it; wall ms: medians; CPU ms: client +"
        " server, means)")
  print("| chunk MiB | raw stream ms | wire ms | wire MB/s | CPU ms raw stream | CPU ms wire |")
  print("|---|---|---|---|---|---|")
  for mib, r in rows:
    p = r["payload"]
    print(f"| {mib:g} | {r['raw stream']:.1f} | {r['wire']:.1f} |"
          f" {_mbps(p.push_bytes + p.pull_bytes, r['wire']):,.0f} | {r['cpu']['raw stream']:.1f} |"
          f" {r['cpu']['wire']:.1f} |", flush=True)


def median_runs(runs: list[dict]) -> dict:
  """Runs of one setting: their figures' medians; pushes and seconds summed."""
  out = dict(runs[0])
  for key in ("rate", "MB/s", "latency_ms"):
    out[key] = statistics.median(r[key] for r in runs)
  out["cpu_per_push"] = {k: statistics.median(r["cpu_per_push"][k] for r in runs)
                         for k in runs[0]["cpu_per_push"]}
  out["pushes"], out["seconds"] = sum(r["pushes"] for r in runs), sum(r["seconds"] for r in runs)
  out["runs"] = len(runs)
  return out


def server_side(r: dict) -> float:
  return r["cpu_per_push"]["control plane + shard 0"] + r["cpu_per_push"].get("shards 1..S-1", 0.0)


def print_server(r: dict, exchange: dict | None) -> None:
  print(f"\nFull real path, S = 1: DistServer (ASP, 1 mesh) in a child process, the mesh's own "
        f"code in another; {r['runs']} run(s) of {r['seconds'] / r['runs']:.1f} s, medians")
  print("| pushes | ms per push | pushes/s | wire exchange ms (ratio part) | transport share |"
        " server CPU s per push | of it the wire server's (ratio part) | mesh CPU s per push |")
  print("|---|---|---|---|---|---|---|---|")
  cpu = r["cpu_per_push"]
  wire_ms = exchange["wire flight"] if exchange else math.nan
  wire_server = exchange["server_cpu"]["wire flight"] / 1e3 if exchange else math.nan
  print(f"| {r['pushes']} | {r['latency_ms']:.1f} | {r['rate']:.2f} | {wire_ms:.1f} |"
        f" {wire_ms / r['latency_ms']:.0%} | {cpu['control plane + shard 0']:.3f} |"
        f" {wire_server:.3f} | {cpu['meshes']:.3f} |", flush=True)


def print_shards(rows: list[dict]) -> None:
  r0 = rows[0]
  print(f"\nAggregate pushes/s against S: {r0['meshes']} meshes (processes), ASP, "
        f"{r0['push_bytes'] / MB:.1f} MB push + {r0['pull_bytes'] / MB:.1f} MB pull each; "
        f"{r0['runs']} run(s) per S (S order alternating), medians; CPU from /proc/PID/stat")
  print("| S | pushes (all runs) | pushes/s | MB/s (push + pull) | latency ms |"
        " CPU s/push: control plane + shard 0 | shards 1..S-1 (all) | meshes (all) |"
        " server side total |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    cpu = r["cpu_per_push"]
    print(f"| {r['S']} | {r['pushes']} | {r['rate']:.2f} | {r['MB/s']:,.0f} |"
          f" {r['latency_ms']:.0f} | {cpu['control plane + shard 0']:.3f} |"
          f" {cpu.get('shards 1..S-1', 0.0):.3f} | {cpu['meshes']:.3f} | {server_side(r):.3f} |",
          flush=True)


def print_projection(rows: list[dict], exchange: dict | None) -> None:
  """A projection from the measured server-side CPU per push; every assumption printed."""
  moved = rows[0]["push_bytes"] + rows[0]["pull_bytes"]
  costs = {f"measured, S = {r['S']}": server_side(r) for r in rows}
  if exchange:
    costs["the wire server's alone (ratio part; rounds free, e.g. on an accelerator)"] = (
        exchange["server_cpu"]["wire flight"] / 1e3)
  nic = 25e9 / 8 / 1e9   # 25 GbE: 3.1 GB/s each way
  push_gb = rows[0]["push_bytes"] / 1e9
  print(f"\nPROJECTION (not measured): 16 GPU workers, {rows[0]['push_bytes'] / MB:.1f} MB pushed "
        "and as much pulled per push; server cores = pushes/s x server-side CPU s per push, in "
        "cores of this CPU")
  print("| server-side CPU s per push | push + pull GB/s per core | cores for 300 pushes/s"
        f" ({300 * moved / 1e9:.0f} GB/s) | cores for 500 pushes/s ({500 * moved / 1e9:.0f} GB/s) |")
  print("|---|---|---|---|")
  for name, cpu in costs.items():
    print(f"| {cpu:.3f} ({name}) | {moved / cpu / 1e9:.2f} | {math.ceil(300 * cpu)} |"
          f" {math.ceil(500 * cpu)} |")
  for rate in (300, 500):
    each_way, host = rate * push_gb, 8 * rate * push_gb / 16
    print(f"NIC at {rate} pushes/s: {each_way:.1f} GB/s into the shards and as much out: at least "
          f"{math.ceil(each_way / nic)} shard hosts on 25 GbE ({nic:.1f} GB/s each way); a worker "
          f"host of 8 GPUs moves {host:.1f} GB/s each way"
          + (f" ({host / nic:.1f}x 25 GbE)" if host > nic else ""))
  # A shard holds whole tensors (layout.py): the largest tensor bounds the busiest shard.
  big = rows[0]["largest_tensor"]
  print(f"One shard process: its handlers share one interpreter (the GIL), so take about one busy "
        f"core each. A shard holds whole tensors, so its bytes are at least the largest tensor's "
        f"({big / MB:.1f} MB); the busiest shard of each measured S, at that S's server-side CPU "
        "per byte:")
  print("| S | shard MB (measured layout) | busiest shard CPU s per push | its pushes/s at one core |"
        " its GB/s each way at 500 pushes/s |")
  print("|---|---|---|---|---|")
  for r in rows:
    per_byte = server_side(r) / r["push_bytes"]
    busiest = max(r["shard_bytes"])
    print(f"| {r['S']} | {' / '.join(f'{b / MB:.1f}' for b in r['shard_bytes'])} |"
          f" {per_byte * busiest:.3f} | {1 / (per_byte * busiest):.0f} |"
          f" {500 * busiest / 1e9:.1f} |")


def main(argv):
  del argv
  common.run_with_allocator("benchmarks.dist_transport", _ALLOCATOR.value)
  quick = _QUICK.value
  try:
    parts = list(_PARTS.value)
    for p in parts:
      if p not in PARTS:
        raise ValueError(f"--parts entry {p!r} is invalid; allowed: {', '.join(PARTS)}")
    names = ["lenet5"] if quick else _MODELS.value
    shapes = {name: model_shapes(name) for name in set(names) | {_SHARD_MODEL.value}}
    num_servers = [2] if quick else [int(s) for s in _NUM_SERVERS.value]
    chunk_mib = [1.0] if quick else [float(c) for c in _CHUNK_MIB.value]
    if min(num_servers) < 1 or _CLIENTS.value < 1 or _ROUNDS.value < 1 or _REPEATS.value < 1:
      raise ValueError("--num_servers, --clients, --rounds and --repeats must be >= 1")
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  rounds, clients = (2, 2) if quick else (_ROUNDS.value, _CLIENTS.value)
  seconds = 1.5 if quick else _SECONDS.value
  repeats = 1 if quick else _REPEATS.value
  shard_model = "lenet5" if quick else _SHARD_MODEL.value
  print(common.describe_backend())
  print(f"grpcio {grpc.__version__}; loopback; {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the start; chunk {wire.CHUNK_BYTES >> 20} MiB; "
        f"allocator: {_ALLOCATOR.value}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
  exchanges = {}   # model -> its ratio row
  if "ratio" in parts:
    rows, local = [], {}
    for name in names:
      payload_mb = Payload(name, shapes[name]).push_bytes / MB
      reps = 3 if quick else (_REPS.value or (100 if payload_mb < 1 else 20 if payload_mb < 10
                                             else 4))
      rows.append(measure_exchanges(name, rounds, reps, shapes=shapes[name]))
      exchanges[name] = rows[-1]
      local[name] = local_steps_ms(rows[-1]["payload"], 3 if quick else 7)
    print_ratio(rows)
    print_local(local)
  if "chunks" in parts:
    name = max(names, key=lambda n: Payload(n, shapes[n]).push_bytes)
    reps = 2 if quick else (_REPS.value or 3)
    rows = [(mib, measure_exchanges(name, rounds, reps, int(mib * (1 << 20)), shapes[name],
                                    variants=("raw stream", "wire")))
            for mib in chunk_mib]
    print_chunks(name, rows)
  if "server" in parts:
    runs = [measure_run(shard_model, 1, 1, seconds, shapes=shapes[shard_model])
            for _ in range(repeats)]
    print_server(median_runs(runs), exchanges.get(shard_model))
  if "shards" in parts:
    runs = {s: [] for s in num_servers}
    for rep in range(repeats):   # S order alternates, so drift in the machine's load spreads
      for s in (num_servers if rep % 2 == 0 else num_servers[::-1]):
        runs[s].append(measure_run(shard_model, s, clients, seconds, shapes=shapes[shard_model]))
    rows = [median_runs(runs[s]) for s in num_servers]
    print_shards(rows)
    print_projection(rows, exchanges.get(shard_model))
  print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  app.run(main)
