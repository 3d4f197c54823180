"""Circuits and findings: selection by calibrated score, necessity, sufficiency, knock-in transfer,
coverage, phase structure and head families.

All quantities are per event and normalised by the event's clean margin, so they read as
"fraction of the clean margin"; coverage aggregates them per example.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from mistill_lens.lens.backends import (
    ablated_margins,
    backend_for,
    chunked_margins,
    clean_margins,
)
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.events import (
    DecisionEvent,
    EncodedExample,
    EventBatch,
    kind_mask,
    row_chunks,
)
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    ablate_all_but_hooks,
    all_heads,
    event_position_classes,
    knock_in_hooks,
    validate_heads,
)
from mistill_lens.lens.margins import margin_fraction
from mistill_lens.lens.model_types import HookedModel

# --- selection -------------------------------------------------------------------------------


def select_heads(
    calibration: Calibration,
    kind: str,
    z_min: float = 3.0,
    rel_min: float = 0.1,
    max_heads: int | None = None,
) -> list[Head]:
    """Heads whose calibrated effect on `kind` events is significant (z >= z_min) and not negligible
    (effect above null >= rel_min x the strongest head's), strongest first."""
    k = calibration.kind_index(kind)
    z, above = calibration.z[k], calibration.above_null[k]
    strongest = float(above.max())
    if strongest <= 0:
        return []
    passing = ((z >= z_min) & (above >= rel_min * strongest)).nonzero().tolist()
    ranked = sorted((tuple(h) for h in passing), key=lambda h: -float(z[h]))
    return ranked[:max_heads] if max_heads is not None else ranked


def select_circuit(
    calibration: Calibration,
    z_min: float = 3.0,
    rel_min: float = 0.1,
    max_heads_per_kind: int | None = None,
) -> dict[str, list[Head]]:
    """The circuit per event kind, plus "all": their union (the global set)."""
    per_kind = {
        kind: select_heads(calibration, kind, z_min, rel_min, max_heads_per_kind)
        for kind in calibration.kinds
    }
    per_kind["all"] = sorted({h for heads in per_kind.values() for h in heads})
    return per_kind


# --- necessity, sufficiency, knock-in --------------------------------------------------------


def necessity(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    heads: Iterable[Head],
    clean: Tensor | None = None,
) -> Float[Tensor, "event"]:
    """Fraction of each event's clean margin lost when `heads` are mean-ablated at its position."""
    clean = clean if clean is not None else clean_margins(model, batch)
    return 1 - margin_fraction(ablated_margins(model, batch, means, heads), clean)


def sufficiency(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    heads: Iterable[Head],
    clean: Tensor | None = None,
) -> Float[Tensor, "event"]:
    """Fraction of each event's clean margin kept when every head *but* `heads` is mean-ablated."""
    clean = clean if clean is not None else clean_margins(model, batch)
    heads = list(heads)
    kept = chunked_margins(
        model,
        batch,
        lambda sub: ablate_all_but_hooks(
            model, heads, means, event_position_classes(sub, means.class_names)
        ),
    )
    return margin_fraction(kept, clean)


def knock_in_donors(batch: EventBatch, seed: int = 0) -> Int[Tensor, "event"]:
    """For each event a donor event from another example, of the same kind, that chose a different
    token (-1 if none), drawn deterministically from `seed`: one stream per kind, so a kind's
    donors do not move when events of another kind join or leave the batch."""
    streams: dict[str, random.Random] = {}
    donors = torch.full((len(batch),), -1, dtype=torch.long)
    for row, event in enumerate(batch.events):
        rng = streams.setdefault(event.kind, random.Random(f"{seed}:{event.kind}"))
        pool = [
            i
            for i, other in enumerate(batch.events)
            if other.kind == event.kind
            and other.chosen_token != event.chosen_token
            and other.example_id != event.example_id
        ]
        if pool:
            donors[row] = rng.choice(pool)
    return donors


GAP_MIN = 1e-6  # logits: a donor gap at or below this has no decision to transfer


def knock_in_transfer(
    model: HookedModel,
    batch: EventBatch,
    heads: Iterable[Head],
    donors: Int[Tensor, "event"],
    clean: Tensor | None = None,
    batch_size: int = 128,
) -> Float[Tensor, "event"]:
    """Fraction of donor A's contrastive decision that appears in B when `heads`' activations at A's
    event position are written into B's run at B's event position:
    (m_A in B knocked-in - m_A in B) / (m_A in A - m_A in B), m_A = logit(A chosen) - logit(A contrast).
    NaN for rows without a donor or where B already prefers A's choice as much as A does."""
    gain, gap = knock_in_parts(model, batch, heads, donors, clean, batch_size)
    return transfer_fraction(gain, gap)


def transfer_fraction(gain: Tensor, gap: Tensor) -> Tensor:
    """Each row's knock-in transfer, gain / gap; NaN where the gap is not positive (B already
    prefers A's choice as much as A does) or the row had no donor."""
    return torch.where(gap > GAP_MIN, gain / gap, torch.nan)


def knock_in_parts(
    model: HookedModel,
    batch: EventBatch,
    heads: Iterable[Head],
    donors: Int[Tensor, "event"],
    clean: Tensor | None = None,
    batch_size: int = 128,
) -> tuple[Float[Tensor, "event"], Float[Tensor, "event"]]:
    """The two sides of :func:`knock_in_transfer` per row (NaN without a donor): the gain, m_A in
    B knocked-in - m_A in B, and the gap, m_A in A - m_A in B. Kept apart so that a summary can
    pool them (sum of gains / sum of gaps), which a row with a tiny gap cannot blow up."""
    heads = validate_heads(model, heads)
    gain = torch.full((len(batch),), torch.nan)
    gap = torch.full((len(batch),), torch.nan)
    rows = (donors >= 0).nonzero().flatten()
    own = clean if clean is not None else clean_margins(model, batch)
    for part in row_chunks(len(rows), batch_size):
        targets = rows[part.start : part.stop]
        sources = donors[targets]
        source_batch = batch.select(sources)
        values = backend_for(model).event_z(source_batch)
        target_batch = batch.select(targets)
        # B's contexts scored on A's decision (A's chosen and contrast tokens)
        donor_choice = EventBatch(
            target_batch.tokens,
            target_batch.predict_positions,
            batch.chosen[sources],
            batch.contrast[sources],
            target_batch.events,
        )
        before = clean_margins(model, donor_choice, batch_size=len(targets))
        after = chunked_margins(
            model,
            donor_choice,
            lambda sub: knock_in_hooks(model, heads, values, sub.predict_positions),
            batch_size=len(targets),  # one chunk: `values` holds one source per row of it
        )
        gain[targets] = after - before
        gap[targets] = own[sources] - before
    return gain, gap


def coverage(values: Float[Tensor, "event"], example_ids: Sequence[int], threshold: float) -> float:
    """Fraction of examples whose mean value over their events is at least `threshold` (NaNs ignored)."""
    frame = pd.DataFrame({"example": list(example_ids), "value": values.tolist()}).dropna()
    if frame.empty:
        return float("nan")
    return float((frame.groupby("example")["value"].mean() >= threshold).mean())


@dataclass
class CircuitReport:
    """Per event: necessity, sufficiency and knock-in transfer of one head set."""

    heads: list[Head]
    events: list[DecisionEvent]
    necessity: Tensor
    sufficiency: Tensor
    knock_in_gain: Tensor  # knock-in's two sides (knock_in_parts); knock_in is their ratio
    knock_in_gap: Tensor

    @property
    def knock_in(self) -> Tensor:
        return transfer_fraction(self.knock_in_gain, self.knock_in_gap)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "example_id": [e.example_id for e in self.events],
                "kind": [e.kind for e in self.events],
                "position": [e.position for e in self.events],
                "necessity": self.necessity.tolist(),
                "sufficiency": self.sufficiency.tolist(),
                "knock_in": self.knock_in.tolist(),
                "knock_in_gain": self.knock_in_gain.tolist(),
                "knock_in_gap": self.knock_in_gap.tolist(),
            }
        )

    def summary(self, thresholds: Mapping[str, float]) -> dict:
        return circuit_measures(self.to_frame(), thresholds)


def circuit_measures(events: pd.DataFrame, thresholds: Mapping[str, float]) -> dict:
    """Per kind of a per-event table (:meth:`CircuitReport.to_frame`): the mean of each measure and
    the fraction of examples at or above its threshold (coverage); and, where the table has
    knock-in's two sides, ``knock_in_pooled``: the sum of the gains over the sum of the gaps of
    the rows with a transfer (a mean of per-row ratios is carried by any row whose gap is tiny)."""
    out = {}
    for kind, rows in events.groupby("kind", sort=False):
        out[kind] = {"n_events": len(rows)}
        for measure in ("necessity", "sufficiency", "knock_in"):
            values = torch.tensor(rows[measure].to_numpy(), dtype=torch.float32)
            out[kind][measure] = float(rows[measure].mean())
            out[kind].setdefault("coverage", {})[measure] = coverage(
                values, rows["example_id"].tolist(), thresholds[measure]
            )
        if "knock_in_gap" in rows:  # tables written before 2026-12-08 lack the two sides
            out[kind]["knock_in_pooled"] = pooled_transfer(rows.knock_in_gain, rows.knock_in_gap)
    return out


def pooled_transfer(gain: pd.Series, gap: pd.Series) -> float:
    """Sum of gains / sum of gaps over the rows whose transfer is defined (gap > GAP_MIN); NaN
    when there is none."""
    defined = gap > GAP_MIN
    return float(gain[defined].sum() / gap[defined].sum()) if defined.any() else float("nan")


def circuit_report(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    heads: Iterable[Head],
    seed: int = 0,
    clean: Float[Tensor, "event"] | None = None,
) -> CircuitReport:
    heads = validate_heads(model, heads)
    clean = clean if clean is not None else clean_margins(model, batch)
    return CircuitReport(
        heads,
        batch.events,
        necessity(model, batch, means, heads, clean),
        sufficiency(model, batch, means, heads, clean),
        *knock_in_parts(model, batch, heads, knock_in_donors(batch, seed), clean),
    )


def ablation_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    ranked_heads: Sequence[Head],
    seed: int = 0,
    max_points: int = 32,
    clean: Float[Tensor, "event"] | None = None,
) -> pd.DataFrame:
    """Mean fraction of the clean margin kept as the first n heads are mean-ablated, heads taken in
    `ranked_heads` order (by score) vs a random order of all heads (seeded)."""
    clean = clean if clean is not None else clean_margins(model, batch)
    every = all_heads(model)
    ranked = list(ranked_heads) + [h for h in every if h not in set(ranked_heads)]
    shuffled = every[:]
    random.Random(seed).shuffle(shuffled)
    counts = sorted(
        {
            round(i * len(every) / min(max_points, len(every)))
            for i in range(min(max_points, len(every)) + 1)
        }
    )
    rows = []
    for order_name, order in (("by score", ranked), ("random", shuffled)):
        for n in counts:
            kept = clean if n == 0 else ablated_margins(model, batch, means, order[:n])
            fraction = margin_fraction(kept, clean)
            for kind in dict.fromkeys(batch.kinds):
                picked = kind_mask(batch.kinds, kind)
                rows.append(
                    {
                        "order": order_name,
                        "n_ablated": n,
                        "kind": kind,
                        "fraction_kept": float(fraction[picked].mean()),
                        "n_events": int(picked.sum()),
                    }
                )
    return pd.DataFrame(rows)


# --- phase structure ---------------------------------------------------------------------------


def phase_structure(calibration: Calibration, circuits: Mapping[str, Sequence[Head]]) -> dict:
    """Which circuit heads matter for which event kind: per kind its heads and mean layer, and the
    overlap (Jaccard) between kinds' head sets."""
    kinds = [k for k in calibration.kinds if k in circuits]
    out = {
        "heads": {k: [list(h) for h in circuits[k]] for k in kinds},
        "mean_layer": {
            k: (sum(l for l, _ in circuits[k]) / len(circuits[k]) if circuits[k] else None)
            for k in kinds
        },
        "overlap": {},
    }
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            union = set(circuits[a]) | set(circuits[b])
            out["overlap"][f"{a}/{b}"] = (
                len(set(circuits[a]) & set(circuits[b])) / len(union) if union else None
            )
    return out


# --- head families -----------------------------------------------------------------------------


def family_targets(
    example: EncodedExample, event: DecisionEvent, near_miss_text: str | None = None
) -> dict[str, list[int]]:
    """Token positions an event can attend to, by family: the prompt's entries of the event's region
    (e.g. every candidate line starting "I21"), and the last mention of the near-miss earlier in the
    output. Only positions inside the event's context are kept."""
    context = event.predict_position + 1
    prompt = example.text[: example.prompt_chars]
    region_positions: set[int] = set()
    if event.region:
        start = prompt.find(event.region)
        while start >= 0:
            region_positions.update(
                example.token_positions_of_chars(start, start + len(event.region))
            )
            start = prompt.find(event.region, start + 1)
    near_miss_positions: list[int] = []
    if near_miss_text:
        start = example.text.rfind(
            near_miss_text, example.prompt_chars, max(event.char_start, example.prompt_chars)
        )
        if start >= 0:
            near_miss_positions = example.token_positions_of_chars(
                start, start + len(near_miss_text)
            )
    return {
        "region_candidates": sorted(p for p in region_positions if p < context),
        "near_miss_mention": [p for p in near_miss_positions if p < context],
    }


def attention_mass(
    model: HookedModel, batch: EventBatch, targets: Sequence[Sequence[int]], batch_size: int = 64
) -> Float[Tensor, "event layer head"]:
    """Attention mass from each event's predicting position to its target positions, every head.
    Only the event's query row of each pattern is kept (full patterns would not fit in memory)."""
    if len(targets) != len(batch):
        raise ValueError(f"{len(targets)} target lists for {len(batch)} events")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    mass = torch.zeros(len(batch), n_layers, n_heads)
    for rows in row_chunks(len(batch), batch_size):
        sub = batch.select(rows)
        target_mask = _target_mask(batch, rows, targets, sub.tokens.shape[1])
        for layer, pattern in event_attention_rows(model, sub, range(n_layers)).items():
            mass[rows, layer] = torch.einsum(
                "bhk,bk->bh", pattern, target_mask[:, : pattern.shape[-1]]
            )
    return mass


def event_attention_rows(
    model: HookedModel, batch: EventBatch, layers: Iterable[int]
) -> dict[int, Float[Tensor, "event head key"]]:
    """Each head's clean attention row from each event's predicting position, per layer: on the
    engine those rows alone, else one forward that keeps only the query rows of its patterns."""
    return backend_for(model).event_rows(batch, list(layers))


def _target_mask(
    batch: EventBatch, rows: range, targets: Sequence[Sequence[int]], width: int
) -> Float[Tensor, "event pos"]:
    mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        if any(p > int(batch.predict_positions[row]) or p < 0 for p in targets[row]):
            raise IndexError(f"attention targets of event {row} lie outside its context")
        mask[i, list(targets[row])] = 1.0
    return mask


def head_families(
    mass_by_family: Mapping[str, Float[Tensor, "event layer head"]],
    kinds: Sequence[str],
    heads: Sequence[Head],
    baselines: Mapping[str, Float[Tensor, "event"]],
    min_ratio: float = 2.0,
) -> pd.DataFrame:
    """Per head and event kind: mean attention mass to each family's targets, its ratio to the mass
    uniform attention would give (`baselines`: target count / context length), and the family the
    head belongs to (the family with the highest ratio, if at least `min_ratio`; else "none")."""
    rows = []
    for kind in dict.fromkeys(kinds):
        picked = kind_mask(kinds, kind)
        for layer, head in heads:
            row = {"kind": kind, "layer": layer, "head": head, "n_events": int(picked.sum())}
            best, best_ratio = "none", min_ratio
            for family, mass in mass_by_family.items():
                has_targets = picked & (baselines[family] > 0)
                if not has_targets.any():
                    continue
                mean_mass = float(mass[has_targets, layer, head].mean())
                ratio = mean_mass / float(baselines[family][has_targets].mean())
                row[f"mass_{family}"], row[f"ratio_{family}"] = mean_mass, ratio
                if ratio >= best_ratio:
                    best, best_ratio = family, ratio
            row["family"] = best
            rows.append(row)
    return pd.DataFrame(rows)
