"""The notebooks run top to bottom (nbclient), so they cannot rot."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOK = NOTEBOOKS / "quickstart.ipynb"


def _execute(path: Path) -> list[Any]:
    """Execute the notebook at ``path``; its code cells' outputs, after checking that none is an error."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert errors == []
    return outputs


def test_quickstart_notebook_executes() -> None:
    outputs = _execute(NOTEBOOK)
    html = [
        o for o in outputs if "text/html" in o.get("data", {}) and "nantrace.Trace" in o["data"]["text/html"]
    ]
    assert len(html) == 1


def test_hunt_notebook_executes_and_names_the_op_and_line() -> None:
    from nantrace.examples.hunting import HandAttention

    lines, start = inspect.getsourcelines(HandAttention.forward)
    line = start + next(i for i, text in enumerate(lines) if "q @ k.transpose" in text)
    outputs = _execute(NOTEBOOKS / "hunt.ipynb")
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    culprit = f"aten::bmm in `blocks.0.attn` (HandAttention), forward, at hunting.py:{line}:"
    assert text.count(culprit) == 2  # hunt(repro.run) and the hunt of the training step
    # the cheap trace's drill-down already names the op and its line: the q·kᵀ +inf before the softmax's NaN
    assert (
        f"At step 8, `blocks.0.attn` (HandAttention, call 0) produced +inf in `matmul` at {HandAttention.forward.__code__.co_filename}:{line} inside its forward"
        in text
    )
    assert text.count("None\n") == 2  # the fixed runs (normalised features): no overflow
