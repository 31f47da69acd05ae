"""Execute every notebook in notebooks/ headless, from its own directory, and fail on any cell error.

The notebooks run in the 'python3' kernel, which must be this environment's interpreter (it has the project's
packages). Run: python -m pytest tests/test_notebooks.py -q   (needs nbclient and ipykernel in the same environment)
"""
import glob
import os

import pytest

from conftest import ROOT

NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits the environment: no display needed
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": NOTEBOOK_DIR}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
