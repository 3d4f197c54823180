"""An event's attention rows over the example's tokens, in CircuitsVis (the TransformerLens
community's viewer): each chosen head's attention from the token that predicts the decision, one
colouring per head, hover for every head's value at a token. CircuitsVis is an optional extra
(``pip install 'mistill_lens[circuitsvis]'``); the rows come from the model's backend, so the
engine serves them at decode cost."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.backends import backend_for
from mistill_lens.lens.events import EncodedExample, make_event_batch
from mistill_lens.lens.hooks import Head, validate_heads
from mistill_lens.lens.model_types import HookedModel
from mistill_lens.lens.plot import token_labels

if TYPE_CHECKING:
    from circuitsvis.utils.render import RenderedHTML

INSTALL = "pip install 'mistill_lens[circuitsvis]'"


def event_attention_rows(
    model: HookedModel, example: EncodedExample, event: int, heads: Iterable[Head | str]
) -> Float[Tensor, "head key"]:
    """Each head's attention row from the predicting position of ``example.events[event]`` over
    positions 0..that position (a head given by name, ``"L23H3"``, or as ``(layer, head)``)."""
    if not 0 <= event < len(example.events):
        raise ValueError(
            f"event {event} is out of range: example {example.example_id} has "
            f"{len(example.events)} events (0-{len(example.events) - 1})"
        )
    heads = validate_heads(model, heads)
    decision = example.events[event]
    batch = make_event_batch([example], [decision])
    rows = backend_for(model).event_rows(batch, sorted({layer for layer, _ in heads}))
    query = decision.predict_position
    return torch.stack([rows[layer][0, head, : query + 1].float() for layer, head in heads])


def circuitsvis_view(
    model: HookedModel, example: EncodedExample, event: int, heads: Iterable[Head | str]
) -> RenderedHTML:
    """The rows of :func:`event_attention_rows` as a CircuitsVis ``colored_tokens_multi`` view
    (renders in a notebook; :func:`write_circuitsvis_view` saves it as a page)."""
    try:
        from circuitsvis.tokens import colored_tokens_multi
    except ImportError:
        raise ImportError(
            f"the CircuitsVis view needs the circuitsvis package: {INSTALL}"
        ) from None
    heads = validate_heads(model, heads)
    rows = event_attention_rows(model, example, event, heads)
    tokens = token_labels(example)[: rows.shape[1]]
    return colored_tokens_multi(tokens, rows.T.contiguous(), [f"L{l}H{h}" for l, h in heads])


def write_circuitsvis_view(view: RenderedHTML, path: str | Path) -> Path:
    """A self-contained page (CircuitsVis's JavaScript inlined, so it opens offline)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<!DOCTYPE html>\n<html><body>{view.local_src}</body></html>\n")
    return path
