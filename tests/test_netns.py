"""tests/netns.py: hosts in network namespaces talk over TCP, the root namespace cannot reach
them, and nothing (namespace, process) outlives the block, whatever ends it."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import netns
from netns import netns_hosts  # noqa: F401  # pylint: disable=unused-import  (the fixture)

PORT = 5000  # inside the namespaces: no other process on the machine can hold it

# Echoes every connection's first message back, forever (teardown kills it).
SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
while True:
  c, _ = s.accept()
  with c:
    c.sendall(c.recv(1024))
"""

# Connects (retrying for 5 s), sends "ping", prints the answer.
CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 5
while True:
  try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
    break
  except OSError:
    if time.monotonic() > deadline:
      raise
    time.sleep(0.05)
c.sendall(b"ping")
print(c.recv(1024).decode())
"""

# Starts a grandchild in a session of its own (out of reach of a process-group kill).
ESCAPER = """
import subprocess, time
p = subprocess.Popen(["sleep", "60"], start_new_session=True)
print(p.pid, flush=True)
time.sleep(60)
"""


def _require_netns():
  reason = netns.skip_reason()
  if reason:
    pytest.skip(reason)


def _wait_for_log(proc, timeout=10.0):
  """The first line ``proc`` wrote to its log, waiting up to ``timeout`` s."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    with open(proc.log_path) as f:
      line = f.readline()
    if line.endswith("\n"):
      return line.strip()
    assert proc.poll() is None, f"exited {proc.returncode}: {open(proc.log_path).read()}"
    time.sleep(0.02)
  raise AssertionError(f"nothing in {proc.log_path} after {timeout} s")


def _serve(host):
  proc = host.popen([sys.executable, "-c", SERVER, host.address, str(PORT)])
  assert _wait_for_log(proc) == "listening"
  return proc


def _ping(client, server):
  done = client.run([sys.executable, "-c", CLIENT, server.address, str(PORT)], timeout=15)
  return done.stdout.strip()


def _network_prefix(name):
  return name.rsplit("-", 1)[0] + "-"  # gsspnet-<pid>-<random>-


def test_echo_between_two_hosts(netns_hosts):
  a, b = netns_hosts(2)
  assert a.address != b.address and a.name != b.name
  _serve(a)
  assert _ping(b, a) == "ping"


def test_root_namespace_cannot_reach_a_host(netns_hosts):
  _require_netns()   # before `ip` is called here: a host without iproute2 skips, with the reason
  root_links = set(_links())
  a, b = netns_hosts(2)
  _serve(a)
  assert _ping(b, a) == "ping"  # a listens and is reachable from its network
  # The root namespace's link table is untouched: no bridge, port or veth end shows up.
  assert not {"br0", "p0", "p1"} & (set(_links()) - root_links)
  # The address is not the root namespace's own ...
  with socket.socket() as s, pytest.raises(OSError) as bind:
    s.bind((a.address, 0))
  assert bind.value.errno == errno.EADDRNOTAVAIL
  # ... nor on any of its links. SO_DONTROUTE limits the connect to local and on-link routes,
  # so it fails at once (ENETUNREACH) without sending a packet through the gateway that the
  # root namespace's default route may name: a host's address must never reach a real link.
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_DONTROUTE, 1)
    s.settimeout(1.0)
    start = time.monotonic()
    assert s.connect_ex((a.address, PORT)) in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    assert time.monotonic() - start < 1.0


def _links():
  out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                       timeout=10, check=True).stdout
  return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def test_nothing_left_after_the_block(tmp_path):
  _require_netns()
  with netns.hosts(2, log_dir=tmp_path) as (a, b):
    prefix = _network_prefix(a.name)
    assert netns.namespaces(prefix) == sorted([prefix + "h0", prefix + "h1", prefix + "switch"])
    pids = [_serve(a).pid, b.popen(["sleep", "60"]).pid]
    assert all(netns.alive(pid) for pid in pids)
  assert netns.namespaces(prefix) == []
  assert not any(netns.alive(pid) for pid in pids)


def test_an_exception_in_the_block_still_cleans_up(tmp_path):
  _require_netns()
  with pytest.raises(RuntimeError, match="boom"):
    with netns.hosts(2, log_dir=tmp_path) as (a, _):
      prefix = _network_prefix(a.name)
      child = a.popen([sys.executable, "-c", ESCAPER])
      grandchild = int(_wait_for_log(child))
      raise RuntimeError("boom")
  assert netns.namespaces(prefix) == []
  # The grandchild left the process group: the sweep of the namespace's pids got it.
  assert not netns.alive(child.pid) and not netns.alive(grandchild)


# The owner makes a network, starts a process in it and dies by SIGKILL: no Python runs.
OWNER = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[1])
import netns
network = netns.hosts(2, log_dir=sys.argv[2])  # kept: collecting it would close it
a, b = network.__enter__()
proc = a.popen(["sleep", "60"])
print(json.dumps({"names": [a.name, b.name], "pid": proc.pid}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_reaper_cleans_up_after_a_killed_owner(tmp_path):
  _require_netns()
  owner = subprocess.run(
      [sys.executable, "-c", OWNER, os.path.dirname(netns.__file__), str(tmp_path)],
      capture_output=True, text=True, timeout=30, check=False)
  assert owner.returncode == -signal.SIGKILL, owner.stderr
  made = json.loads(owner.stdout)
  prefix = _network_prefix(made["names"][0])
  deadline = time.monotonic() + 15
  while (netns.namespaces(prefix) or netns.alive(made["pid"])) and time.monotonic() < deadline:
    time.sleep(0.05)
  left = netns.reap(prefix)  # so a failure here leaves nothing behind either
  assert left == [] and not netns.alive(made["pid"])
  reaper_log = (tmp_path / "netns-reaper.log").read_text()
  assert "left: []" in reaper_log


def test_the_fixture_skips_where_namespaces_cannot_be_made(netns_hosts, monkeypatch):
  monkeypatch.setattr(netns, "skip_reason", lambda: "simulated: no CAP_SYS_ADMIN")
  with pytest.raises(pytest.skip.Exception, match="simulated: no CAP_SYS_ADMIN"):
    netns_hosts(2)


def test_probe_reasons_without_root_or_ip(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  assert "need root" in netns._probe()  # pylint: disable=protected-access
  monkeypatch.setattr(os, "geteuid", lambda: 0)
  monkeypatch.setattr(shutil, "which", lambda name: None)
  assert "no `ip` binary" in netns._probe()  # pylint: disable=protected-access


def test_probe_tries_for_real_without_cap_sys_admin():
  _require_netns()
  if shutil.which("setpriv") is None:
    pytest.skip("no setpriv binary")
  code = (f"import sys; sys.path.insert(0, {os.path.dirname(netns.__file__)!r}); "
          "import netns; print(netns.skip_reason())")
  done = subprocess.run(
      ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin",
       sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
  assert done.stdout.startswith("cannot create a network namespace: `ip netns add gsspnet-")
  assert "Operation not permitted" in done.stdout
  assert len(done.stdout.splitlines()) == 1
  probe = done.stdout.split("`ip netns add ", 1)[1].split("`", 1)[0]
  assert netns.namespaces(probe) == []


def test_ip_errors_name_the_command_and_stderr():
  if shutil.which("ip") is None:
    pytest.skip("no `ip` binary")
  with pytest.raises(netns.NetnsError, match=r"`ip netns delete gsspnet-none` failed \(exit"):
    netns._ip("netns", "delete", "gsspnet-none")  # pylint: disable=protected-access
