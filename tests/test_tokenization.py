"""Teacher and student tokenizers: round trips, offsets, and how codes split."""

import pytest

from mistill_lens import task
from mistill_lens.models.tokenizers import student_tokenizer, teacher_tokenizer
from mistill_lens.task.build_tokenizers import build_student_tokenizer, build_teacher_tokenizer
from mistill_lens.task.icd import load_universe, region_of, suffix_of


def code_tokens(tokenizer, code: str) -> list[str]:
    """How ``tokenizer`` splits a code written after a space, as it is in the trace."""
    ids = tokenizer(" " + code, add_special_tokens=False)["input_ids"]
    return [t for t in tokenizer.convert_ids_to_tokens(ids) if t != "Ġ"]


@pytest.fixture(scope="module")
def texts():
    return [ex.text for ex in task.generate_examples(30, 11, "heldout")]


@pytest.mark.parametrize("load", [teacher_tokenizer, student_tokenizer])
def test_round_trip_and_offsets(load, texts):
    tokenizer = load()
    for text in texts:
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        assert tokenizer.decode(enc["input_ids"]) == text
        offsets = enc["offset_mapping"]
        # offsets cover the text in order; a token decodes to its span unless it is one byte
        # of a multi-byte character (ICD wording has a few), whose bytes share one span
        assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
        for (start, end), (next_start, next_end) in zip(offsets, offsets[1:]):
            assert start <= next_start <= end <= next_end
        for token_id, (start, end) in zip(enc["input_ids"], offsets):
            piece = tokenizer.decode([token_id])
            assert piece == text[start:end] or "\ufffd" in piece


def test_teacher_splits_every_code_into_region_and_suffix():
    tokenizer = teacher_tokenizer()
    universe = load_universe(12536)
    for code in universe.codes:
        assert code_tokens(tokenizer, code) == [region_of(code), suffix_of(code)]


def test_student_splits_codes_differently():
    tokenizer = student_tokenizer()
    assert code_tokens(tokenizer, "I21.4") == ["I", "2", "1", ".", "4"]
    assert len(teacher_tokenizer()) != len(tokenizer)


def test_gold_events_are_single_teacher_tokens(texts):
    tokenizer = teacher_tokenizer()
    for ex in task.generate_examples(30, 11, "train"):
        offsets = tokenizer(ex.text, return_offsets_mapping=True, add_special_tokens=False)[
            "offset_mapping"
        ]
        for event in ex.events:
            assert (event.start, event.end) in offsets


def test_shipped_tokenizers_are_what_the_build_command_makes():
    assert build_teacher_tokenizer().get_vocab() == teacher_tokenizer().get_vocab()
    assert build_student_tokenizer().get_vocab() == student_tokenizer().get_vocab()
