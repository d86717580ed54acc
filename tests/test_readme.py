"""The README and docs/ do not rot: their marked Python examples run, their relative links resolve.

A Python block preceded by the line ``<!-- readme-test -->`` (invisible when rendered) is run
as it stands, in a fresh interpreter, with the offline data; so every name it uses must be
defined or imported in the block itself. It runs from a temporary folder outside the
repository (as a user's own script would, with only the installed package), unless it is a
sweep file of the repository's ``configs/`` (it imports ``configs``): those run from the root.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
MARKER = "<!-- readme-test -->"
REFERENCE = sorted((REPO / "docs").glob("*.md"))      # how things are now
LOG = sorted((REPO / "docs" / "log").glob("*.md"))     # the dated record
DOCS = [REPO / "README.md", *REFERENCE, *LOG]


def marked_blocks(text: str) -> list[str]:
  """The code of every fenced block that follows a ``MARKER`` line; a marker must precede a python block."""
  lines = text.splitlines()
  blocks = []
  for i, line in enumerate(lines):
    if line.strip() != MARKER:
      continue
    if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
      raise ValueError(f"line {i + 1}: {MARKER} must be followed by a ```python fence")
    end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
    if end is None:
      raise ValueError(f"line {i + 2}: the ```python block is never closed")
    blocks.append("\n".join(lines[i + 2:end]) + "\n")
  return blocks


def _examples():
  params = []
  for doc in DOCS:
    for k, code in enumerate(marked_blocks(doc.read_text())):
      slow = "train_and_evaluate" in code   # trains a model: an end-to-end run
      params.append(pytest.param(code, id=f"{doc.relative_to(REPO)}#{k}",
                                 marks=[pytest.mark.slow] if slow else []))
  return params


def test_marked_blocks_are_found_and_well_formed():
  readme = marked_blocks((REPO / "README.md").read_text())
  usage = marked_blocks((REPO / "docs" / "USAGE.md").read_text())
  scheme = next(code for code in usage if "register_scheme" in code)
  assert "configs" not in scheme   # "your own scheme" runs from any folder (the package alone)
  # USAGE's "Your own scheme" example: a protocol, registered and trained; the README's own
  # model example, and USAGE's copy of it.
  assert "train_and_evaluate" in scheme
  assert any("register_model" in code and "train_and_evaluate" in code for code in usage)
  assert all("register_model" in code for code in readme)
  assert marked_blocks("text\n" + MARKER + "\n```python\nx = 1\n```\n") == ["x = 1\n"]
  with pytest.raises(ValueError, match="python fence"):
    marked_blocks(MARKER + "\n```bash\nls\n```\n")
  with pytest.raises(ValueError, match="never closed"):
    marked_blocks(MARKER + "\n```python\nx = 1\n")


@pytest.mark.parametrize("code", _examples())
def test_marked_example_runs(code, data_dir, tmp_path):
  env = {**os.environ, "GSSP_DATA_DIR": data_dir, "JAX_PLATFORMS": "cpu",
         "TMPDIR": str(tmp_path), "GSSP_CACHE_DIR": str(tmp_path / "cache")}
  env.pop("PYTHONPATH", None)   # only what is installed
  in_repo = "from configs" in code or "import configs" in code
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO if in_repo else tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(text: str) -> list[str]:
  """Targets of Markdown links and images outside fenced code blocks and inline code."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
  text = re.sub(r"`[^`\n]*`", "", text)
  return _LINK.findall(text)


def _anchors(path: pathlib.Path) -> set[str]:
  """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to '-'."""
  text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
  slugs = set()
  for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
    slugs.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
  return slugs


def test_relative_links_point_to_existing_files_and_headings():
  broken = []
  for doc in DOCS:
    for target in _links(doc.read_text()):
      if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
        continue
      path, _, anchor = target.partition("#")
      dest = (doc.parent / path).resolve() if path else doc
      if not dest.exists():
        broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
        broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
  assert not broken, "\n".join(broken)


def test_link_checker_sees_links_but_not_code():
  text = "see [a](docs/A.md#x) and ![p](p.png)\n`[b](c.md)`\n```\n[d](e.md)\n```\n[f](https://x)"
  assert _links(text) == ["docs/A.md#x", "p.png", "https://x"]


def test_the_usage_guides_tiny_sweep_is_the_file_itself():
  """docs/USAGE.md shows configs/sweeps/tiny.py less its docstring: the copy cannot drift."""
  import ast  # pylint: disable=g-import-not-at-top
  source = (REPO / "configs/sweeps/tiny.py").read_text()
  body = "\n".join(source.splitlines()[ast.parse(source).body[0].end_lineno:]).strip() + "\n"
  shown = [code for code in marked_blocks((REPO / "docs/USAGE.md").read_text())
           if "def get_sweep" in code and "tiers = (1.0, 2.0)" in code]
  assert shown == [body]


def test_the_log_is_linked_from_the_reference_never_the_other_way_round():
  """docs/log/ is the dated record: a reference page (or the README) may point into it; a log
  page never points at a reference page, whose figures are today's and may have moved on."""
  assert LOG, "docs/log/ holds no page"
  into_log, back = set(), []
  for doc in [REPO / "README.md", *REFERENCE]:
    for target in _links(doc.read_text()):
      dest = (doc.parent / target.partition("#")[0]).resolve()
      if dest.parent == (REPO / "docs" / "log").resolve():
        into_log.add(dest.name)
  for doc in LOG:
    for target in _links(doc.read_text()):
      path = target.partition("#")[0]
      dest = (doc.parent / path).resolve() if path else doc
      if dest.suffix == ".md" and (dest in REFERENCE or dest == REPO / "README.md"):
        back.append(f"{doc.relative_to(REPO)}: {target}")
  assert not back, "log pages link to reference pages:\n" + "\n".join(back)
  unlinked = {p.name for p in LOG} - into_log - {"README.md"}
  index = REPO / "docs" / "log" / "README.md"
  if index.exists():   # pages the index lists count as reached from the reference through it
    unlinked -= {t.partition("#")[0] for t in _links(index.read_text())}
  assert not unlinked, f"log pages no reference page leads to: {sorted(unlinked)}"
