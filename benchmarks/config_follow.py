"""Follows a config through ``validate_config``: the files it enters, and where it goes back.

  python -m benchmarks.config_follow [ROOT]   # ROOT: a checkout (default: this one)

For four configs (the defaults, GSSP on a cluster with GDTopK, DiLoCo, a real run's) it traces
every call between two files of the package during ``config.validate_config`` and prints: the
files entered, the calls between files, the calls *against the import direction* (into a module
that imports the caller's, directly or not, counting imports inside functions: a climb back up
the layers) and the entries into ``config.py``. A method's call to another method of its own
object (a base class reaching a subclass's override) is dispatch, not a call between files; so
is the scheme registry's call of a builder registered with it (each scheme's package registers
its builder, as a researcher's code does: the registry calls back what it was handed). Issue 37's
before/after figures come from it,
with ``ROOT`` an older checkout (a ``git worktree``). It prints, it asserts nothing.
"""

import ast
import glob
import os
import sys

CONFIGS = {
    "default": {},
    "gssp on a cluster": {"sync.scheme": "gssp", "num_workers": 16, "sync.num_groups": 4,
                          "cluster.profile": "tiers", "compress.name": "gdtopk"},
    "diloco": {"sync.scheme": "diloco", "num_workers": 4, "local.steps": 8},
    "dist": {"sync.scheme": "ssp", "executor": "dist", "num_workers": 4,
             "dist.server_address": "127.0.0.1:5000"},
}


def modules(root: str) -> dict[str, str]:
  """File (absolute) -> module name, for every module of ``root``'s package."""
  out = {}
  for path in glob.glob(os.path.join(root, "gssp_jax", "**", "*.py"), recursive=True):
    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    out[os.path.abspath(path)] = name[:-len(".__init__")] if name.endswith(".__init__") else name
  return out


def import_closure(files: dict[str, str]) -> dict[str, set[str]]:
  """Module -> every package module it imports, directly or not (imports inside functions too)."""
  names = set(files.values())
  edges = {name: set() for name in names}
  for path, name in files.items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gssp_jax"):
        for alias in node.names:
          full = f"{node.module}.{alias.name}"
          edges[name].add(full if full in names else node.module)
      elif isinstance(node, ast.Import):
        edges[name].update(a.name for a in node.names if a.name in names)
  closure = {}
  for name in names:
    seen, stack = set(), [name]
    while stack:
      for dep in edges.get(stack.pop(), ()):
        if dep not in seen:
          seen.add(dep)
          stack.append(dep)
    closure[name] = seen
  return closure


def _same_self(frame) -> bool:
  """A method calling another of its own object's (a base class's ``__init__`` reaching an
  override in a subclass's module): dispatch on one object, not a call up the layers."""
  me = frame.f_locals.get("self")
  return me is not None and frame.f_back.f_locals.get("self") is me


def registered_codes() -> set:
  """The code of every scheme builder registered with ``sync.registry`` (its tables as this
  checkout has them; none in a checkout without them)."""
  from gssp_jax.sync import registry  # pylint: disable=g-import-not-at-top (from ROOT)
  tables = [getattr(registry, name, {}) for name in ("_REGISTERED", "_KEYWORD_BUILDERS")]
  return {f.__code__ for table in tables for f in table.values() if hasattr(f, "__code__")}


def follow(config_lib, config, files: dict[str, str],
           callbacks: frozenset = frozenset()) -> list[tuple[str, str]]:
  """``(caller, callee)`` modules of every call between two package files in validation, but a
  call of one of ``callbacks`` (code objects: :func:`registered_codes`)."""
  calls = []

  def tracer(frame, event, arg):
    del arg
    if event == "call" and frame.f_back is not None:
      callee = os.path.abspath(frame.f_code.co_filename)
      caller = os.path.abspath(frame.f_back.f_code.co_filename)
      if (callee in files and caller in files and callee != caller and not _same_self(frame)
          and frame.f_code not in callbacks):
        calls.append((files[caller], files[callee]))

  sys.settrace(tracer)
  try:
    config_lib.validate_config(config)
  finally:
    sys.settrace(None)
  return calls


def main(argv: list[str]) -> None:
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  root = os.path.abspath(argv[1]) if len(argv) > 1 else here
  sys.path.insert(0, root)
  os.chdir(root)
  from gssp_jax import config as config_lib  # pylint: disable=g-import-not-at-top (from ROOT)
  files = modules(root)
  closure = import_closure(files)
  for label, changes in CONFIGS.items():
    config = config_lib.override(config_lib.default_config(), changes)
    config_lib.validate_config(config)   # once untraced: lazy imports happen outside the count
    calls = follow(config_lib, config, files, frozenset(registered_codes()))
    entered = {"gssp_jax.config"} | {callee for _, callee in calls}
    upward = sum(1 for caller, callee in calls if caller in closure.get(callee, ()))
    into_config = 1 + sum(1 for _, callee in calls if callee == "gssp_jax.config")
    print(f"{label:18s} files {len(entered):2d} | calls between files {len(calls):3d} | against"
          f" the import direction {upward:2d} | entries into config.py {into_config}")


if __name__ == "__main__":
  main(sys.argv)
