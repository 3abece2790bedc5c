"""The notebooks run from top to bottom, and are stored with their outputs: a reader on a code
host sees what a run gives. Each figure cell still draws its figure inline (an image output
as Jupyter shows it, not the same pixels or timings), and no cell stored without an image
gains one."""
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra has nbformat and nbclient")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def _figure_cells(nb):
    """Indices of the code cells with an image among their outputs."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_draws_its_figures_inline(path, monkeypatch):
    stored = nbformat.read(path, as_version=4)
    assert any(cell.get("outputs") for cell in stored.cells), \
        f"{path.name} is stored without its outputs: run it and save it (CONTRIBUTING)"
    # the kernel's own inline backend, as in Jupyter (not a backend set by the environment)
    monkeypatch.delenv("MPLBACKEND", raising=False)
    ran = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(ran, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    drawn = _figure_cells(ran)
    assert drawn == _figure_cells(stored)
    makes_figures = [i for i, cell in enumerate(ran.cells)
                     if cell.cell_type == "code" and "plt.subplots" in cell.source]
    assert set(makes_figures) <= set(drawn), "a cell that makes a figure shows none"
