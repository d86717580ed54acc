"""The real runtime on a Ray cluster: every process of a run is started by an actor of its own.

``experiments.launch --launcher=ray [--ray_address=ADDR]`` runs :class:`RayLauncher`, the
one-host launcher (``launch.LocalLauncher``) with its children placed by Ray instead of started
here. Each child (the server, each shard, each mesh process) is the same ``experiments.launch
--role=...`` command as on one host, started by a :class:`RoleProcess` actor on the node Ray
chose, with that node's address, its own GPU (``ray.get_gpu_ids()``) and a log file in the
workdir. What is placed where:

* the server: one actor (``--ray_cpus_per_process`` CPUs, ``--ray_gpus_per_process`` GPUs); it
  reserves a port of its node's address (``launch.reserve_port``, held in the actor) and its
  child binds it, so the address the meshes are told is bound by the server and nobody else;
* shard ``s``: one actor; its child binds a free port of its node and tells the server;
* mesh ``m``: a placement group of P bundles packed onto one node (``STRICT_PACK``), one actor
  per process; rank 0's actor reserves the mesh's ``jax.distributed`` coordinator port.

The secret never passes through Ray: the children read it from ``GSSP_SECRET_FILE`` on their
node (the launcher's ``workdir/.secret`` when the caller set none, so the workdir must be on a
filesystem every node sees, as it must for the shards' checkpoints); only the file's path
travels, with the run id. ``GSSP_SECRET`` (the secret's value in a variable) is refused.

A child dies with its actor (``PR_SET_PDEATHSIG``): a killed actor or a lost node is a lost
process, and the run goes on as on one host (a lost mesh rejoins or stays lost; a lost shard
fails the run). The launcher's shutdown stops every child (SIGTERM, then SIGKILL), kills the
actors, removes the placement groups and, where it started Ray itself (no ``--ray_address``),
stops it.

Concurrency: one driver thread calls the actors; each actor runs its methods one at a time on
its main thread (which started its child, so the child's parent-death signal follows the actor
process) and never blocks: the driver polls.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import time
from typing import Any, Sequence

from absl import logging
import ml_collections

from gssp_jax.runtime import auth
from gssp_jax.runtime import launch
from gssp_jax.runtime import wire

_CALL_TIMEOUT = 60.0   # seconds for an actor's answer before its node counts as lost
NAMESPACE = "gssp"     # the actors' Ray namespace; each is named "<run id>:<process>"
_FRESH = 0.25          # seconds a child's polled state stands (one round of the launcher's loop)


def _ray():
  try:
    import ray  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError("--launcher=ray needs Ray: pip install 'gssp_jax[ray]' (or pip install "
                     "ray); allowed without it: --launcher=local") from None
  return ray


def connect(ray, address: str, num_cpus: int) -> bool:
  """Connects to the cluster at ``address``, or starts a local instance with ``num_cpus``
  logical CPUs for this command (Ray's services listen on this host's address and every
  interface: docs/REAL_RUNS.md); whether it started one (to stop at the end)."""
  if ray.is_initialized():
    return False
  if address:
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return False
  ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
  return True


def start_child(cmd: Sequence[str], cwd: str, env: dict[str, str], log) -> subprocess.Popen:
  """``cmd`` on this node (an actor's or a task's), with the GPUs Ray gave it, its output to
  the open file ``log``, dying with this process (its parent-death signal)."""
  import ray  # pylint: disable=g-import-not-at-top
  from gssp_jax import cli  # pylint: disable=g-import-not-at-top
  env = dict(env)
  gpus = ray.get_gpu_ids()
  if gpus:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(g)) for g in gpus)
  return subprocess.Popen(list(cmd), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                          **cli.child_process(env, signal.SIGKILL))


class RoleProcess:
  """An actor's side of one child process: starts it on this node, answers without blocking."""

  def __init__(self):
    self.proc: subprocess.Popen | None = None
    self.reserved = None

  def node(self) -> str:
    import ray  # pylint: disable=g-import-not-at-top
    return ray.util.get_node_ip_address()

  def reserve(self, host: str) -> int:
    """A port of ``host`` held by this actor (``launch.reserve_port``) until it ends."""
    self.reserved = launch.reserve_port(host)
    return self.reserved.getsockname()[1]

  def start(self, cmd: Sequence[str], env: dict[str, str], cwd: str, log_path: str) -> int:
    """Starts the child with this actor's GPUs; returns its pid."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = auth.open_private_append(log_path)   # no symlink, as the local launcher's logs
    self.proc = start_child(cmd, cwd, env, log)
    log.close()
    return self.proc.pid

  def poll(self) -> int | None:
    return None if self.proc is None else self.proc.poll()

  def signal(self, signum: int) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signum)

  def read(self, path: str, offset: int) -> bytes:
    """This node's copy of a log from ``offset`` on (the driver's may be another disk)."""
    if not os.path.exists(path):
      return b""
    with open(path, "rb") as f:
      f.seek(offset)
      return f.read(1 << 20)


class ActorProcess:
  """The driver's side: a child on another node with ``subprocess.Popen``'s interface
  (``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``, ``pid``), so the launcher
  treats it as one of its own. An actor that is gone (killed, its node lost) is a process that
  exited with ``-SIGKILL``."""

  def __init__(self, ray, actor, name: str):
    self.ray, self.actor, self.name = ray, actor, name
    self.pid = 0
    self.returncode: int | None = None
    self.polled = -1e9   # when its state was last asked (poll answers from it for _FRESH s)

  def call(self, method: str, *args, timeout: float = _CALL_TIMEOUT):
    return self.ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

  def poll(self) -> int | None:
    if self.returncode is None and time.monotonic() - self.polled > _FRESH:
      self.settle(self.actor.poll.remote())
    return self.returncode

  def settle(self, answer) -> None:
    """Records the answer to a ``poll`` call (``RayLauncher._refresh`` asks every actor at
    once): the child's exit code, or ``-SIGKILL`` when the actor or its node is gone."""
    try:
      code = self.ray.get(answer, timeout=_CALL_TIMEOUT)
    except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
      code = -signal.SIGKILL
    self.returncode, self.polled = code, time.monotonic()

  def wait(self, timeout: float | None = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() >= deadline:
        raise subprocess.TimeoutExpired(self.name, timeout)
      time.sleep(0.1)
    return self.returncode

  def send_signal(self, signum: int) -> None:
    if self.poll() is None:
      try:
        self.call("signal", int(signum))
      except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
        pass

  def kill(self) -> None:
    """SIGKILL to the child, then the actor itself."""
    self.send_signal(signal.SIGKILL)
    self.ray.kill(self.actor)
    if self.returncode is None:
      self.returncode = -signal.SIGKILL


class RayLauncher(launch.LocalLauncher):
  """``launch.LocalLauncher`` with its children placed on a Ray cluster (module docstring).

  Args:
    argv_config, workdir, topo, config: as ``LocalLauncher``'s.
    address: an existing cluster's address (``ray.init(address=...)``); "" starts a local
      Ray instance for this run and stops it at the end.
    cpus, gpus: the resources of every process's actor.
  """

  def __init__(self, argv_config: Sequence[str], workdir: str, topo: launch.Topology,
               config: ml_collections.ConfigDict, *, address: str = "", cpus: float = 1.0,
               gpus: float = 0.0):
    if os.environ.get(auth.SECRET_ENV):
      raise ValueError(f"${auth.SECRET_ENV} is refused with --launcher=ray: its value would "
                       "travel through Ray to every node; allowed: a secret file every node "
                       f"can read (${auth.SECRET_FILE_ENV}), or neither (the launcher writes "
                       "one into the workdir)")
    if cpus < 0 or gpus < 0:
      raise ValueError(f"--ray_cpus_per_process={cpus} / --ray_gpus_per_process={gpus} is "
                       "invalid; allowed: numbers >= 0")
    self.ray = _ray()
    super().__init__(argv_config, workdir, topo, config)
    self.gpus = []   # Ray gives each actor its GPUs (RoleProcess.start)
    self.cpus, self.gpus_per_process, self.address = float(cpus), float(gpus), address
    self.groups: list[Any] = []
    self.started_ray = False
    self._actor_class = self.ray.remote(RoleProcess)

  # -- placement --------------------------------------------------------------------------------

  def _init_ray(self) -> None:
    # A local instance for this run gets as many logical CPUs as its processes ask for.
    processes = (self.topo.num_servers + self.topo.num_meshes * self.topo.processes_per_mesh)
    self.started_ray = connect(self.ray, self.address,
                               max(os.cpu_count() or 1, math.ceil(processes * self.cpus)))

  def actor_name(self, name: str) -> str:
    """The Ray name of process ``name``'s actor (namespace ``gssp``): the run id, then it."""
    return f"{self.secret_env[auth.RUN_ID_ENV]}:{name}"

  def _actor(self, name: str, **options):
    actor = self._actor_class.options(num_cpus=self.cpus, num_gpus=self.gpus_per_process,
                                      name=self.actor_name(name), namespace=NAMESPACE,
                                      **options).remote()
    proxy = ActorProcess(self.ray, actor, name)
    self.procs[name] = proxy
    return proxy

  def _start(self, proxy: ActorProcess, role_flags: list[str],
             extra_env: dict[str, str] | None = None) -> ActorProcess:
    env = self._child_env(None, extra_env)
    env.pop("CUDA_VISIBLE_DEVICES", None)   # the actor's own GPUs, set on its node
    log = os.path.join(self.logs, f"{proxy.name}.txt")
    proxy.pid = proxy.call("start", self._command(role_flags), env, os.getcwd(), log)
    self._write_pids()
    return proxy

  def start_server(self) -> str:
    self._init_ray()
    proxy = self._actor("server")
    host = proxy.call("node")
    port = proxy.call("reserve", host)   # held by the actor; its child binds beside it
    address = f"{host}:{port}"
    self._start(proxy, ["--role=server", launch.server_flag(address)],
                {wire.RESERVED_PORT_ENV: str(port)})
    return address

  def start_shard(self, shard: int, server_address: str) -> ActorProcess:
    proxy = self._actor(f"shard{shard}")
    host = proxy.call("node")
    return self._start(proxy, [
        "--role=shard", f"--shard={shard}", launch.server_flag(server_address),
        f"--shard_address={host}:0"])

  def start_mesh(self, mesh: int, server_address: str) -> list[ActorProcess]:
    from ray.util import scheduling_strategies  # pylint: disable=g-import-not-at-top
    P = self.topo.processes_per_mesh
    bundle = {"CPU": self.cpus, **({"GPU": self.gpus_per_process} if self.gpus_per_process
                                   else {})}
    group = self.ray.util.placement_group([dict(bundle) for _ in range(P)],
                                          strategy="STRICT_PACK")
    self.groups.append(group)
    self.ray.get(group.ready(), timeout=float(self.config.dist.join_timeout))
    proxies = [self._actor(f"mesh{mesh}_rank{r}",
                           scheduling_strategy=scheduling_strategies.PlacementGroupSchedulingStrategy(
                               placement_group=group, placement_group_bundle_index=r))
               for r in range(P)]
    flags = ["--role=worker", f"--mesh={mesh}", launch.server_flag(server_address),
             f"--processes_per_mesh={P}"]
    extra = {}
    if P > 1:
      host = proxies[0].call("node")
      port = proxies[0].call("reserve", host)
      flags.append(f"--coordinator_address={host}:{port}")
      extra = {wire.RESERVED_PORT_ENV: str(port)}
    return [self._start(p, flags + [f"--rank={r}"], extra if r == 0 else None)
            for r, p in enumerate(proxies)]

  # -- following and ending ---------------------------------------------------------------------

  def _refresh(self) -> None:
    """Every running child's state in one round of calls (one at a time cost a round trip
    each, every half second, for every process of the run)."""
    live = [p for p in self.procs.values() if p.returncode is None]
    for proxy, answer in [(p, p.actor.poll.remote()) for p in live]:
      proxy.settle(answer)

  def _read_log(self, name: str, offset: int) -> bytes:
    proxy = self.procs.get(name)
    if proxy is None or proxy.returncode is not None and proxy.returncode < 0:
      return super()._read_log(name, offset)
    try:
      return proxy.call("read", os.path.join(self.logs, f"{name}.txt"), offset)
    except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
      return b""

  def _release_ports(self) -> None:
    """Ends every actor and placement group (their reservations with them), and Ray if this
    launcher started it."""
    for proxy in self.procs.values():
      try:
        self.ray.kill(proxy.actor)
      except Exception:  # pylint: disable=broad-except  (already gone)
        pass
    for group in self.groups:
      try:
        self.ray.util.remove_placement_group(group)
      except Exception:  # pylint: disable=broad-except
        pass
    self.groups = []
    if self.started_ray and self.ray.is_initialized():
      self.ray.shutdown()
    super()._release_ports()


def define_flags(unit: str, local: str):
  """``--launcher``, ``--ray_address`` and ``--ray_{cpus,gpus}_per_<unit>`` for a command whose
  Ray unit is ``unit`` (``process``, ``trial``); ``local`` says what ``--launcher=local`` does.
  Returns the four flag holders."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  return (flags.DEFINE_enum("launcher", "local", ["local", "ray"],
                            f"local: {local}; ray: each {unit} on a Ray cluster "
                            "(gssp_jax/runtime/ray_launch.py)"),
          flags.DEFINE_string("ray_address", "", "ray: an existing cluster's address (default: "
                              "a local Ray instance, stopped at the end)"),
          flags.DEFINE_float(f"ray_cpus_per_{unit}", 1.0, f"ray: CPUs of each {unit}"),
          flags.DEFINE_float(f"ray_gpus_per_{unit}", 0.0, f"ray: GPUs of each {unit} (1 on a "
                             "GPU cluster: one device each)"))


def refuse_unused(holders, where: str) -> None:
  """Refuses any of :func:`define_flags`' flags given ``where`` they do not apply (a role's
  own process, or ``--launcher=local``): none is silently ignored."""
  given = [f"--{h.name}={h.value}" for h in holders if h.value != h.default]
  if given:
    raise ValueError(f"{', '.join(given)} is invalid {where}; allowed: only with "
                     "--launcher=ray, on the command that starts the whole run or sweep")


# -- sweeps: one Ray task per trial -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RaySettings:
  """Where and with what a sweep's trials run on Ray.

  Attributes:
    address: an existing cluster's address; "" starts a local instance for the sweep.
    cpus, gpus: each trial task's resources (Ray runs as many at once as they allow).
  """
  address: str = ""
  cpus: float = 1.0
  gpus: float = 0.0

  def __post_init__(self):
    if self.cpus <= 0 or self.gpus < 0:
      raise ValueError(f"--ray_cpus_per_trial={self.cpus} / --ray_gpus_per_trial={self.gpus} "
                       "is invalid; allowed: CPUs > 0, GPUs >= 0")


def _trial_task(cmd: Sequence[str], cwd: str, env: dict[str, str], log_path: str) -> int:
  """A Ray task: one trial's process (``experiments.sweep --only``) on the task's node; its
  exit code. Cancelled (``ray.cancel``), it stops the trial with SIGTERM, as Ctrl-C would: the
  trial records ``interrupted`` and keeps its checkpoint."""
  os.makedirs(os.path.dirname(log_path), exist_ok=True)
  with open(log_path, "a") as log:   # as --parallel's children's stdout.txt
    proc = start_child(cmd, cwd, env, log)
  try:
    return proc.wait()
  except KeyboardInterrupt:
    proc.terminate()
    try:
      return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      return proc.wait()


def run_trials(trials: Sequence[Any], command, trial_dir, progress, settings: RaySettings,
               env: dict[str, str]) -> None:
  """Runs ``trials`` as Ray tasks, each ``command(trial)`` in a process of its task's node.

  ``progress(trial)`` is called as each one ends, in the order they end. A trial whose task or
  node is lost stays unfinished (a rerun of the sweep resumes it); the others go on. On Ctrl-C
  or SIGTERM every running trial is stopped as ``--parallel`` stops its children, then the
  interrupt goes on. A Ray instance started here is stopped at the end.
  """
  ray = _ray()
  started = connect(ray, settings.address, os.cpu_count() or 1)
  task = ray.remote(_trial_task).options(num_cpus=settings.cpus, num_gpus=settings.gpus,
                                         max_retries=0)
  refs = {task.remote(command(t), os.getcwd(), env,
                      os.path.join(trial_dir(t), "stdout.txt")): t for t in trials}
  pending = list(refs)
  try:
    while pending:
      done, pending = ray.wait(pending, num_returns=1)
      for ref in done:
        try:
          ray.get(ref)
        except ray.exceptions.RayError as e:   # its worker or node was lost
          logging.error("trial %s: its Ray task was lost (%s); a rerun resumes it",
                        refs[ref].name, type(e).__name__)
        progress(refs[ref])
  except KeyboardInterrupt:
    for ref in pending:
      ray.cancel(ref)   # KeyboardInterrupt in the task: the trial stops as on Ctrl-C
    ray.wait(pending, num_returns=len(pending), timeout=90)
    raise
  finally:
    if started:
      ray.shutdown()
