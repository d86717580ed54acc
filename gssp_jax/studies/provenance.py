"""Where a study's trials came from, and which of them the claims table may count.

Every trial's ``summary.json`` records its environment (``gssp_jax.base.environment``): the
commit of the code it ran (None: not run from a git checkout), whether the tree was clean
(``tree_clean``; older records mark a dirty one as ``<commit>+dirty``), the CPU model and the
jax version. The claims table counts a trial only if it ran a clean, committed tree, so that
its figures can be traced to code anyone can check out. A trial without that is **refused**
(left out of every figure and named in the table's header) unless it is **marked**: listed,
with the reason it is kept, in its study's ``provenance.json``
(``{"accepted": {"<trial>": "<why>"}}``), which :func:`mark` writes and a person reviews.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Sequence

MARK_FILE = "provenance.json"


def origin(trial_dir: str) -> dict:
  """A finished trial's ``commit`` (without ``+dirty``), ``clean`` (None where unknown),
  ``cpu`` and ``jax``, from its ``summary.json``."""
  try:
    with open(os.path.join(trial_dir, "summary.json")) as f:
      env = json.load(f).get("environment") or {}
  except (OSError, ValueError):
    env = {}
  commit = env.get("commit")
  clean = env.get("tree_clean")
  if commit and commit.endswith("+dirty"):
    commit, clean = commit[:-len("+dirty")], False
  elif commit and clean is None:
    clean = True   # recorded before tree_clean: a dirty tree was marked in the commit
  return {"commit": commit, "clean": clean if commit else None, "cpu": env.get("cpu"),
          "jax": (env.get("packages") or {}).get("jax")}


def marks(workdir: str) -> dict[str, str]:
  """The study's marked trials and why each is kept (``provenance.json``; none if absent).

  Raises:
    ValueError: a file that is not ``{"accepted": {trial: non-empty reason}}``.
  """
  path = os.path.join(workdir, MARK_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    try:
      accepted = json.load(f).get("accepted")
    except (ValueError, AttributeError):
      accepted = None
  if not isinstance(accepted, dict) or not all(
      isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in accepted.items()):
    raise ValueError(f"{path} is invalid; allowed: {{\"accepted\": {{\"<trial>\": \"<why it is "
                     "kept>\", ...}}}} with a non-empty reason for every trial")
  return dict(accepted)


def refusal(info: dict) -> str | None:
  """Why a trial with this :func:`origin` is refused, or None."""
  if not info["commit"]:
    return "no commit recorded (not run from a git checkout)"
  if not info["clean"]:
    return f"a dirty tree at {info['commit']}"
  return None


def check(workdir: str, names: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
  """``(refused, marked)``: each trial of ``names`` the table refuses and why; each it counts
  only because ``provenance.json`` marks it, with that reason."""
  kept = marks(workdir)
  refused, marked = {}, {}
  for name in names:
    why = refusal(origin(os.path.join(workdir, name)))
    if why and name in kept:
      marked[name] = f"{why}; kept: {kept[name]}"
    elif why:
      refused[name] = why
  return refused, marked


def commits(workdir: str, names: Sequence[str]) -> collections.Counter:
  """How many of ``names`` ran each commit (``<commit>+dirty``, ``no commit``)."""
  out = collections.Counter()
  for name in names:
    info = origin(os.path.join(workdir, name))
    out[(info["commit"] or "no commit") + ("" if info["clean"] in (True, None) else "+dirty")] += 1
  return out


def mark(workdir: str, names: Sequence[str], why: str) -> dict[str, str]:
  """Marks ``names`` (trials of the study in ``workdir``) as kept despite their provenance,
  for ``why``; returns every mark. A trial that needs no mark is refused as a mistake."""
  if not why or not why.strip():
    raise ValueError("a mark needs a reason; allowed: a non-empty --why")
  fine = [n for n in names if refusal(origin(os.path.join(workdir, n))) is None]
  missing = [n for n in names if not os.path.isdir(os.path.join(workdir, n))]
  if missing or fine:
    raise ValueError(f"cannot mark {missing + fine} in {workdir}: "
                     + ("no such trial" if missing else "they ran a clean, committed tree")
                     + "; allowed: trials the table refuses")
  kept = {**marks(workdir), **{n: why.strip() for n in names}}
  from gssp_jax.base import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  workdir_lib.write_json(os.path.join(workdir, MARK_FILE), {"accepted": kept})
  return kept
