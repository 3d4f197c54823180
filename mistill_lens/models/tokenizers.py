"""The shipped tokenizers, loaded (no task code): both fast tokenizers with character offsets.

* The **teacher** tokenizer is a byte-level BPE over the task's wording in which every ICD-10-CM
  code is exactly two tokens: its region (``I21``) and its within-region suffix (``.4``).
* The **student** tokenizer is a different byte-level BPE that splits digits individually, so a
  code is several tokens. Distillation aligns the two through character spans.

They are built by :mod:`mistill_lens.task.build_tokenizers` (``mistill-lens build-tokenizers``)
and shipped under ``mistill_lens/assets``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).parent.parent / "assets"
TEACHER_DIR = ASSETS / "teacher_tokenizer"
STUDENT_DIR = ASSETS / "student_tokenizer"


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids as a model reads it: with the special tokens its tokenizer puts in
    front (Gemma's ``<bos>``, without which Gemma's loss on plain English rises from 2.4 to 6.6
    nats per token; none for SmolLM2 and the shipped tokenizers), exactly as the decision events
    are placed (:func:`mistill_lens.lens.events.events_from_spans` encodes the text the same way).
    An output that follows is encoded on its own, without special tokens."""
    return list(tokenizer(prompt)["input_ids"])


def teacher_tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(TEACHER_DIR)


def student_tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(STUDENT_DIR)
