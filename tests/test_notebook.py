"""The notebook (`examples/notebook.ipynb`): generated from its Jupytext source, and executed headless.

The notebook runs in a Jupyter kernel through nbclient, as Jupyter would run it, with its parameters
cell followed by one that makes it small: the suite's trained tiny DeepSeek-V3.2 (2 layers) instead
of the shipped 12-layer model, whose compiles would take a minute of CPU here, 16 new tokens, one
timing run. Its own asserts (stepping by hand equals `generate`; the tree, plain and speculative
decoding emit the same tokens) then run as a user's would, and an error in any cell fails the test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jupytext
import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SOURCE = EXAMPLES / "notebook.pct.py"
NOTEBOOK = EXAMPLES / "notebook.ipynb"
TINY = ROOT / "tests" / "fixtures" / "tiny"  # trained_models' `tiny`: DeepSeek-V3.2, 2 layers, bytes


def cells(notebook) -> list[tuple[str, str, list[str]]]:
    return [(cell.cell_type, cell.source, cell.metadata.get("tags", [])) for cell in notebook.cells]


def parameters(notebook) -> tuple[int, dict]:
    """The index and the values of the cell tagged `parameters`."""
    (index,) = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    values = {}
    for statement in ast.parse(notebook.cells[index].source).body:
        values[statement.targets[0].id] = ast.literal_eval(statement.value)
    return index, values


def test_ipynb_is_generated_from_its_source():
    """`jupytext --sync examples/notebook.pct.py` writes the .ipynb: same cells, no stored outputs."""
    source, notebook = jupytext.read(SOURCE), nbformat.read(NOTEBOOK, as_version=4)
    assert cells(notebook) == cells(source), "examples/notebook.ipynb is stale: run jupytext --sync examples/notebook.pct.py"
    assert notebook.metadata["jupytext"]["formats"] == "ipynb,.pct.py:percent"
    assert not any(cell.get("outputs") for cell in notebook.cells), "commit the notebook without outputs"


def test_notebook_restores_the_shipped_model_by_default():
    _, values = parameters(nbformat.read(NOTEBOOK, as_version=4))
    assert (EXAMPLES / values["CHECKPOINT"]).resolve() == EXAMPLES / "checkpoints" / "tiny-stdlib"
    assert (EXAMPLES / values["CHECKPOINT"] / "config.json").is_file()


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook executed headless at small sizes; its kernel starts in examples/ as Jupyter's would."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    index, _ = parameters(notebook)
    small = {"CHECKPOINT": str(TINY), "MAX_NEW_TOKENS": 16, "TIMING_RUNS": 1, "STEPS_SHOWN": 3,
             "CACHE_DIR": str(tmp_path_factory.mktemp("compile-cache"))}
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in small.items())))
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    return notebook


def text(notebook) -> str:
    return "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))


@pytest.mark.slow
def test_notebook_steps_and_shows_each_steps_accepted_tokens(executed):
    out = text(executed)
    assert "deepseek_v32: 2 layers" in out
    for step in (1, 2, 3):
        for row in (0, 1):
            assert re.search(rf"^step {step} row {row}: drafted '.*' +accepted [0-3] of 3, emitted '.+'$", out, re.M), out
    assert "step 4 row" not in out  # STEPS_SHOWN = 3
    assert "the same tokens as generate" in out


@pytest.mark.slow
def test_notebook_plots_times_and_reloads_from_the_compile_cache(executed):
    out = text(executed)
    images = [o for cell in executed.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1, "one figure: acceptance per draft position and per tree depth"
    assert re.search(r"^speedup [\d.]+x, the same text$", out, re.M), out
    programs = re.search(r"^(\d+) programs in .*compile-cache", out, re.M)
    assert programs and int(programs.group(1)) > 0, out
    assert re.search(r"^plain decoding: compiled in [\d.]+ s the first time, [\d.]+ s from the cache$", out, re.M), out
