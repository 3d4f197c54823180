"""The main job end to end at small settings: every stage runs, the report is written, and the
one-screen summary names the teacher's circuit, each shipped student's scores and heads beside
its recorded figures, and the report."""

import json

import pytest

from mistill_lens import cli
from mistill_lens.models.registry import shipped_students

STUDENT = "smollm2-mistill-fp32-master-0"


def test_demo_runs_every_stage_and_ends_with_its_summary(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", "tiny", "--out", str(out), "--n-eval", "4", "--n-characterize", "4"]
    cli.main([*argv, "--students", STUDENT, "--n-eval-students", "1", "--no-progress"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "characterization" / "summary.json").read_text())
    screen = (out / "summary.txt").read_text()
    assert screen.strip() in printed
    circuit = ", ".join(f"L{l}H{h}" for l, h in summary["circuit"]) or "none"
    assert f"circuit: {circuit}" in screen and str(out / "report" / "index.html") in screen
    student = json.loads((out / "students" / STUDENT / "summary.json").read_text())
    heads = ", ".join(f"L{l}H{h}" for l, h in student["circuit"]) or "none"
    assert student["n_heads_total"] == 270  # SmolLM2's heads, not the tiny teacher's
    assert f"student {STUDENT}: code_f1" in screen and f"circuit {heads}" in screen
    recorded = json.loads((shipped_students()[STUDENT] / "evaluation.json").read_text())
    assert f"recorded: code_f1 {recorded['code_f1']:.2f}" in screen
    page = (out / "report" / "index.html").read_text()
    # the teacher's characterisation, the student's, and the student's recorded evaluation
    assert page.count("<h2>") == 3


def test_demo_refuses_a_student_that_does_not_ship_before_claiming_its_folder(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--out", str(tmp_path / "demo"), "--students", "smollm2-cot"])
    assert exit_.value.code == 2
    assert (
        f"no shipped student 'smollm2-cot'; the shipped students are {STUDENT.replace('mistill', 'cot')}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "demo").exists()
