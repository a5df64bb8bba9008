"""Every notebook in notebooks/ runs top to bottom (with its own small settings) without an error."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
EXPECTED = ["01_quickstart", "02_continual_learning", "03_optimizers", "04_missing_modalities"]


def test_the_four_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == EXPECTED, "rebuild them: python notebooks/build_notebooks.py"


def test_every_notebook_starts_with_the_small_flag():
    for path in NOTEBOOKS:
        first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert first.source.startswith("SMALL = True"), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    """Every cell runs, at the notebooks' TINY sizes (their smoke run: the same code on less data and fewer epochs;
    the saved outputs are the SMALL run's)."""
    monkeypatch.setenv("PEFT_EXT_NOTEBOOK_TINY", "1")  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    saved_images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert saved_images, f"{path.name} was saved without its rendered plots"
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
