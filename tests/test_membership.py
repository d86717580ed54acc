"""Workers that leave (``Protocol.drop``) and come back (``Protocol.rejoin``) while a protocol runs.

Host protocols only: no JAX compilation. Driven directly, event by event, and
through ``sync.TimelineEngine`` with a worker that hangs (its compute never
ends) until the engine drops it (``drop_at``).
"""

import json

import numpy as np
import pytest

from gssp_jax import sync
from gssp_jax import host_state

HANG = 1e6   # a hung iteration: longer than any run here


def _hanging(speeds, worker, iteration):
  """Compute times: ``speeds[w]`` per iteration, except ``worker`` hangs in ``iteration``.

  Only once: a dropped worker's unfinished iteration is run again after it
  rejoins (the engine counts iterations by pushes), and then it completes.
  """
  hung = []

  def compute_time(w, k):
    if (w, k) == (worker, iteration) and not hung:
      hung.append(k)
      return HANG
    return float(speeds[w])
  return compute_time


def _starts(engine, until):
  """Steps ``engine`` through every event up to ``until``.

  Returns ``(time, worker, clock, alive)`` at every iteration start (a start
  changes no protocol state, so the state after it is the state it saw).
  """
  out = []
  while engine.queue and engine.queue[0][0] <= until:
    kind, worker = engine.queue[0][2], engine.queue[0][3]
    engine.step()
    if kind == "start":
      out.append((engine.now, worker, engine.protocol.clock.copy(),
                  engine.protocol.alive.copy()))
  return out


def _worst_ahead(starts, members=None):
  """Largest ``clock[w] - min(clock of the alive workers bounding it)`` over ``starts``."""
  worst = -1
  for _, w, clock, alive in starts:
    mine = alive if members is None else alive & (members == members[w])
    worst = max(worst, int(clock[w] - clock[mine].min()))
  return worst


def _step_through(engine, kind):
  """Steps ``engine`` through its next event of ``kind``; returns that event's rounds."""
  while True:
    popped = engine.queue[0][2]
    rounds = engine.step()
    if popped == kind:
      return rounds


def _pulls(reaction):
  return [np.flatnonzero(r.pulls).tolist() for r in reaction.rounds]


# ---------------------------------------------------------------- SSP, DSSP, ASP


@pytest.mark.parametrize("build,bound,reached", [
    (lambda: sync.SSPProtocol(3, 1), 1, 1),
    (lambda: sync.DSSPProtocol(3, (1, 3)), 3, 2),   # s_L = 1 passed on credit
])
def test_ssp_and_dssp_go_on_after_a_hung_worker_is_dropped(build, bound, reached):
  speeds = [1.0, 1.3, 1.7]
  times = lambda: _hanging(speeds, 2, 3)   # w2 pushes 3 times, then hangs from t = 5.1
  stalled = sync.TimelineEngine(build(), times())
  _starts(stalled, 60.0)
  assert stalled.protocol.clock[0] <= 3 + bound + 1   # held back by the hung worker
  engine = sync.TimelineEngine(build(), times())
  engine.drop_at(8.0, 2)
  before = _starts(engine, 8.0)
  after = _starts(engine, 60.0)
  assert engine.protocol.alive.tolist() == [True, True, False]
  assert engine.protocol.clock[2] == 3
  assert engine.protocol.clock[0] > 40 and engine.protocol.clock[1] > 30
  assert all(w != 2 for _, w, _, _ in after)           # its hung iteration vanished
  assert _worst_ahead(before + after) <= bound          # the bound, over the alive workers, holds
  assert _worst_ahead(after) == reached                 # ... and binds after the drop
  assert engine.blocked_time_so_far()[2] == engine.blocked_time[2]   # dead: not waiting


def test_ssp_drop_releases_the_waiting_workers_in_a_round_of_pulls():
  protocol = sync.SSPProtocol(3, 1)
  assert protocol.on_push(0, 1.0).release == [0]
  assert protocol.on_push(0, 2.0).release == []          # 2 ahead of w1 and w2
  assert protocol.on_push(1, 2.5).release == [1]         # w0 still 2 ahead of w2
  reaction = protocol.drop(2, 3.0)
  assert reaction.release == [0]
  assert _pulls(reaction) == [[0]]
  rnd = reaction.rounds[0]
  assert not rnd.arrived.any() and not rnd.applies.any() and rnd.time == 3.0
  assert protocol.drop(1, 3.5).rounds == []              # frees nobody: no round


def test_dssp_drop_is_no_push():
  # w0, the last pusher, waits (4 - 0 > s_L). The drop of w2 leaves it 2 > s_L ahead of
  # w1: it keeps waiting, spending no credit and meeting no controller, and goes when
  # w1's push brings it within s_L.
  protocol = sync.DSSPProtocol(3, (1, 4))
  protocol.clock[:] = [4, 2, 0]
  protocol.last[:], protocol.prev[:] = [5.0, 5.5, 1.0], [4.0, 3.0, 0.5]
  protocol.blocked[0] = True
  protocol._pusher = 0
  assert protocol.drop(2, 6.0).rounds == []
  assert protocol.thresholds == [] and protocol.credit.tolist() == [0, 0, 0]
  assert protocol.on_push(1, 6.5).release == [0, 1]
  assert protocol.thresholds == []


def test_dssp_controller_sees_only_alive_workers():
  # Hand-computed, s = (1, 4). The dead w2 had the smallest clock and no history: w1 is
  # the slowest alive (pushed at 3 and 5.5: I_s = 2.5). w0 pushes at 6 (I_f = 1) and is
  # 5 - 2 = 3 ahead: cap min(3, 4 - 3 + 1) = 2, w0's simulated pushes 6, 7, 8, w1's 8,
  # 10.5: r = 2.
  protocol = sync.DSSPProtocol(3, (1, 4))
  protocol.clock[:] = [4, 2, 0]
  protocol.last[:], protocol.prev[:] = [5.0, 5.5, np.nan], [4.0, 3.0, np.nan]
  protocol.drop(2, 5.8)
  assert protocol.on_push(0, 6.0).release == [0]
  assert protocol.thresholds == [(6.0, 0, 2)]
  # The dead w2 had the largest clock: w0 is still the fastest alive one.
  protocol = sync.DSSPProtocol(3, (1, 4))
  protocol.clock[:] = [4, 2, 10]
  protocol.last[:], protocol.prev[:] = [5.0, 5.5, 1.0], [4.0, 3.0, 0.5]
  protocol.drop(2, 5.8)
  assert protocol.on_push(0, 6.0).release == [0]
  assert protocol.thresholds == [(6.0, 0, 2)]


def test_asp_drop_and_rejoin():
  protocol = sync.ASPProtocol(2)
  protocol.on_push(0, 1.0)
  protocol.on_push(0, 2.0)
  assert protocol.drop(1, 2.5).rounds == []
  for t in range(3, 10):
    assert protocol.on_push(0, float(t)).release == [0]   # never waits
  reaction = protocol.rejoin(1, 10.0)
  assert reaction.release == [1] and _pulls(reaction) == [[1]]
  assert protocol.clock.tolist() == [9, 9]


# ---------------------------------------------------------------- BSP


def test_bsp_barrier_completes_when_the_missing_worker_is_dropped():
  protocol = sync.BSPProtocol(3)
  assert protocol.on_push(0, 1.0).rounds == []
  assert protocol.on_push(1, 2.0).rounds == []           # waits for w2 forever
  reaction = protocol.drop(2, 3.0)
  assert reaction.release == [0, 1]
  (rnd,) = reaction.rounds
  assert rnd.arrived.tolist() == [True, True, False] and rnd.applies.tolist() == [True]
  assert rnd.pulls.tolist() == [True, True, False] and rnd.time == 3.0
  # Next rounds: the barrier waits for w0 and w1 only.
  assert protocol.on_push(1, 4.0).rounds == []
  (rnd,) = protocol.on_push(0, 5.0).rounds
  assert rnd.arrived.tolist() == [True, True, False]


def test_bsp_keeps_a_dropped_workers_push_unless_it_rejoins_first():
  protocol = sync.BSPProtocol(3)
  protocol.on_push(2, 1.0)
  protocol.on_push(0, 1.5)
  assert protocol.drop(2, 2.0).rounds == []              # w1 has not pushed
  (rnd,) = protocol.on_push(1, 3.0).rounds
  assert rnd.arrived.tolist() == [True, True, True]      # w2's push reached the server
  assert rnd.pulls.tolist() == [True, True, False]
  # A rejoin before the barrier: the worker recomputes its gradient, the old one goes.
  protocol = sync.BSPProtocol(3)
  protocol.on_push(2, 1.0)
  protocol.drop(2, 2.0)
  reaction = protocol.rejoin(2, 2.5)
  assert reaction.release == [2] and _pulls(reaction) == [[2]]
  assert protocol.clock[2] == 0                          # no barrier has passed
  protocol.on_push(0, 3.0)
  assert protocol.on_push(1, 3.5).rounds == []           # the barrier waits for w2 again
  (rnd,) = protocol.on_push(2, 4.0).rounds
  assert rnd.arrived.all() and rnd.pulls.all()


def test_bsp_timeline_goes_on_without_the_hung_worker():
  times = lambda: _hanging([1.0, 1.5, 2.0], 2, 2)
  stalled = sync.TimelineEngine(sync.BSPProtocol(3), times())
  _starts(stalled, 50.0)
  engine = sync.TimelineEngine(sync.BSPProtocol(3), times())
  engine.drop_at(5.7, 2)     # w0 and w1 wait at the barrier since 5.0 and 5.5
  rounds = []
  while engine.now < 50.0:
    rounds.extend(engine.step())
  assert stalled.protocol.clock[0] == 3 and len(stalled.events) < 20   # stuck at round 3
  assert [r.time for r in rounds][:20] == pytest.approx(
      [2.0, 4.0] + [5.7 + 1.5 * i for i in range(18)])   # the drop completes round 3
  assert all(not r.pulls[2] and r.pulls[:2].all() for r in rounds[2:])
  np.testing.assert_allclose(engine.blocked_time[:2], [2.0 + 0.7 + 0.5 * 29, 0.2 + 1.0],
                             atol=1e-9)


def test_engine_counts_a_dropped_workers_wait_up_to_the_drop_only():
  engine = sync.TimelineEngine(sync.SSPProtocol(2, 0), lambda w, k: [1.0, 3.0][w])
  engine.drop_at(2.0, 0)        # w0 waits for w1 since its push at 1
  engine.drop_at(2.5, 0)        # a second drop of the same worker is an error
  _starts(engine, 2.0)
  assert engine.blocked_time.tolist() == [1.0, 0.0]
  with pytest.raises(ValueError, match=r"ssp cannot drop worker 0: it was dropped"):
    engine.step()
  _starts(engine, 30.0)
  assert engine.blocked_time_so_far().tolist() == [1.0, 0.0]   # w1 alone never waits
  assert engine.protocol.clock.tolist() == [1, 10]


# ---------------------------------------------------------------- GSSP


GROUPS = np.array([0, 0, 1, 1])
GSPEEDS = [1.0, 1.1, 2.0, 2.3]


@pytest.mark.parametrize("inter_group", ["peer", "global"])
def test_gssp_slow_groups_survivor_goes_on_and_forwards_flow(inter_group):
  def run(drop):
    protocol = sync.GSSPProtocol(4, GROUPS, 1, inter_group=inter_group)
    engine = sync.TimelineEngine(protocol, _hanging(GSPEEDS, 3, 2),
                                 message_delay=lambda m: 0.1)
    if drop:
      engine.drop_at(6.0, 3)
    return engine, _starts(engine, 80.0)

  stalled, _ = run(False)
  engine, starts = run(True)
  fast = lambda e: [(t, w) for kind, t, w in e.events if kind == "push" and GROUPS[w] == 0]
  assert fast(stalled)[:100] == fast(engine)[:100]       # the fast group never notices
  assert stalled.protocol.clock[2] <= 2 + 1 + 1          # w2 waits for its hung peer ...
  assert engine.protocol.clock[2] > 30                   # ... or goes on after the drop
  assert _worst_ahead(starts, GROUPS) == 1               # SSP(1) inside the alive group


@pytest.mark.parametrize("inter_group", ["peer", "global"])
def test_gssp_forwards_are_delivered_after_a_drop(inter_group):
  protocol = sync.GSSPProtocol(4, GROUPS, 1, inter_group=inter_group)
  engine = sync.TimelineEngine(protocol, _hanging(GSPEEDS, 3, 2), message_delay=lambda m: 0.1)
  engine.drop_at(6.0, 3)
  rounds = []
  while engine.now < 80.0:
    rounds.extend(engine.step())
  pushes = sum(int(r.arrived[2:].sum()) for r in rounds)
  assert protocol.clock[2] > 30 and protocol.clock[3] == 2
  # Every 2 pushes processed (the group's size), before the drop and after: w2's alone.
  forwards = sum(int(r.forward[1]) for r in rounds)
  assert forwards in (pushes // 2, pushes // 2 - 1)     # one may wait for the one in flight
  rounds = [r for r in rounds if r.time > 6.0]
  forwards = sum(int(r.forward[1]) for r in rounds)
  assert forwards > 15
  delivered = sum(int(r.deliver[1]) for r in rounds)
  assert delivered >= forwards - 1
  if inter_group == "global":
    adopted = sum(int(r.adopt[1] >= 0) for r in rounds)
    assert adopted >= forwards - 1
  else:
    assert all(r.applies[0] for r in rounds if r.deliver[1])   # group 0 applies them


def test_gssp_global_drop_leaves_held_pushes_and_the_round_trip_alone():
  protocol = sync.GSSPProtocol(3, [0, 0, 1], 3, inter_group="global", forward_every=2)
  protocol.on_push(0, 1.0)
  reaction = protocol.on_push(1, 1.5)                    # forward: the server waits
  assert reaction.messages == [sync.Message("deliver", 0)] and reaction.release == []
  assert protocol.on_push(0, 2.0).rounds == []           # held
  assert protocol.drop(1, 2.1).rounds == []              # w1 waited for the reply
  assert protocol.held == [[0], []] and protocol.in_flight[0]
  deliver = protocol.on_message(sync.Message("deliver", 0), 2.2)
  assert deliver.messages == [sync.Message("adopt", 0)]
  adopt = protocol.on_message(sync.Message("adopt", 0), 2.3)
  assert adopt.rounds[0].adopt[0] == protocol.reply_slot(0)
  assert [np.flatnonzero(r.arrived).tolist() for r in adopt.rounds] == [[], [0]]
  assert adopt.release == [0]
  # A dropped worker's own held push reached the server: it is applied at the adopt.
  protocol = sync.GSSPProtocol(3, [0, 0, 1], 3, inter_group="global", forward_every=2)
  protocol.on_push(0, 1.0)
  protocol.on_push(0, 1.5)                               # forward: w0 waits for the reply
  protocol.on_push(1, 2.0)                               # held
  protocol.on_message(sync.Message("deliver", 0), 2.2)
  assert protocol.drop(1, 2.25).rounds == [] and protocol.held == [[1], []]
  adopt = protocol.on_message(sync.Message("adopt", 0), 2.3)
  assert [np.flatnonzero(r.arrived).tolist() for r in adopt.rounds] == [[], [1]]
  assert adopt.release == [0] and protocol.clock.tolist() == [2, 1, 0]


def test_gssp_a_group_with_every_member_dead_stops_and_the_rest_goes_on():
  protocol = sync.GSSPProtocol(4, GROUPS, 1)
  engine = sync.TimelineEngine(protocol, lambda w, k: GSPEEDS[w], message_delay=lambda m: 0.1)
  engine.drop_at(5.0, 2)
  engine.drop_at(5.0, 3)
  _starts(engine, 5.0)
  slow = protocol.clock[2:].copy()
  _starts(engine, 60.0)
  assert protocol.clock[2:].tolist() == slow.tolist()
  assert protocol.clock[:2].min() > 50


def test_gssp_regrouping_does_not_wait_for_a_dropped_worker():
  protocol = sync.GSSPProtocol(4, GROUPS, 3)
  protocol.request_regroup([0, 1, 0, 1])
  for w in (0, 1, 2):
    protocol.on_push(w, 1.0 + w)
  assert protocol.regroups == []                          # waits for w3
  reaction = protocol.drop(3, 4.0)
  assert protocol.regroups == [(4.0, [0, 1, 0, 1])]
  assert reaction.release == [0, 1, 2] and _pulls(reaction) == [[0, 1, 2]]
  # Through the engine: w3 hangs while the regrouping waits for it.
  def run(drop):
    protocol = sync.GSSPProtocol(4, GROUPS, 3)
    engine = sync.TimelineEngine(protocol, _hanging(GSPEEDS, 3, 2), message_delay=lambda m: 0.1)
    _starts(engine, 5.0)                                  # w3 hangs from 4.6
    protocol.request_regroup([0, 1, 0, 1])
    if drop:
      engine.drop_at(8.0, 3)
    _starts(engine, 60.0)
    return protocol
  assert run(False).regroups == []
  regrouped = run(True)
  assert len(regrouped.regroups) == 1 and regrouped.clock[:3].min() > 20


# ---------------------------------------------------------------- rejoin


def test_ssp_rejoin_pulls_takes_the_slowest_alive_clock_and_is_bounded_again():
  speeds = [1.0, 1.3, 1.7]
  engine = sync.TimelineEngine(sync.SSPProtocol(3, 1), _hanging(speeds, 2, 3))
  protocol = engine.protocol
  engine.drop_at(8.0, 2)
  engine.rejoin_at(30.0, 2)
  _starts(engine, 30.0 - 1e-9)
  clocks = protocol.clock.copy()
  assert clocks[2] == 3 and clocks[:2].min() > 10
  blocked = engine.blocked_time.copy()
  rounds = _step_through(engine, "rejoin")
  assert protocol.clock[2] == clocks[:2].min()          # the slowest alive clock
  (rnd,) = rounds
  assert np.flatnonzero(rnd.pulls).tolist() == [2] and not rnd.arrived.any()
  assert not rnd.applies.any()
  after = _starts(engine, 80.0)
  assert any(w == 2 for _, w, _, _ in after)             # it works again ...
  assert _worst_ahead(after) == 1                        # ... and bounds the others again
  assert engine.blocked_time[0] > blocked[0]             # w0 waits for w2 again
  assert engine.blocked_time[2] - blocked[2] < 1.0       # its time away was no wait


def test_rejoin_clock_rule_never_stalls_or_releases_anyone():
  protocol = sync.SSPProtocol(4, 2)
  protocol.clock[:] = [9, 7, 8, 1]
  protocol.blocked[0] = True                             # 2 ahead of w1: may go; say it waits
  protocol.drop(3, 1.0)                                  # releases w0 (9 - 7 = 2)
  protocol.on_push(1, 2.0)
  before = protocol.clock.copy()
  reaction = protocol.rejoin(3, 3.0)
  assert protocol.clock[3] == before[:3].min() == 8
  assert protocol.ahead()[:3].tolist() == (before[:3] - 8).tolist()   # the minimum is unchanged
  assert reaction.release == [3]
  # Every worker that is ahead by at most s stays free to go; nobody newly waits.
  protocol.on_push(3, 4.0)
  assert protocol.clock.tolist() == [9, 8, 8, 9]


def test_gssp_rejoin_takes_its_groups_clock_since_the_regrouping():
  protocol = sync.GSSPProtocol(4, GROUPS, 5)
  protocol.drop(3, 0.5)
  for t in range(4):
    protocol.on_push(2, 1.0 + t)                          # w2 (group 1) is at 4
  protocol.on_push(0, 1.0)                               # group 0 at 1 and 0
  reaction = protocol.rejoin(3, 6.0)
  assert protocol.clock[3] == 4                          # its group's, not the global minimum
  assert reaction.release == [3] and _pulls(reaction) == [[3]]
  assert reaction.rounds[0].groups[3] == 1               # it pulls its group server
  # After a regrouping the clocks count from the baseline.
  protocol.drop(3, 7.0)
  protocol.request_regroup([0, 1, 1, 0])
  for w in (0, 1, 2):
    protocol.on_push(w, 8.0)
  assert protocol.regroups and protocol.route.tolist() == [0, 1, 1, 0]
  protocol.on_push(0, 9.0)
  protocol.on_push(0, 10.0)                              # w0: 2 pushes since the regrouping
  protocol.rejoin(3, 11.0)
  assert protocol.clock[3] - protocol.baseline[3] == 2


def test_gssp_rejoin_discards_its_own_held_push():
  protocol = sync.GSSPProtocol(3, [0, 0, 1], 3, inter_group="global", forward_every=2)
  protocol.on_push(0, 1.0)
  protocol.on_push(1, 1.5)
  protocol.on_message(sync.Message("deliver", 0), 1.6)
  protocol.on_push(0, 2.0)                               # held, w0 blocked
  protocol.drop(0, 2.1)
  assert protocol.held[0] == [0]
  reaction = protocol.rejoin(0, 2.2)                      # served at once
  assert reaction.release == [0] and protocol.held[0] == []
  adopt = protocol.on_message(sync.Message("adopt", 0), 2.3)
  assert not any(r.arrived.any() for r in adopt.rounds)


def test_dssp_rejoin_has_no_credit_and_no_history():
  protocol = sync.DSSPProtocol(2, (1, 4))
  for t in range(3):
    protocol.on_push(1, 1.0 + t)
    protocol.on_push(0, 1.5 + t)
  protocol.credit[1] = 2
  protocol.drop(1, 4.0)
  protocol.rejoin(1, 9.0)
  assert protocol.credit[1] == 0
  assert np.isnan(protocol.last[1]) and np.isnan(protocol.prev[1])


def test_inhad_drop_and_rejoin():
  protocol = sync.InHADProtocol(3, [0, 0, 1], threshold=2)
  protocol.on_push(0, 1.0)
  assert protocol.drop(2, 1.5).rounds == []
  reaction = protocol.on_push(1, 2.0)
  assert reaction.release == [1] and reaction.messages == [sync.Message("aggregate", 0)]
  reaction = protocol.rejoin(2, 3.0)
  assert reaction.release == [2] and _pulls(reaction) == [[2]]
  assert protocol.on_push(2, 4.0).release == [2]


# ---------------------------------------------------------------- errors


MEMBERS = {
    "bsp": lambda: sync.BSPProtocol(3),
    "asp": lambda: sync.ASPProtocol(3),
    "ssp": lambda: sync.SSPProtocol(3, 1),
    "dssp": lambda: sync.DSSPProtocol(3, (1, 3)),
    "gssp": lambda: sync.GSSPProtocol(3, [0, 0, 1], 1),
    "gssp-global": lambda: sync.GSSPProtocol(3, [0, 0, 1], 1, inter_group="global"),
    "inhad": lambda: sync.InHADProtocol(3, [0, 0, 1]),
}


@pytest.mark.parametrize("name", MEMBERS)
def test_membership_errors(name):
  protocol = MEMBERS[name]()
  assert protocol.supports_membership and protocol.alive.tolist() == [True] * 3
  prefix = protocol.name
  for bad in (-1, 3, 1.0, True, "1"):
    with pytest.raises(ValueError, match=rf"{prefix} worker={bad!r} is invalid; allowed: 0..2"):
      protocol.drop(bad, 0.0)
  with pytest.raises(ValueError, match=rf"{prefix} cannot rejoin worker 1: it is alive"):
    protocol.rejoin(1, 0.0)
  protocol.drop(1, 0.0)
  with pytest.raises(ValueError, match=rf"{prefix} cannot drop worker 1: it was dropped"):
    protocol.drop(1, 0.5)
  with pytest.raises(ValueError, match=rf"{prefix} worker 1 pushed while dropped"):
    protocol.on_push(1, 1.0)
  protocol.rejoin(1, 2.0)
  protocol.on_push(1, 3.0)


@pytest.mark.parametrize("build,why", [
    (lambda: sync.DSSyncProtocol(4, 2), r"dssync cannot drop worker 1: a worker's group"),
    (lambda: sync.CASPProtocol(4), r"casp cannot drop worker 1: a community pushes"),
])
def test_schemes_without_membership_say_why(build, why):
  protocol = build()
  assert not protocol.supports_membership
  with pytest.raises(ValueError, match=why):
    protocol.drop(1, 0.0)
  with pytest.raises(ValueError, match=why.replace("drop", "rejoin")):
    protocol.rejoin(1, 0.0)


# ---------------------------------------------------------------- old host states


@pytest.mark.parametrize("name", sorted(set(MEMBERS) | {"dssync", "casp"}))
def test_protocols_saved_before_membership_load_and_run_unchanged(name):
  build = {**MEMBERS, "dssync": lambda: sync.DSSyncProtocol(3 + 1, 2),
           "casp": lambda: sync.CASPProtocol(4, max_communities=2, reconfigure_every=4)}[name]
  speeds = [1.0, 1.37, 1.91, 2.53]
  times = lambda w, k: speeds[w]

  def engine(protocol):
    return sync.TimelineEngine(protocol, times, message_delay=lambda m: 0.3)

  whole = engine(build())
  while whole.num_pushes < 60:
    whole.step()
  half = engine(build())
  while half.num_pushes < 30:
    half.step()
  state = half.state_dict()
  for key in ("alive", "orphans"):                       # attributes membership added
    state["protocol"].__dict__.pop(key, None)
  state = host_state.from_tree(json.loads(json.dumps(host_state.to_tree(state))))
  resumed = engine(build())
  resumed.load_state_dict(state)
  assert resumed.protocol.alive.tolist() == [True] * resumed.protocol.num_workers
  while resumed.num_pushes < 60:
    resumed.step()
  assert resumed.events == whole.events[len(half.events):]
  assert resumed.protocol.clock.tolist() == whole.protocol.clock.tolist()
  if resumed.protocol.supports_membership:              # and membership works on it
    resumed.protocol.drop(0, resumed.now)
    resumed.protocol.rejoin(0, resumed.now)
