"""Host state as versioned, code-free JSON: what a checkpoint saves beside the device state.

The simulator's and the real runtime's host state (the timeline engine with its
protocol object, the staleness accounting, counters, buffered device steps) is
a tree of Python and NumPy values and a few objects of known classes. It was a
pickle; loading a pickle from a shared workdir runs whatever code it names.
This module writes the same tree as tagged JSON instead, saved as an item of
the Orbax checkpoint (``checkpoint.Checkpointer``), and reads it back without
importing anything or calling any constructor of a class it was not told about:

* scalars, strings and lists as themselves; tuples, dicts (any keys), sets as
  tagged lists;
* NumPy arrays and scalars as ``dtype``, ``shape`` and base64 bytes (exact);
* ``np.random.Generator`` as its bit generator's name and state;
* NamedTuples and objects only of *allowed* classes: those passed to
  :func:`allow` (each module allows its own classes as it is imported: the
  simulator's steps and jobs, the protocols' rounds, messages and links), and
  every subclass of a class passed to :func:`allow_subclasses` defined in the
  reading process (``sync.Protocol``'s: a user's registered protocol included),
  found by module and name in that list, never imported. An object is saved as
  its ``__dict__`` (or what its class's own ``__getstate__`` returns) and
  rebuilt with ``object.__new__`` and that dict (through the class's
  ``__setstate__`` if it has one, which fills in attributes added since the
  state was saved).

The document carries ``format`` and ``version``; another version is refused
with a message naming it.

A leaf module: it imports nothing of the package, so the layers that own the classes
(``sync``, ``sim``) register them here, and nothing here reaches up to them.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

FORMAT = "gssp_jax.host_state"
VERSION = 1

_ALLOWED: dict[str, type] = {}
_BASES: list[type] = []   # classes whose subclasses, wherever defined, are allowed
_MOVED: dict[str, str] = {}   # a module's old name -> its name now (:func:`moved`)
_BIT_GENERATORS = {cls.__name__: cls for cls in (np.random.PCG64, np.random.PCG64DXSM,
                                                 np.random.MT19937, np.random.Philox,
                                                 np.random.SFC64)}


class HostStateError(ValueError):
  """A host-state document that cannot be read: wrong format or version, or an unknown class."""


def allow(*classes: type) -> None:
  """Allows objects (or NamedTuples) of ``classes`` in host state."""
  for cls in classes:
    _ALLOWED[_name(cls)] = cls


def allow_subclasses(base: type) -> None:
  """Allows objects of ``base`` and of every subclass of it defined in the reading process."""
  if base not in _BASES:
    _BASES.append(base)


def moved(old: str, new: str) -> None:
  """Module ``old`` is now ``new``: a document naming a class in ``old`` (written before the
  move) reads it from ``new``, by name as ever (nothing is imported)."""
  _MOVED[old] = new


def _current(name: str) -> str:
  """A class's ``module:qualname`` as it is now, through :func:`moved`."""
  module, _, qualname = name.partition(":")
  return f"{_MOVED[module]}:{qualname}" if module in _MOVED else name


def _name(cls: type) -> str:
  return f"{cls.__module__}:{cls.__qualname__}"


def _subclasses(cls: type) -> list[type]:
  out = []
  for sub in cls.__subclasses__():
    out += [sub, *_subclasses(sub)]
  return out


def _allowed_classes() -> dict[str, type]:
  classes = [c for base in _BASES for c in (base, *_subclasses(base))]
  return {**{_name(c): c for c in classes}, **_ALLOWED}


def _is_namedtuple(obj) -> bool:
  return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _array(x: np.ndarray) -> dict:
  if x.dtype.hasobject:
    raise HostStateError(f"an object array (dtype {x.dtype}) cannot be saved as host state")
  data = np.ascontiguousarray(x)
  return {"__nd__": [x.dtype.str, list(x.shape), base64.b64encode(data.tobytes()).decode()]}


def to_tree(obj: Any) -> Any:
  """``obj`` as a JSON-able tree (see the module docstring for what it may contain)."""
  if obj is None or isinstance(obj, (bool, str)):
    return obj
  if isinstance(obj, int) and not isinstance(obj, np.integer):
    return obj
  if isinstance(obj, float) and not isinstance(obj, np.floating):
    return {"__float__": obj.hex()}   # exact, and inf/nan in plain JSON
  if isinstance(obj, np.ndarray):
    return _array(obj)
  if isinstance(obj, np.generic):
    return {"__np__": _array(np.asarray(obj))["__nd__"]}
  if isinstance(obj, np.random.Generator):
    return {"__rng__": [type(obj.bit_generator).__name__, to_tree(obj.bit_generator.state)]}
  if isinstance(obj, list):
    return [to_tree(v) for v in obj]
  if _is_namedtuple(obj):
    _check_allowed(type(obj))
    return {"__nt__": [_name(type(obj)), [to_tree(v) for v in obj]]}
  if isinstance(obj, tuple):
    return {"__tuple__": [to_tree(v) for v in obj]}
  if isinstance(obj, (set, frozenset)):
    return {"__set__": [to_tree(v) for v in sorted(obj)]}
  if isinstance(obj, dict):
    return {"__dict__": [[to_tree(k), to_tree(v)] for k, v in obj.items()]}
  if hasattr(obj, "__dict__") and not isinstance(obj, type):
    _check_allowed(type(obj))
    own = type(obj).__getstate__ is not object.__getstate__   # a class's own (drops caches)
    return {"__obj__": [_name(type(obj)), to_tree(obj.__getstate__() if own else vars(obj))]}
  raise HostStateError(f"a {type(obj).__module__}.{type(obj).__qualname__} cannot be saved as"
                       " host state")


def _check_allowed(cls: type) -> None:
  if _name(cls) not in _allowed_classes():
    raise HostStateError(f"class {_name(cls)} is not allowed in host state; allow it with"
                         " gssp_jax.host_state.allow")


def _from_array(spec) -> np.ndarray:
  dtype, shape, data = spec
  dtype = np.dtype(dtype)
  if dtype.hasobject:
    raise HostStateError(f"an object array (dtype {dtype}) in host state is refused")
  return np.frombuffer(base64.b64decode(data), dtype).reshape(shape).copy()


def from_tree(tree: Any, classes: dict[str, type] | None = None) -> Any:
  """Inverse of :func:`to_tree`; classes are looked up, never imported."""
  classes = _allowed_classes() if classes is None else classes
  if isinstance(tree, list):
    return [from_tree(v, classes) for v in tree]
  if not isinstance(tree, dict):
    return tree
  if len(tree) != 1:
    raise HostStateError(f"not a host-state node: keys {sorted(tree)}")
  (tag, value), = tree.items()
  if tag == "__float__":
    return float.fromhex(value)
  if tag == "__nd__":
    return _from_array(value)
  if tag == "__np__":
    return _from_array(value)[()]
  if tag == "__rng__":
    name, state = value
    if name not in _BIT_GENERATORS:
      raise HostStateError(f"bit generator {name!r} is not one of {sorted(_BIT_GENERATORS)}")
    bit_generator = _BIT_GENERATORS[name]()
    bit_generator.state = from_tree(state, classes)
    return np.random.Generator(bit_generator)
  if tag == "__tuple__":
    return tuple(from_tree(v, classes) for v in value)
  if tag == "__set__":
    return {from_tree(v, classes) for v in value}
  if tag == "__dict__":
    return {_hashable(from_tree(k, classes)): from_tree(v, classes) for k, v in value}
  if tag in ("__nt__", "__obj__"):
    name, fields = value
    written, name = name, name if name in classes else _current(name)
    if name not in classes:
      raise HostStateError(f"host state names class {written}, which is not allowed here (allowed:"
                           " gssp_jax's host classes and the sync.Protocol subclasses defined in"
                           " this process; define or register a custom scheme's protocol before"
                           " resuming its run)")
    cls = classes[name]
    if tag == "__nt__":
      return cls(*from_tree(fields, classes))
    obj = object.__new__(cls)
    state = from_tree(fields, classes)
    if hasattr(cls, "__setstate__"):   # an allowed class's own code: fills attributes it added
      obj.__setstate__(state)
    else:
      vars(obj).update(state)
    return obj
  raise HostStateError(f"unknown host-state tag {tag!r}")


def _hashable(key):
  return tuple(key) if isinstance(key, list) else key


def encode(obj: Any) -> dict:
  """The versioned JSON document of ``obj``."""
  return {"format": FORMAT, "version": VERSION, "state": to_tree(obj)}


def decode(document: dict, where: str = "the checkpoint") -> Any:
  """``obj`` back from :func:`encode`'s document.

  Raises:
    HostStateError: the document is not host state, or of another version.
  """
  if not isinstance(document, dict) or document.get("format") != FORMAT:
    raise HostStateError(f"{where} holds no gssp_jax host state")
  if document.get("version") != VERSION:
    raise HostStateError(f"{where} holds host state of format version {document.get('version')!r};"
                         f" this gssp_jax reads version {VERSION}")
  return from_tree(document["state"])
