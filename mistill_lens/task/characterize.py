"""The ICD task's characterisation: its examples (one seed rule) and its readers plugged into the
task-free pipeline (:func:`mistill_lens.lens.characterize.characterize`).

The task supplies what the lens cannot know: which event kind is read out early (the region) and
where the near-miss was named (the mention's near-miss code). Every ICD path (the
``characterize`` command, SmolLM2 zero-shot, the teacher's circuits and each student's in
distillation) goes through :func:`characterize_task`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from mistill_lens.lens.characterize import Characterization, CharacterizeConfig, characterize
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.task.examples import Example, generate_examples, near_miss_named

ELICITATION_KIND = "region"  # the ICD decision read out before it is written


def task_examples(
    n: int, seed: int, split: str, task_config: Mapping[str, Any], n_reference: int | None = None
) -> tuple[list[Example], list[Example]]:
    """Analysed examples (stream `seed`) and reference examples for the means (stream `seed + 1`,
    so no example is reused), from one split: the one seed rule of every ICD characterisation."""
    examples = generate_examples(n, seed, split, **task_config)
    reference = generate_examples(
        n if n_reference is None else n_reference, seed + 1, split, **task_config
    )
    return examples, reference


def longest_example(examples: Sequence[Example], tokenizer: Tokenizer) -> int:
    """Tokens of the longest example (prompt and output, as the characterisation reads them;
    tokenized alone: placing every event and rival would cost minutes at n = 150)."""
    return max(len(tokenizer(e.prompt + e.output)["input_ids"]) for e in examples)


def largest_fitting_k(
    n_ctx: int, tokenizer: Tokenizer, n: int, seed: int, split: str, task_config: Mapping[str, Any]
) -> int | None:
    """The largest K at which the first `n` examples of (seed, split) fit `n_ctx` tokens (the
    options in `task_config` otherwise unchanged); None when not even the smallest K fits."""
    low = 3 * task_config["max_mentions"] + 1  # the smallest K the examples allow

    def fits(k: int) -> bool:
        examples = generate_examples(n, seed, split, **{**task_config, "k": k})
        return longest_example(examples, tokenizer) <= n_ctx

    if not fits(low):
        return None
    high = task_config["k"]  # known not to fit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def characterize_task(
    model: HookedModel,
    tokenizer: Tokenizer,
    examples: Sequence[Any],
    reference: Sequence[Any],
    config: CharacterizeConfig | None = None,
    *,
    sweep_dir: str | Path | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Characterization:
    """:func:`characterize` with the ICD task's readers: region elicitation and the near-miss
    family (from each example's mentions, where it has them)."""
    return characterize(
        model,
        tokenizer,
        examples,
        reference,
        replace(config or CharacterizeConfig(), elicitation_kind=ELICITATION_KIND),
        sweep_dir=sweep_dir,
        near_miss_text=near_miss_named,
        provenance=provenance,
    )
