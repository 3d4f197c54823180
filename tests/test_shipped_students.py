"""The students shipped in the package are the ones that were trained and evaluated: each folder
is intact (its manifest), loads on its base from the base's package, and reproduces the
teacher-forced scores recorded when it shipped; each CoT / MISTILL pair saw the same data and
started from the same weights."""

import json

import pytest

from mistill_lens.distill.shipping import REFERENCE_FILE, reference_scores
from mistill_lens.models.checkpoints import read_metadata
from mistill_lens.models.registry import shipped_students
from mistill_lens.runs import verify_manifest

STUDENTS = shipped_students()


def test_students_ship_in_cot_mistill_pairs_that_saw_the_same_data_and_weights():
    assert STUDENTS, "no student ships: the package should carry the seed-0 pair"
    by_cell: dict[tuple, dict] = {}
    for name, folder in STUDENTS.items():
        metadata = read_metadata(folder)
        config = metadata["config"]
        cell = (config["family"], config["precision"], config["seed"])
        assert name == f"{cell[0]}-{config['objective']}-{cell[1]}-{cell[2]}", (
            f"{name}: its folder name does not match its record"
        )
        by_cell.setdefault(cell, {})[config["objective"]] = metadata["paired"]
    for cell, pair in by_cell.items():
        assert set(pair) == {"cot", "mistill"}, f"{cell} ships {sorted(pair)}, not a pair"
        assert pair["cot"] == pair["mistill"], f"{cell}: the two objectives saw different data"


@pytest.mark.parametrize("name", sorted(STUDENTS))
def test_a_shipped_student_reproduces_its_recorded_scores(name):
    folder = STUDENTS[name]
    verify_manifest(folder)  # every file as it was shipped
    recorded = json.loads((folder / REFERENCE_FILE).read_text())
    examples = recorded["examples"]
    again = reference_scores(folder, examples["k"], examples["max_mentions"])
    assert again["examples"] == examples
    assert set(again["teacher_forced"]) == set(recorded["teacher_forced"])
    for kind, scores in recorded["teacher_forced"].items():
        now = again["teacher_forced"][kind]
        assert now["n"] == scores["n"] > 0
        assert now["acc"] == pytest.approx(scores["acc"], abs=1e-9)
        assert now["margin"] == pytest.approx(scores["margin"], abs=1e-3)
