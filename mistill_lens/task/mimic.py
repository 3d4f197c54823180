"""MIMIC-IV discharge notes as coding examples in the task's format, for a credentialed user's copy.

Reads the real layout: MIMIC-IV-Note ``note/discharge.csv.gz`` (``note_id, subject_id, hadm_id,
note_type, note_seq, charttime, storetime, text``) joined on ``hadm_id`` with MIMIC-IV
``hosp/diagnoses_icd.csv.gz`` (``subject_id, hadm_id, seq_num, icd_code, icd_version``; codes are
stored without the dot). Only ICD-10 diagnoses are kept. Splits are by patient (``subject_id``),
so no patient is in two splits; the candidate universe is the ICD-10 codes of a split (or its
``top_n`` most frequent). Prompts follow the synthetic task's format (summary, candidate lines,
reasoning header); there is no gold trace, so decision events come from the model's own
generation (:func:`generation_examples`), placed as the zero-shot path places them. Nothing here
ships or downloads MIMIC data.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd
import simple_icd_10_cm as cm
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.examples import SpanEvent, SpanExample
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.models.generate import greedy_text
from mistill_lens.task.examples import (
    CANDIDATES_HEADER,
    PROMPT_HEADER,
    REASONING_HEADER,
)
from mistill_lens.task.zero_shot import code_events

NOTES = Path("note") / "discharge.csv.gz"
DIAGNOSES = Path("hosp") / "diagnoses_icd.csv.gz"
NOTE_COLUMNS = (
    "note_id",
    "subject_id",
    "hadm_id",
    "note_type",
    "note_seq",
    "charttime",
    "storetime",
    "text",
)
DIAGNOSIS_COLUMNS = ("subject_id", "hadm_id", "seq_num", "icd_code", "icd_version")
SPLIT_FRACTIONS = {"train": 0.8, "validation": 0.1, "heldout": 0.1}
CODE_PATTERN = re.compile(r"\b[A-Z]\d[0-9A-Z](?:\.[0-9A-Z]{1,4})?\b")


@dataclass(frozen=True)
class Admission:
    hadm_id: int
    subject_id: int
    note: str  # the admission's discharge note(s), in note_seq order
    codes: tuple[str, ...]  # its ICD-10 diagnoses, dotted, in seq_num order


@dataclass(frozen=True)
class MimicExample:
    id: str
    prompt: str
    gold_codes: tuple[str, ...]  # the admission's codes among the candidates
    candidates: tuple[str, ...]


def dotted(code: str) -> str:
    """MIMIC stores ``I214``; ICD-10-CM writes ``I21.4`` (the dot after the category)."""
    code = str(code).strip().upper()
    return code if len(code) <= 3 else f"{code[:3]}.{code[3:]}"


def read_admissions(root: str | Path, limit: int | None = None) -> list[Admission]:
    """Admissions that have a discharge note and at least one ICD-10 diagnosis, from a MIMIC-IV
    copy at `root` (holding ``note/discharge.csv.gz`` and ``hosp/diagnoses_icd.csv.gz``)."""
    root = Path(root)
    notes = _read(root / NOTES, NOTE_COLUMNS, usecols=["subject_id", "hadm_id", "note_seq", "text"])
    diagnoses = _read(root / DIAGNOSES, DIAGNOSIS_COLUMNS)
    _require_values(root / NOTES, notes, ["subject_id", "hadm_id", "note_seq"], numeric=True)
    _require_values(root / DIAGNOSES, diagnoses, ["subject_id", "hadm_id", "seq_num"], numeric=True)
    _require_values(root / DIAGNOSES, diagnoses, ["icd_version"], numeric=True)
    _require_values(root / DIAGNOSES, diagnoses, ["icd_code"], numeric=False)
    for frame, columns in (
        (notes, ["subject_id", "hadm_id", "note_seq"]),
        (diagnoses, ["subject_id", "hadm_id", "seq_num", "icd_version"]),
    ):
        frame[columns] = frame[columns].astype(int)  # checked above: numbers sort as numbers
    notes = notes[notes.text.str.strip() != ""]  # an empty note says nothing to code from
    diagnoses = diagnoses[diagnoses.icd_version.astype(int) == 10]
    codes = {
        int(hadm): tuple(dict.fromkeys(dotted(c) for c in rows.sort_values("seq_num").icd_code))
        for hadm, rows in diagnoses.groupby("hadm_id")
    }
    admissions = []
    for hadm, rows in notes.groupby("hadm_id", sort=True):
        if int(hadm) not in codes:
            continue
        rows = rows.sort_values("note_seq")
        admissions.append(
            Admission(
                int(hadm),
                int(rows.subject_id.iloc[0]),
                "\n".join(str(t).strip() for t in rows.text),
                codes[int(hadm)],
            )
        )
        if limit is not None and len(admissions) >= limit:
            break
    if not admissions:
        raise ValueError(
            f"no admission in {root} has both a discharge note and an ICD-10 diagnosis"
        )
    return admissions


def _read(path: Path, columns: Sequence[str], usecols: Sequence[str] | None = None) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: point `root` at your MIMIC-IV copy, the folder holding "
            f"{NOTES} (MIMIC-IV-Note) and {DIAGNOSES} (MIMIC-IV hosp)"
        )
    try:
        header = list(pd.read_csv(path, nrows=0).columns)
    except (pd.errors.EmptyDataError, UnicodeDecodeError, OSError, EOFError) as err:
        raise ValueError(
            f"{path} is empty or not a readable CSV ({err}): replace it with the file from your "
            "MIMIC-IV copy"
        ) from None
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{path} lacks the MIMIC-IV columns {missing} (it has {header})")
    # Everything as text, no missing-value guessing: an empty note must stay "" and a code "NA"
    # must never become the float NaN (read back as the string "nan" / code "NAN").
    return pd.read_csv(
        path, usecols=list(usecols or columns), dtype=str, keep_default_na=False, na_filter=False
    )


def _require_values(path: Path, frame: pd.DataFrame, columns: Sequence[str], numeric: bool) -> None:
    """Every row holds a value (an integer where `numeric`) in `columns`; else a ValueError naming
    the file, the data row (1 = the first after the header), the column and the value."""
    for column in columns:
        values = frame[column].str.strip()
        bad = values == "" if not numeric else ~values.str.fullmatch(r"-?\d+")
        if bad.any():
            row = int(bad.to_numpy().nonzero()[0][0])
            raise ValueError(
                f"{path}, data row {row + 1}: column {column} holds {frame[column].iloc[row]!r}, "
                f"not {'an integer' if numeric else 'a value'} ({int(bad.sum())} such rows): "
                "check the file against your MIMIC-IV copy"
            )


def split_of(admission: Admission, seed: int = 0) -> str:
    """The admission's split, a deterministic function of its patient and `seed` (80/10/10)."""
    digest = hashlib.sha256(f"{seed}:{admission.subject_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    for split, fraction in SPLIT_FRACTIONS.items():
        if u < fraction:
            return split
        u -= fraction
    return "heldout"


def candidate_universe(admissions: Iterable[Admission], top_n: int | None = None) -> list[str]:
    """The ICD-10 codes of `admissions`, most frequent first (ties by code); the `top_n` first."""
    counts = Counter(code for a in admissions for code in a.codes)
    ranked = sorted(counts, key=lambda code: (-counts[code], code))
    return ranked[:top_n] if top_n is not None else ranked


def description(code: str) -> str:
    """The ICD-10-CM description of `code`, or the code itself where the table lacks it."""
    return cm.get_description(code) if cm.is_valid_item(code) else code


def mimic_examples(
    admissions: Iterable[Admission], candidates: Sequence[str], max_note_chars: int | None = None
) -> list[MimicExample]:
    """One example per admission with at least one code among `candidates`: the note as the
    summary, every candidate as a line ``CODE: description``, then the reasoning header."""
    lines = "".join(f"{code}: {description(code)}\n" for code in candidates)
    allowed = set(candidates)
    examples = []
    for admission in admissions:
        gold = tuple(c for c in admission.codes if c in allowed)
        if not gold:
            continue
        note = admission.note[:max_note_chars] if max_note_chars else admission.note
        examples.append(
            MimicExample(
                id=f"mimic-{admission.hadm_id}",
                prompt=PROMPT_HEADER + note + CANDIDATES_HEADER + lines + REASONING_HEADER,
                gold_codes=gold,
                candidates=tuple(candidates),
            )
        )
    return examples


def written_code_events(
    tokenizer: Tokenizer,
    logits: Float[Tensor, "pos vocab"],
    prompt: str,
    output: str,
    candidates: Sequence[str],
) -> tuple[SpanEvent, ...]:
    """For every candidate code the model wrote in `output`: its category decision (``region``,
    against the other candidates' categories) and its part after the dot (``within``, against
    the same category's other candidates), each against the contrast it preferred least
    (the smallest margin), placed where the pipeline places it."""
    allowed = set(candidates)
    return tuple(
        event
        for match in CODE_PATTERN.finditer(output)
        if match.group(0) in allowed
        for event in code_events(
            tokenizer,
            logits,
            prompt,
            output,
            len(prompt) + match.start(),
            match.group(0),
            candidates,
        )
    )


@torch.no_grad()
def generation_examples(
    model: HookedModel,
    tokenizer: Tokenizer,
    examples: Sequence[MimicExample],
    max_new_tokens: int = 128,
) -> list[SpanExample]:
    """The model's own greedy output per example, with the decisions it made there as events:
    examples for :func:`mistill_lens.lens.characterize.characterize`."""
    out = []
    for example in examples:
        output = greedy_text(model, tokenizer, example.prompt, max_new_tokens)
        tokens = list(tokenizer(example.prompt + output)["input_ids"])
        logits = model(torch.tensor([tokens]))[0]
        events = written_code_events(tokenizer, logits, example.prompt, output, example.candidates)
        out.append(SpanExample(example.prompt, output, events, example.id))
    return out
