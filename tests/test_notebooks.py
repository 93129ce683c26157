"""Every notebook in notebooks/ runs top to bottom (nbclient), on small sizes."""

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_NOTEBOOK_EPOCHS", "3")
    monkeypatch.setenv("MGPU_NO_MPI", "1")  # a kernel is one process
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert outputs, "the notebook printed nothing"
    if path.name == "01_quickstart.ipynb":
        assert "val accuracy" in outputs
        assert (tmp_path / "out" / "quickstart.png").stat().st_size > 1000
    if path.name == "02_scaling_analysis.ipynb":
        assert "batch   256: 2 ranks" in outputs and "of the step" in outputs
        for png in ("scaling.png", "breakdown.png"):
            assert (tmp_path / "out" / png).stat().st_size > 1000
    if path.name == "03_strategy_selector.ipynb":
        assert "strategy: multi_gpu" in outputs and "median |error|" in outputs
        assert (tmp_path / "out" / "selector_heatmap.png").stat().st_size > 1000


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ is empty"
