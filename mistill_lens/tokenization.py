"""Offline, Hugging Face-compatible tokenizers for the coding task, both with character offsets.

* The **teacher** tokenizer is a byte-level BPE over the task's wording in which every ICD-10-CM
  code is exactly two tokens: its region (``I21``) and its within-region suffix (``.4``), both
  added tokens. A region decision and a within decision are therefore each one token.
* The **student** tokenizer is a different byte-level BPE that splits digits individually, so a
  code is several tokens (``I``, ``2``, ``1``, ``.``, ``4``). Distillation has to align the two
  through character spans.

Both are trained deterministically from the real ICD-10-CM wording and shipped under
``mistill_lens/assets``; ``mistill-lens build-tokenizers`` rebuilds them.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mistill_lens import icd, task

ASSETS = Path(__file__).parent / "assets"
TEACHER_DIR = ASSETS / "teacher_tokenizer"
STUDENT_DIR = ASSETS / "student_tokenizer"
END_OF_TEXT = "<|endoftext|>"
TEACHER_TEXT_VOCAB = 2048
STUDENT_VOCAB = 1024


# The fixed wording recurs in every example, ICD descriptions only now and then: weight it so
# that BPE gives the trace's own words single tokens.
TEMPLATE_WEIGHT = 1000


def _task_wording() -> Iterator[str]:
    """Every phrase the generator can emit, codes excluded."""
    templates = (
        task.POSITIVE_TEMPLATES + task.NEGATED_TEMPLATES + task.FILLER_SENTENCES
        + (task.PROMPT_HEADER + task.CANDIDATES_HEADER + task.REASONING_HEADER + task.CODES_HEADER, task.TRACE_LINE)
        + tuple(task.REJECTION_REASONS.values())
    )
    for _ in range(TEMPLATE_WEIGHT):
        yield from templates
    for codes in icd.eligible_codes_by_region().values():
        for code in codes:
            yield task.mention_wording(icd.cm.get_description(code))


def _all_codes() -> list[str]:
    return [c for codes in icd.eligible_codes_by_region().values() for c in codes]


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(pre_tokenizer, vocab_size: int, corpus: Iterator[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def build_teacher_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = _byte_level_bpe(
        pre_tokenizers.ByteLevel(add_prefix_space=False), TEACHER_TEXT_VOCAB, _task_wording()
    )
    codes = _all_codes()
    regions = sorted({icd.region_of(c) for c in codes})
    suffixes = sorted({icd.suffix_of(c) for c in codes})
    # normalized=False: matched on the raw text, before byte-level mapping.
    tokenizer.add_tokens([AddedToken(t, normalized=False, single_word=False) for t in regions + suffixes])
    return _wrap(tokenizer)


def build_student_tokenizer() -> PreTrainedTokenizerFast:
    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    corpus = list(_task_wording()) + [f"{c}: " for c in _all_codes()]
    return _wrap(_byte_level_bpe(pre, STUDENT_VOCAB, iter(corpus)))


def build_and_save(out: Path = ASSETS) -> None:
    build_teacher_tokenizer().save_pretrained(out / TEACHER_DIR.name)
    build_student_tokenizer().save_pretrained(out / STUDENT_DIR.name)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def teacher_tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(TEACHER_DIR)


def student_tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(STUDENT_DIR)


def code_tokens(tokenizer: PreTrainedTokenizerFast, code: str) -> list[str]:
    """How ``tokenizer`` splits a code written after a space, as it is in the trace."""
    ids = tokenizer(" " + code, add_special_tokens=False)["input_ids"]
    return [t for t in tokenizer.convert_ids_to_tokens(ids) if t != "Ġ"]
