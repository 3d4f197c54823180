"""Building the task's tokenizers (deterministic, offline), both with character offsets.

* The **teacher** tokenizer is a byte-level BPE over the task's wording in which every ICD-10-CM
  code is exactly two tokens: its region (``I21``) and its within-region suffix (``.4``), both
  added tokens. A region decision and a within decision are therefore each one token.
* The **student** tokenizer is a different byte-level BPE that splits digits individually, so a
  code is several tokens (``I``, ``2``, ``1``, ``.``, ``4``). Distillation has to align the two
  through character spans.

Both are trained deterministically from the real ICD-10-CM wording; the shipped copies
under ``mistill_lens/assets`` are loaded by :mod:`mistill_lens.models.tokenizers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mistill_lens import task
from mistill_lens.models.tokenizers import STUDENT_DIR, TEACHER_DIR
from mistill_lens.task import icd

END_OF_TEXT = "<|endoftext|>"
TEACHER_TEXT_VOCAB = 2048
STUDENT_VOCAB = 1024


# The fixed wording recurs in every example, ICD descriptions only now and then: weight it so
# that BPE gives the trace's own words single tokens.
TEMPLATE_WEIGHT = 1000


def _task_wording() -> Iterator[str]:
    """Every phrase the generator can emit, codes excluded."""
    templates = (
        task.POSITIVE_TEMPLATES
        + task.NEGATED_TEMPLATES
        + task.FILLER_SENTENCES
        + (
            task.PROMPT_HEADER + task.CANDIDATES_HEADER + task.REASONING_HEADER + task.CODES_HEADER,
            task.TRACE_LINE,
        )
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
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, single_word=False) for t in regions + suffixes]
    )
    return _wrap(tokenizer)


def build_student_tokenizer() -> PreTrainedTokenizerFast:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    corpus = list(_task_wording()) + [f"{c}: " for c in _all_codes()]
    return _wrap(_byte_level_bpe(pre, STUDENT_VOCAB, iter(corpus)))


def build_and_save(out: Path) -> None:
    """Write both tokenizers under ``out`` (as ``teacher_tokenizer/`` and ``student_tokenizer/``)."""
    build_teacher_tokenizer().save_pretrained(out / TEACHER_DIR.name)
    build_student_tokenizer().save_pretrained(out / STUDENT_DIR.name)
