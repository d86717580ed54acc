"""The notebooks run end to end on their small settings (GSSP_NOTEBOOK_SMALL=1), so they cannot rot."""

import json
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = pathlib.Path(__file__).resolve().parent.parent


def _execute(name: str, tmp_path, data_dir, monkeypatch):
  monkeypatch.setenv("GSSP_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("GSSP_NOTEBOOK_WORKDIR", str(tmp_path / "runs"))
  monkeypatch.setenv("GSSP_DATA_DIR", data_dir)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
  # The kernel is this interpreter (ipykernel's native spec); an error in any cell raises.
  nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(REPO)}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
  images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))
  return text, images


def _summaries(tmp_path) -> dict:
  runs = tmp_path / "runs"
  return {d: json.loads((runs / d / "summary.json").read_text()) for d in os.listdir(runs)
          if (runs / d / "summary.json").is_file()}   # not the notebook's own files


def test_notebooks_are_committed_without_outputs():
  for path in (REPO / "notebooks").glob("*.ipynb"):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path


@pytest.mark.slow
def test_quickstart_runs_bsp_and_gssp_and_plots(tmp_path, data_dir, monkeypatch):
  text, images = _execute("quickstart", tmp_path, data_dir, monkeypatch)
  summaries = _summaries(tmp_path)
  assert sorted(summaries) == ["bsp", "gssp"]
  assert all(s["status"] == "done" for s in summaries.values())
  assert summaries["gssp"]["totals"]["virtual_time"] < summaries["bsp"]["totals"]["virtual_time"]
  for name, s in summaries.items():   # the printed table is the runs' own numbers
    assert f"{name:>8} {s['final']['test_accuracy']:9.4f}" in text
  assert images == 1


@pytest.mark.slow
def test_custom_scheme_notebook_registers_and_compares_kasync(tmp_path, data_dir, monkeypatch):
  text, images = _execute("custom_scheme", tmp_path, data_dir, monkeypatch)
  summaries = _summaries(tmp_path)
  assert sorted(summaries) == ["asp", "bsp", "gssp", "kasync"]
  assert summaries["kasync"]["config"]["sync"]["k"] == 8
  assert summaries["kasync"]["status"] == "done"
  # K-async waits for 8 of 16 workers: faster than BSP per epoch, with some staleness.
  assert summaries["kasync"]["totals"]["virtual_time"] < summaries["bsp"]["totals"]["virtual_time"]
  assert summaries["kasync"]["final"]["staleness"]["mean"] > 0
  assert "24 pushes take 10.0 s with K-async (K=2), 18.0 s with BSP" in text
  assert images == 2


@pytest.mark.slow
def test_custom_model_notebook_trains_restores_and_names_by_file(tmp_path, data_dir, monkeypatch):
  text, _ = _execute("custom_model", tmp_path, data_dir, monkeypatch)
  summaries = _summaries(tmp_path)
  assert sorted(summaries) == ["bsp", "gssp", "gssp_by_file"]
  assert all(s["status"] == "done" for s in summaries.values())
  assert summaries["gssp"]["totals"]["virtual_time"] < summaries["bsp"]["totals"]["virtual_time"]
  by_file = summaries["gssp_by_file"]
  assert by_file["config"]["model"].endswith("my_model.py:SmallCNN")
  # Same model, data and seed, imported from files: the same run as the registered one.
  assert by_file["final"]["test_accuracy"] == summaries["gssp"]["final"]["test_accuracy"]
  accuracy = by_file["final"]["test_accuracy"]
  assert f"final accuracy {accuracy} | restored {accuracy}" in text
  assert "collections: ['batch_stats', 'params']" in text
