"""Zero-shot candidate selection by a real pretrained chat model, as decision events.

A task example (a short clinical note and K real ICD-10-CM candidates ``code: description``) is
put to SmolLM2-135M-Instruct in its own chat template. The assistant turn is opened with a fixed
answer prefix, ``ANSWER_PREFIX``, so that the model's first tokens are the code it picks. The code
names the region first and the label inside it second: SmolLM2's tokenizer splits digits
(``" G44.86"`` is ``" G", "4", "4", ".", "8", "6"``), so the **region** event is the first token
where the written region and the strongest competing candidate region differ, and the **within**
event the first token where the written code and the strongest competing candidate of the same
region differ ("strongest": smallest margin at its departure token, read from the model's own
logits). Events are stored as character spans with their contrast text, so
:func:`mistill_lens.lens.events.events_from_spans` places them on the same departure tokens inside the
characterisation pipeline.

Why an answer prefix instead of a two-line ``Region: ... / Code: ...`` reply: the 135M model
does not follow that format (asked for it, it copies the format's placeholders or a demonstration's
code; see docs/pretrained.md), while after "The candidate code is" it writes a code.

Generation is greedy on the bridge's own logits. A plain transformers copy of the same weights,
when given, drafts the continuation with its KV cache and one bridge forward verifies every drafted
token (the bridge's KV cache is broken, ``mistill_lens.models.gguf``): the tokens are exactly the
bridge's greedy tokens, at the cost of about two forwards instead of one per new token.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mistill_lens import task
from mistill_lens.lens.events import events_from_spans
from mistill_lens.lens.examples import SpanEvent
from mistill_lens.lens.model_types import Tokenizer
from mistill_lens.models.bridge import to_bridge
from mistill_lens.models.generate import verified_greedy
from mistill_lens.models.gguf import chat_prompt_text, find_smollm2_gguf, load_gguf_hf_model
from mistill_lens.task.icd import region_of, suffix_of

SYSTEM_MESSAGE = "You are a clinical coder."
QUESTION = (
    "Which candidate code is the diagnosis in the note? Give its region (category), then the code."
)
ANSWER_PREFIX = "The candidate code is"
# The answer is the first code-shaped string right after the prefix (optionally quoted).
_ANSWER_RE = re.compile(r"^\s*[\"'`*]*(?P<code>[A-Z][0-9][0-9A-Z](?:\.[0-9A-Z]{1,4})?)")
# " G44.86" is 6 tokens for SmolLM2; 2 more show where the code ends and give null positions.
MAX_NEW_TOKENS = 8

# Task options and pipeline sizes for `characterize --model smollm2`: one condition per note and
# K = 8 keep the prompt near 210 tokens (its zero-shot replies are what is characterised).
SMOLLM2_TASK_DEFAULTS = {"k": 8, "max_mentions": 1}
SMOLLM2_DEFAULT_N = 2
# Reference replies give the means; at least this many, because a kind is only ablated where the
# reference has an event of that kind, and the model often writes a region without sibling candidates.
SMOLLM2_MIN_REFERENCE = 4


@dataclass(frozen=True)
class ZeroShotExample:
    """One prompt and the model's greedy reply, with the decisions in it as gold-style events
    (character spans into ``prompt + output``), ready for ``characterize``."""

    id: str
    prompt: str
    output: str
    gold_code: str
    candidates: tuple[str, ...]
    answer: str | None  # the code the model wrote, None if it wrote none
    events: tuple[SpanEvent, ...]

    @property
    def correct(self) -> bool:
        return self.answer == self.gold_code

    @property
    def region_correct(self) -> bool:
        return self.answer is not None and region_of(self.answer) == region_of(self.gold_code)


def note_and_candidate_lines(example: task.Example) -> tuple[str, str]:
    """The clinical note and the ``code: description`` lines of a task example's prompt."""
    prompt = example.prompt
    split = prompt.index(task.CANDIDATES_HEADER)
    note = prompt[len(task.PROMPT_HEADER) : split]
    lines = prompt[split + len(task.CANDIDATES_HEADER) : prompt.rindex(task.REASONING_HEADER)]
    return note, lines


def user_message(example: task.Example) -> str:
    note, lines = note_and_candidate_lines(example)
    return f"Clinical note: {note}\n\nCandidate ICD-10-CM codes:\n{lines}\n{QUESTION}"


def zero_shot_prompt(tokenizer: PreTrainedTokenizerBase, example: task.Example) -> str:
    """The chat-template text up to and including the answer prefix of the assistant turn."""
    if len(example.gold_codes) != 1:
        raise ValueError(
            f"zero-shot selection asks for one code; example {example.id} has {len(example.gold_codes)} "
            "(generate examples with max_mentions=1)"
        )
    return chat_prompt_text(tokenizer, user_message(example), SYSTEM_MESSAGE) + ANSWER_PREFIX


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The chat template writes its own special tokens; SmolLM2's tokenizer adds none, and this is
    # the same call events_from_spans makes, so positions agree with the pipeline's.
    return list(tokenizer(text)["input_ids"])


def parse_answer(output: str) -> tuple[str, int] | None:
    """The code the reply starts with and its character offset in ``output`` (None if none)."""
    match = _ANSWER_RE.match(output)
    return (match["code"], match.start("code")) if match else None


def _departure(
    tokenizer: Tokenizer,
    prompt: str,
    output: str,
    kind: str,
    start: int,
    chosen: str,
    contrast: str,
    region: str,
):
    """The pipeline's placement of one candidate event (None where chosen and contrast tokenize
    the same after the prefix)."""
    event = SpanEvent(kind, start, start + len(chosen), chosen, contrast, mention=0, region=region)
    try:
        encoded = events_from_spans(
            {"prompt": prompt, "output": output, "events": [event]}, tokenizer, 0
        )
    except ValueError:
        return None
    return event, encoded.events[0]


def strongest_contrast_event(
    tokenizer: Tokenizer,
    logits: Float[Tensor, "pos vocab"],
    prompt: str,
    output: str,
    kind: str,
    start: int,
    chosen: str,
    contrasts: Sequence[str],
    region: str = "",
) -> SpanEvent | None:
    """The event against the contrast with the smallest margin at its departure token."""
    scored = []
    for contrast in dict.fromkeys(c for c in contrasts if c != chosen):
        placed = _departure(tokenizer, prompt, output, kind, start, chosen, contrast, region)
        if placed is None:
            continue
        event, decision = placed
        at = logits[decision.predict_position]
        scored.append((float(at[decision.chosen_token] - at[decision.contrast_tokens[0]]), event))
    return min(scored, key=lambda pair: pair[0])[1] if scored else None


def code_events(
    tokenizer: Tokenizer,
    logits: Float[Tensor, "pos vocab"],
    prompt: str,
    output: str,
    start: int,
    code: str,
    candidates: Sequence[str],
) -> tuple[SpanEvent, ...]:
    """The decisions in writing `code` at character `start` of ``prompt + output``: its region
    (against the candidates' regions) and, for a code with a dot, its within-region part (against
    the region's other candidates), each against its strongest contrast."""
    region = region_of(code)
    events = [
        strongest_contrast_event(
            tokenizer,
            logits,
            prompt,
            output,
            "region",
            start,
            region,
            [region_of(c) for c in candidates],
            region,
        )
    ]
    if "." in code:
        rivals = [suffix_of(c) for c in candidates if region_of(c) == region and c != code]
        events.append(
            strongest_contrast_event(
                tokenizer,
                logits,
                prompt,
                output,
                "within",
                start + len(region),
                suffix_of(code),
                rivals,
                region,
            )
        )
    return tuple(e for e in events if e is not None)


def answer_events(
    tokenizer: Tokenizer,
    logits: Float[Tensor, "pos vocab"],
    prompt: str,
    output: str,
    candidates: Sequence[str],
) -> tuple[str | None, tuple[SpanEvent, ...]]:
    """The code the model wrote and its region / within events against the candidates."""
    parsed = parse_answer(output)
    if parsed is None:
        return None, ()
    code, offset = parsed
    return code, code_events(
        tokenizer, logits, prompt, output, len(prompt) + offset, code, candidates
    )


def zero_shot_example(
    bridge: TransformerBridge,
    tokenizer: PreTrainedTokenizerBase,
    example: task.Example,
    draft: PreTrainedModel | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> ZeroShotExample:
    """Prompt the model with one task example, decode greedily and place its decisions."""
    prompt = zero_shot_prompt(tokenizer, example)
    prompt_ids = torch.tensor([encode_text(tokenizer, prompt)])
    tokens, logits = verified_greedy(
        bridge, prompt_ids, max_new_tokens, [tokenizer.eos_token_id], draft
    )
    output = tokenizer.decode(tokens[0, prompt_ids.shape[1] :])
    answer, events = answer_events(tokenizer, logits, prompt, output, example.candidates)
    if encode_text(tokenizer, prompt + output) != tokens[0].tolist():
        # the decoded reply re-tokenizes differently: its events would sit on other tokens than
        # the model produced, so keep the answer (for accuracy) but no events
        events = ()
    return ZeroShotExample(
        example.id, prompt, output, example.gold_codes[0], example.candidates, answer, events
    )


def zero_shot_examples(
    bridge: TransformerBridge,
    tokenizer: Tokenizer,
    examples: Sequence[task.Example],
    draft: PreTrainedModel | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[ZeroShotExample]:
    return [zero_shot_example(bridge, tokenizer, e, draft, max_new_tokens) for e in examples]


def accuracy(examples: Sequence[ZeroShotExample]) -> dict[str, float | int]:
    n = len(examples)
    return {
        "n": n,
        "code_accuracy": sum(e.correct for e in examples) / n,
        "region_accuracy": sum(e.region_correct for e in examples) / n,
        "answered_a_candidate": sum(e.answer in e.candidates for e in examples) / n,
        "with_events": sum(bool(e.events) for e in examples),
    }


def load_smollm2_with_draft(gguf_path: str | Path | None = None):
    """``(bridge, tokenizer, draft)``: the bridged model and an unbridged copy of the same weights
    for drafting (bridging modifies the transformers model in place, so the copy is made first)."""
    path = Path(find_smollm2_gguf() if gguf_path is None else gguf_path)
    hf_model, tokenizer = load_gguf_hf_model(path)
    draft = copy.deepcopy(hf_model)
    return to_bridge(hf_model, tokenizer, name=path.stem), tokenizer, draft
