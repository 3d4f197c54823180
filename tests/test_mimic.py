"""The MIMIC-IV loader on a small fake copy in the real layout (every row written by hand here;
no real data)."""

import gzip

import pytest
import torch

from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.checkpoints import load_model
from mistill_lens.task.examples import CANDIDATES_HEADER, PROMPT_HEADER, REASONING_HEADER
from mistill_lens.task.mimic import (
    Admission,
    candidate_universe,
    dotted,
    generation_examples,
    mimic_examples,
    read_admissions,
    split_of,
    written_code_events,
)

NOTES = """note_id,subject_id,hadm_id,note_type,note_seq,charttime,storetime,text
10001-DS-2,10001,20001,DS,2,2180-01-02 00:00:00,2180-01-02 10:00:00,"Addendum: troponin peaked on day 2."
10001-DS-1,10001,20001,DS,1,2180-01-01 00:00:00,2180-01-01 10:00:00,"Chest pain, NSTEMI. History of hypertension."
10001-DS-3,10001,20002,DS,1,2181-03-01 00:00:00,2181-03-01 10:00:00,"Readmitted with pneumonia."
10002-DS-1,10002,20003,DS,1,2182-05-01 00:00:00,2182-05-01 10:00:00,"Type 2 diabetes, acute kidney injury."
10003-DS-1,10003,20004,DS,1,2150-01-01 00:00:00,2150-01-01 10:00:00,"Old admission coded in ICD-9 only."
10004-DS-1,10004,20006,DS,1,2160-01-01 00:00:00,2160-01-01 10:00:00,"A note whose admission has no diagnoses."
"""
DIAGNOSES = """subject_id,hadm_id,seq_num,icd_code,icd_version
10001,20001,2,I10,10
10001,20001,1,I214,10
10001,20001,3,4280,9
10001,20002,1,J189,10
10002,20003,1,E119,10
10002,20003,2,N179,10
10002,20003,3,I10,10
10003,20004,1,41071,9
10005,20005,1,I214,10
"""


def write_copy(root, notes=NOTES, diagnoses=DIAGNOSES):
    (root / "note").mkdir(parents=True)
    (root / "hosp").mkdir()
    for path, text in (
        (root / "note" / "discharge.csv.gz", notes),
        (root / "hosp" / "diagnoses_icd.csv.gz", diagnoses),
    ):
        with gzip.open(path, "wt") as f:
            f.write(text)
    return root


def test_admissions_join_notes_and_icd10_diagnoses(tmp_path):
    admissions = read_admissions(write_copy(tmp_path / "mimic"))
    by_id = {a.hadm_id: a for a in admissions}
    # 20004 (ICD-9 only), 20005 (no note) and 20006 (no diagnoses) are left out
    assert sorted(by_id) == [20001, 20002, 20003]
    first = by_id[20001]
    assert first.codes == ("I21.4", "I10")  # seq_num order, dotted, the ICD-9 row dropped
    assert first.note.startswith("Chest pain") and first.note.endswith("peaked on day 2.")
    assert first.subject_id == 10001 and by_id[20003].codes == ("E11.9", "N17.9", "I10")
    assert dotted("I214") == "I21.4" and dotted("i10") == "I10" and dotted("E1165") == "E11.65"
    assert len(read_admissions(tmp_path / "mimic", limit=1)) == 1


def test_splits_keep_each_patient_in_one_split_and_the_universe_ranks_codes(tmp_path):
    admissions = read_admissions(write_copy(tmp_path / "mimic"))
    same_patient = [a for a in admissions if a.subject_id == 10001]
    assert len({split_of(a, seed=3) for a in same_patient}) == 1
    assert [split_of(a, 0) for a in admissions] == [split_of(a, 0) for a in admissions]
    many = [Admission(i, i, "", ("I10",)) for i in range(2000)]
    shares = {s: sum(split_of(a) == s for a in many) / len(many) for s in ("train", "heldout")}
    assert shares["train"] == pytest.approx(0.8, abs=0.04)
    assert shares["heldout"] == pytest.approx(0.1, abs=0.03)
    assert candidate_universe(admissions) == ["I10", "E11.9", "I21.4", "J18.9", "N17.9"]
    assert candidate_universe(admissions, top_n=2) == ["I10", "E11.9"]


def test_prompts_follow_the_task_format(tmp_path):
    admissions = read_admissions(write_copy(tmp_path / "mimic"))
    examples = mimic_examples(admissions, ["I21.4", "I10", "N17.9"], max_note_chars=20)
    assert [e.id for e in examples] == ["mimic-20001", "mimic-20003"]  # 20002 has no candidate
    prompt = examples[0].prompt
    assert prompt.startswith(PROMPT_HEADER + "Chest pain, NSTEMI. ")
    assert len(prompt.split(CANDIDATES_HEADER)[0]) == len(PROMPT_HEADER) + 20
    assert "I21.4: Non-ST elevation (NSTEMI) myocardial infarction\n" in prompt
    assert prompt.endswith(REASONING_HEADER) and examples[0].gold_codes == ("I21.4", "I10")


def test_bad_copies_are_refused_with_the_layout_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="note/discharge.csv.gz"):
        read_admissions(tmp_path)
    write_copy(tmp_path / "bad", diagnoses=DIAGNOSES.replace("icd_version", "version"))
    with pytest.raises(ValueError, match="icd_version"):
        read_admissions(tmp_path / "bad")


def test_events_come_from_the_models_own_output(tmp_path):
    model, tokenizer = load_model("tiny")
    admissions = read_admissions(write_copy(tmp_path / "mimic"))
    candidates = ["I21.4", "I21.3", "I10", "N17.9"]
    example = mimic_examples(admissions, candidates, max_note_chars=200)[0]
    output = "Codes: I21.4, I10\n"
    text = example.prompt + output
    tokens = tokenizer(text)["input_ids"]
    logits = model(torch.tensor([tokens]))[0]
    events = written_code_events(tokenizer, logits, example.prompt, output, candidates)
    kinds = [(e.kind, e.chosen) for e in events]
    assert kinds == [("region", "I21"), ("within", ".4"), ("region", "I10")]
    assert events[1].contrast == ".3"  # the only other candidate in the category
    for event in events:
        assert text[event.start : event.end] == event.chosen
    placed = events_from_spans(
        {"prompt": example.prompt, "output": output, "events": list(events)}, tokenizer, 0
    )
    assert len(placed.events) == 3
    generated = generation_examples(model, tokenizer, [example], max_new_tokens=6)
    assert generated[0].prompt == example.prompt and generated[0].id == example.id
    for event in generated[0].events:
        assert generated[0].text[event.start : event.end] == event.chosen


def test_empty_and_malformed_values_are_named_never_read_as_nan(tmp_path):
    # an empty note is left out, not read as the text "nan"
    notes = NOTES.replace('"Readmitted with pneumonia."', '""')
    admissions = read_admissions(write_copy(tmp_path / "empty_note", notes=notes))
    assert all(a.note.strip() and a.note != "nan" for a in admissions)
    assert 20002 not in {a.hadm_id for a in admissions}
    # an empty code is an error naming file, row and column, not the code "NAN"
    blank_code = DIAGNOSES.replace("10001,20002,1,J189,10", "10001,20002,1,,10")
    with pytest.raises(ValueError, match=r"diagnoses_icd.csv.gz, data row 4: column icd_code"):
        read_admissions(write_copy(tmp_path / "blank_code", diagnoses=blank_code))
    bad_version = DIAGNOSES.replace("10002,20003,1,E119,10", "10002,20003,1,E119,ten")
    with pytest.raises(ValueError, match=r"data row 5: column icd_version holds 'ten'"):
        read_admissions(write_copy(tmp_path / "bad_version", diagnoses=bad_version))
    with pytest.raises(ValueError, match=r"discharge.csv.gz is empty or not a readable CSV"):
        read_admissions(write_copy(tmp_path / "zero", notes=""))
