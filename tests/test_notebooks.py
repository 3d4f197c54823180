"""The example notebooks run top to bottom against the shipped teacher and write their figures."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_writes_its_figures(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    figures = {p.name for p in (tmp_path / "runs").rglob("*.html")}
    assert "head_maps.html" in figures and "notebook_z_maps.html" in figures
    assert namespace["summary"]["circuit"] and namespace["summary"]["n_decided_events"] > 0


def test_there_is_a_notebook():
    assert NOTEBOOKS
