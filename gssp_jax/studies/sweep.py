"""Ablation sweeps declared in config files, and a resumable runner.

A sweep file (``configs/sweeps/<name>.py``) defines ``get_config()`` (the base
config) and ``get_sweep()`` (the trials, built with :func:`sweep`,
:func:`product` and :func:`zipped`)::

    def get_sweep():
      return product(sweep("sync.scheme", ["bsp", "gssp"]), sweep("seed", [0, 1]))

Every trial is the base config with its overrides; each runs in its own
workdir under the sweep's workdir, so a rerun skips finished trials
(``done``, ``collapsed``, ``diverged``), retries the others (``failed``,
``interrupted``, ``stopped``) and resumes a trial from its checkpoint.

A rerun after the sweep file changed refuses to mix old and new results: a
trial whose recorded config differs from the one the file now builds is named
with the changed keys, and only ``rerun_changed`` moves such trials aside
(into ``_stale/<time>/``, nothing is deleted) and runs them again. The current
grid is written to ``sweep.json``, which the report keeps to.

Overrides of the base config (``--config.key=value`` on the command line, ``overrides=``
here) apply to every trial before its grid values; a key the grid sets is refused
(:func:`check_overrides`). They are part of each trial's config, so a rerun with other
overrides is a changed sweep (refused, or ``rerun_changed``), and ``sweep.json``
records them.

An axis declared with :func:`tune` instead of :func:`sweep` (e.g. the learning
rate) is a hyperparameter to tune, not a factor to compare: every trial
records the tuned keys in its ``trial.json`` and the report shows each
configuration at its best tuned value (``gssp_jax.studies.report``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any, Sequence

from absl import logging
import ml_collections

from gssp_jax import cli
from gssp_jax import config as config_lib
from gssp_jax import xla_env
from gssp_jax.base import interrupt
from gssp_jax.sync import registry

FINISHED = ("done", "collapsed", "diverged")   # a rerun does not retry these
GRID_FILE = "sweep.json"   # the current grid: what `report` reports
EXTENDED_FILE = "extended.json"   # trials the grid-edge rule added (``gssp_jax.studies.grid_edge``)
STALE_DIR = "_stale"       # changed trials moved aside by `rerun_changed`
MAX_NAME = 200             # characters of a trial directory's name (file names: 255 bytes)


class ChangedTrialsError(ValueError):
  """Trials in the sweep's directory were run with a config the sweep file no longer builds."""


class Grid(list):
  """A list of override dicts that also knows which of its keys are tuned (:func:`tune`).

  ``tune_seeds``: the seeds whose trials choose each configuration's tuned value (default:
  every seed); a grid that runs the other seeds only at the chosen value declares it, and
  the report chooses on those seeds alone (``report.select_tuned``).

  ``ladders``: per tuned key, the increasing values it may be extended to (:func:`tune`'s
  ``ladder``): where a configuration's best value is an end of those it tried, the runner adds
  the ladder's next value on that side (``gssp_jax.studies.grid_edge``).

  ``report_seeds`` (:func:`report_on`): seeds kept apart for reporting. The grid's own seeds
  tune (every value, ladders included); once a configuration's tuning has settled, the runner
  adds its chosen value on each reporting seed (``gssp_jax.studies.grid_edge``), and the report and
  the claims table count those seeds alone.
  """

  def __init__(self, items=(), tuned: Sequence[str] = (), tune_seeds: Sequence[int] | None = None,
               ladders: dict[str, Sequence[float]] | None = None,
               report_seeds: Sequence[int] | None = None):
    super().__init__(items)
    self.tuned = tuple(dict.fromkeys(tuned))
    self.tune_seeds = None if tune_seeds is None else tuple(int(s) for s in tune_seeds)
    self.ladders = {k: tuple(v) for k, v in (ladders or {}).items()}
    self.report_seeds = None if report_seeds is None else _seeds(report_seeds)
    for key, ladder in self.ladders.items():
      if key not in self.tuned:
        raise ValueError(f"ladders: key {key!r} is not tuned; allowed: the tuned keys "
                         f"{list(self.tuned)}")
      _check_ladder(key, ladder, ())


class Trials(list):
  """:func:`expand`'s trials, with the grid's ``tune_seeds``, ``ladders`` and ``report_seeds``
  (for ``sweep.json``)."""
  tune_seeds: tuple[int, ...] | None = None
  ladders: dict[str, tuple] = {}
  report_seeds: tuple[int, ...] | None = None


def _seeds(seeds: Sequence[int]) -> tuple[int, ...]:
  """``seeds`` as a tuple of distinct ints (at least one)."""
  if (isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or not seeds
      or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
      or len(set(seeds)) < len(seeds)):
    raise ValueError(f"report_seeds={seeds!r} is invalid; allowed: a list of distinct integers, "
                     "at least one")
  return tuple(seeds)


def report_on(grid: "Grid", seeds: Sequence[int]) -> "Grid":
  """``grid`` (with tuned keys) with reporting seeds kept apart from its own, tuning seeds:
  e.g. ``report_on(product(schemes, tune("optimizer.learning_rate", RATES), sweep("seed",
  (0, 1, 2))), range(100, 105))`` tunes on seeds 0-2 and reports on seeds 100-104 at each
  configuration's chosen rate (:class:`Grid`)."""
  return Grid(grid, tuned=getattr(grid, "tuned", ()), tune_seeds=getattr(grid, "tune_seeds", None),
              ladders=getattr(grid, "ladders", None), report_seeds=list(seeds))


def _tuned(axes) -> tuple[str, ...]:
  return tuple(k for a in axes for k in getattr(a, "tuned", ()))


def _ladders(axes) -> dict[str, tuple]:
  """The axes' ladders merged; one key with two different ladders is refused."""
  merged: dict[str, tuple] = {}
  for axis in axes:
    for key, ladder in getattr(axis, "ladders", {}).items():
      if merged.setdefault(key, ladder) != ladder:
        raise ValueError(f"tuned key {key!r} has two ladders, {merged[key]} and {ladder}; "
                         "allowed: one ladder per key")
  return merged


def _check_ladder(key: str, ladder: Sequence[Any], values: Sequence[Any]) -> tuple:
  """``ladder`` as a tuple: numbers, strictly increasing, holding every value of ``values``."""
  if isinstance(ladder, (str, bytes)) or not isinstance(ladder, Sequence):
    raise ValueError(f"tune {key!r}: ladder={ladder!r} is invalid; allowed: a list of numbers")
  ladder = tuple(ladder)
  if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in ladder):
    raise ValueError(f"tune {key!r}: ladder={ladder!r} is invalid; allowed: numbers only")
  if len(ladder) < 2 or any(a >= b for a, b in zip(ladder, ladder[1:])):
    raise ValueError(f"tune {key!r}: ladder={ladder!r} is invalid; allowed: at least two numbers, "
                     "strictly increasing")
  missing = [v for v in values if v not in ladder]
  if missing:
    raise ValueError(f"tune {key!r}: values {missing} are not on ladder={ladder!r}; allowed: a "
                     "ladder that holds every tuned value")
  return ladder


def sweep(key: str, values: Sequence[Any]) -> list[dict]:
  """One axis: ``[{key: v} for v in values]``."""
  if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
    raise ValueError(f"sweep {key!r}: values={values!r} is invalid; allowed: a list of values")
  return [{key: v} for v in values]


def tune(key: str, values: Sequence[Any], ladder: Sequence[float] | None = None) -> Grid:
  """An axis of a hyperparameter tuned per configuration, e.g. ``tune("optimizer.learning_rate",
  [0.02, 0.05, 0.1])``: every value runs, the report picks each configuration's best.

  ``ladder`` (increasing numbers holding ``values``, e.g. ``(0.005, 0.01, 0.02, 0.05, 0.1,
  0.2, 0.5)``): where a configuration's best value is the lowest (highest) it has tried, the
  runner also runs it at the ladder's next lower (higher) value, every seed, until its best
  lies inside the values tried or the ladder ends (``gssp_jax.studies.grid_edge``).
  """
  if key == "seed":
    raise ValueError("tune('seed', ...) is invalid; allowed: any config key but seed (seeds "
                     "are repetitions, declared with sweep('seed', ...))")
  axis = sweep(key, values)
  if not axis:
    raise ValueError(f"tune {key!r}: values={values!r} is invalid; allowed: at least one value")
  ladders = {} if ladder is None else {key: _check_ladder(key, ladder, list(values))}
  return Grid(axis, tuned=(key,), ladders=ladders)


def product(*axes: list[dict]) -> Grid:
  """Every combination of the axes (the first varies slowest)."""
  return Grid([dict(itertools.chain.from_iterable(d.items() for d in combo))
               for combo in itertools.product(*axes)], tuned=_tuned(axes),
              ladders=_ladders(axes))


def zipped(*axes: list[dict]) -> Grid:
  """Axes taken together element by element; they must have the same length."""
  lengths = {len(a) for a in axes}
  if len(lengths) > 1:
    raise ValueError(f"zipped axes have different lengths {sorted(lengths)}; allowed: equal")
  return Grid([dict(itertools.chain.from_iterable(d.items() for d in combo))
               for combo in zip(*axes)], tuned=_tuned(axes), ladders=_ladders(axes))


@dataclasses.dataclass(frozen=True)
class Trial:
  name: str
  overrides: dict
  config: ml_collections.ConfigDict
  tuned: tuple[str, ...] = ()   # the overrides' keys that are tuned, not compared
  # Sync keys the base config sets for other trials' schemes (config.validate_config).
  allow_unread: tuple[str, ...] = ()
  extended: bool = False   # added by the grid-edge rule (``extended.json``), not the sweep file


def trial_name(overrides: dict) -> str:
  """A readable, filesystem-safe name from the overrides, e.g. ``sync.scheme=gssp,seed=1``.

  A name longer than :data:`MAX_NAME` characters keeps its first characters and ends with a
  digest of the whole (``...,~<12 hex digits>``).
  """
  parts = [f"{k}={v}" for k, v in overrides.items()]
  name = re.sub(r"[^A-Za-z0-9_.=,+-]", "", ",".join(parts).replace(" ", "")) or "base"
  if len(name) <= MAX_NAME:
    return name
  # A file name may be at most 255 bytes: keep a readable head, and a digest of the whole name
  # so that two long names sharing that head stay apart.
  digest = hashlib.sha256(name.encode()).hexdigest()[:12]
  return f"{name[:MAX_NAME - len(digest) - 2]},~{digest}"


def split_spec(spec: str) -> tuple[str, str | None]:
  """``"configs/sweeps/x.py:full"`` -> ``("configs/sweeps/x.py", "full")``, as config files take args."""
  path, sep, arg = spec.partition(":")
  return path, (arg if sep else None)


def _call(fn, arg):
  """``fn(arg)`` if the sweep file's function takes an argument, else ``fn()`` (no arg given)."""
  if inspect.signature(fn).parameters:
    return fn(arg)
  if arg is not None:
    raise ValueError(f"sweep file function {fn.__name__}() takes no argument, but ':{arg}' was "
                     "given; allowed: no ':arg' for this file")
  return fn()


def _missing_sweep_file(path: str) -> str:
  """Says that ``path`` is no sweep file, the sweep files beside it, and the nearest name."""
  what = "is a directory" if os.path.isdir(path) else "does not exist"
  folder = os.path.dirname(path) or "."
  if not os.path.isdir(folder):
    folder = "configs/sweeps"
  files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                 if f.endswith(".py") and not f.startswith("_")) if os.path.isdir(folder) else []
  near = difflib.get_close_matches(path, files, n=1, cutoff=0.6)
  hint = f" (did you mean {near[0]!r}?)" if near else ""
  allowed = ", ".join(files) if files else "a Python file defining get_config() and get_sweep()"
  return f"sweep file {path!r} {what}{hint}; allowed: {allowed}"


def load_sweep(spec: str):
  """The sweep file's module and its ``:arg`` (None without one)."""
  path, arg = split_spec(spec)
  if not os.path.isfile(path):
    raise ValueError(_missing_sweep_file(path))
  module_spec = importlib.util.spec_from_file_location("gssp_sweep_" + trial_name({"p": path}),
                                                       path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  for fn in ("get_config", "get_sweep"):
    if not hasattr(module, fn):
      raise ValueError(f"sweep file {path} defines no {fn}(); a sweep file defines get_config() "
                       "(the base config) and get_sweep() (the trials)")
  return module, arg


def _set(config: ml_collections.ConfigDict, changes: dict, where: str) -> None:
  """``config_lib.override`` with errors that say where the key came from."""
  for key, value in changes.items():
    try:
      config_lib.override(config, {key: value})
    except KeyError as e:
      raise ValueError(f"{where}: key {key!r} is not a config key ({e})") from None
    except TypeError as e:
      raise ValueError(f"{where}: {key}={value!r} has the wrong type: {e}") from None


def check_overrides(overrides: dict, grid: Sequence[dict], path: str) -> None:
  """Refuses a base-config override of a key (or a parent or child of one) the grid sets.

  The grid's value would silently replace the override in the trials that set
  it; a sweep over ``seed`` run with ``--config.seed=3`` would not do what it
  says. Such a value belongs in the sweep file.
  """
  grid_keys = list(dict.fromkeys(k for trial in grid for k in trial))
  for key in overrides:
    clash = [g for g in grid_keys if g == key or g.startswith(key + ".")
             or key.startswith(g + ".")]
    if clash:
      raise ValueError(f"--config.{key}={overrides[key]!r} overrides a key the grid of {path} "
                       f"sets ({', '.join(clash)}); allowed: keys the grid does not set (change "
                       "the grid's values in the sweep file)")


def expand(path: str, overrides: dict | None = None, workdir: str | None = None) -> list[Trial]:
  """The sweep's trials, each config built and validated (nothing runs or compiles).

  ``path`` may end in ``:arg`` (``configs/sweeps/x.py:full``); the arg goes to
  ``get_config(arg)`` and ``get_sweep(arg)`` when they take one. ``overrides``
  (dotted keys, as ``--config.key=value``) change the base config of every
  trial; they do not enter the trial names. With ``workdir``, the trials the grid-edge
  rule added there (``extended.json``, :func:`extended_overrides`) follow the file's.

  Raises:
    ValueError: an empty grid, an unknown key, a value of the wrong type or an
      invalid value, naming the key; two trials with the same overrides; an
      override of a key the grid sets; ladders with ``tune_seeds``.
  """
  overrides = dict(overrides or {})
  module, arg = load_sweep(path)
  grid = _call(module.get_sweep, arg)
  if not grid:
    raise ValueError(f"sweep file {path}: get_sweep() returned an empty grid; allowed: at least "
                     "one trial")
  check_overrides(overrides, grid, path)
  allow_unread = _base_sync_keys(module, arg, grid, overrides)
  trials, names = Trials(), set()
  trials.tune_seeds = getattr(grid, "tune_seeds", None)
  trials.ladders = dict(getattr(grid, "ladders", {}))
  if trials.tune_seeds is not None and not set(trials.tune_seeds) & {
      o.get("seed") for o in grid}:
    raise ValueError(f"sweep file {path}: tune_seeds={trials.tune_seeds!r} is invalid; allowed: "
                     "seeds the grid's trials set")
  if trials.tune_seeds is not None and trials.ladders:
    raise ValueError(f"sweep file {path}: ladders with tune_seeds are invalid (the other seeds "
                     "ran at a value chosen before, which an extension could change); allowed: "
                     "one or the other")
  trials.report_seeds = getattr(grid, "report_seeds", None)
  tuned = tuple(getattr(grid, "tuned", ()))
  _check_report_seeds(path, grid, tuned, trials)
  extra = [] if workdir is None else extended_overrides(workdir, grid, trials.ladders,
                                                         trials.report_seeds)
  for overrides_of_trial, extended in [(o, False) for o in grid] + [(o, True) for o in extra]:
    config = _call(module.get_config, arg)
    _set(config, overrides, f"sweep {path}, --config.*")
    _set(config, overrides_of_trial, f"sweep file {path}")
    try:
      config_lib.validate_config(config, allow_unread=allow_unread)
    except ValueError as e:
      where = f"{EXTENDED_FILE} in {workdir}" if extended else f"sweep file {path}"
      raise ValueError(f"{where}, trial {overrides_of_trial}: {e}") from None
    name = trial_name(overrides_of_trial)
    if name in names:
      if extended:   # the sweep file has since declared this value itself
        continue
      raise ValueError(f"sweep file {path}: trial {overrides_of_trial} appears twice")
    names.add(name)
    trials.append(Trial(name, dict(overrides_of_trial), config,
                        tuple(k for k in tuned if k in overrides_of_trial), allow_unread,
                        extended))
  return trials


def _check_report_seeds(path: str, grid: Sequence[dict], tuned: tuple, trials: Trials) -> None:
  """``report_seeds`` need tuned keys, no ``tune_seeds`` and none of the grid's own seeds."""
  seeds = trials.report_seeds
  if seeds is None:
    return
  if not tuned:
    raise ValueError(f"sweep file {path}: report_seeds={list(seeds)} with no tuned key is "
                     "invalid; allowed: a grid that tunes a key (sweep.tune)")
  if trials.tune_seeds is not None:
    raise ValueError(f"sweep file {path}: report_seeds with tune_seeds are invalid; allowed: one "
                     "or the other (report_seeds: the runner adds the chosen value on them)")
  shared = sorted({o.get("seed") for o in grid} & set(seeds))
  if shared:
    raise ValueError(f"sweep file {path}: report_seeds={list(seeds)} share seed(s) {shared} with "
                     "the grid's, which tune; allowed: seeds the grid does not run")


def extended_records(workdir: str) -> list[dict]:
  """``workdir``'s ``extended.json`` entries, in order: ``name``, ``overrides`` (``[key, value]``
  pairs: the grid's key order, which names the trial; JSON objects are sorted) and ``why``."""
  path = os.path.join(workdir, EXTENDED_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)["trials"]


def extended_overrides(workdir: str, grid: Sequence[dict] | None = None,
                       ladders: dict[str, tuple] | None = None,
                       report_seeds: Sequence[int] | None = None) -> list[dict]:
  """The trials the grid-edge rule added to ``workdir`` (``extended.json``), in order.

  With ``grid``, ``ladders`` and ``report_seeds`` (the sweep file's), only those that still
  belong to it: one laddered key differs from a trial of the grid, to a value on that key's
  ladder; or (a reporting trial) the seed is a reporting seed and the tuned keys hold values
  the grid or their ladders have. The others (the file dropped their configuration, ladder or
  seed) stay in the file, unused.
  """
  added = [dict(t["overrides"]) for t in extended_records(workdir)]
  if grid is None:
    return added
  ladders = ladders or {}
  return [o for o in added if _on_ladder(o, grid, ladders)
          or (report_seeds and _reporting_trial(o, grid, ladders, report_seeds))]


def _on_ladder(o: dict, grid: Sequence[dict], ladders: dict[str, tuple]) -> bool:
  for key, ladder in ladders.items():
    if key in o and o[key] in ladder:
      rest = {k: v for k, v in o.items() if k != key}
      if any(key in g and {k: v for k, v in g.items() if k != key} == rest for g in grid):
        return True
  return False


def _reporting_trial(o: dict, grid: Sequence[dict], ladders: dict[str, tuple],
                     report_seeds: Sequence[int]) -> bool:
  tuned = tuple(getattr(grid, "tuned", ()))
  if o.get("seed") not in report_seeds:
    return False
  rest = lambda d: {k: v for k, v in d.items() if k != "seed" and k not in tuned}
  values = lambda key: {g.get(key) for g in grid} | set(ladders.get(key, ()))
  return (any(rest(g) == rest(o) for g in grid)
          and all(o.get(k) in values(k) for k in tuned if k in o))


def add_extended(workdir: str, added: Sequence[dict], why: Sequence[str]) -> None:
  """Appends trials (override dicts) to ``workdir``'s ``extended.json``, each with its reason."""
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  trials = extended_records(workdir) + [
      {"name": trial_name(o), "overrides": [[k, v] for k, v in o.items()], "why": w}
      for o, w in zip(added, why)]
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.write_json(os.path.join(workdir, EXTENDED_FILE), {"trials": trials}, default=str)


def _base_sync_keys(module, arg, grid, overrides: dict) -> tuple[str, ...]:
  """The sync keys the base config sets that some trial's scheme reads.

  A sweep over schemes shares one base config, so it may set a key for some
  trials (``sync.group_size`` for DS-Sync) that others do not read; moving it
  into the grid would rename the trials. Keys no trial reads stay errors.
  """
  base = _call(module.get_config, arg)
  _set(base, overrides, "--config.*")
  schemes = {overrides.get("sync.scheme", base.sync.scheme) for overrides in grid}
  read = {f"sync.{k}" for s in schemes for k in registry.SYNC_KEYS.get(s, ())}
  return tuple(k for k in registry.changed_sync_keys(base) if k in read)


def report_command(workdir: str, statuses: dict[str, str | None]) -> str:
  """The line a finished sweep ends with: how to report it (of its finished trials, if some
  are not)."""
  done = sum(status in FINISHED for status in statuses.values())
  if not done:
    return "no trial finished, nothing to report yet; rerun the same command to retry them"
  which = "" if done == len(statuses) else f" (its {done} finished trial(s) of {len(statuses)})"
  return f"report{which}: python -m experiments.report {shlex.quote(workdir)}"


def trial_status(trial_dir: str) -> str | None:
  """``done``/``collapsed``/``diverged``/``failed``/… from the trial's summary, or None if it
  never ran."""
  path = os.path.join(trial_dir, "summary.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f).get("status")


def _record(trial_dir: str, trial: Trial, status: str, error: str | None, attempts: int,
            seconds: float):
  # Imported here: gssp_jax.train loads JAX, and sweep files import this module just to
  # declare their grids.
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  os.makedirs(trial_dir, exist_ok=True)
  workdir_lib.write_json(os.path.join(trial_dir, "trial.json"),
                         {"name": trial.name, "overrides": trial.overrides, "status": status,
                          "error": error, "attempts": attempts, "tuned": list(trial.tuned),
                          "seconds": round(seconds, 3)},
                         default=str)


def _recorded(trial_dir: str) -> dict:
  path = os.path.join(trial_dir, "trial.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def trial_seconds(trial_dir: str) -> float | None:
  """The wall seconds this trial's process spent on it, every attempt's (start-up and
  compilation included), as ``trial.json`` records them; None where it does not."""
  seconds = _recorded(trial_dir).get("seconds")
  return float(seconds) if seconds is not None else None


def run_trial(trial: Trial, workdir: str) -> str:
  """Runs one trial in this process; records its status (and the error) in ``trial.json``."""
  from gssp_jax.train import loop  # pylint: disable=g-import-not-at-top (heavy)
  trial_dir = os.path.join(workdir, trial.name)
  before = _recorded(trial_dir)
  attempts, spent = int(before.get("attempts", 0)) + 1, float(before.get("seconds") or 0.0)
  start = time.perf_counter()
  _record(trial_dir, trial, "running", None, attempts, spent)
  # The trial's log goes to its workdir as well as to the console.
  with cli.log_to_file(os.path.join(trial_dir, "log.txt")):
    try:
      summary = loop.train_and_evaluate(trial.config, trial_dir, allow_unread=trial.allow_unread)
      status, error = summary["status"], None
    except KeyboardInterrupt:
      _record(trial_dir, trial, "interrupted", None, attempts,
              spent + time.perf_counter() - start)
      raise
    except Exception as e:  # pylint: disable=broad-except  (recorded, the sweep goes on)
      status = "diverged" if isinstance(e, FloatingPointError) else "failed"
      error = "".join(traceback.format_exception_only(type(e), e)).strip()
      logging.error("trial %s %s: %s", trial.name, status, error)
  _record(trial_dir, trial, status, error, attempts, spent + time.perf_counter() - start)
  return status


def _latest(trial_dir: str) -> str:
  """The trial's latest evaluation, e.g. ``epoch 2.50 test_accuracy 0.9712`` ('' before any)."""
  path = os.path.join(trial_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  if not lines:
    return ""
  try:
    last = json.loads(lines[-1])
  except json.JSONDecodeError:   # a line being written right now
    return ""
  metric = next((k for k in ("test_accuracy", "bleu") if k in last), None)
  return (f"epoch {last.get('epoch', 0):.2f} {metric} {last[metric]:.4f}" if metric else "")


def changed_trials(trials: Sequence[Trial], workdir: str) -> dict[str, list[tuple]]:
  """Per trial that already ran with another config, ``(key, recorded, new)`` for each change.

  The recorded config is the trial directory's ``config.json``, written by the run;
  keys that may change on resume (data location, checkpoint cadence) do not count.
  """
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  changed = {}
  for trial in trials:
    path = os.path.join(workdir, trial.name, "config.json")
    if os.path.exists(path):
      with open(path) as f:
        changes = workdir_lib.config_changes(json.load(f), trial.config)
      if changes:
        changed[trial.name] = changes
  return changed


def _only_more_epochs(changes: list[tuple]) -> bool:
  return (len(changes) == 1 and changes[0][0] == "train.num_epochs"
          and isinstance(changes[0][1], (int, float)) and changes[0][2] > changes[0][1])


def describe_changes(changed: dict[str, list[tuple]], workdir: str) -> str:
  """One line: the changed trials grouped by their changes, e.g.
  ``optimizer.learning_rate: 0.05 -> 0.1 in a, b; train.num_epochs: 1.0 -> 2.0 (finished;
  only more epochs: …) in c``."""
  groups: dict[str, list[str]] = {}
  for name, changes in changed.items():
    text = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes[:5])
    text += f" and {len(changes) - 5} more keys" if len(changes) > 5 else ""
    if _only_more_epochs(changes) and trial_status(os.path.join(workdir, name)) in FINISHED:
      text += " (finished; only more epochs)"
    groups.setdefault(text, []).append(name)
  return "; ".join(f"{text} in {', '.join(names)}" for text, names in groups.items())


def more_epochs(changed: dict[str, list[tuple]], workdir: str) -> dict[str, tuple]:
  """The finished trials whose only change is a larger ``train.num_epochs``: ``(ran, asked)``."""
  return {name: changes[0][1:] for name, changes in changed.items()
          if _only_more_epochs(changes) and trial_status(os.path.join(workdir, name)) in FINISHED}


def describe_more_epochs(longer: dict[str, tuple], workdir: str) -> str:
  """How to extend finished runs that now ask for more epochs ('' for none)."""
  if not longer:
    return ""
  by_epochs: dict[tuple, list[str]] = {}
  for name, epochs in longer.items():
    by_epochs.setdefault(epochs, []).append(name)
  runs = "; ".join(f"{', '.join(names)} ({old!r} -> {new!r})"
                   for (old, new), names in by_epochs.items())
  keep = " or ".join(f"--config.train.num_epochs={old!r}" for old, _ in by_epochs)
  return (f"Finished runs asking for more train.num_epochs: {runs}. A finished run is not "
          "extended in place (its learning-rate schedule spans the epochs it was given, and "
          "resuming it with another train.num_epochs is refused): --rerun_changed trains them "
          f"again from the start for the new length (the old runs kept in "
          f"{os.path.join(workdir, STALE_DIR, '<time>')}/), or {keep} keeps them as they are")


def recorded_overrides(workdir: str) -> dict | None:
  """The ``--config.*`` overrides the sweep's last run recorded in ``sweep.json`` (None: no
  record; a record from before overrides existed counts as none)."""
  path = os.path.join(workdir, GRID_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f).get("overrides", {})


def override_args(overrides: dict) -> list[str]:
  """``--config.key=value`` flags that ml_collections parses back into ``overrides``
  (for the trial processes of a parallel sweep)."""
  def text(value):
    if isinstance(value, bool):
      return "true" if value else "false"
    if isinstance(value, str):
      return value
    if isinstance(value, (list, tuple)):
      return repr(tuple(value))
    return repr(value)
  return [f"--config.{key}={text(value)}" for key, value in overrides.items()]


def move_aside(workdir: str, names: Sequence[str]) -> str:
  """Moves the trials' directories into a fresh ``<workdir>/_stale/<time>/``; returns it."""
  base = os.path.join(workdir, STALE_DIR, time.strftime("%Y%m%d-%H%M%S"))
  dest, n = base, 1
  while os.path.exists(dest):
    dest, n = f"{base}-{n}", n + 1
  os.makedirs(dest)
  for name in names:
    os.replace(os.path.join(workdir, name), os.path.join(dest, name))
  return dest


def write_grid(workdir: str, path: str, trials: Sequence[Trial],
               overrides: dict | None = None) -> None:
  """Records the current grid (trial names, overrides, tuned keys) and the base config's
  ``--config.*`` overrides in ``<workdir>/sweep.json``."""
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  grid = [{"name": t.name, "overrides": t.overrides, "tuned": list(t.tuned),
           **({"extended": True} if t.extended else {})} for t in trials]
  record = {"sweep": path, "overrides": dict(overrides or {}), "trials": grid}
  if getattr(trials, "tune_seeds", None) is not None:
    record["tune_seeds"] = list(trials.tune_seeds)
  if getattr(trials, "ladders", None):
    record["ladders"] = {k: list(v) for k, v in trials.ladders.items()}
  if getattr(trials, "report_seeds", None) is not None:
    record["report_seeds"] = list(trials.report_seeds)
  workdir_lib.write_json(os.path.join(workdir, GRID_FILE), record, default=str)


def run_sweep(path: str, workdir: str, *, parallel: int = 1, max_trials: int = 0,
              report_every: float = 60.0, rerun_changed: bool = False,
              overrides: dict | None = None, ray=None) -> dict[str, str]:
  """Runs every unfinished trial of the sweep ``path``; returns each trial's status.

  Progress (trials finished, ETA, each finished trial's metric; with
  ``parallel`` > 1 also every ``report_every`` seconds the running trials'
  latest evaluation) is logged and written to ``<workdir>/sweep.log``.

  Args:
    path: the sweep file (optionally ``path:arg``).
    workdir: one subdirectory per trial lands here.
    parallel: trials run at once (each in its own process when > 1).
    max_trials: stop after starting this many trials (0: all); a rerun goes on.
    report_every: seconds between progress lines on running trials (parallel).
    rerun_changed: trials recorded with a config other than the one the sweep
      file now builds are moved into ``<workdir>/_stale/<time>/`` and run again.
    overrides: dotted keys of the base config set for every trial
      (``--config.key=value``), before the trial's grid values; a key the grid
      sets is refused.
    ray: ``ray_launch.RaySettings``: each trial a Ray task with those resources (Ray decides
      how many run at once; ``parallel`` must be 1), else None.

  Raises:
    ChangedTrialsError: such trials exist and ``rerun_changed`` is False
      (raised before anything runs or moves).
  """
  if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
    raise ValueError(f"parallel={parallel!r} is invalid; allowed: an int >= 1")
  if isinstance(max_trials, bool) or not isinstance(max_trials, int) or max_trials < 0:
    raise ValueError(f"max_trials={max_trials!r} is invalid; allowed: an int >= 0 (0 = all)")
  if not isinstance(rerun_changed, bool):
    raise ValueError(f"rerun_changed={rerun_changed!r} is invalid; allowed: True or False")
  if ray is not None and parallel != 1:
    raise ValueError(f"parallel={parallel} is invalid with Ray; allowed: 1 (Ray runs as many "
                     "trials at once as their resources allow: --ray_cpus_per_trial, "
                     "--ray_gpus_per_trial)")
  overrides = dict(overrides or {})
  trials = expand(path, overrides, workdir)
  changed = changed_trials(trials, workdir)
  if changed and not rerun_changed:
    before = recorded_overrides(workdir)
    flags_changed = (f" (the --config.* overrides were {before}, now {overrides})"
                     if before is not None and json.dumps(before, default=str, sort_keys=True)
                     != json.dumps(overrides, default=str, sort_keys=True) else "")
    longer = describe_more_epochs(more_epochs(changed, workdir), workdir)
    raise ChangedTrialsError(
        f"sweep {path}: {len(changed)} trial(s) in {workdir} were run with a different config "
        f"({describe_changes(changed, workdir)}){flags_changed}; rerun with --rerun_changed to "
        f"move them to {os.path.join(workdir, STALE_DIR, '<time>')}/ and run them again, or use "
        "a new --workdir" + (f". {longer}" if longer else ""))
  os.makedirs(workdir, exist_ok=True)
  with cli.log_to_file(os.path.join(workdir, "sweep.log")):
    if changed:
      what = describe_changes(changed, workdir)   # reads the statuses before the move
      dest = move_aside(workdir, list(changed))
      logging.info("sweep %s: config changed (%s); moved %s to %s; running them again",
                   path, what, ", ".join(changed), dest)
    write_grid(workdir, path, trials, overrides)
    return _run(path, trials, workdir, parallel, max_trials, report_every, overrides, ray)


def _children_env(parallel: int) -> dict[str, str]:
  """The environment of ``parallel`` trial processes: each gets a share of one GPU's memory."""
  user = xla_env.user_memory_fraction(os.environ)
  if user:
    logging.info("%d trials at once: keeping your %s=%s for each (not %.3f)", parallel, *user,
                 xla_env.memory_share(parallel))
  else:
    logging.info("%d trials at once: each may take %s=%.3f of a GPU's memory", parallel,
                 xla_env.MEM_FRACTION_VARS[0], xla_env.memory_share(parallel))
  return xla_env.child_env(os.environ, parallel)


def _child_command(path: str, workdir: str, trial: Trial, overrides: dict) -> list[str]:
  """The command that runs ``trial`` alone in a process of its own (``--parallel``, Ray)."""
  return [sys.executable, "-m", "experiments.sweep", f"--sweep={path}", f"--workdir={workdir}",
          f"--only={trial.name}", *override_args(overrides)]


def _run(path, trials, workdir, parallel, max_trials, report_every,
         overrides, ray=None) -> dict[str, str]:
  """Runs the unfinished ``trials``: here, ``parallel`` child processes at once, or Ray tasks."""
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  statuses = {t.name: trial_status(os.path.join(workdir, t.name)) for t in trials}
  todo = [t for t in trials if statuses[t.name] not in FINISHED]
  if max_trials:
    todo = todo[:max_trials]
  logging.info("sweep %s: %d trials, %d finished, %d to run", path, len(trials),
               sum(s in FINISHED for s in statuses.values()), len(todo))
  start = time.perf_counter()
  done_here = 0

  def progress(trial, status=None):
    nonlocal done_here
    done_here += 1
    status = status or trial_status(os.path.join(workdir, trial.name)) or "failed"
    statuses[trial.name] = status
    finished = sum(s in FINISHED for s in statuses.values())
    rate = (time.perf_counter() - start) / done_here
    logging.info("[%d/%d finished] %s: %s %s | ETA %s", finished, len(trials), trial.name,
                 status, _latest(os.path.join(workdir, trial.name)),
                 workdir_lib.format_duration(rate * (len(todo) - done_here) / parallel))

  command = lambda t: _child_command(path, workdir, t, overrides)
  if ray is not None:
    from gssp_jax.runtime import ray_launch  # pylint: disable=g-import-not-at-top
    ray_launch.run_trials(todo, command, lambda t: os.path.join(workdir, t.name), progress, ray,
                          xla_env.child_env(os.environ, 1))
  elif parallel <= 1:
    _run_here(todo, workdir, progress)
  else:
    _run_children(todo, command, workdir, parallel, report_every, progress)
  return statuses


def _run_here(todo, workdir, progress) -> None:
  """The trials one after another in this process. A signal stops the trial it arrives in
  (which records ``interrupted``); one that arrives as a trial ends, or between two, stops the
  sweep before the next trial starts."""
  with interrupt.deferred():
    for trial in todo:
      if interrupt.requested():
        raise KeyboardInterrupt(f"{interrupt.requested()}: the sweep stops before trial "
                                f"{trial.name}")
      logging.info("trial %s: starting", trial.name)
      progress(trial, run_trial(trial, workdir))


def _run_children(todo, command, workdir, parallel, report_every, progress) -> None:
  """``parallel`` trials at once, each in a child process (``command(trial)``); on an interrupt
  every child is stopped (each records ``interrupted`` and keeps its checkpoint)."""
  running: list = []
  queue = list(todo)
  last_report = time.perf_counter()
  env = _children_env(max(1, min(parallel, len(todo))))   # no more shares than children
  try:
    while queue or running:
      while queue and len(running) < parallel:
        trial = queue.pop(0)
        os.makedirs(os.path.join(workdir, trial.name), exist_ok=True)
        log = open(os.path.join(workdir, trial.name, "stdout.txt"), "a")
        logging.info("trial %s: starting in a child process", trial.name)
        running.append((trial, subprocess.Popen(command(trial), stdout=log,
                                                stderr=subprocess.STDOUT,
                                                **cli.child_process(env)), log))
      time.sleep(0.5)
      for item in list(running):
        trial, proc, log = item
        if proc.poll() is not None:
          log.close()
          running.remove(item)
          progress(trial)
      if running and time.perf_counter() - last_report >= report_every:
        last_report = time.perf_counter()
        logging.info("running: %s", "; ".join(
            f"{t.name} ({_latest(os.path.join(workdir, t.name)) or 'no evaluation yet'})"
            for t, _, _ in running))
  finally:   # interrupted: stop the children (each records `interrupted`; checkpoints stay)
    for _, proc, _ in running:
      proc.terminate()
    for trial, proc, log in running:
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        logging.warning("trial %s did not stop within 60 s of SIGTERM; killing it", trial.name)
        proc.kill()
        proc.wait()
      log.close()

