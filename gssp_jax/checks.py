"""The one-line errors of config validation, shared by every builder that checks its own keys.

A leaf like :mod:`gssp_jax.defaults`. Each check names the key with its
``config.`` prefix, the value, and what is allowed::

  config.optimizer.momentum=1.5 is invalid; allowed: a number in [0, 1)

The builders (``sync/registry.py``, ``sync/local.py``, ``sim/cluster.py``,
``base/optim.py``, ``compress/topk.py``, ``runtime/settings.py``,
``executors.py``, ``base/tasks.py``) call these with the dotted key
under ``config``; :func:`gssp_jax.config.validate_config` calls the builders in order.
"""

from __future__ import annotations

from typing import Any


def fail(key: str, value, allowed: str) -> None:
  """Raises the one-line error: ``config.{key}={value!r} is invalid; allowed: {allowed}``."""
  raise ValueError(f"config.{key}={value!r} is invalid; allowed: {allowed}")


def get(config, key: str) -> Any:
  """The value at a dotted key (``"optimizer.momentum"``)."""
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def choice(config, key: str, allowed) -> None:
  """The value is one of ``allowed``."""
  value = get(config, key)
  if value not in allowed:
    fail(key, value, ", ".join(allowed))


def positive(config, key: str, kind=(int, float)) -> None:
  """A number (``kind=int``: an integer) above 0; a bool is not a number here."""
  value = get(config, key)
  if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
    fail(key, value, "a positive number" if kind != int else "a positive integer")


def non_negative(config, key: str) -> None:
  """A number at or above 0."""
  check_non_negative(key, get(config, key))


def check_non_negative(key: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
    fail(key, value, "a number >= 0")


def check_bool(key: str, value) -> None:
  if not isinstance(value, bool):
    fail(key, value, "True or False")


def below_one(config, key: str) -> None:
  """A momentum: a number in [0, 1) (the range check of :func:`non_negative` comes first)."""
  if get(config, key) >= 1:
    fail(key, get(config, key), "a number in [0, 1)")


def int_at_least(minimum: int):
  """A check ``(key, value)`` that the value is an integer at or above ``minimum``."""
  def check(key, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
      fail(key, value, f"an integer >= {minimum}")
  return check


def one_of(*allowed):
  """A check ``(key, value)`` that the value is one of ``allowed``."""
  def check(key, value):
    if value not in allowed:
      fail(key, value, ", ".join(allowed))
  return check
