"""The claims table counts only trials of a clean, committed tree, unless a mark keeps one
(``gssp_jax.studies.provenance``)."""

import json

import pytest

from gssp_jax.studies import reproduce
from gssp_jax.studies import claims
from gssp_jax.studies import provenance
from tests.test_fair import _trial

FAST, SLOW = [0.9, 0.97, 0.99, 0.99], [0.9, 0.95, 0.97, 0.985]


def _with_commit(root, name, commit, clean=None):
  path = root / name / "summary.json"
  summary = json.loads(path.read_text())
  summary["environment"] = {"commit": commit, "cpu": "AMD EPYC", "packages": {"jax": "0.10.2"},
                            **({} if clean is None else {"tree_clean": clean})}
  path.write_text(json.dumps(summary))


def _study(root):
  """BSP and GSSP on seeds 0-4, committed and clean, but GSSP's seed 4 from a dirty tree (it
  is also the fastest) and BSP's seed 3 from no checkout."""
  names = {}
  for seed in range(5):
    names["bsp", seed] = _trial(root, "bsp", seed, 0.05, SLOW, tuned=False)
    names["gssp", seed] = _trial(root, "gssp", seed, 0.05, FAST, tuned=False,
                                 times=(5.0, 10.0, 15.0, 20.0) if seed == 4 else
                                 (10.0, 20.0, 30.0, 40.0))
  for (scheme, seed), name in names.items():
    _with_commit(root, name, "abc123def456")
  _with_commit(root, names["gssp", 4], "abc123def456+dirty")
  _with_commit(root, names["bsp", 3], None)
  return names


def test_a_record_from_a_dirty_tree_or_without_a_commit_is_refused(tmp_path):
  root = tmp_path / "runs" / "s"
  names = _study(root)
  assert provenance.origin(str(root / names["gssp", 4])) == {
      "commit": "abc123def456", "clean": False, "cpu": "AMD EPYC", "jax": "0.10.2"}
  refused, marked = provenance.check(str(root), list(names.values()))
  assert refused == {names["gssp", 4]: "a dirty tree at abc123def456",
                     names["bsp", 3]: "no commit recorded (not run from a git checkout)"}
  assert marked == {}
  figs = claims.figures(str(root))
  assert sorted(figs[("gssp", "none")]["seeds"]) == [0, 1, 2, 3]
  assert sorted(figs[("bsp", "none")]["seeds"]) == [0, 1, 2, 4]
  # The tree_clean field, where recorded, says the same as the suffix.
  _with_commit(root, names["gssp", 4], "abc123def456", clean=False)
  assert provenance.refusal(provenance.origin(str(root / names["gssp", 4]))) == (
      "a dirty tree at abc123def456")
  assert provenance.commits(str(root), list(names.values())) == {
      "abc123def456": 8, "abc123def456+dirty": 1, "no commit": 1}


def test_a_mark_with_its_reason_counts_a_refused_record_and_the_table_names_it(tmp_path):
  root = tmp_path / "runs" / "tiny"
  names = _study(root)
  with pytest.raises(ValueError, match="needs a reason"):
    provenance.mark(str(root), [names["gssp", 4]], " ")
  with pytest.raises(ValueError, match="they ran a clean, committed tree"):
    provenance.mark(str(root), [names["gssp", 0]], "why not")
  with pytest.raises(ValueError, match="no such trial"):
    reproduce.mark(str(tmp_path), ["tiny/nope"], "a reason")
  with pytest.raises(ValueError, match="allowed: <study>/<trial>"):
    reproduce.mark(str(tmp_path), ["nostudy/x"], "a reason")
  reproduce.mark(str(tmp_path), [f"tiny/{names['gssp', 4]}"], "the diff was a comment")
  refused, marked = provenance.check(str(root), list(names.values()))
  assert list(refused) == [names["bsp", 3]]
  assert marked == {names["gssp", 4]: "a dirty tree at abc123def456; kept: the diff was a "
                                      "comment"}
  assert sorted(claims.figures(str(root))[("gssp", "none")]["seeds"]) == [0, 1, 2, 3, 4]
  (root / report_grid()).write_text(json.dumps({"trials": [{"name": n}
                                                           for n in names.values()]}))
  lines = "\n".join(reproduce.provenance_lines(str(tmp_path), [reproduce.STUDIES["tiny"]]))
  assert "- `tiny`: 8 at `abc123def456`, 1 at `abc123def456+dirty`, 1 at `no commit`" in lines
  assert f"**refused, left out of every figure** (1): `{names['bsp', 3]}`" in lines
  assert "kept: the diff was a comment" in lines
  # A hand-written file without a reason for every trial is refused, naming the format.
  (root / provenance.MARK_FILE).write_text(json.dumps({"accepted": {names["bsp", 3]: ""}}))
  with pytest.raises(ValueError, match="a non-empty reason for every trial"):
    provenance.marks(str(root))


def test_marks_travel_with_the_saved_records(tmp_path):
  out = tmp_path / "out"
  root = out / "runs" / "tiny"
  names = _study(root)
  for name in names.values():
    (root / name / "trial.json").write_text(json.dumps({"name": name, "status": "done"}))
  reproduce.mark(str(out), [f"tiny/{names['bsp', 3]}"], "a worktree before the fix")
  reproduce.save_runs(str(out), [reproduce.STUDIES["tiny"]], str(tmp_path / "kept"))
  assert provenance.marks(str(tmp_path / "kept" / "runs" / "tiny")) == {
      names["bsp", 3]: "a worktree before the fix"}
  reproduce._merge_marks(str(tmp_path / "kept" / "runs" / "tiny"),   # pylint: disable=protected-access
                         str(tmp_path / "fresh" / "runs" / "tiny"))
  assert provenance.marks(str(tmp_path / "fresh" / "runs" / "tiny")) == {
      names["bsp", 3]: "a worktree before the fix"}


def report_grid():
  from gssp_jax.studies import report  # pylint: disable=g-import-not-at-top
  return report.GRID_FILE
