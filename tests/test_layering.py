"""The package's import graph: no circle (imports inside functions count), leaves stay leaves."""

import ast
import os

import gssp_jax

ROOT = os.path.dirname(gssp_jax.__file__)


def _modules() -> dict[str, str]:
  """Module name -> file, for every module of the package."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _imports(path: str, modules) -> list[tuple[str, int, bool]]:
  """``(module, line, at top level)`` of every package module ``path`` imports."""
  tree = ast.parse(open(path).read())
  top = set(map(id, tree.body))
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gssp_jax"):
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        out.append((name if name in modules else node.module, node.lineno, id(node) in top))
    elif isinstance(node, ast.Import):
      out += [(a.name, node.lineno, id(node) in top) for a in node.names if a.name in modules]
  return out


def _graph():
  modules = _modules()
  return {m: {d for d, _, _ in _imports(f, modules) if d in modules and d != m}
          for m, f in modules.items()}


def _circles(graph) -> list[list[str]]:
  """The strongly connected groups of more than one module (Tarjan)."""
  index, low, stack, on, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        found.append(sorted(group))

  for v in graph:
    if v not in index:
      visit(v)
  return found


def test_no_import_circle_counting_imports_inside_functions():
  assert _circles(_graph()) == []


def test_the_circle_finder_finds_a_circle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _circles(graph) == [["a", "b", "c"]]


def test_the_leaves_import_nothing_of_the_package():
  graph = _graph()
  for leaf in ("gssp_jax.defaults", "gssp_jax.checks", "gssp_jax.studies.report_labels"):
    assert graph[leaf] == set(), leaf


def test_config_imports_at_the_top_only():
  modules = _modules()
  inside = [(m, line) for m, line, top in _imports(modules["gssp_jax.config"], modules) if not top]
  assert inside == []


def test_nothing_below_config_imports_it():
  """Validation goes down: config calls the builders, and no builder calls back up into it."""
  graph = _graph()
  importers = sorted(m for m, deps in graph.items() if "gssp_jax.config" in deps)
  assert importers == ["gssp_jax.studies.sweep", "gssp_jax.train.loop"]


def test_validation_never_calls_back_up_the_imports(capsys, monkeypatch):
  """benchmarks/config_follow.py's trace of four configs: every call goes down the layers, and
  config.py is entered once (by the caller)."""
  from benchmarks import config_follow  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(os.path.dirname(ROOT))
  config_follow.main(["config_follow"])
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == len(config_follow.CONFIGS)
  for line in lines:
    assert "against the import direction  0" in line and line.endswith("entries into config.py 1")
