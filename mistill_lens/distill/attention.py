"""Attention targets at decision events, the student's pooled attention, and the MISTILL loss.

Target of one event: the teacher's attention from the position that predicts the event token
(its ``predict_position``) over its source positions, averaged over the characterised heads of
the event's kind (on the InterventionEngine: those rows alone, from one clean pass with
memory-efficient attention; on a bridge: ``hook_pattern`` with ``run_with_cache``); then moved onto the
student's tokens by character overlap (:mod:`mistill_lens.distill.align`). Events are placed in
each tokenizer by :func:`mistill_lens.lens.events.events_from_spans`, the characterisation's own
placement, so teacher and student events pair up one to one.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities import get_act_name

from mistill_lens.distill.align import require_offsets, transfer_mass
from mistill_lens.lens.adapters import Adapter
from mistill_lens.lens.backends import backend_for
from mistill_lens.lens.events import EncodedExample, events_from_spans, make_event_batch
from mistill_lens.lens.hooks import Head, HookPair, validate_heads
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.training.data import collate, encode

PROBABILITY_FLOOR = 1e-30  # keeps log(student attention) finite where it underflows to zero


def pattern_name(layer: int) -> str:
    return get_act_name("pattern", layer)


def read_heads_json(path: str | Path) -> dict[str, list[Head]]:
    """Circuits per kind from a characterisation's ``heads.json`` ({kind: [{layer, head, ...}]})."""
    data = json.loads(Path(path).read_text())
    return {
        kind: [(int(e["layer"]), int(e["head"])) for e in entries] for kind, entries in data.items()
    }


def teacher_head_sets(
    circuits: Mapping[str, Sequence[Head]], kinds: Sequence[str] | None = None
) -> dict[str, list[Head]]:
    """The head set whose attention is pooled for each event kind (default: every kind the
    characterisation calibrated): the kind's own circuit, or the global circuit ("all") for a kind
    whose own circuit is empty."""
    kinds = [k for k in circuits if k != "all"] if kinds is None else kinds
    fallback = list(circuits.get("all", []))
    sets = {kind: list(circuits.get(kind, [])) or fallback for kind in kinds}
    empty = [kind for kind, heads in sets.items() if not heads]
    if empty:
        raise ValueError(
            f"empty teacher head set for event kind(s) {empty}: the characterisation selected no heads "
            "(pass another heads.json, or lower z_min)"
        )
    return sets


def heads_in_layers(n_heads: int, layers: Sequence[int]) -> list[Head]:
    """Every head of the given layers (the default student head set)."""
    return [(layer, head) for layer in layers for head in range(n_heads)]


@torch.no_grad()
def teacher_event_attention(
    teacher: HookedModel, encoded: EncodedExample, heads_by_kind: Mapping[str, Sequence[Head]]
) -> list[Float[Tensor, "key"]]:
    """Per event of `encoded`: the teacher's attention row at its predicting position over source
    positions ``0..predict_position``, averaged over the event kind's heads. On an
    :class:`~mistill_lens.lens.engine.InterventionEngine` only those rows are computed (no [T, T]
    pattern)."""
    if not encoded.events:
        return []
    for kind in {e.kind for e in encoded.events}:
        if kind not in heads_by_kind:
            raise KeyError(f"no teacher head set for event kind {kind!r}")
        validate_heads(teacher, heads_by_kind[kind])  # raises on an empty or out-of-range set
    layers = sorted({layer for e in encoded.events for layer, _ in heads_by_kind[e.kind]})
    # on the engine the event rows alone, from one clean pass: no [T, T] pattern
    per_layer = backend_for(teacher).event_rows(make_event_batch([encoded]), layers)
    rows = []
    for row, event in enumerate(encoded.events):
        q = event.predict_position
        heads = heads_by_kind[event.kind]
        per_head = torch.stack([per_layer[layer][row, head, : q + 1] for layer, head in heads])
        rows.append(per_head.float().mean(dim=0))
    return rows


@dataclass
class DistillItem:
    """One training sequence in the student's tokens with its attention targets at events."""

    ids: list[int]
    target_mask: list[bool]
    query_positions: list[int]
    kinds: list[str]
    attention_targets: list[
        Tensor
    ]  # event i: a distribution over student positions 0..query_positions[i]


def student_item(
    example: Any,
    example_id: int,
    teacher: HookedModel,
    teacher_tokenizer: Tokenizer,
    student_tokenizer: Tokenizer,
    heads_by_kind: Mapping[str, Sequence[Head]],
    student_n_ctx: int,
) -> DistillItem:
    """Place `example`'s events in both tokenizers and map the teacher's pooled attention at each
    onto the student's tokens. `example` has ``prompt``, ``output`` (the teacher's) and ``events``."""
    require_offsets(teacher_tokenizer, "teacher tokenizer")
    require_offsets(student_tokenizer, "student tokenizer")
    ids, target_mask = encode(student_tokenizer, example.prompt, example.output)
    student = events_from_spans(example, student_tokenizer, example_id)
    teacher_encoded = events_from_spans(example, teacher_tokenizer, example_id)
    if student.tokens != ids[: len(student.tokens)] or len(student.tokens) != len(ids) - 1:
        raise ValueError(
            f"example {example_id}: the student tokenizer splits prompt + output differently when they are "
            "encoded together (events) and apart (training): a merge across the prompt boundary"
        )
    outside = [e for e in student.events if e.position >= student_n_ctx]
    if outside:
        raise ValueError(
            f"example {example_id}: event(s) at student token(s) {[e.position for e in outside]} lie outside the "
            f"student's context of {student_n_ctx} tokens"
        )
    if len(ids) > student_n_ctx:
        raise ValueError(
            f"example {example_id}: {len(ids)} student tokens exceed the student's context of {student_n_ctx}"
        )
    rows = teacher_event_attention(teacher, teacher_encoded, heads_by_kind)
    targets = [
        transfer_mass(
            row,
            teacher_encoded.offsets[: t.predict_position + 1],
            student.offsets[: s.predict_position + 1],
        ).float()
        for row, t, s in zip(rows, teacher_encoded.events, student.events)
    ]
    return DistillItem(
        ids,
        target_mask,
        [e.predict_position for e in student.events],
        [e.kind for e in student.events],
        targets,
    )


@dataclass
class DistillBatch:
    ids: Int[Tensor, "batch pos"]
    attention: Bool[Tensor, "batch pos"]
    targets: Bool[Tensor, "batch pos"]
    query_positions: Int[Tensor, "batch event"]
    event_mask: Bool[Tensor, "batch event"]
    attention_targets: Float[Tensor, "batch event pos"]


def collate_items(items: Sequence[DistillItem], pad_id: int) -> DistillBatch:
    """Right-padded sequences (as `training.data.collate`) and event targets padded to the batch
    width."""
    ids, attention, targets = collate([(item.ids, item.target_mask) for item in items], pad_id)
    n_events = max(1, max(len(item.query_positions) for item in items))
    query = torch.zeros(len(items), n_events, dtype=torch.long)
    mask = torch.zeros(len(items), n_events, dtype=torch.bool)
    dense = torch.zeros(len(items), n_events, ids.shape[1])
    for row, item in enumerate(items):
        for e, (q, target) in enumerate(zip(item.query_positions, item.attention_targets)):
            query[row, e], mask[row, e] = q, True
            dense[row, e, : q + 1] = target
    return DistillBatch(ids, attention, targets, query, mask, dense)


def pattern_recorder(layers: Sequence[int], store: dict[int, Tensor]) -> list[HookPair]:
    """Hooks that keep each layer's ``hook_pattern`` [batch, head, query, key] in `store`, in the
    autograd graph (the attention loss backpropagates through them into the student)."""

    def keep(layer: int):
        def hook(pattern: Tensor, hook) -> Tensor:
            store[layer] = pattern
            return pattern

        return hook

    return [(pattern_name(layer), keep(layer)) for layer in sorted(set(layers))]


@contextmanager
def residual_recorder(adapter: Adapter, layers: Sequence[int], store: dict[int, Tensor]):
    """Keeps the residual entering each of `layers` [batch, pos, d_model] in `store` while the
    block runs, in the autograd graph: what :func:`event_attention` computes the rows from."""

    def keep(layer: int):
        def hook(module, args, kwargs):
            store[layer] = args[0] if args else kwargs["hidden_states"]

        return hook

    handles = [
        adapter.layer_module(layer).register_forward_pre_hook(keep(layer), with_kwargs=True)
        for layer in sorted(set(layers))
    ]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _check_recorded(heads: Sequence[Head], recorded: Mapping[int, Tensor], what: str) -> None:
    """The head set is not empty and every one of its layers has its `what` recorded."""
    if not heads:
        raise ValueError("empty student head set: no attention to pool")
    missing = sorted({layer for layer, _ in heads} - set(recorded))
    if missing:
        raise KeyError(f"no recorded {what} for student layer(s) {missing}")


def event_attention(
    adapter: Adapter,
    residuals: Mapping[int, Float[Tensor, "batch pos d_model"]],
    heads: Sequence[Head],
    query_positions: Int[Tensor, "batch event"],
) -> Float[Tensor, "batch event key"]:
    """Mean over `heads` of each head's attention row at each event's query position, as
    :func:`pooled_attention` reads it from ``hook_pattern``, but computed for those rows alone from
    the residual entering each head's layer (:func:`residual_recorder`): the student can then run
    memory-efficient attention everywhere, with no [pos, pos] pattern in any layer."""
    _check_recorded(heads, residuals, "residual")
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    rows = []
    for layer, layer_heads in by_layer.items():
        x = residuals[layer]
        batch, width, d_model = x.shape
        positions = torch.arange(width, device=x.device)
        _, keys, _ = adapter.qkv(
            layer, einops.rearrange(x, "b t d -> (b t) d"), positions.repeat(batch)
        )
        keys = einops.rearrange(keys, "(b t) k d -> b k t d", b=batch)
        at_queries = x.gather(1, einops.repeat(query_positions, "b e -> b e d", d=d_model))
        queries, _, _ = adapter.qkv(
            layer, einops.rearrange(at_queries, "b e d -> (b e) d"), query_positions.flatten()
        )
        queries = einops.rearrange(queries, "(b e) (k g) d -> b e k g d", b=batch, k=keys.shape[1])
        scores = einops.einsum(queries, keys, "b e k g d, b k t d -> b e k g t")
        scores = scores * adapter.scaling(layer)
        visible = positions <= query_positions[..., None]  # [batch, event, key]
        window = adapter.window(layer)
        if window is not None:
            visible = visible & (positions > query_positions[..., None] - window)
        scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        pattern = einops.rearrange(scores.float().softmax(dim=-1), "b e k g t -> b e (k g) t")
        rows.append(pattern[:, :, layer_heads])
    return torch.cat(rows, dim=2).mean(dim=2)


def pooled_attention(
    patterns: Mapping[int, Float[Tensor, "batch head query key"]],
    heads: Sequence[Head],
    query_positions: Int[Tensor, "batch event"],
) -> Float[Tensor, "batch event key"]:
    """Mean over `heads` of each head's attention row at each event's query position."""
    _check_recorded(heads, patterns, "hook_pattern")
    rows = []
    for layer, head in heads:
        pattern = patterns[layer][:, head]  # [batch, query, key]
        index = einops.repeat(query_positions, "b e -> b e k", k=pattern.shape[-1])
        rows.append(pattern.gather(1, index))
    return torch.stack(rows).mean(dim=0)


def attention_kl(
    pooled: Float[Tensor, "batch event key"],
    target: Float[Tensor, "batch event key"],
    event_mask: Bool[Tensor, "batch event"],
) -> Tensor:
    """Mean over real events of KL(target || student pooled attention); zero iff they are equal."""
    if pooled.shape != target.shape:
        raise ValueError(
            f"pooled attention {tuple(pooled.shape)} and targets {tuple(target.shape)} differ in shape"
        )
    student = pooled.float().clamp(min=PROBABILITY_FLOOR)
    target = target.float()
    # t (log t - log s) with 0 log 0 = 0; written as a difference of logs so equal inputs give exactly 0
    log_ratio = target.clamp(min=PROBABILITY_FLOOR).log() - student.log()
    per_event = torch.where(target > 0, target * log_ratio, torch.zeros_like(target)).sum(dim=-1)
    weights = event_mask.float()
    # no events in the batch: a zero that keeps the graph (so the total loss is unchanged)
    return (per_event * weights).sum() / weights.sum().clamp(min=1.0)
