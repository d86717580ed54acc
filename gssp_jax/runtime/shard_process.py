"""The ``shard`` role: one parameter shard's process (``experiments.launch --role=shard``).

It binds its address first (so a bad one fails at once), registers with the
server, receives the layout and its initial tensors (or restores its own
checkpoint of a resumed run), compiles, and serves ``PutGrad``/``Pull`` to
the meshes and ``Ops``/``Snapshot``/``Saved``/``Stop`` to the server. It
needs neither the dataset nor the model: only the config (scheme, optimizer)
and what the server sends.

It stops when the server says so (``Stop``, after the server's final
checkpoint), or when the server has been silent for ``dist.retry_seconds``
(the server sends ops, or a ``noop`` at least every heartbeat interval). A
SIGTERM alone does not stop it at once: the server, signalled at the same
time, still needs it to save its tensors; it waits for the server's ``Stop``
up to ``dist.save_timeout``.
"""

from __future__ import annotations

import json
import socket
import time
from typing import NamedTuple

from absl import logging
import numpy as np

from gssp_jax.runtime import auth
from gssp_jax.runtime import endpoints
from gssp_jax.runtime import layout as layout_lib
from gssp_jax.runtime import server as server_lib
from gssp_jax.runtime import shard as shard_lib
from gssp_jax.runtime import wire


def _advertised(bind_address: str, port: int) -> str:
  host, _ = wire.check_address("--shard_address", bind_address)
  if host in ("0.0.0.0", "::", ""):
    host = socket.getfqdn()
  return f"{host}:{port}"


class ShardHandle(NamedTuple):
  """A started shard: its state, its service, its gRPC server and its link to the server."""
  core: shard_lib.ShardCore
  service: shard_lib.ShardService
  grpc_server: endpoints.Server
  client: endpoints.Client
  address: str


def start(config, workdir: str, index: int, num_servers: int, server_address: str,
          bind_address: str, credentials: auth.Credentials) -> ShardHandle:
  """Binds, registers, builds (or restores), compiles, then serves and announces shard ``index``.

  Its port is bound first and held, answering nothing, until the shard is
  ready: a caller's call waits meanwhile (``endpoints.Server``).
  """
  grpc_server = endpoints.bind_server(bind_address, credentials,
                                      max_workers=2 * config.num_workers + 8,
                                      **endpoints.server_settings(config.dist, credentials))
  address = _advertised(bind_address, grpc_server.port)
  client = endpoints.Client(server_address, credentials,
                            retry_seconds=float(config.dist.join_timeout),
                            **endpoints.client_settings(config.dist, credentials))
  try:
    header, _ = client.call("Register", {"shard": index, "address": address,
                                         "num_servers": num_servers,
                                         "config": server_lib.config_id(config)})
    session = wire.field(header, "session", str)
    layout = layout_lib.ShardLayout.from_description(json.loads(header["layout"]))
    _, body = client.call("Tensors", {"shard": index, "session": session},
                          reply_limit=4 * layout.grad_size(index))
    params = layout.split(index, body.view(np.float32))
    core = shard_lib.ShardCore(index, layout, config, params, [],
                               shard_lib.checkpoint_dir(workdir, index))
    if header["restore"] >= 0:
      seqs = wire.field(header, "seqs", list)
      if len(seqs) != config.num_workers or not all(
          isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seqs):
        raise wire.BadMessage(f"the server's seqs are invalid; allowed: {config.num_workers} "
                              "push numbers >= 0")
      core.restore(int(header["restore"]), seqs)
    core.warm_up()
    core.start()
    service = shard_lib.ShardService(core, credentials, session,
                                     wait_timeout=float(config.dist.save_timeout))
    grpc_server.serve(service.methods())
  except BaseException:
    grpc_server.stop(grace=0)
    client.close()
    raise
  client.call("Ready", {"shard": index, "session": session})
  logging.info("shard %d of %d serving at %s (%d tensors, %.1f MB)", index, num_servers,
               address, len(layout.leaves(index)), layout.pull_bytes(index) / 1e6)
  return ShardHandle(core, service, grpc_server, client, address)


def stop(handle: ShardHandle) -> None:
  handle.core.stop()
  handle.grpc_server.stop(grace=0.5).wait()
  handle.client.close()


def serve(config, workdir: str, index: int, num_servers: int, server_address: str,
          bind_address: str, credentials: auth.Credentials) -> None:
  """Runs shard ``index`` until the server stops it; returns after its checkpoints are written."""
  handle = start(config, workdir, index, num_servers, server_address, bind_address, credentials)
  try:
    _wait(handle.service, config)
  finally:
    stop(handle)


def _wait(service: shard_lib.ShardService, config) -> None:
  """Serves until ``Stop``, a silent server, or (after a SIGTERM) ``dist.save_timeout``."""
  silent = float(config.dist.retry_seconds)
  signalled = None
  while True:
    try:
      if service.stop.wait(0.2):
        logging.info("shard stopped by the server")
        return
      if service.core.error is not None:
        raise service.core.error
      if time.monotonic() - service.last_call > silent:
        logging.error("the server went silent for %.0f s (dist.retry_seconds); this shard stops "
                      "(rerun the command to resume from the last checkpoint)", silent)
        return
      if signalled is not None and time.monotonic() - signalled > config.dist.save_timeout:
        logging.warning("stopping: no Stop from the server within dist.save_timeout")
        return
    except KeyboardInterrupt:
      if signalled is not None:
        return   # a second signal: at once
      signalled = time.monotonic()
