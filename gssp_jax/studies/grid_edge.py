"""The grid-edge rule: a tuned value that wins at an end of the values tried is tried beyond it.

A sweep file may give a tuned key a ladder (``sweep.tune(key, values, ladder=...)``: increasing
numbers that hold the declared values). Once every trial of a configuration (every swept value
but the tuned keys and the seed) has finished, its best value is the one the report picks
(``report.best_value``, :data:`report.TUNING_CRITERION`). If that value of a laddered key is the
lowest (highest) the configuration has tried along that key, and the ladder goes on below
(above), the configuration runs at the ladder's next value, on every seed of its best value.
The rule repeats until no configuration's best can move, so no winner sits at the edge of what
it tried unless the ladder ends there (the report says which).

A grid that keeps reporting seeds apart (``sweep.report_on``) tunes on its own seeds alone: the
rule reads only their trials. Once no configuration's best can move, each configuration's
chosen value runs on every reporting seed (:func:`reporting`), so those seeds never take
part in a choice; a rerun that finds them finished adds nothing.

The added trials go to the sweep's ``extended.json`` before they run, so a rerun, a child
process (``experiments.sweep --only``) and the report treat them as trials of the grid; the
sweep runner does not take them for a changed sweep. Nothing is extended while any trial of the
sweep is unfinished (failed, interrupted, not run): a rerun finishes them first.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from absl import logging

from gssp_jax.studies import report
from gssp_jax.studies import sweep as sweep_lib


def _configuration(overrides: dict, tuned: Sequence[str]) -> tuple:
  return report.configurations([{"_overrides": overrides}], list(tuned)).popitem()[0]


def extensions(workdir: str, trials: Sequence[sweep_lib.Trial],
               ladders: dict[str, tuple]) -> list[tuple[dict, str]]:
  """The trials the rule adds now: ``(overrides, why)`` for each, in the grid's order.

  Args:
    workdir: the sweep's directory (its ``sweep.json`` names ``trials``).
    trials: the sweep's current trials (``sweep.expand(path, overrides, workdir)``).
    ladders: per tuned key, its ladder (``Trials.ladders``).
  """
  if not ladders:
    return []
  by_name = {t.name: t for t in trials}
  tuned, settled = _settled(workdir, trials)
  added = []
  for by_value in settled.values():
    best = report.best_value(by_value)
    for i, key in enumerate(tuned):
      step = _next_value(key, i, best, list(by_value), ladders.get(key))
      if step is None:
        continue
      value, why = step
      for member in by_value[best]:
        overrides = _changed(member, by_name, key, value)
        if overrides is not None:
          added.append((overrides, why))
  return added


def _changed(member: dict, by_name: dict, key: str, value) -> dict | None:
  """A trial's overrides with ``key`` set to ``value``, in the grid's key order (the trial's own;
  trial.json sorts them); None where the sweep has that trial already."""
  trial = by_name.get(member["trial"])
  overrides = {**(trial.overrides if trial else member["_overrides"]), key: value}
  return None if sweep_lib.trial_name(overrides) in by_name else overrides


def _settled(workdir: str, trials: Sequence[sweep_lib.Trial]) -> tuple[list[str], dict]:
  """The tuned keys, and per configuration whose trials have all finished, its tuning trials
  by tuned value (``report.configurations``, without the reporting seeds' trials)."""
  rows = report.collect(workdir)
  tuned = report.tuned_keys(rows)
  waiting = {_configuration(t.overrides, tuned) for t in trials
             if sweep_lib.trial_status(os.path.join(workdir, t.name)) not in sweep_lib.FINISHED}
  reporting = getattr(trials, "report_seeds", None)
  out = {}
  for cfg, by_value in report.configurations(rows, tuned).items():
    by_value = report.tuning_trials(by_value, reporting)
    if cfg not in waiting and by_value:
      out[cfg] = by_value
  return tuned, out


def reporting(workdir: str, trials: Sequence[sweep_lib.Trial]) -> list[tuple[dict, str]]:
  """The reporting trials to add now (``sweep.report_on``): each settled configuration's chosen
  value on every reporting seed it has not run, ``(overrides, why)`` each."""
  seeds = getattr(trials, "report_seeds", None)
  if not seeds:
    return []
  by_name = {t.name: t for t in trials}
  tuned, settled = _settled(workdir, trials)
  added = []
  for by_value in settled.values():
    best = report.best_value(by_value)
    chosen = ", ".join(f"{k}={json.loads(v)}" for k, v in zip(tuned, best))
    for seed in seeds:
      overrides = _changed(by_value[best][0], by_name, "seed", seed)
      if overrides is not None:
        added.append((overrides, f"reporting seed {seed} at the chosen {chosen}"))
  return added


def _next_value(key: str, i: int, best: tuple, values: list[tuple],
                ladder: tuple | None) -> tuple[float, str] | None:
  """The ladder's next value beyond ``best[i]`` where it is an end of the values tried along
  ``key`` (the other tuned keys at ``best``'s), with the reason; None where it is not, where
  fewer than two values were tried, a value is off the ladder, or the ladder ends there."""
  if not ladder:
    return None
  along = sorted(json.loads(v[i]) for v in values
                 if all(v[j] == best[j] for j in range(len(best)) if j != i))
  chosen = json.loads(best[i])
  if len(along) < 2 or any(x not in ladder for x in along):
    return None
  at = ladder.index(chosen)
  if chosen == along[0] and at > 0:
    value, side = ladder[at - 1], "lowest"
  elif chosen == along[-1] and at < len(ladder) - 1:
    value, side = ladder[at + 1], "highest"
  else:
    return None
  tried = ", ".join(f"{x:g}" for x in along)
  return value, f"{key}={chosen:g} won as the {side} value tried ({tried}); next on the ladder"


def run_sweep(path: str, workdir: str, **kwargs) -> dict[str, str]:
  """``sweep.run_sweep``, then the rule: adds and runs trials until no winner can move.

  ``kwargs`` go to ``sweep.run_sweep``. With ``max_trials`` set, the sweep runs as asked and
  nothing is extended (a rerun without it extends).

  Returns:
    each trial's status, the added ones included.
  """
  while True:
    statuses = sweep_lib.run_sweep(path, workdir, **kwargs)
    if kwargs.get("max_trials"):
      return statuses
    unfinished = [n for n, s in statuses.items() if s not in sweep_lib.FINISHED]
    trials = sweep_lib.expand(path, kwargs.get("overrides"), workdir)
    if not trials.ladders and not trials.report_seeds:
      return statuses
    if unfinished:
      logging.info("grid edge: not extended while %d trial(s) are unfinished (%s); a rerun "
                   "finishes them first", len(unfinished), ", ".join(unfinished[:5]))
      return statuses
    added = extensions(workdir, trials, trials.ladders) or reporting(workdir, trials)
    if not added:
      logging.info("grid edge: every configuration's best value lies inside the values it "
                   "tried, or at the end of its ladder%s", ", and has run on every reporting "
                   "seed" if trials.report_seeds else "")
      return statuses
    for overrides, why in added:
      logging.info("grid edge: adding %s: %s", sweep_lib.trial_name(overrides), why)
    sweep_lib.add_extended(workdir, [o for o, _ in added], [w for _, w in added])


def possible(trials: Sequence[sweep_lib.Trial], ladders: dict[str, tuple],
             workdir: str | None = None) -> int:
  """The most trials the rule could still add (an upper bound, for the plan).

  Per configuration and laddered key it tunes: the ladder's values not tried yet, times its
  tuning seeds; and per configuration, the reporting seeds (``sweep.report_on``) it has not
  run. With ``workdir`` (the sweep's directory), a configuration whose trials have all
  finished counts only what lies beyond its best value on the side the rule would move it
  (:func:`_next_value`): nothing where its best is inside the values tried or at the ladder's
  end, so a finished study that the rule has settled says 0.
  """
  tuned = list(dict.fromkeys(k for t in trials for k in t.tuned))
  reporting = set(getattr(trials, "report_seeds", None) or ())
  by_cfg: dict[tuple, list[dict]] = {}
  for t in trials:
    by_cfg.setdefault(_configuration(t.overrides, tuned), []).append(t.overrides)
  settled = {}
  if workdir is not None and (ladders or reporting) and os.path.isdir(workdir):
    settled = {cfg: v for cfg, v in _settled(workdir, trials)[1].items() if cfg in by_cfg}
  total = 0
  for cfg, members in by_cfg.items():
    seeds = {json.dumps(m.get("seed")) for m in members if m.get("seed") not in reporting}
    total += len(reporting - {m.get("seed") for m in members})
    for key, ladder in ladders.items():
      tried = {m[key] for m in members if key in m}
      if len(tried) < 2 or not tried <= set(ladder):
        continue
      if cfg in settled and key in tuned:
        untried = _beyond_best(key, tuned.index(key), settled[cfg], ladder)
      else:
        untried = [x for x in ladder if x not in tried]
      total += len(untried) * len(seeds)
  return total


def _beyond_best(key: str, i: int, by_value: dict, ladder: tuple) -> list:
  """The ladder's values the rule may still try along ``key`` for a finished configuration
  (``by_value`` as ``report.configurations`` gives it): those beyond its best value on the side
  the rule moves it, none where it does not move it."""
  best = report.best_value(by_value)
  step = _next_value(key, i, best, list(by_value), ladder)
  if step is None:
    return []
  value, chosen = step[0], json.loads(best[i])
  return [x for x in ladder if (x <= value if value < chosen else x >= value)]
