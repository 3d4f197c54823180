"""Circuits found by a learned mask: one continuous gate per head, optimised by gradient descent.

Each head's ``hook_z`` at the event positions is partially mean-ablated,
``z + g * (mean - z)`` (:func:`~mistill_lens.lens.hooks.gated_ablation_hooks`), and the gates are
trained on the events with a sparsity penalty:

* **necessity**: ``g`` is how much of a head is ablated; the loss is the normalised mean margin
  left, ``mean m(g) / mean m(M)``, plus ``sparsity * sum(g)``: the gates that stay open are the
  heads whose joint ablation removes the margin;
* **sufficiency**: ``g`` is how much of a head is *kept* (ablated by ``1 - g``); the loss is minus
  the normalised margin kept, ``(mean m(g) - mean m(empty)) / (mean m(M) - mean m(empty))``, plus
  ``sparsity * sum(g)``: the gates that stay open are the heads that carry the margin alone.

The gates are then binarised by ranking the heads by gate and measuring the exact curve of the
top-n sets (n = 1 .. max_size), the same measures the greedy search reports
(:mod:`mistill_lens.lens.faithfulness`), so the two methods (and a ranking by single-head effect)
are compared on the same curves. Gradients flow through the model's backend: on the engine, the
single-position recomputation at each event.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from mistill_lens.lens.backends import EventModel, HooksFor, backend_for
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.faithfulness import (
    MEASURES,
    check_baseline_gap,
    mean_clean_margin,
    mean_set_margins,
)
from mistill_lens.lens.hooks import (
    HeadMeans,
    event_position_classes,
    gated_ablation_hooks,
    n_layers_heads,
)
from mistill_lens.lens.model_types import HookedModel


def learn_mask(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    measure: str,
    steps: int = 100,
    lr: float = 0.1,
    sparsity: float = 0.01,
    progress: bool = False,
) -> Float[Tensor, "layer head"]:
    """Gates in [0, 1] per head (a sigmoid of a learned logit, every logit starting at 0), trained
    with Adam for `steps` full-batch steps on `batch`'s events to minimise the `measure`'s loss
    (module docstring). `sparsity` is the price of one open gate in shares of the margin: a head
    stays open when it carries more than that share. Deterministic: no sampling."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; expected one of {MEASURES}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if sparsity < 0:
        raise ValueError(f"sparsity must be 0 or more, got {sparsity}")
    backend = backend_for(model)
    clean = mean_clean_margin(backend, batch, means)
    empty = mean_set_margins(backend, batch, means, [[]], keep=True)[0]
    if measure == "sufficiency":
        check_baseline_gap(clean, empty)
    elif clean < 1e-6:
        raise ValueError(
            f"the mean clean margin of these events is {clean:.3g}: a share of it means nothing"
        )
    logits = torch.zeros(n_layers_heads(backend.model), requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=lr)

    def hooks_for(sub: EventBatch):
        gates = torch.sigmoid(logits)
        ablation = gates if measure == "necessity" else 1 - gates
        classes = event_position_classes(sub, means.class_names)
        return gated_ablation_hooks(backend.model, ablation, means, classes)

    # the loss is affine in the mean margin: this factor times it, plus a constant
    scale = 1 / clean if measure == "necessity" else -1 / (clean - empty)
    for _ in tqdm(range(steps), desc=f"learned {measure} mask", disable=not progress):
        optimizer.zero_grad()
        backpropagate_mean_margin(backend, batch, hooks_for, scale)
        (sparsity * torch.sigmoid(logits).sum()).backward()
        optimizer.step()
    return torch.sigmoid(logits).detach()


def backpropagate_mean_margin(
    backend: EventModel, batch: EventBatch, hooks_for: HooksFor, scale: float
) -> None:
    """Accumulate the gradient of `scale` x the mean margin of `batch` (with `hooks_for`'s hooks)
    into whatever the hooks read that requires grad, one chunk of `backend.grad_rows` rows at a
    time: the gradient of a mean is the sum of the chunks' sums / n, so one chunk's graph is held
    at once and memory is bounded by the chunk, not by the number of events. Chunks keep the
    batch's row order, so an example's rows stay together (one clean pass on the engine)."""
    for sub in batch.chunks(backend.grad_rows):
        (scale * backend.differentiable_margins(sub, hooks_for).sum() / len(batch)).backward()
