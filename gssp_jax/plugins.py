"""A researcher's own code named in a config: ``"package.module:name"`` or ``"path/file.py:name"``.

A config holds strings, and a run may be many processes (a sweep's trials, the real runtime's
server and meshes), so user code is named by where to import it from rather than passed as an
object: every process resolves the same spec to the same object. ``package.module`` must be
importable in each process (installed, or on ``PYTHONPATH``); a ``.py`` path (absolute, or
relative to the working directory) is loaded from that file, once per process, with its folder
added to the end of ``sys.path`` (as running the file would) so it can import its neighbours.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Collection

SPEC_HELP = "'package.module:name' (importable) or 'path/to/file.py:name'"


_NAME = re.compile(r"[a-z][a-z0-9_]*")


def check_registered_name(where: str, name: Any, builtins: Collection[str]) -> None:
  """Raises ValueError unless ``name`` may be registered: lower-case letters, digits and ``_``,
  starting with a letter (so never a spec), and not one of ``builtins``."""
  if not isinstance(name, str) or not _NAME.fullmatch(name) or name in builtins:
    raise ValueError(f"{where}: name {name!r} is invalid; allowed: lower-case letters, digits "
                     f"and '_', starting with a letter, other than {', '.join(builtins)}")


def is_spec(value: Any) -> bool:
  """Whether ``value`` names user code (has a ``:``, as no built-in name does)."""
  return isinstance(value, str) and ":" in value


def _load_file(path: str):
  """The module of the Python file ``path``, loaded once per process (keyed by its real path)."""
  real = os.path.realpath(path)
  name = "gssp_jax_user_" + hashlib.sha256(real.encode()).hexdigest()[:12]
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, real)
  if spec is None or spec.loader is None:
    raise ImportError(f"cannot load {real}")
  module = importlib.util.module_from_spec(spec)
  # As `python file.py` would: the file's folder is importable, so it can import its siblings.
  folder = os.path.dirname(real)
  if folder not in sys.path:
    sys.path.append(folder)
  sys.modules[name] = module   # before exec: the file may import itself (dataclasses do)
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def resolve(spec: str, key: str) -> Any:
  """The object ``spec`` names.

  Args:
    spec: ``"package.module:name"`` or ``"path/to/file.py:name"`` (``name`` may be dotted).
    key: the config key it came from, for the error message.

  Raises:
    ValueError: a malformed spec, a module or file that cannot be imported (with the reason)
      or a missing name, naming ``key``, the value and what is allowed.
  """
  where, _, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
  if not where or not attr:
    raise ValueError(f"{key}={spec!r} is invalid; allowed: {SPEC_HELP}")
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise ImportError(f"no file {os.path.abspath(where)}")
      obj = _load_file(where)
    else:
      obj = importlib.import_module(where)
  except Exception as e:  # pylint: disable=broad-except (any failure of the user's import)
    raise ValueError(f"{key}={spec!r}: cannot import {where!r} ({type(e).__name__}: {e}); "
                     f"allowed: {SPEC_HELP}") from None
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{key}={spec!r}: {where!r} has no {attr!r}; allowed: {SPEC_HELP}")
    obj = getattr(obj, part)
  return obj
