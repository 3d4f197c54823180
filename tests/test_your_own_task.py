"""Your own model and task, end to end through the command line: a kind the ICD task does not have
("answer"), a one-token answer as the whole output, examples from a JSONL file."""

import json

import pandas as pd
import pytest
from planted import (
    DECIDER,
    GENERIC,
    GENERIC_GAIN,
    REGION_GAIN,
    planted_examples,
    planted_hf_model,
    planted_tokenizer,
)

from mistill_lens import cli
from mistill_lens.lens.examples import read_examples
from mistill_lens.models.checkpoints import save_checkpoint


def short_answer_examples(n: int, seed: int) -> list[dict]:
    """The planted task as a question with a one-token answer: the prompt ends at "=", the output
    is the region alone, decided by the planted DECIDER head."""
    rows = []
    for example in planted_examples(n, seed):
        region = example["events"][0]
        text = example["prompt"] + example["output"]
        prompt, answer = text[: region["start"]], region["chosen"]
        rows.append(
            {
                "id": f"q{seed}-{len(rows)}",
                "prompt": prompt,
                "output": answer,
                "events": [
                    {
                        "kind": "answer",
                        "start": len(prompt),
                        "end": len(prompt) + len(answer),
                        "chosen": answer,
                        "contrast": region["contrast"],
                        "region": region["region"],
                    }
                ],
            }
        )
    return rows


def write(rows, path):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_non_icd_task_with_short_answers_runs_end_to_end(tmp_path, capsys):
    model_dir = save_checkpoint(
        planted_hf_model(), planted_tokenizer(tmp_path / "tok"), tmp_path / "model", {}
    )
    examples = write(short_answer_examples(32, seed=0), tmp_path / "questions.jsonl")
    reference = write(short_answer_examples(40, seed=1), tmp_path / "reference.jsonl")
    assert {e.kind for x in read_examples(examples) for e in x.events} == {"answer"}
    cli.main(
        [
            "characterize",
            "--model",
            str(model_dir),
            "--examples",
            str(examples),
            "--reference",
            str(reference),
            "--out",
            str(tmp_path / "char"),
            "--z-min",
            "3",
            "--no-progress",
        ]
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((tmp_path / "char" / "summary.json").read_text())
    # 32 events and nulls: above the minimum counts (20 per kind, 30 null), so no warning
    assert summary["answer"]["n_events"] == 32 and summary["n_null_events"] == 32
    # the deciding head is found, the previous-token head (as strong on null tokens) is discounted
    assert printed["circuit"] == summary["circuit"] == [list(DECIDER)]
    assert (
        summary["top_heads"]["answer"][0]["layer"] == DECIDER[0]
        and summary["top_heads"]["answer"][0]["head"] == DECIDER[1]
    )
    assert list(GENERIC) not in summary["circuit"]
    # closed form: the decider carries REGION_GAIN of the margin, the previous-token head the rest
    assert summary["answer"]["necessity"] == pytest.approx(
        REGION_GAIN / (REGION_GAIN + GENERIC_GAIN), abs=0.01
    )
    assert summary["families"]["L0H0/answer"] == "region_candidates"
    assert summary["elicitation"] == {"skipped": "no elicitation_kind configured"}
    assert summary["examples"] == str(examples) and summary["warnings"] == []
    events = pd.read_csv(tmp_path / "char" / "events.csv")  # each event names its example's id
    assert events["id"].tolist() == [f"q0-{i}" for i in events["example_id"]]


def test_a_task_whose_events_name_no_region_gets_no_families_panel(tmp_path, capsys):
    """Attention families are measured against each event's region and near-miss text: events
    naming neither have none, so the summary lists none and no empty families figure is drawn."""
    model_dir = save_checkpoint(
        planted_hf_model(), planted_tokenizer(tmp_path / "tok"), tmp_path / "model", {}
    )
    files = {}
    for name, n, seed in (("examples", 32, 0), ("reference", 40, 1)):
        rows = short_answer_examples(n, seed=seed)
        for row in rows:
            del row["events"][0]["region"]
        files[name] = write(rows, tmp_path / f"{name}.jsonl")
    out = tmp_path / "char"
    cli.main(
        ["characterize", "--model", str(model_dir), "--examples", str(files["examples"])]
        + ["--reference", str(files["reference"]), "--out", str(out), "--no-progress"]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert "families" not in summary and summary["circuit"] == [list(DECIDER)]
    assert not (out / "figures" / "attention_families.html").exists()
    assert (out / "figures" / "head_maps.html").is_file()


def test_bad_example_files_name_the_line(tmp_path, capsys):
    rows = short_answer_examples(3, seed=0)
    latin1 = tmp_path / "latin1.jsonl"
    lines = [json.dumps(row) for row in rows]
    lines[2] = lines[2].replace('"id": ', '"note": "caf\u00e9", "id": ')
    latin1.write_bytes(("\n".join(lines[:2]) + "\n").encode() + lines[2].encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl, line 3: not UTF-8 \(byte 0xe9"):
        read_examples(latin1)
    for field, value, message in (
        ("kind", "null", r"line 1: event 0: kind must be a non-empty name other than 'null'"),
        (
            "contrast",
            rows[0]["events"][0]["chosen"],
            r"line 1: event 0: contrast .* must be a text",
        ),
    ):
        bad = [json.loads(json.dumps(row)) for row in rows]
        bad[0]["events"][0][field] = value
        with pytest.raises(ValueError, match=message):
            read_examples(write(bad, tmp_path / "bad_field.jsonl"))
    rows[1]["events"][0]["chosen"] = "R9"
    path = write(rows, tmp_path / "bad.jsonl")
    with pytest.raises(
        ValueError, match=r"bad.jsonl, line 2: event 0: .* not its chosen text 'R9'"
    ):
        read_examples(path)
    del rows[1]["events"][0]["contrast"]
    with pytest.raises(ValueError, match=r"line 2: event 0 is missing field\(s\) \['contrast'\]"):
        read_examples(write(rows, tmp_path / "bad.jsonl"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            [
                "characterize",
                "--examples",
                str(tmp_path / "none.jsonl"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert exit_.value.code == 2 and "examples file" in capsys.readouterr().err


def test_problems_found_at_tokenization_name_file_line_and_id_before_any_folder(tmp_path, capsys):
    model_dir = save_checkpoint(
        planted_hf_model(), planted_tokenizer(tmp_path / "tok"), tmp_path / "model", {}
    )
    rows = short_answer_examples(3, seed=0)
    n_ctx = json.loads((model_dir / "config.json").read_text())["n_positions"]
    long = rows[1]["prompt"] * (n_ctx + 1)  # at least a token per copy
    rows[1] = {**rows[1], "prompt": long}
    for event in rows[1]["events"]:  # the answer follows the prompt
        event["start"], event["end"] = len(long), len(long) + len(event["chosen"])
    examples = write(rows, tmp_path / "long.jsonl")
    out = tmp_path / "char"
    with pytest.raises(SystemExit) as exit_:
        cli.main(
            ["characterize", "--model", str(model_dir), "--examples", str(examples)]
            + ["--out", str(out), "--no-progress"]
        )
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"the longest, {examples}, line 2 (id 'q0-1')" in error
    assert not out.exists()


def test_the_elicitation_kind_must_be_a_kind_of_your_events(tmp_path, capsys):
    examples = write(short_answer_examples(3, seed=0), tmp_path / "questions.jsonl")
    with pytest.raises(SystemExit):
        cli.main(
            ["characterize", "--model", "tiny", "--examples", str(examples)]
            + ["--elicitation-kind", "region", "--out", str(tmp_path / "char")]
        )
    assert "their kinds are ['answer']" in capsys.readouterr().err
    assert not (tmp_path / "char").exists()
