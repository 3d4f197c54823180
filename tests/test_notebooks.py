"""The notebooks run top to bottom through a Jupyter kernel against the shipped models; each ends
(here, not in the file) with a check of what it claims, their committed outputs show every figure
as a static image too (GitHub and nbconvert render it), and no output is a loading bar."""

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

CHECKS = {
    "01_explore_circuits": """
ablated = ablated_margins(engine, batch, means, found.circuit)
assert found.circuit and margin_by_kind(ablated)["near_miss"] < 0.5 * margin_by_kind(clean)["near_miss"]
assert abs(float(row.sum()) - 1) < 1e-4 and query == event.predict_position
# the heads shown are the ones found, the control is not one of them
assert (LAYER, HEAD) in found.circuit and control not in found.circuit
""",
    "02_ablation_sweeps": """
assert len(sweep) == len(decided) * n_layers * n_heads and circuits["all"]
by_score = curve[(curve.order == "by score") & (curve.kind == "near_miss")].fraction_kept.min()
shuffled = curve[(curve.order == "random") & (curve.kind == "near_miss")].fraction_kept.min()
assert by_score < shuffled  # the ranked heads take the margin down faster than random ones
""",
    "03_distill": """
kl = {name: value for name, (_, value) in rows.items()}
# MISTILL moves the student's attention at the events to the target; the CoT run does not
assert kl["mistill"] < 0.5 * kl["base"] and kl["mistill"] < 0.5 * kl["cot"]
assert abs(float(student_row.sum()) - 1) < 1e-5
""",
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_through_a_kernel_and_its_claims_hold(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(CHECKS[path.stem]))
    client = NotebookClient(
        notebook, timeout=2400, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()  # raises CellExecutionError, with the cell, on any failure
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("name") == "stderr"], "stderr output (loading bars?)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_show_every_figure_as_an_image(path):
    cells = json.loads(path.read_text())["cells"]
    outputs = [o for cell in cells for o in cell.get("outputs", [])]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert figures and all("image/png" in o["data"] for o in figures)
    assert not [o for o in outputs if o.get("name") == "stderr" or o["output_type"] == "error"]
    # a notebook loading bar is a widget whose saved text is a bar stuck where the save caught it
    bars = [o for o in outputs if "it/s]" in "".join(o.get("data", {}).get("text/plain", ""))]
    assert not bars, bars
    html, _ = HTMLExporter().from_notebook_node(nbformat.read(path, as_version=4))
    assert html.count("data:image/png") >= len(figures)  # an nbconvert export shows them too


HAND_WRITTEN = re.compile(r"\bL\d+H\d+\b|[Ll]ayer \d+, head \d+|\(\d+, \d+\)|\b\d+\.\d+\b")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_prose_names_no_head_and_no_figure_by_hand(path):
    """Heads and numbers come from the code's output, so the text cannot contradict it."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            assert not HAND_WRITTEN.search(text), (path.stem, HAND_WRITTEN.search(text).group())


def test_every_notebook_is_checked():
    assert NOTEBOOKS and {p.stem for p in NOTEBOOKS} == set(CHECKS)
