"""Contrasts the model picks: each event scored against its strongest rival, frozen at the clean run.

A decision's margin depends on what it is measured against. An event whose data names its rivals
(every text of its kind that could stand there: for the ICD task, the other regions among the
candidates, or the region's other codes but the near-miss) is scored against the rival the model
itself ranks highest on the unablated run: the one with the smallest clean margin,
logit(chosen) - logit(rival), each read at the token where the chosen text departs from that
rival (an "I21" against "J45" departs at the letter, against "I25" at a digit). The choice is made
once and frozen: an intervention changes the margin against that rival, never which rival it is
measured against (re-picking under an ablation would let a suppressed rival make the decision look
intact, or the reverse).

Events of different kinds on one token stay separate events when their contrasts differ: a paired
contrast on a shared position (the ICD task's within and near-miss decisions on a sibling
near-miss's departure token). :func:`shared_positions` counts them, and the events whose frozen
contrast is the same token as another kind's (one decision under two labels).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from mistill_lens.lens.events import DecisionEvent, EncodedExample, Rival
from mistill_lens.lens.fingerprint import model_digest, value_digest
from mistill_lens.lens.margins import logits_at
from mistill_lens.lens.model_types import HookedModel
from mistill_lens.lens.search_log import SearchLog, in_memory

# how an event's contrast is chosen: the data's listed contrast, or the strongest named rival
CONTRAST_RULES = ("strongest", "listed")


def check_contrast_rule(rule: str) -> None:
    if rule not in CONTRAST_RULES:
        raise ValueError(f"unknown contrast rule {rule!r}; expected one of {CONTRAST_RULES}")


def freeze_contrasts(
    model: HookedModel,
    encoded: Sequence[EncodedExample],
    progress: bool = False,
    desc: str = "strongest contrasts",
    log: SearchLog | None = None,
) -> tuple[list[EncodedExample], dict[str, dict[str, Any]]]:
    """Every event with named rivals scored against the strongest of them by `model`'s clean
    logits (one forward per example, the needed positions alone unembedded), frozen as the event's
    one contrast; events with no rival of their own (none named, or every one another event's
    decision: :func:`_own_rivals`) are left out. Events without
    named rivals keep their listed contrast. Returns the examples and, per kind, what the choice
    did: `events`, `rivals` (mean number per event), `listed_strongest` (share of events whose
    listed contrast was at least as strong as every rival), `margin_listed` / `margin_strongest` (mean clean margins
    against the listed contrast and against the frozen one) and `no_rival` (events left out).
    `progress` shows a bar over the examples (at ~1,200 tokens each forward takes seconds). With a
    `log` (:func:`contrast_log`: fingerprinted by the model's weights) each example's clean margins
    are kept there as they are read, so a rerun reads none again; the margins are stored exactly,
    so a resumed choice equals a fresh one."""
    log = in_memory() if log is None else log
    frozen_examples = []
    records: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for example in tqdm(encoded, desc=desc, disable=not progress):
        key = _example_key(example)
        scores = log.result(key)
        if scores is None:
            scores = _rival_margins(model, example)
            log.finish(key, scores)
        own = _own_rivals(example)
        events = []
        for event, score in zip(example.events, scores):
            if event.rivals is None:
                events.append(event)
                continue
            record = records[event.kind]
            if not own[event]:
                record["no_rival"].append(1.0)
                continue
            margins = score["rivals"]
            strongest = own[event][min(range(len(margins)), key=margins.__getitem__)]
            events.append(_frozen(event, strongest))
            record["rivals"].append(float(len(margins)))
            record["listed_strongest"].append(float(min(margins) >= score["listed"]))
            record["margin_listed"].append(score["listed"])
            record["margin_strongest"].append(min(margins))
        frozen_examples.append(dataclasses.replace(example, events=events))
    return frozen_examples, {kind: _summarise(record) for kind, record in records.items()}


def contrast_log(path: str | Path | None, model: HookedModel, stale: str = "error") -> SearchLog:
    """Where :func:`freeze_contrasts` keeps each example's clean margins against its rivals
    (`path`: JSON, rewritten atomically after each example; None: in memory), refused (or, with
    ``stale="recompute"``, discarded) when written for other weights."""
    return SearchLog(
        path,
        {"model weights": model_digest(model), "contrasts": "strongest"},
        stale,
        what="contrast log",
    )


@torch.no_grad()
def _rival_margins(model: HookedModel, example: EncodedExample) -> list[dict[str, Any] | None]:
    """Per event, its clean margin against the listed contrast and against each of its own rivals
    (in :func:`_own_rivals`' order); None for an event without named rivals."""
    own = _own_rivals(example)
    logits = _logits_by_position(model, example, [e for e in own if own[e]])
    scores: list[dict[str, Any] | None] = []
    for event in example.events:
        if event.rivals is None or not own[event]:
            scores.append(None if event.rivals is None else {"listed": None, "rivals": []})
            continue
        scores.append(
            {
                "listed": _margin(
                    logits, event.position, event.chosen_token, event.contrast_tokens[0]
                ),
                "rivals": [
                    _margin(logits, r.position, r.chosen_token, r.contrast_token)
                    for r in own[event]
                ],
            }
        )
    return scores


def _example_key(example: EncodedExample) -> str:
    """An example's identity for the log: its id, tokens and events (rivals included)."""
    return f"{example.example_id}-" + value_digest(
        [example.tokens, [dataclasses.asdict(e) for e in example.events]]
    )


def listed_contrasts(encoded: Sequence[EncodedExample]) -> list[EncodedExample]:
    """Every event scored against its listed contrast: named rivals set aside."""
    return [
        dataclasses.replace(
            example, events=[dataclasses.replace(e, rivals=None) for e in example.events]
        )
        for example in encoded
    ]


def _own_rivals(example: EncodedExample) -> dict[DecisionEvent, tuple[Rival, ...]]:
    """Each event with named rivals, with those that are its own: a rival that departs at the same
    token as another event's listed contrast is that event's decision (the ICD task's within
    event against a code that differs from the near-miss only after their shared digit), so it
    is left out rather than counted under two labels."""
    decided_elsewhere = {
        (e.position, token)
        for e in example.events
        if e.rivals is None
        for token in e.contrast_tokens
    }
    return {
        e: tuple(r for r in e.rivals if (r.position, r.contrast_token) not in decided_elsewhere)
        for e in example.events
        if e.rivals is not None
    }


def _logits_by_position(
    model: HookedModel, example: EncodedExample, events: Sequence[DecisionEvent]
) -> dict[int, torch.Tensor]:
    """The example's logits at every position that predicts one of `events`' rivals or listed
    contrasts, by the position of the token they predict."""
    positions = sorted(
        {e.position for e in events} | {r.position for e in events for r in e.rivals}
    )
    if not positions:
        return {}
    tokens = torch.tensor([example.tokens[: max(positions)]])
    at = torch.tensor(positions) - 1
    rows = logits_at(model, tokens, torch.zeros_like(at), at).float()
    return dict(zip(positions, rows))


def _margin(logits: dict[int, torch.Tensor], position: int, chosen: int, contrast: int) -> float:
    row = logits[position]
    return float(row[chosen] - row[contrast])


def _frozen(event: DecisionEvent, rival: Rival) -> DecisionEvent:
    return dataclasses.replace(
        event,
        position=rival.position,
        chosen_token=rival.chosen_token,
        contrast_tokens=(rival.contrast_token,),
        contrast=rival.contrast,
        rivals=None,
    )


def _summarise(record: dict[str, list[float]]) -> dict[str, Any]:
    n = len(record["rivals"])

    def mean(name: str) -> float | None:
        return round(sum(record[name]) / n, 4) if n else None

    return {
        "events": n,
        "rivals": mean("rivals"),
        "listed_strongest": mean("listed_strongest"),
        "margin_listed": mean("margin_listed"),
        "margin_strongest": mean("margin_strongest"),
        "no_rival": len(record["no_rival"]),
    }


def shared_positions(encoded: Sequence[EncodedExample]) -> dict[str, dict[str, int]]:
    """Tokens that decide events of more than one kind, by the kinds' names joined with "+":
    `positions` (such tokens) and `same_contrast` (of them, tokens where two kinds' contrasts are
    the same token: one decision counted under two labels; otherwise a paired contrast)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for example in encoded:
        by_position: dict[int, list[DecisionEvent]] = defaultdict(list)
        for event in example.events:
            by_position[event.position].append(event)
        for events in by_position.values():
            kinds = sorted({e.kind for e in events})
            if len(kinds) < 2:
                continue
            name = "+".join(kinds)
            counts[name]["positions"] += 1
            contrasts = [frozenset(e.contrast_tokens) for e in events]
            counts[name]["same_contrast"] += int(len(set(contrasts)) < len(contrasts))
    return {
        name: {"positions": c["positions"], "same_contrast": c["same_contrast"]}
        for name, c in counts.items()
    }
