"""A scheme a researcher registers gets everything a built-in one gets (issue 61, item 4).

A built-in scheme's parts registered again under another name, exactly as a researcher would
(``sync.register_scheme`` with its builder, its sync keys and, for a local-update scheme, its
``sync.LocalUpdate``), train to the same figures as the built-in: the weights' metrics, the
virtual time, the staleness accounting, every traffic class, the blocked time and the report's
row. Anything that keyed off a built-in's name (and not what a scheme declares) would differ.
"""

import ast
import dataclasses
import json
import os
import pathlib

import pytest

import helpers
from gssp_jax import config as config_lib
from gssp_jax import sync
from gssp_jax.studies import report
from gssp_jax.train import loop

# Built-in -> its sync keys and its LocalUpdate, as a researcher would pass them.
_AS_REGISTERED = {
    "gssp": (("staleness", "num_groups", "grouping", "regroup_every_epoch", "inter_group",
              "forward_every"), None),
    "diloco": ((), sync.LocalUpdate()),
}
_CHANGES = {"gssp": {}, "diloco": {"local.steps": 2}}


def _register_copy(built_in: str, name: str) -> None:
  """``built_in``'s scheme registered again as ``name``: its builder's Scheme, renamed."""
  keys, local = _AS_REGISTERED[built_in]

  def build(config, worker_times):
    as_built_in = config_lib.override(config.copy_and_resolve_references(),
                                      {"sync.scheme": built_in})
    return dataclasses.replace(sync.scheme_from_config(as_built_in, worker_times), name=name)
  sync.register_scheme(name, build, sync_keys=keys, local=local)


def _figures(summary: dict) -> dict:
  """A run's summary without what names its scheme or times the host (wall clock)."""
  def strip(x):
    if isinstance(x, dict):
      return {k: strip(v) for k, v in x.items() if not _WALL(k)}
    if isinstance(x, list):
      return [strip(v) for v in x]
    return x
  out = strip(json.loads(json.dumps(summary)))
  for key in ("config", "environment"):
    out.pop(key, None)
  out.get("scheme", {}).pop("name", None)
  return out


_WALL = lambda key: "wall" in key or key in ("eta", "timing", "compile_seconds")


@pytest.mark.parametrize("built_in", ["gssp", "diloco"])
def test_a_registered_copy_of_a_built_in_scheme_trains_reports_and_counts_as_it(
    built_in, data_dir, tmp_path):
  mine = f"my_{built_in}"
  _register_copy(built_in, mine)
  try:
    summaries = {}
    for name in (built_in, mine):
      config = helpers.cluster_config(built_in, data_dir, **_CHANGES[built_in])
      config.sync.scheme = name
      summaries[name] = loop.train_and_evaluate(config, str(tmp_path / name), progress=False)
    ours, theirs = _figures(summaries[mine]), _figures(summaries[built_in])
    assert set(ours) == set(theirs)
    for key in theirs:
      assert ours[key] == theirs[key], key
    assert summaries[mine]["totals"]["bytes_by_class"], summaries[mine]["totals"]
    if built_in == "diloco":   # a local-update scheme: its workers' inner steps
      assert summaries[mine]["scheme"]["local_steps"] == [2] * 4
    # The report: the same row but for the scheme's name.
    rows = {r["scheme"]: r for r in report.collect(str(tmp_path))}
    drop = {"trial", "scheme", "_overrides", "_metrics", "_cluster_config", "sync.scheme"}
    same = lambda r: {k: v for k, v in r.items() if k not in drop}
    assert same(rows[mine]) == same(rows[built_in])
    assert json.load(open(os.path.join(tmp_path, mine, "summary.json")))["config"]["sync"][
        "scheme"] == mine
  finally:
    sync.unregister_scheme(mine)
  assert mine not in sync.local.LOCAL and mine not in sync.scheme_names()


def test_a_registered_local_update_scheme_is_checked_by_what_it_declares():
  """Its ``local.*`` keys are checked by its declaration, as a built-in's are."""
  sync.register_scheme("my_avg", lambda config, times: dataclasses.replace(
      sync.build_scheme("bsp", config.num_workers), name="my_avg"), sync_keys=(),
                       local=sync.LocalUpdate(workers="optimizer"))
  try:
    config = config_lib.default_config()
    config.sync.scheme, config.cluster.profile = "my_avg", "tiers"
    config_lib.validate_config(config)
    assert sync.local.outer_config(config).learning_rate == 1.0   # its server averages
    config.local.dylu = True
    with pytest.raises(ValueError, match=r"config.local.dylu=True cannot apply: "
                                         r"sync.scheme='my_avg' does not read it \(read only by "
                                         r"async_local_sgd, halos\)"):
      config_lib.validate_config(config)
    config.local.dylu = False
    config.local.optimizer.learning_rate = 0.5
    with pytest.raises(ValueError, match=r"cannot apply to sync.scheme='my_avg': its workers run "
                                         r"optimizer\.\*"):
      config_lib.validate_config(config)
  finally:
    sync.unregister_scheme("my_avg")
  with pytest.raises(ValueError, match=r"LocalUpdate reads=\('steps',\) is invalid"):
    sync.LocalUpdate(reads=("steps",))
  with pytest.raises(ValueError, match=r"local=.* is invalid; allowed: None or a "
                                       r"sync.local.LocalUpdate"):
    sync.register_scheme("bad", lambda c, t: None, local={"workers": "optimizer"})


def _name_tests(tree) -> list[int]:
  """Lines of ``tree`` that compare something named like a scheme with a built-in's name
  (``scheme == "gssp"``, ``config.sync.scheme in ("bsp", "ssp")``)."""
  names = set(sync.SCHEMES)
  mentions = lambda node: "scheme" in ast.unparse(node).lower()
  is_name = lambda node: isinstance(node, ast.Constant) and node.value in names
  hits = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Compare):
      continue
    sides = [node.left, *node.comparators]
    listed = [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
    if any(mentions(s) for s in sides) and any(map(is_name, sides + listed)):
      hits.append(node.lineno)
  return hits


def test_no_code_outside_the_registry_and_the_schemes_tests_a_schemes_name():
  """What a scheme has is registered with it (its keys, its LocalUpdate, its legs, its protocol's
  barrier), so nothing else asks for it by name; the studies' reports compare against BSP, a
  declared baseline, and may."""
  root = pathlib.Path(sync.__file__).parent.parent
  allowed = ("sync/registry.py", "sync/schemes/", "studies/")
  found = {}
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if not rel.startswith(allowed):
      lines = _name_tests(ast.parse(path.read_text()))
      if lines:
        found[rel] = lines
  assert found == {}, found
  # The check's own reading, on code that does it.
  assert _name_tests(ast.parse("if config.sync.scheme == 'gssp': pass\n"
                               "ok = scheme_name in ('bsp', 'ssp')\n"
                               "fine = topology == 'halos'\n")) == [1, 2]
