"""The quickstart notebook runs top to bottom (so it cannot rot)."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow  # minutes on CPU; -m slow
def test_quickstart_notebook_runs(tmp_path):
    path = os.path.join(HERE, "..", "notebooks", "quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "rejected:" in text and "events" in text
