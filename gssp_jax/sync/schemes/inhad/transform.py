"""InHAD on the device: workers add gradients to their node's aggregate; the server pulls the
aggregates when its protocol says so."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gssp_jax.sync import arguments
from gssp_jax.sync import transforms


class InHADState(NamedTuple):
  """InHAD: ``ServerState`` fields plus the node aggregates the server pulls.

  A worker may push several times before the server pulls the aggregates; each
  push is one gradient, applied (and counted in ``clock``) when the server
  pulls. The version cannot change while a gradient waits (the server applies
  every waiting gradient at once), so a gradient's staleness is fixed when it
  reaches its node: the version then minus the version its worker read.

  Attributes:
    node_acc: pytree of ``[N, ...]`` float32, each node's sum of scaled gradients
      not yet pulled by the server.
    waiting: ``[W]`` int32 gradients of the worker in its node's aggregate.
    pending_staleness: ``[W]`` int32 staleness of the worker's latest waiting gradient.
    pending_staleness_sum: ``[W]`` int32 summed staleness of its waiting gradients.
    staleness_total: ``[W]`` int32 summed staleness of its applied gradients
      (saturating); with ``clock`` and ``staleness`` (the latest applied
      gradient's) it pins every applied gradient's staleness.
    count: ``[]`` int32 iteration numbers the server counted since its last update.
  """
  clock: jax.Array
  read: jax.Array
  staleness: jax.Array
  version: jax.Array
  node_acc: Any
  waiting: jax.Array
  pending_staleness: jax.Array
  pending_staleness_sum: jax.Array
  staleness_total: jax.Array
  count: jax.Array


def inhad(num_workers: int, num_nodes: int = 4, *, assignment=None,
          scale: float | None = None) -> optax.GradientTransformationExtraArgs:
  """InHAD: workers add gradients to their node's aggregate; the server pulls them on ``aggregate``.

  Each arrived worker's scaled gradient joins its node's aggregate (nothing is applied). When
  the protocol's iteration-number count passes its threshold it sets ``aggregate``: the server
  applies the sum of every node aggregate as one update and the aggregates empty.

  Args:
    num_workers: W.
    num_nodes: N, the machines workers aggregate on.
    assignment: static ``[W]`` node ids; default equal contiguous nodes.
    scale: factor on every worker gradient, default ``1 / W``.
  """
  num_workers = arguments.check_int("inhad", "num_workers", num_workers, 1)
  num_nodes = arguments.check_int("inhad", "num_nodes", num_nodes, 1)
  static_route = (arguments.equal_groups("inhad", num_workers, num_nodes) if assignment is None
                  else arguments.check_assignment("inhad", "assignment", assignment, num_workers,
                                                  num_nodes))
  scale = arguments.check_scale("inhad", 1.0 / num_workers if scale is None else scale)

  def init(params):
    zeros = lambda: jnp.zeros([num_workers], jnp.int32)   # distinct buffers (donated)
    acc = transforms.zeros_like_stacked(params, num_nodes)
    return InHADState(**transforms.init_clocks(num_workers, 1), node_acc=acc, waiting=zeros(),
                      pending_staleness=zeros(), pending_staleness_sum=zeros(),
                      staleness_total=zeros(), count=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             aggregate=None, worker_ids=None, **extra):
    del params, extra
    arrived, route, pulls = transforms.worker_masks(num_workers, static_route, arrived, groups,
                                                    pulls)
    aggregate = jnp.asarray(True if aggregate is None else aggregate, bool)
    applies = aggregate[None] if applies is None else transforms.mask(applies, [1], bool, True)
    apply = applies[0]
    acc = jax.tree.map(lambda a, c: a + c, state.node_acc,
                       transforms.route_sum(updates, arrived, route, num_nodes, scale, worker_ids))
    out = jax.tree.map(lambda a: jnp.where(apply, a.sum(0, keepdims=True), 0.0), acc)
    acc = jax.tree.map(lambda a: jnp.where(apply, 0.0, a), acc)
    # Every push is its own gradient in the node's aggregate; the version is
    # constant while it waits, so its staleness is known on arrival.
    arriving = jnp.where(arrived, state.version[0] - state.read, 0)
    waiting = transforms.saturating_add(state.waiting, arrived)
    latest = jnp.where(arrived, arriving, state.pending_staleness)
    pending_sum = transforms.saturating_add(state.pending_staleness_sum, arriving)
    applied = (waiting > 0) & apply   # every gradient in the aggregates is applied now
    staleness = jnp.where(applied, latest, state.staleness)
    clock = transforms.saturating_add(state.clock, jnp.where(apply, waiting, 0))
    total = transforms.saturating_add(state.staleness_total, jnp.where(apply, pending_sum, 0))
    version = transforms.saturating_add(state.version, applies)
    read = jnp.where(pulls, version[0], state.read)
    count = jnp.where(apply, 0, transforms.saturating_add(state.count, jnp.sum(arrived)))
    keep = lambda x: jnp.where(apply, 0, x).astype(jnp.int32)
    return out, InHADState(clock=clock, read=read, staleness=staleness.astype(jnp.int32),
                           version=version, node_acc=acc, waiting=keep(waiting),
                           pending_staleness=keep(latest), pending_staleness_sum=keep(pending_sum),
                           staleness_total=total, count=count.astype(jnp.int32))

  return optax.GradientTransformationExtraArgs(init, update)
