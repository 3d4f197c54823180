"""The main job end to end on the shipped defaults, at small settings: every stage runs, the
report is written, and the one-screen summary names the circuit and the report."""

import json

from mistill_lens import cli


def test_demo_runs_every_stage_and_ends_with_its_summary(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--model", "tiny", "--out", str(out), "--n-eval", "4", "--n-characterize", "6"]
    cli.main([*argv, "--distill-steps", "2", "--no-progress"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "characterization" / "summary.json").read_text())
    screen = (out / "summary.txt").read_text()
    assert screen.strip() in printed
    circuit = ", ".join(f"L{l}H{h}" for l, h in summary["circuit"]) or "none"
    assert f"circuit: {circuit}" in screen and str(out / "report" / "index.html") in screen
    assert "a short run, not a result" in screen
    for objective in ("cot", "mistill"):
        assert (out / "distill" / objective / "evaluation.json").is_file()
    page = (out / "report" / "index.html").read_text()
    assert page.count("<h2>") == 1 + 2 * 2  # the teacher's, and each student with its own
