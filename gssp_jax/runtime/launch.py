"""Roles of a real run and the one-host launcher that starts them all.

* ``server``: the parameter server; runs the training loop with the ``dist``
  executor (``server.DistServer``) and writes the workdir's metrics, summary
  and checkpoints.
* ``shard``: parameter shard ``s`` (``1..S-1`` of ``config.dist.num_servers=S``; shard 0
  lives in the server): its tensors of every replica, fed the server's op
  stream (``runtime/shard.py``).
* ``worker``: one process (rank ``r``) of mesh ``m``; a mesh of several
  processes is one ``jax.distributed`` cluster of its own.
* ``local``: this host starts the server, ``S - 1`` shards and ``M x P``
  worker processes on loopback with free ports and a fresh run secret, prints one merged progress line at a time, and
  tears everything down on exit, Ctrl-C or SIGTERM (children also die with it
  if it is killed outright: ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from absl import logging
import ml_collections

from gssp_jax import cli
from gssp_jax import xla_env
from gssp_jax.runtime import auth
from gssp_jax.runtime import wire

ROLES = ("local", "server", "shard", "worker")
PIDS_FILE = "pids.json"
SECRET_FILE = ".secret"   # the local launcher's run secret (mode 0600), removed when it exits
# A process's place in the run (the run's own shape, its worker count, shards and server address,
# is the config's: ``num_workers``, ``dist.num_servers``, ``dist.server_address``).
ENV = {"role": "GSSP_ROLE", "mesh": "GSSP_MESH", "rank": "GSSP_RANK",
       "coordinator_address": "GSSP_COORDINATOR_ADDRESS", "shard": "GSSP_SHARD",
       "shard_address": "GSSP_SHARD_ADDRESS"}
# glibc's malloc in every process the launcher starts (a value already in its environment wins;
# set these yourself for processes you start by hand): buffers up to 64 MB come from the heap
# and up to 256 MB of freed heap stays mapped, so a body's buffers do not fault in fresh pages
# on every push and pull. Without it, a ResNet-18 push + pull took 1.1-1.3x as long over
# Flight and 1.6-1.9x over gRPC streams (docs/PERFORMANCE.md). Ignored by other C libraries.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


SERVER_KEY = "config.dist.server_address"


def server_flag(address: str) -> str:
  """The flag that tells a child process the server's address: the config key, after the
  user's own ``--config.*`` flags (the last of a flag given twice wins)."""
  return f"--{SERVER_KEY}={address}"


def with_allocator_env(env: dict[str, str]) -> dict[str, str]:
  """``env`` with :data:`ALLOCATOR_ENV`'s settings where it has none of its own."""
  return {**ALLOCATOR_ENV, **env}


@dataclasses.dataclass
class Topology:
  """Who is who in a real run: a process's place from flags, else the environment, else the
  defaults; the run's shape from the config (:func:`check_topology` fills it).

  Attributes:
    role: ``local``, ``server``, ``shard`` or ``worker``.
    num_meshes: M, one per protocol worker (``config.num_workers``).
    processes_per_mesh: P; the worker's batch is split over them.
    mesh, rank: a worker process's mesh and rank in it (-1: from the environment
      or, for the rank, from ``jax.distributed``'s cluster detection).
    server_address: the parameter server's ``host:port`` (``config.dist.server_address``).
    coordinator_address: the mesh's ``jax.distributed`` coordinator (P > 1;
      '' lets ``jax.distributed.initialize`` detect SLURM, Open MPI, Kubernetes).
    num_servers: S, the parameter shards (``config.dist.num_servers``; the server holds
      shard 0).
    shard: a shard process's index, ``1..S-1``.
    shard_address: the ``host:port`` a shard process binds (and tells the server).
  """
  role: str = "local"
  num_meshes: int = 0
  processes_per_mesh: int = 1
  mesh: int = -1
  rank: int = -1
  server_address: str = ""
  coordinator_address: str = ""
  num_servers: int = 0
  shard: int = -1
  shard_address: str = ""

  @classmethod
  def from_env(cls, **flags) -> "Topology":
    """Flags given (not None) win; then ``GSSP_*`` environment variables; then defaults."""
    values = {}
    for key, value in flags.items():
      if value is None and key in ENV and os.environ.get(ENV[key]):
        value = os.environ[ENV[key]]
        value = int(value) if key in ("mesh", "rank", "shard") else value
      if value is not None:
        values[key] = value
    return cls(**values)


def check_topology(topo: Topology, config: ml_collections.ConfigDict) -> Topology:
  """Checks the topology against the config and fills the run's shape from it (meshes, shards,
  the server's address: no flag repeats a config key). Raises ValueError naming the bad value."""
  if topo.role not in ROLES:
    raise ValueError(f"--role={topo.role!r} is invalid; allowed: {', '.join(ROLES)}")
  num_workers = config.num_workers
  topo.num_meshes = num_workers   # each mesh is one protocol worker
  topo.num_servers = int(config.dist.get("num_servers", 1))
  topo.server_address = str(config.dist.get("server_address", ""))
  if topo.processes_per_mesh < 1:
    raise ValueError(f"--processes_per_mesh={topo.processes_per_mesh} is invalid; allowed: an "
                     "integer >= 1")
  if config.batch_size % topo.processes_per_mesh:
    raise ValueError(f"--processes_per_mesh={topo.processes_per_mesh} does not divide "
                     f"config.batch_size={config.batch_size} (a mesh splits its worker's batch"
                     " over its processes); allowed: a divisor of the batch size")
  if topo.num_servers < 1:
    raise ValueError(f"config.dist.num_servers={topo.num_servers} is invalid; allowed: an "
                     "integer >= 1 (parameter shards; the server holds shard 0)")
  if topo.server_address:
    wire.check_address(SERVER_KEY, topo.server_address)
  if topo.role == "shard":
    if not 1 <= topo.shard < topo.num_servers:
      raise ValueError(f"--shard={topo.shard} is invalid; allowed: 1..{topo.num_servers - 1} "
                       f"(config.dist.num_servers={topo.num_servers}; shard 0 is the server's)")
    if not topo.server_address:
      raise ValueError(f"{SERVER_KEY} is required for --role=shard (host:port of the "
                       "parameter server)")
    wire.check_address("--shard_address", topo.shard_address or "127.0.0.1:0")
  if topo.role == "worker":
    if not 0 <= topo.mesh < num_workers:
      raise ValueError(f"--mesh={topo.mesh} is invalid; allowed: 0..{num_workers - 1} "
                       f"(or {ENV['mesh']})")
    if not topo.server_address:
      raise ValueError(f"{SERVER_KEY} is required for --role=worker (host:port of the "
                       "parameter server)")
    if topo.processes_per_mesh > 1 and topo.coordinator_address:
      wire.check_address("--coordinator_address", topo.coordinator_address)
  return topo


def free_port(host: str = "127.0.0.1") -> int:
  """A port free now (closed again at once: another process may take it before it is used;
  the launcher reserves its children's ports instead, :func:`reserve_port`)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
  """A socket bound to ``port`` of ``host`` (0: a free one) with SO_REUSEPORT, never listening:
  keep it open.

  While it is open, Linux lets only sockets of this user with SO_REUSEPORT bind
  the port (a child told so by ``wire.RESERVED_PORT_ENV``, jax's coordination
  service), so another user who reads the port on a child's command line
  cannot take it first. It never listens, so it takes no connections.

  Raises:
    ValueError: ``port`` is taken (by anyone).
  """
  s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
  try:
    s.bind((host, port))
  except OSError as e:
    s.close()
    raise ValueError(f"{SERVER_KEY}={host}:{port}: port {port} cannot be bound here "
                     f"({e.strerror}); allowed: a free port, or 0 for any") from None
  return s


def visible_gpus() -> list[str]:
  """This host's GPU ids: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``'s; [] without."""
  env = os.environ.get("CUDA_VISIBLE_DEVICES")
  if env is not None:
    return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return []
  return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]


# -- the roles ------------------------------------------------------------------------------------


def check_bindable(name: str, address: str, timeout: float = 10.0) -> None:
  """Raises ValueError, within ``timeout`` seconds, unless ``address`` can be bound here.

  Checked before anything is built: a port in use or an address of another
  machine is reported at once (a name that does not resolve, within
  ``timeout``), not after the model and data are loaded.
  """
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  host, port = wire.check_address(name, address)
  pool = concurrent.futures.ThreadPoolExecutor(1)
  try:
    infos = pool.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM).result(timeout)
  except concurrent.futures.TimeoutError:
    raise ValueError(f"{name}={address!r}: {host!r} did not resolve within {timeout:g} s") from None
  except OSError as e:
    raise ValueError(f"{name}={address!r}: {host!r} does not resolve ({e.strerror})") from None
  finally:
    pool.shutdown(wait=False)
  family, _, _, _, sockaddr = infos[0]
  with socket.socket(family, socket.SOCK_STREAM) as s:
    # As gRPC binds its servers: a port whose last server died moments ago (its connections in
    # TIME_WAIT) is free to a new one (a restarted server), a port another socket listens on not.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if wire.port_reserved_for_us(address):   # beside the launcher's reservation, as grpc will
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
      s.bind(sockaddr)
    except OSError as e:
      raise ValueError(f"{name}={address!r} cannot be bound here ({e.strerror}); allowed: a "
                       "free port of an address of this machine (port 0 for any)") from None


def server_config(config: ml_collections.ConfigDict, topo: Topology) -> ml_collections.ConfigDict:
  """The server role's config: ``config`` with the ``dist`` executor (the parameter server, and
  shard 0) at the address it binds, which is checked first, as the run's secret is: one line,
  before anything is built. The training loop (``train.loop``, above this layer) runs it."""
  address = topo.server_address or "127.0.0.1:0"
  check_bindable(SERVER_KEY, address)
  auth.load_credentials()
  config.executor = "dist"
  config.dist.server_address = address
  return config


def run_shard(config: ml_collections.ConfigDict, workdir: str, topo: Topology) -> None:
  """The shard role: serves shard ``topo.shard`` until the server stops it (or goes silent)."""
  address = topo.shard_address or "127.0.0.1:0"
  check_bindable("--shard_address", address)
  credentials = auth.load_credentials()
  from gssp_jax.runtime import shard_process  # pylint: disable=g-import-not-at-top
  shard_process.serve(config, workdir, topo.shard, topo.num_servers, topo.server_address,
                      address, credentials)


def distributed_kwargs(config: ml_collections.ConfigDict, topo: Topology, rank: int) -> dict:
  """``jax.distributed.initialize``'s arguments for a mesh of several processes.

  With ``--coordinator_address`` the coordinator (rank 0) binds exactly that
  address: jax's default is every interface (``[::]``), and its coordination
  service has no authentication of its own (docs/REAL_RUNS.md says what an
  operator does about it). Without it jax detects the cluster (SLURM, Open
  MPI, Kubernetes) and chooses both.
  """
  kwargs = {"heartbeat_timeout_seconds": max(10, int(config.dist.heartbeat_timeout)),
            "initialization_timeout": int(config.dist.join_timeout)}
  if topo.coordinator_address:
    kwargs.update(coordinator_address=topo.coordinator_address,
                  coordinator_bind_address=topo.coordinator_address,
                  num_processes=topo.processes_per_mesh, process_id=rank)
  return kwargs


def run_worker(config: ml_collections.ConfigDict, topo: Topology) -> int:
  """The worker role: joins the mesh's ``jax.distributed`` cluster (P > 1), then trains."""
  import jax  # pylint: disable=g-import-not-at-top
  rank = max(topo.rank, 0)
  if topo.processes_per_mesh > 1:
    # Cross-process collectives of CPU devices (a GPU mesh uses NCCL; this changes nothing there).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**distributed_kwargs(config, topo, rank))
    rank = jax.process_index()
  from gssp_jax.runtime import worker  # pylint: disable=g-import-not-at-top
  try:
    iterations = worker.MeshWorker(config, topo.mesh, rank, topo.processes_per_mesh,
                                   topo.server_address).run()
  except BaseException as e:
    if topo.processes_per_mesh > 1:
      leave_mesh(topo.mesh, rank, e)
    raise
  if topo.processes_per_mesh > 1:
    jax.distributed.shutdown()
  return iterations


def leave_mesh(mesh: int, rank: int, error: BaseException) -> None:
  """A rank of a multi-process mesh that left its loop (an error, a signal) ends its process now.

  Not through ``jax.distributed.shutdown``: its barrier waits for every rank, and a rank left
  behind in a collective (the job broadcast) never comes, so this process would go on beating
  to the coordination service for the barrier's timeout (minutes) while the mesh's rank 0 went
  on beating to the server: a mesh "alive" that trains no more. Ended, it stops beating; the
  coordination service tells the other ranks within ``dist.heartbeat_timeout`` (jax ends their
  processes), and the server drops the mesh after as long again.
  """
  interrupted = isinstance(error, KeyboardInterrupt)
  if not interrupted:
    logging.exception("mesh %d rank %d left its loop: %s", mesh, rank, error)
  logging.error("mesh %d rank %d: ending its process without the mesh's shutdown barrier",
                mesh, rank)
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(cli.INTERRUPTED_EXIT if interrupted else 1)   # pylint: disable=protected-access


# -- the one-host launcher ------------------------------------------------------------------------


def interrupted(error: KeyboardInterrupt, workdir: str):
  """The launcher's Ctrl-C or SIGTERM, once every child ended: where the server's checkpoint is
  (``interrupt.Interrupted``, which ``cli`` prints as one line with the resume command)."""
  from gssp_jax.base import interrupt  # pylint: disable=g-import-not-at-top
  directory = os.path.join(workdir, "checkpoints")
  steps = sorted(int(n) for n in (os.listdir(directory) if os.path.isdir(directory) else ())
                 if n.isdigit() and os.path.exists(os.path.join(directory, n, "commit_success.txt")))
  name = str(error) if str(error) in ("SIGINT", "SIGTERM") else "SIGINT"
  return interrupt.Interrupted(name, directory, f"pushes {steps[-1]}" if steps else "")


class LocalLauncher:
  """Starts the server and the meshes' processes on this host; owns and ends them all.

  Args:
    argv_config: the ``--config`` and ``--config.*`` flags, passed to every child.
    workdir: the run's workdir (children's logs go to ``workdir/logs``).
    topo: the checked topology.
    config: the run's config (for the addresses' defaults and timeouts).
  """

  def __init__(self, argv_config: Sequence[str], workdir: str, topo: Topology,
               config: ml_collections.ConfigDict):
    self.argv_config, self.workdir, self.topo, self.config = (list(argv_config), workdir, topo,
                                                             config)
    self.procs: dict[str, subprocess.Popen] = {}
    self.reserved: list[socket.socket] = []   # ports held for children until the run ends
    self.gpus = visible_gpus()
    self.logs = os.path.join(workdir, "logs")
    # Ours, and no one else's to write: it will hold the run secret and the children's logs.
    auth.check_private_dir(workdir, "the workdir")
    auth.check_private_dir(self.logs, "the logs directory")
    self.secret_env = self._secret()

  def _secret(self) -> dict[str, str]:
    """The run secret and run id every child gets.

    The run id (``GSSP_RUN_ID``): the caller's, else a fresh one (the server writes it to
    ``server_address.json``). The secret: the caller's (``GSSP_SECRET[_FILE]``), else a fresh
    one in ``workdir/.secret`` (mode 0600, removed when the launcher exits; the workdir is
    checked to be the user's and writable by no one else, so no one can swap it)."""
    # The run id: the caller's (to attach processes of their own), else a fresh one per launch.
    run = {auth.RUN_ID_ENV: auth.check_run_id(os.environ[auth.RUN_ID_ENV])
           if os.environ.get(auth.RUN_ID_ENV) else auth.new_run_id()}
    for key in (auth.SECRET_ENV, auth.SECRET_FILE_ENV):
      if os.environ.get(key):
        auth.load_secret()   # checked now: a bad one is one line, before anything starts
        return {key: os.environ[key], **run}
    path = os.path.join(os.path.abspath(self.workdir), SECRET_FILE)
    if os.path.exists(path):
      os.remove(path)   # a previous launcher's, killed before it could remove it
    auth.write_secret_file(path, auth.new_secret())
    self._secret_file = path
    return {auth.SECRET_FILE_ENV: path, **run}

  def _remove_secret(self) -> None:
    path = getattr(self, "_secret_file", None)
    if path and os.path.exists(path):
      os.remove(path)

  def _reserve(self, host: str, port: int = 0) -> int:
    """A port of ``host`` (0: a free one) held for a child until the launcher ends
    (:func:`reserve_port`)."""
    sock = reserve_port(host, port)
    self.reserved.append(sock)
    return sock.getsockname()[1]

  def _release_ports(self) -> None:
    for sock in self.reserved:
      sock.close()
    self.reserved = []

  def _command(self, role_flags: list[str]) -> list[str]:
    # The role's flags after the user's --config flags: its server address is the one given.
    return [sys.executable, "-m", "experiments.launch", *self.argv_config, *role_flags,
            f"--workdir={self.workdir}"]

  def _spawn(self, name: str, role_flags: list[str], gpu: str | None = None,
             extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = self._command(role_flags)
    env = self._child_env(gpu, extra_env)
    log = auth.open_private_append(os.path.join(self.logs, f"{name}.txt"))   # no symlink
    # Its own session: a terminal's Ctrl-C reaches only the launcher, whose shutdown sends one
    # SIGTERM; the server, had it got the SIGINT too, would take that as a second signal and
    # stop without its checkpoint (base/interrupt.py). SIGKILL if the launcher dies outright.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            **cli.child_process(env, signal.SIGKILL))
    log.close()
    self.procs[name] = proc
    self._write_pids()
    return proc

  def _child_env(self, gpu: str | None, extra_env: dict[str, str] | None) -> dict[str, str]:
    """A child's environment: this one's, its role variables removed, the run's secret (its
    file's path or the caller's variable), malloc settings, its GPU, the compilation cache."""
    env = with_allocator_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    for key in ENV.values():
      env.pop(key, None)
    env.update(self.secret_env)
    env.pop(wire.RESERVED_PORT_ENV, None)
    env.update(extra_env or {})
    # Processes share a GPU: none preallocates (JAX's default takes 75 % of it at start-up).
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if gpu is not None:
      env["CUDA_VISIBLE_DEVICES"] = gpu   # this process's own device
    # Every mesh compiles the same programs: a shared persistent cache lets restarted meshes
    # and resumed runs skip compilation (xla_env.compilation_cache_env: its size cap turns on
    # jax's file lock, which processes sharing the directory need).
    env.update(xla_env.compilation_cache_env(env, xla_env.default_cache_dir()))
    return env

  def _write_pids(self) -> None:
    """``workdir/logs/pids.json``: every child's pid by name (for operators and tests)."""
    from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    workdir_lib.write_json(os.path.join(self.logs, PIDS_FILE),
                           {"launcher": os.getpid(),
                            **{name: proc.pid for name, proc in self.procs.items()}})

  def start_server(self) -> str:
    """Starts the server on a fixed port (a free one for port 0); returns its address.

    The meshes start at once beside it: they retry until it serves, so their
    start-up (imports, data, compilation) overlaps the server's.
    """
    host, port = wire.check_address(SERVER_KEY, self.topo.server_address or "127.0.0.1:0")
    # Held from here until the launcher ends, the user's port as one it picks (port 0): no one
    # else can take it between this check and the server's own bind, and be called with the
    # run's token by the meshes and shards that start meanwhile.
    port = self._reserve(host, port)
    extra = {wire.RESERVED_PORT_ENV: str(port)}
    address = f"{host}:{port}"
    self._spawn("server", ["--role=server", server_flag(address)], self._gpu(0), extra)
    return address

  def start_shard(self, shard: int, server_address: str) -> subprocess.Popen:
    """Starts shard ``shard``'s process (no GPU: it applies rounds). It binds a free loopback
    port itself (port 0) and tells the server the one it got."""
    return self._spawn(f"shard{shard}", [
        "--role=shard", f"--shard={shard}", server_flag(server_address),
        "--shard_address=127.0.0.1:0"],
        self._gpu(0))

  def start_mesh(self, mesh: int, server_address: str) -> list[subprocess.Popen]:
    """Starts mesh ``mesh``'s processes (P > 1: a coordinator port this launcher holds until it
    ends, which jax's coordination service binds beside the reservation)."""
    P = self.topo.processes_per_mesh
    flags = ["--role=worker", f"--mesh={mesh}", server_flag(server_address),
             f"--processes_per_mesh={P}"]
    if P > 1:
      flags.append(f"--coordinator_address=127.0.0.1:{self._reserve('127.0.0.1')}")
    return [self._spawn(f"mesh{mesh}_rank{r}", flags + [f"--rank={r}"], self._gpu(mesh * P + r))
            for r in range(P)]

  def _gpu(self, index: int) -> str | None:
    """Round-robin over this host's GPUs (None on a host without): one device per process."""
    return self.gpus[index % len(self.gpus)] if self.gpus else None

  def run(self, poll: float = 0.5) -> int:
    """Runs until the server exits; returns its exit code. Always ends every child."""
    try:
      address = self.start_server()
      logging.info("server at %s (it holds shard 0 of %d); starting %d more shard process(es)"
                   " and %d meshes x %d processes", address, self.topo.num_servers,
                   self.topo.num_servers - 1, self.topo.num_meshes, self.topo.processes_per_mesh)
      for s in range(1, self.topo.num_servers):
        self.start_shard(s, address)
      for m in range(self.topo.num_meshes):
        self.start_mesh(m, address)
      code = self._follow(poll)
      self._wait_meshes(3.0)   # they read their stop from the server and exit
      return code
    finally:
      self.shutdown()
      self._remove_secret()
      self._release_ports()

  def _wait_meshes(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in self.procs.values():
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        return

  def _follow(self, poll: float) -> int:
    """Prints the server's progress lines (merged view of the run) until it exits."""
    offset = self._log_size("server")
    reported = set()
    while True:
      self._refresh()
      code = self.procs["server"].poll()
      chunk = self._read_log("server", offset)
      offset += len(chunk)
      for line in chunk.decode(errors="replace").splitlines():
        if any(tag in line for tag in ("epoch", "lost", "rejoin", "Error", "error")):
          print(line.split("] ", 1)[-1], flush=True)
      for name, proc in self.procs.items():
        if name != "server" and proc.poll() not in (None, 0) and name not in reported:
          reported.add(name)
          print(f"{name} exited with code {proc.returncode}; see "
                f"{os.path.join(self.logs, name + '.txt')}", flush=True)
      if code is not None:
        return code
      time.sleep(poll)

  def _refresh(self) -> None:
    """Brings every child's state up to date before a round of ``poll`` calls (local: no-op)."""

  def _log_size(self, name: str) -> int:
    path = os.path.join(self.logs, f"{name}.txt")
    return os.path.getsize(path) if os.path.exists(path) else 0

  def _read_log(self, name: str, offset: int) -> bytes:
    """A child's log from byte ``offset`` on."""
    path = os.path.join(self.logs, f"{name}.txt")
    if not os.path.exists(path):
      return b""
    with open(path, "rb") as f:
      f.seek(offset)
      return f.read()

  def shutdown(self, grace: float = 5.0, server_grace: float | None = None) -> None:
    """SIGTERM to every child still running, then SIGKILL to a mesh process still running after
    ``grace`` seconds and to the server after ``server_grace`` (default
    ``dist.save_timeout``: it is saving its checkpoint); waits for all."""
    if server_grace is None:
      server_grace = self.config.dist.save_timeout
    saves = lambda name: name == "server" or name.startswith("shard")   # they write checkpoints
    live = sorted(((name, p) for name, p in self.procs.items() if p.poll() is None),
                  key=lambda item: saves(item[0]))   # the meshes first
    for _, proc in live:
      try:
        proc.send_signal(signal.SIGTERM)
      except ProcessLookupError:
        pass
    if any(name == "server" for name, _ in live):
      logging.info("waiting up to %g s (dist.save_timeout) for the server to save its "
                   "checkpoint and stop", server_grace)
    start = time.monotonic()
    for name, proc in live:
      deadline = start + (server_grace if saves(name) else grace)
      try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
