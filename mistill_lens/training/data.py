"""The training data: task examples encoded as token ids, the output as the targets (and the
decision-event tokens, for a weighted loss), in batches.

Examples stream from the task generator: example ``i`` of a run is a function of the seed and
``i`` alone, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from transformers import PreTrainedTokenizerFast

from mistill_lens import task
from mistill_lens.models.tokenizers import prompt_token_ids
from mistill_lens.training.config import TrainConfig


def encode(
    tokenizer: PreTrainedTokenizerFast, prompt: str, output: str
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + output + end-of-text, and which of them are training targets.

    The prompt is encoded on its own, exactly as it is at generation time.
    """
    prompt_ids = prompt_token_ids(tokenizer, prompt)
    output_ids = tokenizer(output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + output_ids, [False] * len(prompt_ids) + [True] * len(output_ids)


def event_token_mask(tokenizer: PreTrainedTokenizerFast, example: task.Example) -> list[bool]:
    """Which positions of ``encode(tokenizer, example.prompt, example.output)`` hold a gold decision."""
    n_prompt = len(prompt_token_ids(tokenizer, example.prompt))
    offsets = tokenizer(example.output, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    spans = [(e.start - len(example.prompt), e.end - len(example.prompt)) for e in example.events]
    in_event = [
        any(start < end_ and end > start_ for start_, end_ in spans) for start, end in offsets
    ]
    return [False] * n_prompt + in_event + [False]


EncodedExample = tuple[list[int], list[bool], list[bool] | None]


def encode_example(
    tokenizer: PreTrainedTokenizerFast, example: task.Example, with_events: bool
) -> EncodedExample:
    """``encode`` of the example, and (``with_events``) its decision-event mask."""
    ids, targets = encode(tokenizer, example.prompt, example.output)
    return ids, targets, event_token_mask(tokenizer, example) if with_events else None


# Set in each data worker before its first batch (fork start: inherited, never pickled).
_WORKER_JOB: tuple | None = None


def training_example(config: TrainConfig, index: int) -> task.Example:
    """Example `index` of the run's training stream (a function of the seed and the index)."""
    return task.example_at(
        config.seed,
        "train",
        index,
        universe_size=config.universe_size,
        k=config.k,
        max_mentions=config.max_mentions,
    )


def _encode_batch(indices: range) -> list[EncodedExample]:
    config, tokenizer = _WORKER_JOB
    return [
        encode_example(tokenizer, training_example(config, i), config.event_weight != 1.0)
        for i in indices
    ]


def training_batches(
    config: TrainConfig, tokenizer: PreTrainedTokenizerFast, start_step: int, workers: int = 0
):
    """The encoded batches of steps ``start_step .. config.steps - 1``, in order. Batch ``s`` holds
    examples ``s * batch_size ..`` of the training stream whatever ``workers`` is: with workers,
    a few batches are made ahead in other processes while the model trains on the current one."""
    global _WORKER_JOB
    _WORKER_JOB = (config, tokenizer)
    steps = range(start_step, config.steps)
    batch = config.batch_size

    def indices(step: int) -> range:
        return range(step * batch, (step + 1) * batch)

    if workers == 0:
        for step in steps:
            yield _encode_batch(indices(step))
        return
    import multiprocessing

    ahead = 4 * workers
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pending = [pool.apply_async(_encode_batch, (indices(s),)) for s in steps[:ahead]]
        for n, step in enumerate(steps):
            if n + ahead < len(steps):
                pending.append(pool.apply_async(_encode_batch, (indices(steps[n + ahead]),)))
            yield pending[n].get()
            pending[n] = None  # done with: let it be freed


def collate(
    encoded: list[tuple[list[int], list[bool]]], pad_id: int
) -> tuple[
    Int[torch.Tensor, "batch pos"], Bool[torch.Tensor, "batch pos"], Bool[torch.Tensor, "batch pos"]
]:
    """Right-padded ids, attention mask, and target mask."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.bool)
    targets = torch.zeros((len(encoded), width), dtype=torch.bool)
    for row, (token_ids, target) in enumerate(encoded):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        attention[row, : len(token_ids)] = True
        targets[row, : len(target)] = torch.tensor(target)
    return ids, attention, targets
