"""The notebooks' first cell installs gssp_jax as it is, in a checkout and in a fresh Colab runtime.

The install tests run the cell's own code, unedited but for the repository's address in the clone
test, in a fresh virtual environment that holds every package of this one except gssp_jax, and
let pip really install (with ``--no-deps``: the dependencies are this environment's). pip builds
the editable wheel offline when this environment's setuptools can; otherwise it takes setuptools
from the package index pip is configured with, as ``pip install -e .`` does.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _sync_module():
  spec = importlib.util.spec_from_file_location("notebooks_sync", REPO / "notebooks" / "sync.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _repository_url() -> str:
  return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]["Repository"]


def _install_cell(notebook: pathlib.Path) -> str:
  code = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
  return "".join(code[0]["source"])


def test_notebooks_carry_the_repository_url_of_pyproject():
  url = _repository_url()
  assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
  assert NOTEBOOKS
  for notebook in NOTEBOOKS:
    cells = json.loads(notebook.read_text())["cells"]
    assert f'\nREPOSITORY = "{url}"\n' in _install_cell(notebook), notebook.name
    assert "GSSP_JAX_SOURCE" not in _install_cell(notebook)
    # The Colab link sits at the top and opens this very notebook of that repository.
    owner_repo = url.removeprefix("https://github.com/")
    link = (f"(https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/"
            f"{notebook.name})")
    assert cells[0]["cell_type"] == "markdown" and link in "".join(cells[0]["source"])
  assert _sync_module().main(["--check"]) == 0   # both cells exactly as sync.py writes them


def test_pip_installs_only_gssp_jax_at_the_top_level(tmp_path):
  # What pip records as the distribution's top-level names, from setuptools' own discovery.
  subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "--quiet",
                  "egg_info", f"--egg-base={tmp_path}"], cwd=REPO, check=True,
                 capture_output=True)
  (egg_info,) = tmp_path.glob("*.egg-info")
  assert (egg_info / "top_level.txt").read_text().split() == ["gssp_jax"]
  sources = (egg_info / "SOURCES.txt").read_text().split()
  assert "gssp_jax/sync/__init__.py" in sources and "gssp_jax/sim/simulate.py" in sources
  assert not [s for s in sources if s.startswith(("configs/", "experiments/"))]


def _venv_without_gssp_jax(path: pathlib.Path) -> pathlib.Path:
  """A virtual environment seeing this one's packages, gssp_jax left out; its python."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
  python = path / "bin" / "python"
  purelib = pathlib.Path(subprocess.check_output(
      [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      text=True).strip())
  # Some Pythons (Debian's) list site directories that do not exist.
  for packages in filter(os.path.isdir, site.getsitepackages()):
    for entry in pathlib.Path(packages).iterdir():
      if "gssp_jax" in entry.name or (purelib / entry.name).exists():
        continue
      (purelib / entry.name).symlink_to(entry)
  return python


def _can_build_offline() -> bool:
  """Whether this environment's setuptools builds an editable wheel without fetching anything."""
  import setuptools   # pylint: disable=import-outside-toplevel
  major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
  return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _env() -> dict:
  """This environment without what would point Python at a checkout or a source."""
  return {k: v for k, v in os.environ.items()
          if k not in ("GSSP_JAX_SOURCE", "PYTHONPATH") and not k.startswith("VIRTUAL_ENV")}


def _run_cell(python: pathlib.Path, code: str, cwd: pathlib.Path) -> str:
  """Runs the install cell, then reports where gssp_jax and configs come from."""
  env = _env()
  env["PIP_NO_DEPS"] = "1"
  if _can_build_offline():
    env["PIP_NO_BUILD_ISOLATION"] = "0"   # pip's spelling of --no-build-isolation
    env["PIP_NO_INDEX"] = "1"
  probe = ("\nimport configs, experiments, gssp_jax\n"
           "print('CWD', os.getcwd())\n"
           "print('GSSP_JAX', gssp_jax.__file__)\n"
           "print('CONFIGS', configs.__file__)\n")
  done = subprocess.run([str(python), "-c", code + probe], cwd=cwd, env=env, text=True,
                        capture_output=True, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  return done.stdout


def _imports_from_elsewhere(python: pathlib.Path, cwd: pathlib.Path) -> str:
  """Where a new process outside the checkout imports gssp_jax from, and whether configs imports."""
  return subprocess.run(
      [str(python), "-c", "import importlib.util, gssp_jax; print(gssp_jax.__file__, "
       "importlib.util.find_spec('configs'), importlib.util.find_spec('experiments'))"],
      cwd=cwd, env=_env(), text=True, capture_output=True, check=True).stdout.split()


@pytest.fixture
def keep_checkout_clean():
  """Removes the egg-info an editable install writes into the checkout, unless it was there."""
  egg_info = REPO / "gssp_jax.egg-info"
  existed = egg_info.exists()
  yield
  if not existed:
    shutil.rmtree(egg_info, ignore_errors=True)


@pytest.mark.slow
def test_install_cell_installs_the_checkout_without_gssp_jax_source(tmp_path, keep_checkout_clean):
  python = _venv_without_gssp_jax(tmp_path / "venv")
  code = _install_cell(REPO / "notebooks" / "quickstart.ipynb")
  # Jupyter starts a notebook's kernel in the notebook's folder, inside the checkout.
  out = _run_cell(python, code, REPO / "notebooks")
  assert f"installing {REPO}\n" in out and "cloning" not in out
  assert f"CWD {REPO}\n" in out
  assert f"GSSP_JAX {REPO / 'gssp_jax' / '__init__.py'}\n" in out
  assert f"CONFIGS {REPO / 'configs' / '__init__.py'}\n" in out
  # pip really installed the checkout (editable), and nothing but gssp_jax at the top level.
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  assert _imports_from_elsewhere(python, elsewhere) == [
      str(REPO / "gssp_jax" / "__init__.py"), "None", "None"]
  # The README's commands run from the checkout's root.
  usage = subprocess.run([str(python), "-m", "experiments.main", "--helpshort"], cwd=REPO,
                         env=_env(), text=True, capture_output=True).stdout
  assert "python -m experiments.main --config=configs/" in usage
  # Run again (a restarted runtime): already installed, nothing to do but use the checkout.
  out = _run_cell(python, code, REPO / "notebooks")
  assert "installing" not in out and f"CONFIGS {REPO / 'configs' / '__init__.py'}\n" in out


@pytest.mark.slow
def test_install_cell_clones_and_installs_outside_a_checkout(tmp_path):
  # The repository: a git repository of this checkout's files (its tracked ones need not be
  # committed). The cell's address is the one thing changed, from pyproject's to this one.
  origin = tmp_path / "origin"
  origin.mkdir()
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(REPO / name, origin / name)
  for name in ("gssp_jax", "configs", "experiments"):
    shutil.copytree(REPO / name, origin / name, ignore=shutil.ignore_patterns("__pycache__"))
  git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-C", str(origin)]
  for args in (["init", "--quiet"], ["add", "."], ["commit", "--quiet", "-m", "snapshot"]):
    subprocess.run(git + args, check=True, capture_output=True)
  code = _install_cell(REPO / "notebooks" / "quickstart.ipynb")
  url = _repository_url()
  assert code.count(f'"{url}"') == 1
  code = code.replace(f'"{url}"', repr(origin.as_uri()))

  python = _venv_without_gssp_jax(tmp_path / "venv")
  content = tmp_path / "content"        # Colab's working directory, outside any checkout
  content.mkdir()
  clone = content / "gssp_jax"
  out = _run_cell(python, code, content)
  assert f"cloning {origin.as_uri()} into {clone}\n" in out and f"installing {clone}\n" in out
  assert f"CWD {clone}\n" in out
  assert f"GSSP_JAX {clone / 'gssp_jax' / '__init__.py'}\n" in out
  assert f"CONFIGS {clone / 'configs' / '__init__.py'}\n" in out
  assert _imports_from_elsewhere(python, tmp_path) == [
      str(clone / "gssp_jax" / "__init__.py"), "None", "None"]
  # The runtime restarted: back in /content, the clone and the install are found and kept.
  out = _run_cell(python, code, content)
  assert "cloning" not in out and "installing" not in out and f"CWD {clone}\n" in out


def test_outside_a_checkout_a_placeholder_address_is_refused_with_what_to_set(tmp_path):
  """Until the project is published pyproject's address is a placeholder: in a fresh Colab
  runtime the cell says which variable to set, before it clones or installs anything."""
  code = _install_cell(REPO / "notebooks" / "quickstart.ipynb")
  code = re.sub(r'\nREPOSITORY = "[^"]*"\n',
                '\nREPOSITORY = "https://github.com/REPLACE-WITH-OWNER/gssp_jax"\n', code)
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("RuntimeError: REPOSITORY = 'https://github.com/REPLACE-WITH-OWNER/"
                         "gssp_jax' is a placeholder until gssp_jax is published: set it"), last
  assert list(tmp_path.iterdir()) == [] and "cloning" not in proc.stdout
