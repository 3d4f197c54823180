"""The example notebooks run top to bottom against the shipped models and write their figures."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def characterised_the_teacher(namespace: dict, figures: set[str]) -> None:
    assert "head_maps.html" in figures and "notebook_z_maps.html" in figures
    assert namespace["summary"]["circuit"] and namespace["summary"]["n_decided_events"] > 0


def distilled_a_student(namespace: dict, figures: set[str]) -> None:
    assert {"notebook_alignment.html", "notebook_student_attention.html"} <= figures
    assert float(namespace["student_row"].sum()) == pytest.approx(
        1.0, abs=1e-5
    )  # the target is a distribution
    kl = {name: value for name, (_, value) in namespace["rows"].items()}
    # MISTILL moves the student's attention at the events to the target; the CoT run (lambda = 0) does not
    assert kl["mistill"] < 0.5 * kl["base"] and kl["mistill"] < 0.5 * kl["cot"]


CHECKS = {
    "characterise_the_teacher": characterised_the_teacher,
    "distil_a_student": distilled_a_student,
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_writes_its_figures(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    figures = {p.name for p in (tmp_path / "runs").rglob("*.html")}
    CHECKS[path.stem](namespace, figures)


def test_every_notebook_is_checked():
    assert NOTEBOOKS and {p.stem for p in NOTEBOOKS} == set(CHECKS)
