r"""Hosts for multi-process tests: Linux network namespaces on a private switch, one address each.

The test files import it as ``netns`` (pytest puts ``tests/`` on the path). A test gets
``n`` namespaces, each with ``lo`` up and one veth link to a bridge that lives in a further
"switch" namespace, so every host reaches every other over TCP at its own address and
nothing is created in the root namespace (its link table, routes and addresses are never
touched). Processes started through a host run inside its namespace, in their own session.

Cleanup, whatever happens: leaving the ``with`` block (normally or by an exception,
Ctrl-C included) kills every process started through the hosts (SIGTERM to its process
group, SIGKILL after a short grace), then SIGKILLs whatever else still runs in the
namespaces, deletes them (which removes their veth ends and the bridge) and checks that
none with the network's name prefix is left. Two safety nets: an ``atexit`` hook closes
networks still open when the interpreter exits, and a small reaper process (in its own
session, reading a pipe from this one) does the same cleanup if this process dies without
running Python code (SIGKILL, or a SIGTERM pytest does not catch).

Everything here needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN): tests call
``pytest.skip(reason)`` when ``reason := skip_reason()`` is not None, or use the
``netns_hosts`` fixture, which does.

Usage (ports are per namespace, so fixed ones never collide with other tests)::

  from netns import netns_hosts  # pylint: disable=unused-import  (the fixture)

  def test_fetch(netns_hosts, tmp_path):
    server, client = netns_hosts(2)  # skips unless root; torn down after the test
    server.popen([sys.executable, "-m", "http.server", "8000", "--bind", server.address],
                 cwd=tmp_path)
    code = ("import time, urllib.request as u\n"
            "for _ in range(50):\n"
            "  try: print(u.urlopen(%r).status); break\n"
            "  except OSError: time.sleep(0.1)" % f"http://{server.address}:8000/")
    assert client.run([sys.executable, "-c", code], timeout=20).stdout.strip() == "200"
"""

import atexit
import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Mapping, Sequence

import pytest

PREFIX = "gsspnet-"
IP_TIMEOUT = 10.0   # seconds for one `ip` command; they take milliseconds
PROBE_TIMEOUT = 5.0  # seconds for each command of skip_reason()'s trial
MAX_HOSTS = 250     # addresses .1 to .250 of the network's /24

# Interface names inside the namespaces: each namespace has its own link table, so fixed
# names never collide between networks (or with the root namespace's links).
_BRIDGE = "br0"
_HOST_LINK = "eth0"


class NetnsError(RuntimeError):
  """An `ip` command failed or timed out, or a namespace survived its teardown."""


def _ip(*args: str, timeout: float = IP_TIMEOUT) -> str:
  """Runs ``ip ARGS`` and returns its stdout; raises NetnsError with the command and stderr."""
  cmd = ["ip", *args]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)
  except subprocess.TimeoutExpired as e:
    raise NetnsError(f"`{' '.join(cmd)}` timed out after {timeout:g} s") from e
  except OSError as e:  # no `ip` binary
    raise NetnsError(f"`{' '.join(cmd)}` could not run: {e}") from e
  if done.returncode != 0:
    raise NetnsError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): "
                     f"{done.stderr.strip() or done.stdout.strip()}")
  return done.stdout


# --- Whether namespaces can be made here ---------------------------------------------------

@functools.cache
def skip_reason() -> str | None:
  """None when this process can make connected namespaces, else a one-line reason (cached)."""
  return _probe()


def _probe() -> str | None:
  """Tries it: a throwaway namespace with ``lo`` up, a bridge and a veth pair, then deletes it."""
  if os.geteuid() != 0:
    return f"network namespaces need root (euid {os.geteuid()})"
  if shutil.which("ip") is None:
    return "no `ip` binary (iproute2) on PATH"
  name = _unique_name("probe")
  try:
    _ip("netns", "add", name, timeout=PROBE_TIMEOUT)
  except NetnsError as e:
    return f"cannot create a network namespace: {_one_line(e)}"
  try:
    _ip("-n", name, "link", "set", "lo", "up", timeout=PROBE_TIMEOUT)
    _ip("-n", name, "link", "add", "pbr", "type", "bridge", timeout=PROBE_TIMEOUT)
    _ip("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb",
        timeout=PROBE_TIMEOUT)
    _ip("netns", "exec", name, "true", timeout=PROBE_TIMEOUT)
  except NetnsError as e:
    return f"namespace made but not usable: {_one_line(e)}"
  finally:
    with contextlib.suppress(NetnsError):
      reap(name)
  return None


def _one_line(error: Exception) -> str:
  return " ".join(str(error).split())


# --- Cleanup (shared by the teardown, atexit and the reaper) -------------------------------


def _unique_name(kind: str) -> str:
  """``gsspnet-<pid>-<random>-<kind>``: unique across processes (pid) and within one."""
  return f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-{kind}"


def namespaces(prefix: str = PREFIX) -> list[str]:
  """Names of the existing network namespaces that start with ``prefix``."""
  names = (line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip())
  return sorted(name for name in names if name.startswith(prefix))


def _namespace_pids(name: str) -> list[int]:
  try:
    return [int(pid) for pid in _ip("netns", "pids", name).split()]
  except NetnsError:
    return []  # already deleted


def alive(pid: int) -> bool:
  """Whether process ``pid`` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return False
  return state not in ("Z", "X")


def _kill(pid: int, sig: int, *, group: bool = False) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    (os.killpg if group else os.kill)(pid, sig)


def reap(prefix: str) -> list[str]:
  """SIGKILLs every process in the namespaces named ``prefix*``, deletes them, returns leftovers."""
  for name in namespaces(prefix):
    for pid in _namespace_pids(name):
      _kill(pid, signal.SIGKILL)
    with contextlib.suppress(NetnsError):  # gone meanwhile; checked below
      _ip("netns", "delete", name)
  return namespaces(prefix)


_ALL_CLEAN = "all clean"


def _start_reaper(prefix: str, log_path: str) -> subprocess.Popen:
  """A process that runs ``reap(prefix)`` when its pipe from this one closes, unless told not to.

  The pipe closes when this process dies, however it dies. The reaper sits in a session of
  its own (a Ctrl-C to the terminal's process group or a kill of pytest's group spares it)
  and imports this module (and pytest) only when it has work to do: a clean teardown writes
  ``_ALL_CLEAN`` first.
  """
  code = (f"import sys\nif sys.stdin.read() == {_ALL_CLEAN!r}: sys.exit(0)\n"
          "sys.path.insert(0, sys.argv[1]); import netns\n"
          "left = netns.reap(sys.argv[2]); print('left:', left); sys.exit(1 if left else 0)")
  with open(log_path, "ab") as log:
    return subprocess.Popen(
        [sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), prefix],
        stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


# --- Addresses -----------------------------------------------------------------------------

_networks_made = itertools.count()


def _root_networks() -> list[ipaddress.IPv4Network]:
  """The root namespace's on-link and local IPv4 networks (its default route excluded)."""
  nets = []
  for line in _ip("-4", "route", "show", "table", "all").splitlines():
    words = line.split()
    if words and words[0] in ("local", "broadcast", "unicast", "multicast", "unreachable",
                              "blackhole", "prohibit", "throw", "nat"):
      words = words[1:]
    if words and words[0] != "default":
      with contextlib.suppress(ValueError):
        nets.append(ipaddress.ip_network(words[0], strict=False))
  return nets


def _choose_subnet() -> ipaddress.IPv4Network:
  """A 10.X.Y.0/24 from the pid and a per-process count, clear of the root namespace's routes.

  Each network lives in its own namespaces, so two networks with one subnet would not
  collide anyway; distinct subnets only keep logs unambiguous. Staying clear of the root
  namespace's networks keeps its view unambiguous: from there a host's address is only
  reachable through a gateway, never on a local link.
  """
  taken = _root_networks()
  base = os.getpid() * 251 + next(_networks_made)
  for k in range(65536):
    index = (base + k) % 65536
    subnet = ipaddress.ip_network(f"10.{index >> 8}.{index & 255}.0/24")
    if not any(subnet.overlaps(net) for net in taken):
      return subnet
  raise NetnsError("every 10.X.Y.0/24 overlaps a route of the root namespace")


# --- Hosts ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Host:
  """One network namespace: a machine with one address on the test network.

  Attributes:
    name: the namespace's name (``ip netns exec NAME ...``).
    address: its IPv4 address on the test network, e.g. ``"10.23.7.1"``.
    index: its position among the network's hosts (address ``.index + 1``).
  """
  name: str
  address: str
  index: int
  _network: "Network" = dataclasses.field(repr=False)

  def cmd(self, *argv: str) -> list[str]:
    """``argv`` prefixed to run inside this namespace: ``["ip", "netns", "exec", NAME, ...]``."""
    return ["ip", "netns", "exec", self.name, *argv]

  def popen(self, argv: Sequence[str], *, log: str | os.PathLike | None = None,
            env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
            **kwargs) -> subprocess.Popen:
    """Starts ``argv`` in this namespace, in a new session; teardown kills its process group.

    Args:
      argv: the command (no shell).
      log: file for its stdout and stderr (appended to); default
        ``<log_dir>/h<host index>-<count>.log``. The path is ``proc.log_path``.
      env: variables added to this process's environment (which passes through).
      cwd: its working directory.
      **kwargs: more ``subprocess.Popen`` arguments (not stdout, stderr, start_new_session).

    Returns:
      The ``Popen``; its pid is the command's own (``ip netns exec`` execs it).
    """
    return self._network.popen(self, list(argv), log=log, env=env, cwd=cwd, **kwargs)

  def run(self, argv: Sequence[str], *, timeout: float,
          env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
          check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``argv`` in this namespace to completion (text output captured), bounded by ``timeout``.

    Raises:
      subprocess.TimeoutExpired: after killing it, if it ran past ``timeout`` seconds.
      subprocess.CalledProcessError: if ``check`` and it exited non-zero.
    """
    return subprocess.run(self.cmd(*argv), timeout=timeout, env=_environment(env), cwd=cwd,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          check=check)


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
  return {**os.environ, **(env or {})}


class Network:
  """``n`` hosts on one bridge; use through :func:`hosts` or the ``netns_hosts`` fixture."""

  def __init__(self, n: int, *, log_dir: str | os.PathLike | None = None, grace: float = 1.0):
    if not 1 <= n <= MAX_HOSTS:
      raise ValueError(f"hosts: n must be in [1, {MAX_HOSTS}], got {n}")
    self.prefix = _unique_name("")  # ends with "-": every namespace name extends it
    self.log_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix=PREFIX)
    self.grace = grace
    self.subnet = _choose_subnet()
    self.switch = self.prefix + "switch"
    self.hosts = [Host(self.prefix + f"h{i}", str(self.subnet[i + 1]), i, self)
                  for i in range(n)]
    self.procs: list[subprocess.Popen] = []
    self.closed = False
    self._reaper = None

  def start(self) -> None:
    """Starts the reaper, then makes the switch and the hosts (close() undoes a partial start)."""
    os.makedirs(self.log_dir, exist_ok=True)
    _open_networks.append(self)
    self._reaper = _start_reaper(self.prefix, os.path.join(self.log_dir, "netns-reaper.log"))
    _ip("netns", "add", self.switch)
    _ip("-n", self.switch, "link", "set", "lo", "up")
    _ip("-n", self.switch, "link", "add", _BRIDGE, "type", "bridge")
    _ip("-n", self.switch, "link", "set", _BRIDGE, "up")
    for host in self.hosts:
      self._plug(host)

  def _plug(self, host: Host) -> None:
    """Makes ``host``'s namespace and its veth pair: port ``p<i>`` on the bridge, eth0 inside."""
    port = f"p{host.index}"
    _ip("netns", "add", host.name)
    _ip("-n", host.name, "link", "set", "lo", "up")
    # Both ends are created directly in their namespaces: none passes through the root one.
    _ip("-n", self.switch, "link", "add", port, "type", "veth",
        "peer", "name", _HOST_LINK, "netns", host.name)
    _ip("-n", self.switch, "link", "set", port, "master", _BRIDGE, "up")
    _ip("-n", host.name, "addr", "add", f"{host.address}/{self.subnet.prefixlen}",
        "dev", _HOST_LINK)
    _ip("-n", host.name, "link", "set", _HOST_LINK, "up")

  def popen(self, host: Host, argv: list[str], *, log, env, cwd, **kwargs) -> subprocess.Popen:
    """See :meth:`Host.popen`."""
    if self.closed:
      raise NetnsError(f"network {self.prefix} is closed")
    if log is None:
      log = os.path.join(self.log_dir, f"h{host.index}-{len(self.procs)}.log")
    with open(log, "ab") as out:
      proc = subprocess.Popen(host.cmd(*argv), stdout=out, stderr=subprocess.STDOUT,
                              env=_environment(env), cwd=cwd, start_new_session=True,
                              **{"stdin": subprocess.DEVNULL, **kwargs})
    proc.log_path = str(log)
    self.procs.append(proc)
    return proc

  def close(self) -> None:
    """Kills the processes, deletes the namespaces; raises NetnsError if any is left."""
    if self.closed:
      return
    self.closed = True
    left = None
    try:
      self._stop_processes()
      left = reap(self.prefix)
    finally:
      self._stop_reaper(all_clean=left == [])
      with contextlib.suppress(ValueError):
        _open_networks.remove(self)
    if left:
      raise NetnsError(f"namespaces left after teardown: {left}")

  def _stop_processes(self) -> None:
    """SIGTERM to every process group, SIGKILL to all after ``grace`` seconds, then reap them."""
    for proc in self.procs:
      _kill(proc.pid, signal.SIGTERM, group=True)
    deadline = time.monotonic() + self.grace
    while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
      time.sleep(0.02)
    for proc in self.procs:
      # Also when the leader has exited: children in its group may not have.
      _kill(proc.pid, signal.SIGKILL, group=True)
    for proc in self.procs:
      with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)

  def _stop_reaper(self, *, all_clean: bool) -> None:
    """Closes the reaper's pipe: it exits, after trying to reap unless ``all_clean``."""
    if self._reaper is None:
      return
    with contextlib.suppress(BrokenPipeError):
      if all_clean:
        self._reaper.stdin.write(_ALL_CLEAN.encode())
      self._reaper.stdin.close()
    try:
      self._reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._reaper.kill()
      self._reaper.wait()


_open_networks: list[Network] = []


@atexit.register
def _close_open_networks() -> None:
  """Safety net: networks nobody closed (a test torn down abruptly) are closed at exit."""
  for network in list(_open_networks):
    with contextlib.suppress(Exception):
      network.close()


@contextlib.contextmanager
def hosts(n: int, *, log_dir: str | os.PathLike | None = None,
          grace: float = 1.0) -> Iterator[list[Host]]:
  """``n`` connected hosts (network namespaces), torn down on exit however the block ends.

  Args:
    n: how many hosts; host ``i`` has address ``10.X.Y.(i+1)`` on a /24 of its own.
    log_dir: where the processes' logs go (default: a fresh temporary directory, kept).
    grace: seconds between SIGTERM and SIGKILL for the processes started through them.

  Yields:
    The list of :class:`Host`, in address order.

  Raises:
    NetnsError: an `ip` command failed (message: the command and its stderr), or a
      namespace survived teardown.
  """
  network = Network(n, log_dir=log_dir, grace=grace)
  try:
    network.start()
    yield network.hosts
  finally:
    network.close()


@pytest.fixture
def netns_hosts(tmp_path):
  """Factory fixture: ``netns_hosts(n)`` returns ``n`` hosts, closed after the test.

  Skips the test (with :func:`skip_reason`) where namespaces cannot be made. Logs go to
  ``tmp_path / "netns"``. Import it into the test module: ``from netns import netns_hosts``.
  """
  with contextlib.ExitStack() as stack:

    def make(n: int, **kwargs) -> list[Host]:
      reason = skip_reason()
      if reason:
        pytest.skip(reason)
      kwargs.setdefault("log_dir", tmp_path / "netns")
      return stack.enter_context(hosts(n, **kwargs))

    yield make
