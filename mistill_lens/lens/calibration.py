"""Null calibration: discount heads that matter everywhere, not just at decisions.

Null events sit at matched non-decision positions of the same examples (output tokens that are
not decision tokens), with the actual next token as "chosen" and a shuffled contrast (the chosen
token of another null event). A previous-token or positional head moves these margins as much as
real ones; a decision head does not. Each head's effect on the null events gives it a null
distribution (mean, std), and its calibrated score is its real effect above that null.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.events import NULL_KIND, DecisionEvent, EncodedExample, kind_mask


def null_events(
    examples: Sequence[EncodedExample],
    events: Sequence[DecisionEvent],
    per_event: int = 1,
    seed: int = 0,
) -> list[DecisionEvent]:
    """`per_event` null events per real event, drawn from the output positions of the same example
    that are not decision tokens, with contrasts shuffled among the null events. Where the output
    is too short for that (a short-answer task: one or two output tokens), the non-decision
    positions of the whole text are drawn from instead, prompt included."""
    rng = random.Random(seed)
    by_id = {example.example_id: example for example in examples}
    drawn: list[tuple[int, int]] = []
    for event in events:
        example = by_id[event.example_id]
        decided = {e.position for e in example.events}
        eligible = [
            p for p in range(max(1, example.prompt_tokens), len(example.tokens)) if p not in decided
        ]
        if len(eligible) < per_event:  # a short answer: non-decision positions anywhere in the text
            eligible = [p for p in range(1, len(example.tokens)) if p not in decided]
        if len(eligible) < per_event:
            raise ValueError(
                f"example {example.example_id} has {len(eligible)} non-decision positions, {per_event} needed"
            )
        drawn += [(example.example_id, p) for p in rng.sample(eligible, per_event)]
    chosen = [by_id[i].tokens[p] for i, p in drawn]
    if len(set(chosen)) < 2:
        raise ValueError(
            "all null positions predict the same token: no contrast can be shuffled in"
        )
    order = list(range(len(drawn)))
    rng.shuffle(order)
    nulls = []
    for index, (example_id, position) in enumerate(drawn):
        # the shuffled partner, or the next one along the shuffled order if it predicts the same token
        partners = (chosen[order[(index + step) % len(order)]] for step in range(len(order)))
        contrast = next(token for token in partners if token != chosen[index])
        nulls.append(
            DecisionEvent(
                example_id=example_id,
                kind=NULL_KIND,
                position=position,
                chosen_token=chosen[index],
                contrast_tokens=(contrast,),
            )
        )
    return nulls


@dataclass
class Calibration:
    """Per-head real effect per event kind against the head's null distribution. Inspectable:
    `null_mean` and `null_std` are the null distribution itself."""

    kinds: tuple[str, ...]
    raw: Float[Tensor, "kind layer head"]  # mean effect over the real events of each kind
    null_mean: Float[Tensor, "layer head"]
    null_std: Float[Tensor, "layer head"]
    std_floor: float
    n_events: tuple[int, ...] = ()  # real events per kind, in `kinds` order
    n_null: int = 0

    @property
    def above_null(self) -> Float[Tensor, "kind layer head"]:
        return self.raw - self.null_mean

    @property
    def z(self) -> Float[Tensor, "kind layer head"]:
        """Effect above null in units of null std (floored: a head the null never moves would
        otherwise get an infinite score)."""
        return self.above_null / self.null_std.clamp(min=self.std_floor)

    def kind_index(self, kind: str) -> int:
        if kind not in self.kinds:
            raise KeyError(f"no calibration for event kind {kind!r}; have {self.kinds}")
        return self.kinds.index(kind)

    def to_frame(self) -> pd.DataFrame:
        n_layers, n_heads = self.null_mean.shape
        rows = [
            {
                "kind": kind,
                "layer": l,
                "head": h,
                "raw": float(self.raw[k, l, h]),
                "null_mean": float(self.null_mean[l, h]),
                "null_std": float(self.null_std[l, h]),
                "above_null": float(self.above_null[k, l, h]),
                "z": float(self.z[k, l, h]),
            }
            for k, kind in enumerate(self.kinds)
            for l in range(n_layers)
            for h in range(n_heads)
        ]
        return pd.DataFrame(rows)


def calibrate(
    real_effects: Float[Tensor, "event layer head"],
    real_kinds: Sequence[str],
    null_effects: Float[Tensor, "null layer head"],
    std_floor: float = 1e-2,
) -> Calibration:
    """Calibrate per-event head effects (any method: exact ablation drops or attribution) on the
    same method's effects at null events."""
    if real_effects.shape[0] != len(real_kinds):
        raise ValueError(f"{real_effects.shape[0]} effect rows but {len(real_kinds)} kinds")
    if null_effects.shape[0] < 2:
        raise ValueError("at least two null events are needed for a null standard deviation")
    if real_effects.shape[1:] != null_effects.shape[1:]:
        raise ValueError(
            f"real {tuple(real_effects.shape[1:])} and null {tuple(null_effects.shape[1:])} head grids differ"
        )
    if torch.isnan(real_effects).any() or torch.isnan(null_effects).any():
        raise FloatingPointError("NaN head effect passed to calibrate")
    kinds = tuple(dict.fromkeys(real_kinds))
    raw = torch.stack([real_effects[kind_mask(real_kinds, kind)].mean(dim=0) for kind in kinds])
    n_events = tuple(int(kind_mask(real_kinds, kind).sum()) for kind in kinds)
    return Calibration(
        kinds,
        raw,
        null_effects.mean(dim=0),
        null_effects.std(dim=0),
        std_floor,
        n_events,
        null_effects.shape[0],
    )
