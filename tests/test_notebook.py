"""The quickstart notebook runs top to bottom on the CPU, so it never rots."""
import os
import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from conftest import optimized_env

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    # the kernel inherits this environment: the CPU, and the real model's steps with LLVM's optimisation
    env = optimized_env(JAX_PLATFORMS="cpu")
    saved = {name: os.environ.get(name) for name in ("JAX_PLATFORMS", "XLA_FLAGS")}
    os.environ.update({name: env[name] for name in saved})
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert (tmp_path / "bench.png").stat().st_size > 1000
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.output_type == "stream")
    assert "accepted" in printed
