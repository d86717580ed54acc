"""How a sweep's rows are named and matched: legend labels, column order, a trial's context.

A leaf module (it imports nothing of the project), shared by ``gssp_jax.studies.report`` and
``gssp_jax.studies.report_figures``.
"""

from __future__ import annotations

import json

SCHEME_KEYS = ("sync.", "compress.")


def label(row: dict) -> str:
  """A short legend label: the non-seed swept values (``gssp gdtopk``), 'none' left out.

  Plain runs (no sweep file to say what was swept) name their keys: ``sync.scheme=gssp``.
  """
  items = sorted(enumerate(row["_overrides"].items()),
                 key=lambda ikv: column_order(ikv[1][0], ikv[0]))
  if row.get("_named"):
    parts = [f"{k}={v}" for _, (k, v) in items if k != "seed"]
    return " ".join(parts) or row["trial"]
  parts = [str(v) for _, (k, v) in items if k != "seed" and v != "none"]
  return " ".join(parts) or row["trial"]


def short_labels(rows: list[dict]) -> list[str]:
  """Figure legends: the scheme (and compressor), then only what differs within that scheme.

  A swept setting every trial of a scheme shares (a local-update scheme's inner optimizer,
  its steps, ...) is left out: ``report.md``'s tables give every value. Two configurations
  that would read the same keep their full :func:`label`.
  """
  def head(r):
    o = r["_overrides"]
    return " ".join(str(o[k]) for k in ("sync.scheme", "compress.name")
                    if k in o and o[k] != "none") or label(r)

  def varying(members):
    keys = {k for r in members for k in r["_overrides"]
            if k not in ("sync.scheme", "compress.name", "seed")}
    return sorted(k for k in keys if len({json.dumps(r["_overrides"].get(k)) for r in members}) > 1)

  groups: dict[str, list[dict]] = {}
  for r in rows:
    groups.setdefault(head(r), []).append(r)
  out = []
  for r in rows:
    if r.get("_named"):
      out.append(label(r))
      continue
    keys = varying(groups[head(r)])
    out.append(" ".join([head(r)] + [f"{k}={r['_overrides'].get(k, '–')}" for k in keys]))
  full = [label(r) for r in rows]
  clash = {s for s in out if len({f for f, o in zip(full, out) if o == s}) > 1}
  return [f if o in clash else o for f, o in zip(full, out)]


def context(row: dict, ignore=()) -> tuple:
  """What a trial shares with its BSP baseline: every swept value but the scheme's own keys
  (and the ``ignore``d ones, e.g. tuned keys: each side at its own best value)."""
  return tuple(sorted((k, json.dumps(v)) for k, v in row["_overrides"].items()
                      if not k.startswith(SCHEME_KEYS) and k not in ignore))


def column_order(key: str, index: int) -> tuple:
  """Swept keys in the tables: sync.* first, then compress.*, the rest, the seed last."""
  return (not key.startswith("sync."), not key.startswith("compress."), key == "seed", index)
