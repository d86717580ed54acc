"""Writes the notebooks' "Open in Colab" cell and install cell from pyproject.toml.

The repository's address is declared once, in pyproject.toml's ``[project.urls] Repository``.
A fresh Colab runtime has no gssp_jax to read it from, so the install cell must hold it
literally: this script writes it there (and into the Colab links), and
``tests/test_colab.py`` fails while a notebook disagrees with pyproject.toml.

  python notebooks/sync.py           # rewrite the two cells of every notebook
  python notebooks/sync.py --check   # exit 1 if a notebook is out of date

Standard library only: it runs before anything is installed.
"""

import json
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
BRANCH = "main"                 # the branch the Colab links open
BADGE_ID = "open-in-colab"      # the cell ids this script owns
INSTALL_ID = "install"

BADGE = """\
[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab})

Run the first code cell as it is, in Colab or in a checkout. In Colab it clones the repository \
at `REPOSITORY` (set near the top of that cell: a placeholder until gssp_jax is published, so set \
it to your copy's address) and installs it with pip; in a checkout it installs that checkout. \
If pip upgrades jax (or another \
package this session has already imported), the cell stops and asks you to restart the runtime \
(Runtime → Restart session); then run all cells again: the second time the cell finds the install \
and goes on. Data needs no path: MNIST comes from `$GSSP_DATA_DIR` if set, else it is downloaded \
once, checksummed, into `~/.cache/gssp_jax`."""

INSTALL = '''\
# Install gssp_jax. Run as it is. Inside a checkout of the repository it installs that checkout
# (`pip install -e`); anywhere else (a fresh Colab runtime) it clones REPOSITORY into ./gssp_jax
# and installs the clone. Then it moves to the checkout's root, where `configs` and `experiments`
# import (pip installs only `gssp_jax`) and the README's commands run as written.
# REPOSITORY: the address to clone from, pyproject.toml's [project.urls] Repository (written
# here by notebooks/sync.py). Until gssp_jax is published it is a placeholder: set it to the
# address of your copy of the repository (a fork or a mirror) to run this notebook in Colab.
import importlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

REPOSITORY = "{url}"


def find_checkout(start: pathlib.Path):
  """The folder at or above ``start``, or ``start/gssp_jax``, holding gssp_jax's pyproject.toml."""
  for folder in (start, *start.parents, start / "gssp_jax"):
    pyproject = folder / "pyproject.toml"
    if pyproject.is_file() and re.search(r'^name = "gssp_jax"$', pyproject.read_text(), re.M):
      return folder
  return None


def versions() -> dict:
  """Installed distributions, name -> version."""
  return {{d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}}


def installed(name: str) -> bool:
  try:
    importlib.metadata.distribution(name)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


checkout = find_checkout(pathlib.Path.cwd().resolve())
if checkout is None and "REPLACE-WITH-OWNER" in REPOSITORY:
  raise RuntimeError(f"REPOSITORY = {{REPOSITORY!r}} is a placeholder until gssp_jax is "
                     "published: set it, at the top of this cell, to the address of your copy "
                     "of the repository and run the cell again (or open the notebook in a "
                     "checkout)")
if checkout is None:
  checkout = pathlib.Path.cwd().resolve() / "gssp_jax"
  print("cloning", REPOSITORY, "into", checkout)
  subprocess.check_call(["git", "clone", "--depth=1", "--quiet", REPOSITORY, str(checkout)])
if not installed("gssp_jax"):
  print("installing", checkout)
  before = versions()
  subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "-e", str(checkout)])
  importlib.invalidate_caches()
  # A module imported before pip replaced its files stays the old one until a restart.
  changed = {{name for name, v in versions().items() if before.get(name, v) != v}}
  owners = importlib.metadata.packages_distributions()
  stale = sorted(m for m in list(sys.modules)
                 if "." not in m and changed & set(owners.get(m, ())))
  if stale:
    raise RuntimeError(f"pip upgraded {{', '.join(stale)}}, already imported in this session: "
                       "restart the runtime (Colab: Runtime > Restart session), then run all "
                       "cells again")
os.chdir(checkout)
if str(checkout) not in sys.path:
  sys.path.insert(0, str(checkout))
print(f"gssp_jax {{importlib.metadata.version('gssp_jax')}}, checkout {{checkout}}")'''


def repository_url(pyproject: pathlib.Path = REPO / "pyproject.toml") -> str:
  """``[project.urls] Repository`` of ``pyproject`` (a GitHub address, for the Colab links)."""
  import tomllib   # Python >= 3.11; the maintainers' tool, not the notebooks'
  url = tomllib.loads(pyproject.read_text())["project"]["urls"]["Repository"]
  if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
    raise ValueError(f"[project.urls] Repository={url!r} is not a GitHub repository address "
                     "(https://github.com/OWNER/NAME), which Colab links need")
  return url


def colab_url(url: str, notebook: str) -> str:
  """The Colab address that opens ``notebooks/<notebook>`` of the repository at ``url``."""
  return (f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}"
          f"/blob/{BRANCH}/notebooks/{notebook}")


def _lines(text: str) -> list[str]:
  return text.splitlines(keepends=True)


def synced(nb: dict, notebook: str, url: str) -> dict:
  """``nb`` with its Colab cell first and its install cell the first code cell.

  The first run replaces the first code cell (the old install cell) and adds the Colab cell;
  later runs find both by their ids.
  """
  cells = [c for c in nb["cells"] if c.get("id") != BADGE_ID]
  badge = {"cell_type": "markdown", "id": BADGE_ID, "metadata": {},
           "source": _lines(BADGE.format(colab=colab_url(url, notebook)))}
  install = {"cell_type": "code", "execution_count": None, "id": INSTALL_ID, "metadata": {},
             "outputs": [], "source": _lines(INSTALL.format(url=url))}
  ids = [c.get("id") for c in cells]
  at = ids.index(INSTALL_ID) if INSTALL_ID in ids else next(
      i for i, c in enumerate(cells) if c["cell_type"] == "code")
  cells[at] = install
  return {**nb, "cells": [badge, *cells]}


def main(argv: list[str]) -> int:
  check = "--check" in argv
  url = repository_url()
  stale = []
  for path in sorted(NOTEBOOKS.glob("*.ipynb")):
    text = path.read_text()
    new = json.dumps(synced(json.loads(text), path.name, url), indent=1, ensure_ascii=False) + "\n"
    if new != text:
      stale.append(path.name)
      if not check:
        path.write_text(new)
  if stale:
    print(("out of date: " if check else "rewrote: ") + ", ".join(stale))
  return 1 if check and stale else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
