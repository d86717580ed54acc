"""Multi-host for real on one machine: a run's roles in four network namespaces (tests/netns.py).

Host A runs the server (shard 0), host B shard 1, hosts C and D one mesh each; every
process binds or dials its host's own 10.x.y.z address, so every call of the run crosses
the namespaces' bridge as it would cross a cluster's network, under the run's own mutual TLS
(``dist.tls_mode='run'``, the default). While the run goes on, outsiders inside host D's
namespace call the server with plain gRPC and with the runtime's own client holding another
secret (its TLS and token): neither gets a connection. The run then finishes.
Bounded in time (``BUDGET``); every process is collected and every namespace deleted.
"""

import json
import subprocess
import sys
import time

import pytest

import netns
from gssp_jax.runtime import auth
from tests.conftest import REPO

BUDGET = 300.0            # seconds for the whole test, start-up included
SERVER_PORT, SHARD_PORT = 5701, 5702   # per namespace: nothing else can hold them
FLAGS = ["--config=configs/mnist_lenet5.py:smoke", "--config.num_workers=2",
         "--config.sync.scheme=ssp", "--config.data.train_size=512",
         "--config.train.num_epochs=2.0"]
PUSHES = 2 * 512 // 32    # epochs x train_size / batch_size: every mesh's pushes together
NOT_IN_THE_RUN = {auth.SECRET_ENV: "", auth.SECRET_FILE_ENV: ""}   # an outsider's environment

# A raw gRPC call without TLS or the token: a well-formed header (a handler would answer it).
# Prints the status code's name.
NO_TOKEN = """
import sys, grpc
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import wire
header = wire.encode_header({"mesh": 0, "instance": "outsider", "session": "outsider"})
channel = grpc.insecure_channel(sys.argv[1])
try:
  channel.unary_unary("/gssp.Run/Heartbeat")(b"", metadata=((wire.HEADER_KEY, header),),
                                             timeout=30)
  print("OK")
except grpc.RpcError as e:
  print(e.code().name)
"""

# The run's own client with another random secret (its TLS and its token). Prints "METHOD
# CODE" lines, "METHOD GONE" where it got no connection.
WRONG_SECRET = """
import sys
from gssp_jax.runtime import auth, endpoints, wire
credentials = auth.Credentials(bytes.fromhex(auth.new_secret()), "outsider")
client = endpoints.Client(sys.argv[1], credentials, retry_seconds=1,
                          **endpoints.client_settings({"tls_mode": "run"}, credentials))
for method in ("Heartbeat", "Join"):
  try:
    client.call(method, {"mesh": 0, "instance": "outsider", "session": "outsider",
                         "config": "outsider"}, timeout=30)
    print(method, "OK")
  except wire.ServerGone:
    print(method, "GONE")
  except wire.CallError as e:
    print(method, e.code.name)
"""


def _tail(path, chars: int = 3000) -> str:
  try:
    with open(path, errors="replace") as f:
      return f"--- {path} ---\n" + f.read()[-chars:]
  except FileNotFoundError:
    return f"--- {path}: none ---"


@pytest.mark.slow
def test_multi_host_for_real_on_one_machine(tmp_path, data_dir):
  if reason := netns.skip_reason():
    pytest.skip(reason)
  start = time.monotonic()
  left = lambda: max(1.0, BUDGET - (time.monotonic() - start))
  workdir, logs = tmp_path / "run", tmp_path / "logs"
  logs.mkdir()
  env = {"GSSP_DATA_DIR": data_dir, auth.SECRET_ENV: auth.new_secret(), "PYTHONUNBUFFERED": "1",
         auth.RUN_ID_ENV: auth.new_run_id(),
         # The meshes compile the same programs: a shared cache (a size cap turns on jax's
         # file lock, which processes sharing the directory need), as the launcher sets it.
         "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 30)}
  procs = {}
  with netns.hosts(4, log_dir=tmp_path / "netns") as (a, b, c, d):
    prefix = a.name[:-len("h0")]   # every namespace of this network, the switch included
    server = f"{a.address}:{SERVER_PORT}"
    launch = lambda host, name, *role: procs.setdefault(name, host.popen(
        [sys.executable, "-m", "experiments.launch", *FLAGS, *role, f"--workdir={workdir}"],
        env=env, cwd=REPO, log=logs / f"{name}.txt"))
    # One config for every process, as on a cluster: the server binds the address the others
    # reach it at, and the run's two shards are the config's.
    at = [f"--config.dist.server_address={server}", "--config.dist.num_servers=2"]
    launch(a, "server", "--role=server", *at)
    launch(b, "shard1", "--role=shard", "--shard=1", *at,
           f"--shard_address={b.address}:{SHARD_PORT}")
    for mesh, host in enumerate((c, d)):
      launch(host, f"mesh{mesh}", "--role=worker", f"--mesh={mesh}", *at)
    logs_text = lambda: "\n".join(_tail(logs / f"{name}.txt") for name in procs)

    # The server writes its address once it serves (before the meshes have joined).
    address_file = workdir / "server_address.json"
    while not address_file.exists():
      exited = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
      assert not exited and time.monotonic() - start < BUDGET / 2, (
          f"the server did not serve (exited: {exited})\n{logs_text()}")
      time.sleep(0.2)
    assert json.loads(address_file.read_text())["address"] == server

    # (a) No TLS or token, (b) another secret's TLS and token: no connection, no handler runs.
    no_token = d.run([sys.executable, "-c", NO_TOKEN, server], cwd=REPO, env=NOT_IN_THE_RUN,
                     timeout=min(90, left()))
    assert no_token.stdout.split() == ["UNAVAILABLE"], no_token.stdout + no_token.stderr
    wrong = d.run([sys.executable, "-c", WRONG_SECRET, server], cwd=REPO, env=NOT_IN_THE_RUN,
                  timeout=min(90, left()))
    assert wrong.stdout.splitlines() == ["Heartbeat GONE", "Join GONE"], (
        wrong.stdout + wrong.stderr)
    assert procs["server"].poll() is None, "the run ended before the outsiders called"

    # (c) The run finishes; the shard and the meshes stop when the server tells them.
    try:
      for name in ("server", "shard1", "mesh0", "mesh1"):
        procs[name].wait(timeout=left())
    except subprocess.TimeoutExpired:
      pytest.fail(f"the run did not finish within {BUDGET:g} s\n{logs_text()}")
    codes = {name: p.returncode for name, p in procs.items()}
    assert codes == dict.fromkeys(procs, 0), f"{codes}\n{logs_text()}"
  # The network's teardown has run: every process collected, every namespace deleted.
  assert not [p.pid for p in procs.values() if p.returncode is None or netns.alive(p.pid)]
  assert not netns.namespaces(prefix)
  assert time.monotonic() - start < BUDGET + 30   # the last wait's bound, plus the teardown

  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["status"] == "done", summary["status"]
  # A push is applied only with shard 1's receipt for its slice: every one crossed C or D -> B.
  assert summary["totals"]["pushes"] == PUSHES
  assert summary["servers"]["addresses"][1:] == [f"{b.address}:{SHARD_PORT}"]   # as it advertised
  with open(workdir / "metrics.jsonl") as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  assert metrics and metrics[-1]["pushes"] == PUSHES
  server_log = (logs / "server.txt").read_text()
  assert "status done" in server_log
  for host, mesh in ((c, 0), (d, 1)):   # each mesh called from its own host's address
    assert f"mesh {mesh} joined from ipv4:{host.address}:" in server_log, server_log[-3000:]
  # The outsiders never reached the token check: TLS turned them away before any call.
  assert "refused a call to" not in server_log
  assert env[auth.SECRET_ENV] not in server_log + (workdir / "summary.json").read_text()
