"""Decision margins: the one place that computes them.

A decision event is scored by the model's own logit margin, logit(chosen) - max logit(contrast),
at the event's predicting position. Every measurement of the lens (clean margins, ablated margins,
sweeps, circuits, attribution) is a margin or a change of one, so they are all computed here, the
same way: from logits at the events' rows (:func:`margins_at`, :func:`decision_margins`,
:func:`row_margins`), by running a hooked model for the events' rows alone (:func:`run_event_logits`,
:func:`run_margins`, in chunks of rows: :func:`run_margins_in_chunks`), normalised by the clean
margin (:func:`margin_fraction`, :func:`decided_rows`), and differentiated (:func:`attribution_scores`).

Which machinery runs the model (the intervention engine or the full forward) is not decided here:
:mod:`mistill_lens.lens.backends` makes that choice and calls into this module for the full
forward; the engine calls into it for margins from its own logits.
"""

from __future__ import annotations

from typing import Sequence

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.hooks import (
    AttributionStore,
    HeadMeans,
    HookPair,
    HooksFor,
    attribution_hooks,
    check_hook_names,
    run_reading,
)
from mistill_lens.lens.model_types import HookedModel

# --- margins from logits ---------------------------------------------------------------------


def margins_at(
    logits: Float[Tensor, "event pos vocab"],
    predict_positions: Int[Tensor, "event"],
    chosen: Int[Tensor, "event"],
    contrast: Int[Tensor, "event n_contrast"],
) -> Float[Tensor, "event"]:
    """logit(chosen) - max over contrasts of logit(contrast), at each row's predicting position."""
    rows = torch.arange(logits.shape[0])
    if int(predict_positions.max()) >= logits.shape[1] or int(predict_positions.min()) < 0:
        raise IndexError(
            f"predicting positions {predict_positions.tolist()} outside logits of length {logits.shape[1]}"
        )
    at_event = logits[rows, predict_positions]  # [event, vocab]
    chosen_logit = at_event[rows, chosen]
    contrast_logits = at_event.gather(1, contrast.clamp(min=0))
    if (contrast < 0).all(dim=1).any():
        bad = (contrast < 0).all(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"event rows {bad} have no contrast token: their margin would be +inf")
    contrast_logits = contrast_logits.masked_fill(contrast < 0, float("-inf"))
    margins = chosen_logit - contrast_logits.max(dim=1).values
    if torch.isnan(margins).any():
        bad = torch.isnan(margins).nonzero().flatten().tolist()
        raise FloatingPointError(f"NaN decision margin at event rows {bad}")
    return margins


def decision_margins(
    logits: Float[Tensor, "event pos vocab"], batch: EventBatch
) -> Float[Tensor, "event"]:
    """Each event's own decision margin from a forward pass over `batch.tokens`."""
    return margins_at(logits, batch.predict_positions, batch.chosen, batch.contrast)


def row_margins(logits: Float[Tensor, "event vocab"], batch: EventBatch) -> Float[Tensor, "event"]:
    """Each event's margin from its own row of logits (the logits at its predicting position
    alone, as :func:`run_event_logits` and the engine give them), computed in float32."""
    at_rows = torch.zeros(len(batch), dtype=torch.long)
    return margins_at(logits[:, None].float(), at_rows, batch.chosen, batch.contrast)


def margin_fraction(
    margins: Float[Tensor, "event"], clean: Float[Tensor, "event"]
) -> Float[Tensor, "event"]:
    """Per-event normalisation: the fraction of the clean margin that `margins` keeps."""
    if torch.isnan(clean).any() or torch.isnan(margins).any():
        raise FloatingPointError("NaN margin passed to margin_fraction")
    if (clean <= 0).any():
        bad = (clean <= 0).nonzero().flatten().tolist()
        raise ValueError(
            f"clean margins at rows {bad} are not positive: the fraction is undefined; keep decided events only "
            "(see decided_rows)"
        )
    return margins / clean


def decided_rows(clean: Float[Tensor, "event"], min_margin: float = 0.0) -> Int[Tensor, "decided"]:
    """Rows whose clean margin exceeds `min_margin` (events the model actually decides its way)."""
    return (clean > min_margin).nonzero().flatten()


# --- running a model for margins -------------------------------------------------------------


# Hook points on the logits' own path: with a hook there, the margins come from the full logits.
UNEMBED_INPUT = "unembed.hook_in"
_LOGIT_PATH = ("ln_final.", "unembed.", "hook_unembed")


def run_event_logits(
    model: HookedModel, batch: EventBatch, hooks: Sequence[HookPair] = ()
) -> Float[Tensor, "event vocab"]:
    """Each event row's logits at its predicting position from one forward with `hooks` applied.
    The forward stops at the unembedding's input and only the events' rows are unembedded: the
    [batch, pos, vocab] logits (~1 GB per 1,000-token example at Gemma's 262,144 tokens) are never
    made. Hooks on the final norm or the unembedding run the full forward instead."""
    return logits_at(model, batch.tokens, torch.arange(len(batch)), batch.predict_positions, hooks)


def logits_at(
    model: HookedModel,
    tokens: Int[Tensor, "batch pos"],
    rows: Int[Tensor, "n"],
    positions: Int[Tensor, "n"],
    hooks: Sequence[HookPair] = (),
) -> Float[Tensor, "n vocab"]:
    """The logits at (`rows[i]`, `positions[i]`) of one forward over `tokens` with `hooks`
    applied, unembedding those positions alone (see :func:`run_event_logits`)."""
    check_hook_names(model, [name for name, _ in hooks])
    on_logit_path = any(name.startswith(_LOGIT_PATH) for name, _ in hooks)
    if on_logit_path or UNEMBED_INPUT not in model.hook_dict:
        with torch.no_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=list(hooks))
        return logits[rows, positions]
    store: dict[str, Tensor] = {}

    def keep(act: Tensor, hook) -> None:
        store["x"] = act[rows, positions]

    run_reading(model, tokens, [*hooks, (UNEMBED_INPUT, keep)], UNEMBED_INPUT)
    with torch.no_grad():
        logits = model.unembed(store["x"][:, None])[:, 0]
    cap = getattr(model.cfg, "output_logits_soft_cap", None) or 0.0
    # the logits' soft cap (Gemma) is applied by the model's forward after the unembedding
    return torch.tanh(logits / cap) * cap if cap > 0 else logits


@torch.no_grad()
def run_margins(
    model: HookedModel, batch: EventBatch, hooks: Sequence[HookPair] = ()
) -> Float[Tensor, "event"]:
    """The events' margins from one forward pass with `hooks` applied (the events' rows of the
    logits alone: :func:`run_event_logits`)."""
    return row_margins(run_event_logits(model, batch, hooks), batch)


def run_margins_in_chunks(
    model: HookedModel, batch: EventBatch, hooks_for: HooksFor, size: int
) -> Float[Tensor, "event"]:
    """:func:`run_margins` over `batch` in chunks of at most `size` rows (memory stays bounded by
    the chunk), `hooks_for(chunk)` building each chunk's hooks; the margins in row order."""
    return torch.cat([run_margins(model, sub, hooks_for(sub)) for sub in batch.chunks(size)])


# --- the margins' gradient -------------------------------------------------------------------


def attribution_scores(
    model: HookedModel, batch: EventBatch, means: HeadMeans, extra_hooks: Sequence[HookPair] = ()
) -> Float[Tensor, "event layer head"]:
    """Attribution patching: gradient x (activation - class mean) of each event's margin, per head,
    at the event's predicting position. Positive = the head pushes toward the chosen token (the
    linear estimate of the margin lost by mean-ablating it). One forward and one backward.

    Works in any model dtype: the product is computed in float32 (gradients and activations of a
    bf16 / fp16 model are upcast to the float32 reference means), and the scores are float32."""
    store = AttributionStore()
    with torch.enable_grad():
        logits = model.run_with_hooks(
            batch.tokens, fwd_hooks=[*extra_hooks, *attribution_hooks(model, store)]
        )
        margins = decision_margins(logits, batch)
        layers = sorted(store.leaves)
        grads = torch.autograd.grad(margins.sum(), [store.leaves[l] for l in layers])
    rows = torch.arange(len(batch))
    class_index = torch.tensor([means.class_index(kind) for kind in batch.kinds])
    scores = []
    for layer, grad in zip(layers, grads):
        act = store.activations[layer][
            rows, batch.predict_positions
        ].float()  # [event, head, d_head]
        mean = means.means[class_index, layer].float()  # [event, head, d_head]
        g = grad[rows, batch.predict_positions].float()
        scores.append(einops.einsum(g, act - mean, "e h d, e h d -> e h"))
    return einops.rearrange(torch.stack(scores), "l e h -> e l h")
