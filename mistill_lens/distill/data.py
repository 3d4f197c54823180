"""Distillation data: the gold traces the teacher reproduces verbatim.

Sequence-level distillation trains the student on what the teacher writes. Where the teacher's
greedy output equals the gold trace, the two are one text, and that is decided by a single
teacher-forced forward: the teacher's argmax at every output position (end-of-text included)
equals the gold token. Every event of such an example is a decision the teacher made, with the
task's own contrast, and no decoding is needed (one forward per example instead of one per
output token). Examples the teacher gets wrong anywhere are left out, and how many is recorded.
The kept examples are cached in a JSONL file named by the teacher's weights, so runs share them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mistill_lens import task
from mistill_lens.lens.fingerprint import (
    StaleResultWarning,
    check_fingerprint,
    read_fingerprint,
    write_fingerprint,
)
from mistill_lens.lens.model_types import Tokenizer
from mistill_lens.models.checkpoints import load_hf_model, weights_digest
from mistill_lens.runs import file_digest
from mistill_lens.training.data import encode
from mistill_lens.training.loop import target_logits


@torch.no_grad()
def reproduces_verbatim(model, tokenizer: Tokenizer, example: task.Example) -> bool:
    """Whether greedy decoding of `model` on ``example.prompt`` writes exactly ``example.output``
    and stops: its teacher-forced argmax equals the gold token at every output position. The
    unembedding runs only at those positions."""
    ids, targets = encode(tokenizer, example.prompt, example.output)
    logits, gold = target_logits(model, torch.tensor([ids]), torch.tensor([targets]))
    return bool((logits.argmax(dim=-1) == gold).all())


def teacher_traces(
    teacher_dir: str | Path,
    n: int,
    seed: int,
    split: str,
    task_config: dict,
    cache_dir: str | Path,
    progress: bool = True,
) -> tuple[list[task.Example], int]:
    """Of the first `n` examples of (seed, split), those whose gold trace the teacher reproduces
    verbatim (cached), and `n` (how many were tried)."""
    config_key = json.dumps({"n": n, "seed": seed, "split": split, **task_config}, sort_keys=True)
    key = hashlib.sha256(config_key.encode()).hexdigest()[:8]
    path = Path(cache_dir) / f"verbatim-{weights_digest(teacher_dir)}-{split}-{key}.jsonl"
    if path.is_file():
        try:
            check_fingerprint(
                read_fingerprint(path), _cache_fingerprint(path, n), f"verbatim traces cache {path}"
            )
            return task.read_jsonl(path), n
        except (
            ValueError
        ) as err:  # stale (a StaleResultError), truncated or unreadable: ours to redo
            warnings.warn(f"{err}: redone", StaleResultWarning, stacklevel=2)
    model, tokenizer = load_hf_model(teacher_dir, progress=progress)
    examples = task.generate_examples(n, seed, split, **task_config)
    kept = [
        example
        for example in tqdm(examples, desc="teacher traces", disable=not progress, file=sys.stderr)
        if reproduces_verbatim(model, tokenizer, example)
    ]
    if not kept:
        raise ValueError(
            f"the teacher reproduces none of the {n} gold traces verbatim: it cannot do this task "
            "(check the teacher and the task options, K and max_mentions)"
        )
    task.write_jsonl(kept, path)
    write_fingerprint(path, _cache_fingerprint(path, n))
    return kept, n


def _cache_fingerprint(path: Path, n: int) -> dict[str, str]:
    """The cache file as it is: examples tried, lines held, and its bytes' digest (the file name
    already names the teacher's weights and the example options). Stored when written, compared
    when read, so a truncated or edited cache is detected."""
    with path.open("rb") as f:
        lines = sum(1 for line in f if line.strip())
    return {"examples": str(n), "lines": str(lines), "sha256": file_digest(path)}
