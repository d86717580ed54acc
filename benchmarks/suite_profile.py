"""A pytest plugin: each test's wall time and its process's XLA compile time, to a CSV.

Compilation is most of the suite's time on a CPU; this says where. Load it with ``-p``::

  GSSP_SUITE_PROFILE=/tmp/suite.csv python -m pytest -q -n 2 -p benchmarks.suite_profile

Each pytest process (each xdist worker) writes ``<path>.<worker>`` at its end, one row per
test: ``start`` (Unix seconds), ``seconds`` (setup, call and teardown), ``compile_seconds``
(jax.monitoring's backend-compile events in that process while the test ran: the
compilations the persistent cache did not serve; the test's subprocesses are not counted),
``cache_seconds`` (reading programs from the persistent cache) and ``test``. Then
``python -m benchmarks.suite_profile <path>`` prints the totals, each worker's span and the
slowest files and tests, and ``... <path> --merge out.csv`` writes the rows to one CSV (a
``worker`` column first), which the first form reads too.
"""

import collections
import csv
import glob
import os
import sys
import time

import pytest

ENV = "GSSP_SUITE_PROFILE"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_READ = "/jax/compilation_cache/cache_retrieval_time_sec"
FIELDS = ("start", "seconds", "compile_seconds", "cache_seconds", "test")

_events = collections.Counter()
_rows = []


def _listen(event: str, duration: float, **_) -> None:
  if event in (_BACKEND_COMPILE, _CACHE_READ):
    _events[event] += duration


_worker = ["main"]


def pytest_configure(config):
  # An xdist worker's id from xdist itself: $PYTEST_XDIST_WORKER also reaches the pytest
  # processes a test starts.
  _worker[0] = getattr(config, "workerinput", {}).get("workerid", "main")
  if os.environ.get(ENV):
    from jax import monitoring  # pylint: disable=g-import-not-at-top
    monitoring.register_event_duration_secs_listener(_listen)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  _events.clear()
  start = time.time()
  try:
    return (yield)
  finally:
    _rows.append((round(start, 2), round(time.time() - start, 2),
                  round(_events[_BACKEND_COMPILE], 2), round(_events[_CACHE_READ], 2),
                  item.nodeid))


def pytest_sessionfinish(session):
  del session
  path = os.environ.get(ENV)
  if not path or not _rows:
    return
  with open(f"{path}.{_worker[0]}", "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(FIELDS)
    writer.writerows(_rows)


def read(path: str) -> list[dict]:
  """The rows of ``path.*`` (one file per process) or of ``path`` itself (merged: a ``worker``
  column first), each with its ``worker`` and numbers as floats."""
  if os.path.isfile(path):
    sources = [(None, path)]
  else:
    sources = [(name.rsplit(".", 1)[1], name) for name in sorted(glob.glob(f"{path}.*"))]
  rows = []
  for worker, name in sources:
    with open(name, newline="") as f:
      for r in csv.DictReader(f):
        rows.append({**r, "worker": worker or r["worker"], "start": float(r["start"]),
                     "seconds": float(r["seconds"]),
                     "compile_seconds": float(r["compile_seconds"])})
  if not rows:
    raise SystemExit(f"no rows in {path} or {path}.*")
  return rows


def merge(path: str, out: str) -> None:
  """Writes the rows of ``path.*`` to one CSV, ``out``, with a ``worker`` column first."""
  rows = read(path)
  with open(out, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(("worker",) + FIELDS)
    writer.writerows([r["worker"]] + [r[k] for k in FIELDS] for r in rows)


def summarize(path: str, top: int = 25) -> str:
  """The totals, each worker's span, and the slowest files and tests of :func:`read`'s rows."""
  rows = read(path)
  ends = collections.defaultdict(float)   # each worker's last test's end
  for r in rows:
    ends[r["worker"]] = max(ends[r["worker"]], r["start"] + r["seconds"])
  total = sum(r["seconds"] for r in rows)
  compiled = sum(r["compile_seconds"] for r in rows)
  first = min(r["start"] for r in rows)
  out = [f"{len(rows)} tests, {total:.0f} s of test time, {compiled:.0f} s of it compiling "
         f"in the test processes ({100 * compiled / total:.0f} %)"]
  out += [f"  {w}: busy until {ends[w] - first:.0f} s" for w in sorted(ends)]
  files = collections.defaultdict(lambda: [0.0, 0.0])
  for r in rows:
    file = files[r["test"].split("::")[0]]
    file[0] += r["seconds"]
    file[1] += r["compile_seconds"]
  out.append("files (seconds, compiling):")
  out += [f"  {s:7.1f} {c:7.1f}  {f}" for f, (s, c) in
          sorted(files.items(), key=lambda kv: -kv[1][0])[:top]]
  out.append("tests (seconds, compiling):")
  out += [f"  {r['seconds']:7.1f} {r['compile_seconds']:7.1f}  {r['test']}" for r in
          sorted(rows, key=lambda r: -r["seconds"])[:top]]
  return "\n".join(out)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[2] == "--merge":
    merge(sys.argv[1], sys.argv[3])
  elif len(sys.argv) == 2:
    print(summarize(sys.argv[1]))
  else:
    raise SystemExit("usage: python -m benchmarks.suite_profile PATH [--merge OUT.csv]\n"
                     "  PATH: the $GSSP_SUITE_PROFILE of a run (its PATH.* files), or a merged CSV")
