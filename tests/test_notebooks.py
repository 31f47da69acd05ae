"""Execute every notebook in notebooks/ headless, from its own directory, and fail on any cell error.

Run: python -m pytest tests/test_notebooks.py -q   (needs nbclient and ipykernel in the same environment)
"""
import glob
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(ROOT, "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))


@pytest.mark.slow
def test_python3_kernel_is_this_python():
    """The notebooks run in the 'python3' kernel: it must be this interpreter, which has the project's packages."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120).execute()
    printed = nb.cells[0].outputs[0]["text"].strip()
    assert os.path.realpath(printed) == os.path.realpath(sys.executable)


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
