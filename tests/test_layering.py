"""The package's import graph: no circle, layers that only point down (imports inside functions
and package ``__init__``s count), leaves stay leaves."""

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
  for leaf in ("gssp_jax.defaults", "gssp_jax.checks", "gssp_jax.host_state",
               "gssp_jax.studies.report_labels"):
    assert graph[leaf] == set(), leaf


# The layers, bottom up: a module may import its own layer's and those below, never above. A
# module belongs to the longest prefix listed (a package, with its ``__init__``, or a module).
LAYERS = (
    # leaves: the config's defaults and checks, plugins, host state (whose classes register)
    ("gssp_jax.checks", "gssp_jax.defaults", "gssp_jax.plugins", "gssp_jax.host_state"),
    # the pieces: data, models, compressors, the sync schemes; the package's face and the XLA
    # environment it sets on import (whose cache directory is the data's)
    ("gssp_jax", "gssp_jax.xla_env", "gssp_jax.data", "gssp_jax.models", "gssp_jax.compress",
     "gssp_jax.sync"),
    # what a run is built from (task, optimizers, step, checkpoints, workdir), the entry points'
    # shared code
    ("gssp_jax.base", "gssp_jax.cli"),
    ("gssp_jax.sim",),        # the simulator
    ("gssp_jax.runtime",),    # the real runtime (it replays the simulator's rules)
    ("gssp_jax.executors",),  # picks and builds either, or the fused BSP loop
    ("gssp_jax.config",),     # validates a config once, by each part's own checks
    ("gssp_jax.train",),      # the loop that drives an executor, observation, trained runs
    ("gssp_jax.studies",),    # sweeps, reports, the claims table
)


def _layer(module: str) -> int:
  found = [(len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
           if module == prefix or module.startswith(prefix + ".")]
  assert found, f"{module} is in no layer: add it to LAYERS"
  return max(found)[1]


def test_every_import_points_down_the_layers():
  """No import points up a layer: at module level or inside a function, a package's
  ``__init__`` included (``_modules`` names it as the package)."""
  modules = _modules()
  up = [f"{m}:{line} imports {d} ({'top' if top else 'inside a function'}): layer "
        f"{_layer(m)} -> {_layer(d)}"
        for m, f in sorted(modules.items()) for d, line, top in _imports(f, modules)
        if d in modules and _layer(d) > _layer(m)]
  assert up == [], "\n".join(up)


def test_the_layer_check_sees_an_import_inside_a_function_and_in_an_init(tmp_path):
  """The check's own reading: an import inside a function and one in a package ``__init__``
  are edges like any other."""
  (tmp_path / "pkg").mkdir()
  init = tmp_path / "pkg" / "__init__.py"
  init.write_text("from gssp_jax.train import loop\n")
  body = tmp_path / "mod.py"
  body.write_text("def f():\n  from gssp_jax.studies import sweep\n  return sweep\n")
  modules = {"gssp_jax.train.loop": "", "gssp_jax.studies.sweep": ""}
  assert _imports(str(init), modules) == [("gssp_jax.train.loop", 1, True)]
  assert _imports(str(body), modules) == [("gssp_jax.studies.sweep", 2, False)]
  assert _layer("gssp_jax.sync.local") < _layer("gssp_jax.base.optim") < _layer(
      "gssp_jax.sim.simulate") < _layer("gssp_jax.train.loop")


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
