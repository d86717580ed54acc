"""HALoS's device half: local servers with Delayed Nesterov, a global server with its own.

The transform of ``sync.scheme='halos'`` (its host half is
``protocol.HALoSProtocol`` beside it; the workers' jobs are the local-update jobs
of ``sync/local.py``). Replicas as GSSP's global layout: ``G`` local servers,
the global server ``G``, ``G`` reply slots. Per round:

* Each local server applies its arrived pseudo-gradients (scaled ``1/W`` like
  every push here) with its own Delayed Nesterov (``local_momentum``,
  ``local_period``), at ``local_learning_rate``; what it applied since its
  last merge is kept (``progress``, ``[G, ...]``: its weights minus its
  weights right after that merge).
* ``forward[g]``: group ``g`` sends ``-progress[g]`` (the reference's
  ``theta_ref - theta_local``, a descent direction) to ``outbox[g]``.
* ``deliver[g]``: the global server applies ``outbox[g]`` with its Delayed
  Nesterov (``optimizer.momentum``, ``global_period``) at the round's
  ``learning_rate`` (``optimizer.learning_rate`` and its schedule).
* ``adopt[g] >= 0`` (the reply): ``rounds.apply_round`` merges the reply slot
  into local server ``g`` with ``adopt_weight``; its progress restarts at 0.

The hierarchical momentum is the two Delayed Nesterov states: one per local
server, one at the global server (Kim et al., ICML 2025; ``utnslab/halos``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gssp_jax.sync import local as local_lib
from gssp_jax.sync import arguments
from gssp_jax.sync import transforms


# The HALoS authors' Pythia-70M settings (utnslab/halos examples/run_halos.sh): local servers
# at 0.2 per update with N = 16 (their lr 3.2), beta 0.9; the global server at 0.15 per update
# with N = 2 (lr 0.3, optimizer.learning_rate here), beta 0.5; merge weight 0.25.
DEFAULTS = dict(local_learning_rate=3.2, local_momentum=0.9, local_period=16, global_momentum=0.5,
                global_period=2)


def settings_from_config(config) -> dict:
  """``build_scheme``'s ``halos`` settings from ``config.local.halos`` and ``config.optimizer``."""
  h = config.local.halos
  return dict(merge_weight=h.merge_weight, local_learning_rate=h.local_learning_rate,
              local_momentum=h.local_momentum, local_period=h.local_period,
              global_momentum=config.optimizer.momentum, global_period=h.global_period)


class HALoSState(NamedTuple):
  """``ServerState``'s fields, the two momenta, each local server's progress and its outbox."""
  clock: jax.Array
  read: jax.Array
  staleness: jax.Array
  version: jax.Array
  local_opt: Any      # replicated Delayed Nesterov state, [G, ...]
  global_opt: Any     # Delayed Nesterov state of the global server
  progress: Any       # [G, ...] float32
  outbox: Any         # [G, ...] float32


def halos(num_workers: int, num_groups: int, *, assignment=None, local_learning_rate: float,
          local_momentum: float, local_period: int, global_momentum: float,
          global_period: int) -> optax.GradientTransformationExtraArgs:
  """The HALoS transform (see the module docstring); its updates are final (no optimizer after).

  Args:
    num_workers: W.
    num_groups: G local servers.
    assignment: static ``[W]`` groups (the protocol passes ``groups`` per round).
    local_learning_rate: the local servers' rate; a push ``g`` moves its local
      server by ``local_learning_rate * g / local_period`` (plus momentum).
    local_momentum, local_period: the local servers' Delayed Nesterov (beta, N).
    global_momentum, global_period: the global server's (beta, N); a delivered
      progress ``d`` moves it by ``learning_rate * d / global_period``.
  """
  W, G, static_route = _checked_groups(num_workers, num_groups, assignment)
  R = 2 * G + 1
  local_opt = transforms.replicated(
      local_lib.delayed_nesterov(local_momentum, local_period, num_workers=W), G)
  # The global server's input is unscaled progress: N = global_period, no 1/W to undo.
  global_opt = local_lib.delayed_nesterov(global_momentum, global_period, num_workers=1)
  zeros = lambda params, n: jax.tree.map(lambda p: jnp.zeros((n, *jnp.shape(p)), jnp.float32),
                                         params)

  def init(params):
    return HALoSState(**transforms.init_clocks(W, R), local_opt=local_opt.init(params),
                      global_opt=global_opt.init(params), progress=zeros(params, G),
                      outbox=zeros(params, G))

  def update(updates, state, params=None, *, arrived=None, groups=None, pulls=None, applies=None,
             forward=None, deliver=None, adopt=None, worker_ids=None, learning_rate=None,
             no_branches=False, **extra):
    del params, extra
    arrived, route, pulls = transforms.worker_masks(W, static_route, arrived, groups, pulls)
    forward = transforms.mask(forward, [G], bool, False)
    deliver = transforms.mask(deliver, [G], bool, False)
    adopt = transforms.mask(adopt, [R], jnp.int32, -1)
    lr = jnp.float32(1.0) if learning_rate is None else jnp.asarray(learning_rate, jnp.float32)
    pushed = transforms.route_sum(updates, arrived, route, G, 1.0 / W, worker_ids)   # [G, ...]
    got = jnp.zeros([G], bool).at[route].max(arrived)
    local_upd, local_state = local_opt.update(pushed, state.local_opt, applies=got)
    local_upd = jax.tree.map(lambda u: u * local_learning_rate, local_upd)
    progress = jax.tree.map(lambda p, u: p + u, state.progress, local_upd)
    outbox = jax.tree.map(lambda o, p: jnp.where(transforms.rows(forward, o), -p, o),
                          state.outbox, progress)
    any_deliver = jnp.any(deliver)
    global_upd, global_state = _global_step(global_opt, state, deliver, lr, no_branches)
    # The reply's merge happens after this update (apply_round): the progress restarts there.
    merged = adopt[:G] >= 0
    progress = jax.tree.map(lambda p: jnp.where(transforms.rows(merged, p), 0.0, p), progress)
    out = jax.tree.map(lambda lu, gu: jnp.concatenate([lu, gu[None], jnp.zeros_like(lu)]),
                       local_upd, global_upd)
    derived = jnp.concatenate([got, any_deliver[None], jnp.zeros([G], bool)])
    applies = derived if applies is None else transforms.mask(applies, [R], bool, True)
    clocks = transforms.account(state, arrived=arrived, route=route, pulls=pulls,
                                applies=applies, bumps=adopt >= 0)
    return out, HALoSState(**clocks, local_opt=local_state, global_opt=global_state,
                           progress=progress, outbox=outbox)

  return optax.GradientTransformationExtraArgs(init, update)


def _checked_groups(num_workers, num_groups, assignment):
  """:func:`halos`'s ``(W, G, [W] static groups)``, checked."""
  W = arguments.check_int("halos", "num_workers", num_workers, 1)
  G = arguments.check_int("halos", "num_groups", num_groups, 1)
  if G > W:
    raise ValueError(f"halos num_groups={G} is invalid; allowed: at most num_workers={W}")
  static_route = (arguments.equal_groups("halos", W, G) if assignment is None
                  else arguments.check_assignment("halos", "assignment", assignment, W, G))
  return W, G, static_route


def _global_step(global_opt, state: HALoSState, deliver, lr, no_branches: bool):
  """The global server's step on the delivered progress, only in rounds that deliver.

  ``no_branches``: masks (as GSSP's transform), the step kept only where a
  sum arrives; otherwise a ``cond`` skips it. Returns ``(update, its state)``.
  """
  any_deliver = jnp.any(deliver)

  def step(opt_state):
    sent = jax.tree.map(lambda o: jnp.where(transforms.rows(deliver, o), o, 0.0).sum(0),
                        state.outbox)
    upd, new_state = global_opt.update(sent, opt_state)
    upd = jax.tree.map(lambda u: jnp.where(any_deliver, u * lr, 0.0), upd)
    return upd, jax.tree.map(lambda n, o: jnp.where(any_deliver, n, o), new_state, opt_state)

  def no_step(opt_state):
    return jax.tree.map(lambda o: jnp.zeros_like(o[0]), state.outbox), opt_state

  if no_branches:
    return step(state.global_opt)
  return jax.lax.cond(any_deliver, step, no_step, state.global_opt)
