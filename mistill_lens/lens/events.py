"""Decision events: their types, their encoding on a tokenizer, and their batches.

A decision event is one token of the model's own tokenization where it picks between a chosen
token and a competing token of the same kind. Events are built (a) from the task's gold character
spans through any fast tokenizer's offsets, or (b) from the model's own greedy generation.

Every intervention runs on an `EventBatch`: one row per event, holding that event's context up to
the position that predicts the event token. One event per row keeps effects independent (an
ablation at one event's position can never leak into another event's margin) and lets one
backward pass give every event its own gradient. The events' margins are computed in
:mod:`mistill_lens.lens.margins`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from mistill_lens.lens.model_types import HookedModel, Tokenizer

NULL_KIND = (
    "null"  # the kind of null events (calibration); event kinds are otherwise the data's own
)


def position_class_names(kinds: Sequence[str]) -> tuple[str, ...]:
    """Canonical position classes of a set of event kinds: the kinds sorted, then the null class.
    The same kinds give the same classes in any order, so means and interventions agree."""
    return (*sorted(set(kinds) - {NULL_KIND}), NULL_KIND)


@dataclass(frozen=True)
class Rival:
    """One text that could stand where an event's chosen text stands, placed on a tokenizer: the
    chosen side departs from it at token `position`, where the chosen side has `chosen_token` and
    the rival `contrast_token`."""

    position: int
    chosen_token: int
    contrast_token: int
    contrast: str


@dataclass(frozen=True)
class DecisionEvent:
    """One decision: at token `position` the model emits `chosen_token` instead of the contrast.

    `position` indexes the decided token in the example's tokens; the logits that decide it sit at
    `predict_position` (the position before). `region` (optional) is text whose occurrences in the
    prompt are this decision's candidate region (for the ICD task, "I21" for every decision about
    an I21 code), used to find that region's candidate-list entries; `mention` (optional, -1 when
    absent) lets a task find what the event refers to.

    `rivals` is None for an event scored against its listed contrast. When the data names the
    event's rivals, they are kept here, each placed on the tokenizer, and the event's own fields hold
    the listed contrast until a model's clean run picks the strongest rival
    (:func:`mistill_lens.lens.contrasts.freeze_contrasts`); an empty tuple is an event with no rival
    of its own, left out when contrasts are the model's.
    """

    example_id: int
    kind: str
    position: int
    chosen_token: int
    contrast_tokens: tuple[int, ...]
    chosen: str = ""
    contrast: str = ""
    char_start: int = -1
    char_end: int = -1
    mention: int = -1
    region: str = ""
    rivals: tuple[Rival, ...] | None = None

    @property
    def predict_position(self) -> int:
        return self.position - 1


@dataclass
class EncodedExample:
    """An example in the model's own tokenization, with its events."""

    example_id: int
    text: str
    prompt_chars: int
    tokens: list[int]
    offsets: list[tuple[int, int]]
    events: list[DecisionEvent] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """Number of tokens that lie entirely inside the prompt."""
        return sum(1 for _, end in self.offsets if end <= self.prompt_chars)

    def token_positions_of_chars(self, start: int, end: int) -> list[int]:
        """Token indices whose character span overlaps [start, end)."""
        return [i for i, (s, e) in enumerate(self.offsets) if s < end and e > start]


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def _encode(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = tokenizer(text, return_offsets_mapping=True)
    return list(encoding["input_ids"]), [tuple(o) for o in encoding["offset_mapping"]]


def _departure_token(
    chosen_ids: Sequence[int], contrast_ids: Sequence[int], chosen: str, contrast: str
) -> tuple[int, int]:
    """Index of the first token where `prefix + chosen` and `prefix + contrast` (their tokens
    given) differ, and the contrast token there. Why this way: it is where the model decides, in
    any tokenizer (a region that is one token for the teacher may be three for a student, and only
    the last of them may differ)."""
    for index, (a, b) in enumerate(zip(chosen_ids, contrast_ids)):
        if a != b:
            return index, b
    raise ValueError(
        f"chosen {chosen!r} and contrast {contrast!r} tokenize identically after the prefix: no decision to score"
    )


def _optional(obj: Any, name: str, default: Any) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def events_from_spans(example: Any, tokenizer: Tokenizer, example_id: int) -> EncodedExample:
    """Place an example's gold events (character spans into `prompt + output`) on `tokenizer`'s tokens.

    `example` has `prompt`, `output` and `events`, as dicts or attributes. Each event has `kind`
    (any name: kinds are data), `start`, `end` (its span in ``prompt + output``), `chosen` (the
    text of that span) and `contrast` (the competing text at the same place), and optionally
    `mention` (an index the task uses to find what the event refers to; default -1) and `region`
    (text whose occurrences in the prompt are the decision's candidate region, for head
    families; default "").
    """
    prompt, output = _field(example, "prompt"), _field(example, "output")
    text = prompt + output
    tokens, offsets = _encode(tokenizer, text)
    gold_events = list(_field(example, "events"))
    events = []
    for gold in gold_events:
        kind, start, end = _field(gold, "kind"), _field(gold, "start"), _field(gold, "end")
        chosen, contrast = _field(gold, "chosen"), _field(gold, "contrast")
        if not isinstance(kind, str) or not kind or kind == NULL_KIND:
            raise ValueError(
                f"event kind must be a non-empty name other than {NULL_KIND!r}, got {kind!r}"
            )
        if not (0 <= start < end <= len(text)) or text[start:end] != chosen:
            raise ValueError(
                f"event span [{start}, {end}) does not hold its chosen text {chosen!r} in example {example_id}"
            )
        chosen_ids, contrast_ids = _prefixed_ids(tokenizer, text[:start], [chosen, contrast])
        listed = _rival(text, tokens, start, chosen, contrast, example_id, chosen_ids, contrast_ids)
        named = _optional(gold, "rivals", None)
        events.append(
            DecisionEvent(
                example_id=example_id,
                kind=kind,
                position=listed.position,
                chosen_token=listed.chosen_token,
                contrast_tokens=(listed.contrast_token,),
                chosen=chosen,
                contrast=contrast,
                char_start=start,
                char_end=end,
                mention=int(_optional(gold, "mention", -1)),
                region=str(_optional(gold, "region", "")),
                rivals=None
                if named is None
                else _rivals(tokenizer, text, tokens, start, chosen, named, example_id, chosen_ids),
            )
        )
    return EncodedExample(example_id, text, len(prompt), tokens, offsets, events)


def _rival(
    text: str,
    tokens: list[int],
    start: int,
    chosen: str,
    contrast: str,
    example_id: int,
    chosen_ids: list[int],
    contrast_ids: list[int],
) -> Rival:
    """`contrast` placed against `chosen` at character `start` (`chosen_ids` / `contrast_ids`:
    the tokens of `text[:start]` followed by each): a ValueError where no token can decide between
    them (the same tokens, a merge across the span's boundary, the first token)."""
    index, contrast_token = _departure_token(chosen_ids, contrast_ids, chosen, contrast)
    if tokens[: index + 1] != chosen_ids[: index + 1]:
        raise ValueError(
            f"event {chosen!r} at char {start} does not tokenize the same inside the full text "
            f"of example {example_id} (a merge across the span boundary)"
        )
    if index == 0:
        raise ValueError(
            f"event {chosen!r} is the first token of example {example_id}: nothing predicts it"
        )
    return Rival(index, chosen_ids[index], contrast_token, contrast)


def _prefixed_ids(tokenizer: Tokenizer, prefix: str, endings: Sequence[str]) -> list[list[int]]:
    """The tokens of `prefix + ending` for each ending, in one batched call (an event's prefix
    is thousands of characters and the ICD task names ~20 rivals per region event)."""
    if not endings:
        return []
    return [list(ids) for ids in tokenizer([prefix + e for e in endings])["input_ids"]]


def _rivals(
    tokenizer: Tokenizer,
    text: str,
    tokens: list[int],
    start: int,
    chosen: str,
    named: Sequence[str],
    example_id: int,
    chosen_ids: list[int],
) -> tuple[Rival, ...]:
    """The named rivals that a token can decide against on this tokenizer, one per (position,
    token). A rival that cannot be told apart at any token of the chosen span (".1" against ".11":
    the difference lies after the span) is left out; when every named rival is, that is an error."""
    if isinstance(named, str) or not all(isinstance(r, str) for r in named):
        raise ValueError(f"rivals must be a list of texts, got {named!r}")
    placed: dict[tuple[int, int], Rival] = {}
    if chosen in named:
        raise ValueError(f"rival {chosen!r} is the event's chosen text")
    for contrast, contrast_ids in zip(named, _prefixed_ids(tokenizer, text[:start], named)):
        try:
            rival = _rival(
                text, tokens, start, chosen, contrast, example_id, chosen_ids, contrast_ids
            )
        except ValueError:
            continue
        placed.setdefault((rival.position, rival.contrast_token), rival)
    if named and not placed:
        raise ValueError(
            f"none of the rivals {list(named)} of event {chosen!r} at char {start} of example "
            f"{example_id} can be told apart from it at a token of its span"
        )
    return tuple(placed.values())


def candidate_token_ids(tokenizer: Tokenizer, pattern: str) -> list[int]:
    """Ids of the vocabulary tokens whose decoded text fully matches `pattern` (e.g. r"[A-Z]\\d\\d")."""
    compiled = re.compile(pattern)
    return sorted(
        token_id
        for token_id in range(len(tokenizer))
        if compiled.fullmatch(tokenizer.decode([token_id]).strip())
    )


@torch.no_grad()
def events_from_generation(
    model: HookedModel,
    tokenizer: Tokenizer,
    prompt: str,
    output: str,
    locate: Callable[[str], Iterable[tuple[str, int, int]]],
    candidates: Mapping[str, Sequence[int]],
    example_id: int,
) -> EncodedExample:
    """The decisions the model actually makes in its own generated `output`.

    `locate(output)` yields `(kind, start, end)` character spans of decisions inside `output`
    (e.g. from a code regex). The event token is the first token in the span whose id is in
    `candidates[kind]`; its contrast is the best competing candidate of the same kind at the
    predicting position.
    """
    text = prompt + output
    tokens, offsets = _encode(tokenizer, text)
    logits = model(torch.tensor([tokens]))[0]
    encoded = EncodedExample(example_id, text, len(prompt), tokens, offsets)
    for kind, start, end in locate(output):
        if kind not in candidates:
            raise ValueError(f"no candidate token set for event kind {kind!r}")
        candidate_ids = torch.tensor(list(candidates[kind]))
        candidate_set = set(candidate_ids.tolist())
        span_positions = encoded.token_positions_of_chars(len(prompt) + start, len(prompt) + end)
        decided = [p for p in span_positions if tokens[p] in candidate_set and p > 0]
        if not decided:
            continue
        position = decided[0]
        competitors = candidate_ids[candidate_ids != tokens[position]]
        if len(competitors) == 0:
            raise ValueError(f"candidate set for {kind!r} has no token besides the chosen one")
        contrast_token = int(competitors[logits[position - 1, competitors].argmax()])
        s, e = offsets[position]
        encoded.events.append(
            DecisionEvent(
                example_id=example_id,
                kind=kind,
                position=position,
                chosen_token=tokens[position],
                contrast_tokens=(contrast_token,),
                chosen=text[s:e],
                contrast=tokenizer.decode([contrast_token]),
                char_start=s,
                char_end=e,
            )
        )
    return encoded


@dataclass
class EventBatch:
    """One row per event: the context up to the predicting position, right-padded.

    Right padding is safe without an attention mask: causal attention never looks ahead.
    """

    tokens: Int[Tensor, "event pos"]
    predict_positions: Int[Tensor, "event"]
    chosen: Int[Tensor, "event"]
    contrast: Int[Tensor, "event n_contrast"]  # -1 pads rows with fewer contrasts
    events: list[DecisionEvent]

    @property
    def kinds(self) -> list[str]:
        return [event.kind for event in self.events]

    def __len__(self) -> int:
        return len(self.events)

    def select(self, rows: Sequence[int] | Sequence[bool] | Tensor) -> "EventBatch":
        """The given rows: integer indices, or a boolean mask with one entry per event."""
        rows = torch.as_tensor(rows)
        if rows.dtype == torch.bool:
            if rows.shape != (len(self),):
                raise ValueError(
                    f"boolean row mask has shape {tuple(rows.shape)}; this batch has {len(self)} events"
                )
            rows = rows.nonzero().flatten()
        elif len(rows) and (rows.dtype.is_floating_point or rows.ndim != 1):
            raise TypeError(
                f"rows must be integer indices or a boolean mask, got a {rows.dtype} tensor of shape "
                f"{tuple(rows.shape)}"
            )
        rows = rows.long()
        if len(rows) and (int(rows.min()) < -len(self) or int(rows.max()) >= len(self)):
            raise IndexError(f"rows {rows.tolist()} outside a batch of {len(self)} events")
        keep = [self.events[int(i)] for i in rows]
        width = int(self.predict_positions[rows].max()) + 1 if len(rows) else 1
        return EventBatch(
            self.tokens[rows, :width],
            self.predict_positions[rows],
            self.chosen[rows],
            self.contrast[rows],
            keep,
        )

    def chunks(self, size: int) -> Iterator["EventBatch"]:
        """The batch in consecutive chunks of at most `size` rows (see `row_chunks`)."""
        return (self.select(rows) for rows in row_chunks(len(self), size))

    def of_kind(self, kind: str) -> "EventBatch":
        return self.select(kind_mask(self.kinds, kind).nonzero().flatten())


def row_chunks(n: int, size: int) -> Iterator[range]:
    """Consecutive row ranges of at most `size` covering `0..n`: the one chunking rule (memory
    stays bounded by the chunk, results are concatenated in order)."""
    if size < 1:
        raise ValueError(f"chunk size must be at least 1, got {size}")
    return (range(start, min(start + size, n)) for start in range(0, n, size))


def kind_mask(kinds: Sequence[str], kind: str) -> Bool[Tensor, "event"]:
    """Which rows are events of `kind`."""
    return torch.tensor([k == kind for k in kinds], dtype=torch.bool)


def make_event_batch(
    examples: Sequence[EncodedExample],
    events: Sequence[DecisionEvent] | None = None,
    pad_token_id: int = 0,
) -> EventBatch:
    """Stack events (by default every event of every example) into an `EventBatch`."""
    by_id = {example.example_id: example for example in examples}
    chosen_events = list(events) if events is not None else [e for x in examples for e in x.events]
    if not chosen_events:
        raise ValueError("no events to batch")
    for event in chosen_events:
        if not event.contrast_tokens:
            raise ValueError(
                f"event {event.kind!r} at token {event.position} of example {event.example_id} has no "
                "contrast token: a decision margin needs one"
            )
        if event.example_id not in by_id:
            raise KeyError(f"event refers to unknown example {event.example_id}")
        length = len(by_id[event.example_id].tokens)
        if not (1 <= event.position < length):
            raise IndexError(
                f"event at token {event.position} lies outside the context of example {event.example_id} "
                f"(tokens 1..{length - 1} can be predicted)"
            )
    width = max(event.position for event in chosen_events)
    n_contrast = max(len(event.contrast_tokens) for event in chosen_events)
    tokens = torch.full((len(chosen_events), width), pad_token_id, dtype=torch.long)
    contrast = torch.full((len(chosen_events), n_contrast), -1, dtype=torch.long)
    for row, event in enumerate(chosen_events):
        context = by_id[event.example_id].tokens[: event.position]
        tokens[row, : len(context)] = torch.tensor(context)
        contrast[row, : len(event.contrast_tokens)] = torch.tensor(event.contrast_tokens)
    predict = torch.tensor([event.predict_position for event in chosen_events])
    chosen = torch.tensor([event.chosen_token for event in chosen_events])
    return EventBatch(tokens, predict, chosen, contrast, chosen_events)
