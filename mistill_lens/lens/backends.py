"""The one place that decides how event-level questions are answered: the seam between the lens's
algorithms and the machinery that runs the model.

Every algorithm of the lens asks a model the same few questions about decision events: margins
under hooks, clean ``hook_z`` at the events, attention rows at the events, attribution, residuals
at (earlier) positions, per-class head means, single-head sweeps. An :class:`EventModel` answers
them. Two backends implement it: the :class:`~mistill_lens.lens.engine.InterventionEngine`
(single-position recomputation, at decode cost) and :class:`FullForward` (one forward of the model
per batch of event rows, with TransformerLens hooks: the reference path, for any hooked model).
:func:`backend_for` turns whatever an algorithm was given into a backend, :func:`choose_backend`
makes (and records) the run's choice; no algorithm tests which backend it holds.

The margins of a hooked model *or* a backend (:func:`chunked_margins`, :func:`clean_margins`,
:func:`ablated_margins`) are answered here because answering them is this choice (with the
engine's fallback to the full forward); the margins themselves are computed in
:mod:`mistill_lens.lens.margins`, which the backends call into.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities import get_act_name

from mistill_lens.lens.adapters import EngineUnsupported
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import EventBatch, position_class_names
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    HookPair,
    HooksFor,
    collect_z,
    compute_head_means,
    event_position_classes,
    gather_at_positions,
    mean_ablation_hooks,
    row_set_ablation_hooks,
)
from mistill_lens.lens.margins import attribution_scores, decision_margins, run_margins_in_chunks
from mistill_lens.lens.model_types import HookedModel, StandsIn


class EngineFallbackWarning(UserWarning):
    """An intervention the engine cannot apply ran on the full forward instead."""


@runtime_checkable
class EventModel(Protocol):
    """What the lens asks of a model at decision events (see the module docstring). ``model`` is
    the hooked model itself (``cfg``, ``run_with_hooks``, ``hook_dict``)."""

    model: HookedModel
    # The most event rows whose autograd graph is held at once: a caller differentiating a sum
    # over more events backpropagates it in chunks of this many rows, so memory stays bounded
    # by the chunk, not by the number of events.
    grad_rows: int

    def margins(
        self, batch: EventBatch, hooks_for: HooksFor, chunk: int | None = None
    ) -> Float[Tensor, "event"]: ...

    def differentiable_margins(
        self, batch: EventBatch, hooks_for: HooksFor
    ) -> Float[Tensor, "event"]: ...

    def sweep_groups(self, heads: Sequence[Head]) -> list[list[Head]]: ...

    def sweep_blocks(self, batch: EventBatch) -> list[Int[Tensor, "row"]]: ...

    def sweep_heads(
        self, batch: EventBatch, means: HeadMeans, heads: Sequence[Head]
    ) -> Float[Tensor, "head event"]: ...

    def set_margins(
        self, batch: EventBatch, means: HeadMeans, masks: Bool[Tensor, "set layer head"]
    ) -> Float[Tensor, "set event"]: ...

    def event_z(self, batch: EventBatch) -> Float[Tensor, "layer event head d_head"]: ...

    def event_rows(
        self, batch: EventBatch, layers: Sequence[int]
    ) -> dict[int, Float[Tensor, "event head key"]]: ...

    def attribution(
        self, batch: EventBatch, means: HeadMeans
    ) -> Float[Tensor, "event layer head"]: ...

    def residuals_at(
        self, batch: EventBatch, positions: Int[Tensor, "k event"], hooks_for: HooksFor | None
    ) -> Float[Tensor, "k stage event d_model"]: ...

    def head_means(self, batch: EventBatch, class_names: Sequence[str]) -> HeadMeans: ...


def residual_stages(model: HookedModel) -> list[str]:
    """Hook names of the residual stream before each layer and after the last."""
    n_layers = model.cfg.n_layers
    return [get_act_name("resid_pre", l) for l in range(n_layers)] + [
        get_act_name("resid_post", n_layers - 1)
    ]


class FullForward(StandsIn):
    """The reference backend: every question answered by forwards of the hooked model over the
    event rows (``batch_size`` rows at a time), with TransformerLens hooks."""

    def __init__(self, model: HookedModel, batch_size: int = 256):
        self.model = model
        self.batch_size = batch_size
        self.grad_rows = batch_size  # one forward's graph (every position of its rows) at a time

    def margins(self, batch, hooks_for, chunk=None):
        return run_margins_in_chunks(self.model, batch, hooks_for, chunk or self.batch_size)

    def differentiable_margins(self, batch, hooks_for):
        """The margins with their autograd graph, one forward per chunk of rows."""
        with torch.enable_grad():
            return torch.cat(
                [
                    decision_margins(
                        self.model.run_with_hooks(sub.tokens, fwd_hooks=list(hooks_for(sub))), sub
                    )
                    for sub in batch.chunks(self.batch_size)
                ]
            )

    def sweep_groups(self, heads):
        return [[head] for head in heads]  # one forward per head

    def sweep_blocks(self, batch):
        return [torch.arange(len(batch))]  # nothing kept between forwards: one block

    def sweep_heads(self, batch, means, heads):
        return torch.stack(
            [
                self.margins(
                    batch,
                    lambda sub, head=head: mean_ablation_hooks(
                        self.model, [head], means, event_position_classes(sub, means.class_names)
                    ),
                )
                for head in heads
            ]
        )

    def set_margins(self, batch, means, masks):
        """One pass over the events per head set."""
        return torch.stack(
            [
                self.margins(
                    batch,
                    lambda sub, mask=mask: row_set_ablation_hooks(
                        self.model,
                        mask.expand(len(sub), *mask.shape),
                        means,
                        event_position_classes(sub, means.class_names),
                    ),
                )
                for mask in masks
            ]
        )

    def event_z(self, batch):
        return gather_at_positions(
            collect_z(self.model, batch.tokens), torch.arange(len(batch)), batch.predict_positions
        )

    def event_rows(self, batch, layers):
        """One forward that keeps only the events' query rows of the patterns."""
        rows: dict[int, Tensor] = {}

        def keep_query_row(layer: int):
            def hook(pattern, hook):
                rows[layer] = pattern[torch.arange(len(batch)), :, batch.predict_positions].detach()
                return pattern

            return hook

        with torch.no_grad():
            self.model.run_with_hooks(
                batch.tokens,
                fwd_hooks=[(get_act_name("pattern", l), keep_query_row(l)) for l in layers],
            )
        return rows

    def attribution(self, batch, means):
        return torch.cat(
            [attribution_scores(self.model, sub, means) for sub in batch.chunks(self.batch_size)]
        )

    @torch.no_grad()
    def residuals_at(self, batch, positions, hooks_for):
        """One forward; `hooks_for` (one k only: the hooks act at the read positions) gets the
        rows with their read positions as predicting positions."""
        stages = residual_stages(self.model)
        rows = torch.arange(len(batch))
        store: dict[str, Tensor] = {}

        def keep(name: str):
            def hook(act: Tensor, hook) -> Tensor:
                store[name] = torch.stack([act[rows, p] for p in positions]).detach()
                return act

            return hook

        extra_hooks = []
        if hooks_for is not None:
            if len(positions) != 1:
                raise ValueError("hooks_for reads one k at a time (the hooks act at r - k)")
            read = EventBatch(
                batch.tokens, positions[0], batch.chosen, batch.contrast, batch.events
            )
            extra_hooks = list(hooks_for(read))
        self.model.run_with_hooks(
            batch.tokens, fwd_hooks=[*extra_hooks, *[(s, keep(s)) for s in stages]]
        )
        return einops.rearrange(torch.stack([store[s] for s in stages]), "s k e d -> k s e d")

    def head_means(self, batch, class_names):
        position_class = event_position_classes(batch, class_names)
        return compute_head_means(self.model, batch.tokens, position_class, class_names)


def backend_for(model: HookedModel | EventModel, batch_size: int = 256) -> EventModel:
    """`model` itself when it is a backend (an engine), else the full forward over it, in chunks of
    `batch_size` event rows."""
    if isinstance(model, FullForward):
        return FullForward(model.model, batch_size)
    if isinstance(model, EventModel):
        return model
    return FullForward(model, batch_size)


def means_from_events(
    model: HookedModel | EventModel, batch: EventBatch, class_names: Sequence[str] | None = None
) -> HeadMeans:
    """Reference means at the predicting positions of `batch`'s events, one class per event kind
    (default classes: `position_class_names` of the batch's kinds)."""
    names = position_class_names(batch.kinds) if class_names is None else tuple(class_names)
    return backend_for(model).head_means(batch, names)


def chunked_margins(
    model: HookedModel | EventModel, batch: EventBatch, hooks_for: HooksFor, batch_size: int = 256
) -> Float[Tensor, "event"]:
    """Margins over `batch` in row chunks of `batch_size`, `hooks_for(sub_batch)` building each
    chunk's hooks, on the model's backend. On an
    :class:`~mistill_lens.lens.engine.InterventionEngine` each chunk runs at decode cost on the
    event-position view; hooks the engine cannot apply (another hook point, other positions) run on
    the full forward, with a warning (:class:`EngineFallbackWarning`)."""
    backend = backend_for(model, batch_size)
    try:
        return backend.margins(batch, hooks_for, chunk=batch_size)
    except EngineUnsupported as err:
        warnings.warn(
            f"{err}: these margins ran on the full forward", EngineFallbackWarning, stacklevel=2
        )
        return FullForward(backend.model, batch_size).margins(batch, hooks_for)


def ablated_margins(
    model: HookedModel | EventModel,
    batch: EventBatch,
    means: HeadMeans,
    heads: Iterable[Head],
    batch_size: int = 256,
) -> Float[Tensor, "event"]:
    """Margins with `heads` mean-ablated at each event's predicting position (class = its kind)."""
    heads = list(heads)
    return chunked_margins(
        model,
        batch,
        lambda sub: mean_ablation_hooks(
            model, heads, means, event_position_classes(sub, means.class_names)
        ),
        batch_size,
    )


def clean_margins(
    model: HookedModel | EventModel,
    batch: EventBatch,
    extra_hooks: Sequence[HookPair] = (),
    batch_size: int = 256,
) -> Float[Tensor, "event"]:
    """The events' margins with no intervention (but `extra_hooks`, the same for every chunk)."""
    return chunked_margins(model, batch, lambda sub: list(extra_hooks), batch_size)


def choose_backend(
    model: HookedModel | EventModel, engine: bool = True, **engine_options: Any
) -> tuple[EventModel, str | None]:
    """A run's backend: the intervention engine when `engine` and the architecture has an adapter
    (`engine_options` go to it), else the full forward; and why the engine was not used, if it was
    asked for (recorded, and warned as :class:`EngineFallbackWarning`)."""
    backend = backend_for(model)
    if not engine:
        return FullForward(backend.model), None
    if not isinstance(backend, FullForward):  # already an engine
        return backend, None
    try:
        return InterventionEngine(backend.model, **engine_options), None
    except EngineUnsupported as err:
        warnings.warn(f"{err}: the run uses the full forward", EngineFallbackWarning, stacklevel=2)
        return backend, str(err)


def backend_record(backend: EventModel, fallback: str | None = None) -> dict[str, Any]:
    """What a run's summary says of its backend: its name, why the engine was not used, and the
    engine's self-check against the model's own forward."""
    if isinstance(backend, FullForward):
        return {"name": "full forward", **({"fallback": fallback} if fallback else {})}
    return {"name": "engine", "check": getattr(backend, "check_record", None)}
