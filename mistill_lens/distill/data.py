"""Distillation data: the teacher's own greedy generations on training prompts.

Sequence-level distillation trains the student on what the teacher writes, not on the gold
reference. Gold decision events are defined on the reference output; a generated output keeps
the events of every trace line it reproduces exactly (shifted to where that line sits in the
generation), so every event is a decision the teacher made, with the task's own contrast.
Generations are cached in a JSONL file named by the teacher's weights, so runs share them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from mistill_lens import task
from mistill_lens.lens.fingerprint import (
    StaleResultWarning,
    check_fingerprint,
    read_fingerprint,
    write_fingerprint,
)
from mistill_lens.models.checkpoints import load_hf_model, weights_digest
from mistill_lens.models.generate import greedy_text
from mistill_lens.runs import file_digest
from mistill_lens.task.metrics import MAX_NEW_TOKENS


def _trace_lines(output: str) -> list[str]:
    return output.splitlines(keepends=True)


def generation_events(example: task.Example, generated: str) -> tuple[task.Event, ...]:
    """The gold events of `example` that hold in `generated`: those of each mention whose trace
    line appears, verbatim and as a whole line, in the generated output."""
    gold_lines = _trace_lines(example.output)
    line_starts = [sum(len(line) for line in gold_lines[:i]) for i in range(len(gold_lines))]
    generated_lines = _trace_lines(generated)
    generated_starts = {}
    offset = 0
    for line in generated_lines:
        generated_starts.setdefault(line, offset)
        offset += len(line)
    events = []
    for event in example.events:
        line = gold_lines[event.mention]
        if line not in generated_starts:
            continue
        shift = generated_starts[line] - line_starts[event.mention]
        events.append(replace(event, start=event.start + shift, end=event.end + shift))
    text = example.prompt + generated
    assert all(text[e.start : e.end] == e.chosen for e in events), (
        "shifted event spans must hold their text"
    )
    return tuple(events)


def as_generated(example: task.Example, generated: str) -> task.Example:
    """`example` with the teacher's output in place of the reference and the events that hold in it."""
    return replace(example, output=generated, events=generation_events(example, generated))


def teacher_generations(
    teacher_dir: str | Path,
    n: int,
    seed: int,
    split: str,
    task_config: dict,
    cache_dir: str | Path,
    progress: bool = True,
) -> list[task.Example]:
    """The first `n` examples of (seed, split) with the teacher's greedy outputs (cached)."""
    config_key = json.dumps({"n": n, "seed": seed, "split": split, **task_config}, sort_keys=True)
    key = hashlib.sha256(config_key.encode()).hexdigest()[:8]
    path = Path(cache_dir) / f"generations-{weights_digest(teacher_dir)}-{split}-{key}.jsonl"
    if path.is_file():
        try:
            check_fingerprint(
                read_fingerprint(path), _cache_fingerprint(path, n), f"generations cache {path}"
            )
            return task.read_jsonl(path)
        except (
            ValueError
        ) as err:  # stale (a StaleResultError), truncated or unreadable: ours to redo
            warnings.warn(f"{err}: regenerated", StaleResultWarning, stacklevel=2)
    model, tokenizer = load_hf_model(teacher_dir)
    examples = task.generate_examples(n, seed, split, **task_config)
    generated = [
        as_generated(example, greedy_text(model, tokenizer, example.prompt, MAX_NEW_TOKENS))
        for example in tqdm(
            examples, desc="teacher generations", disable=not progress, file=sys.stderr
        )
    ]
    task.write_jsonl(generated, path)
    write_fingerprint(path, _cache_fingerprint(path, n))
    return generated


def _cache_fingerprint(path: Path, n: int) -> dict[str, str]:
    """The cache file as it is: examples asked for, lines held, and its bytes' digest (the file
    name already names the teacher's weights and the example options). Stored when written,
    compared when read, so a truncated or edited cache is detected."""
    with path.open("rb") as f:
        lines = sum(1 for line in f if line.strip())
    return {"examples": str(n), "lines": str(lines), "sha256": file_digest(path)}
