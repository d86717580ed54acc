"""A one-host run on a network of its own: a Linux network namespace only its processes are in.

The run's gRPC and Flight ports are closed to whoever lacks the run's secret
(``auth``), but a mesh of several processes is a ``jax.distributed`` cluster
whose coordination service and gloo connections have no authentication: on
loopback they keep off the network, not off the host's other users. With
``experiments.launch --private_network`` the one-host launcher starts itself
again under ``unshare --net`` (util-linux), so it and every process it starts
share a fresh network namespace with nothing but its own loopback: no process
outside it, of any user but root, reaches any of their ports. A user who is
not root gets a user namespace too (``--user --map-root-user``: they are
"root" inside it, with no more rights outside it than before), where the host
allows unprivileged user namespaces.

``unshare`` execs the launcher in place (the same process id, so Ctrl-C and
the launcher's own signal handling are unchanged); the launcher then brings
the namespace's loopback up (an ``ioctl``, as ``ip link set lo up``) before
it binds anything. Only the one-host launcher can do this: a cluster's
processes must reach each other over the network (a firewall or a private
network there, ``docs/REAL_RUNS.md``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import NoReturn, Sequence

from gssp_jax.runtime import wire

INSIDE_ENV = "GSSP_PRIVATE_NETWORK"   # set in the namespace (the launcher and its children)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"                    # struct ifreq: the name, then the flags of its union
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def unshare_command() -> list[str]:
  """``unshare`` with the namespaces this user needs: the network's, and a user namespace of
  their own where they are not root."""
  return ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--user", "--map-root-user"])


def check_available() -> None:
  """Raises ValueError saying why this host cannot give a run a network of its own."""
  if not sys.platform.startswith("linux"):
    raise ValueError(f"--private_network needs Linux network namespaces; this is {sys.platform}")
  if shutil.which("unshare") is None:
    raise ValueError("--private_network needs util-linux's unshare, which is not on the PATH")
  command = unshare_command()
  trial = subprocess.run(command + ["true"], capture_output=True, text=True, timeout=30)
  if trial.returncode:
    raise ValueError(f"--private_network: {' '.join(command)} fails here "
                     f"({trial.stderr.strip() or trial.returncode}); this host does not let you "
                     "make a network namespace (as root it always can; as another user it needs "
                     "unprivileged user namespaces, e.g. sysctl kernel.unprivileged_userns_clone=1"
                     " or user.max_user_namespaces > 0)")


def check_addresses(addresses: dict[str, str | None]) -> None:
  """Raises ValueError for an address (``{flag: host:port}``) that is not loopback: inside the
  namespace loopback is the only interface."""
  for flag, address in addresses.items():
    if address and wire.check_address(flag, address)[0] not in LOOPBACK_HOSTS:
      raise ValueError(f"{flag}={address!r} with --private_network is invalid; allowed: a "
                       f"loopback address ({', '.join(LOOPBACK_HOSTS)}), the namespace's only "
                       "interface")


def inside() -> bool:
  return os.environ.get(INSIDE_ENV) == "1"


def reexec(args: Sequence[str]) -> NoReturn:
  """Starts ``python args`` in place of this process, in a fresh network namespace."""
  command = unshare_command() + ["--", sys.executable, *args]
  sys.stdout.flush()
  sys.stderr.flush()
  os.execvpe(command[0], command, {**os.environ, INSIDE_ENV: "1"})


def loopback_up() -> None:
  """Brings this namespace's ``lo`` up (a fresh namespace has it down)."""
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack(_IFREQ, fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
    if not flags & _IFF_UP:
      fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
