"""Which layer outputs carry a decision: the MLPs' and the attention blocks' shares of the margin.

Heads are not the only candidates: "is the region decided by heads or by MLPs?" is answered by
mean-ablating a layer's MLP output (``hook_mlp_out``) or attention output (``hook_attn_out``) at
the event's predicting position, with the per-kind mean of that output over reference events, and
reading the share of the mean clean margin that goes: one layer at a time, and cumulatively (layers
0..l together). Interventions at the predicting position miss what MLPs do at earlier positions
(an MLP that writes a fact into the residual of a mention, read later by a head): a low MLP share
here bounds only the MLPs' work *at the decision token*.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.backends import chunked_margins
from mistill_lens.lens.events import EventBatch, kind_mask
from mistill_lens.lens.model_types import HookedModel

SITES = ("hook_mlp_out", "hook_attn_out")


def output_means(
    model: HookedModel, reference: EventBatch, site: str, kinds: Sequence[str]
) -> Float[Tensor, "kind layer d_model"]:
    """Per kind, the mean of every layer's `site` output at the reference events' predicting
    positions (recorded by hooks that change nothing)."""
    n_layers = model.cfg.n_layers
    store: dict[int, list[Tensor]] = {layer: [] for layer in range(n_layers)}

    def hooks_for(sub: EventBatch):
        rows = torch.arange(len(sub))

        def keep(layer):
            def fn(act, hook):
                store[layer].append(act[rows, sub.predict_positions].detach().float())

            return fn

        return [(f"blocks.{layer}.{site}", keep(layer)) for layer in range(n_layers)]

    chunked_margins(model, reference, hooks_for)
    outputs = torch.stack([torch.cat(store[layer]) for layer in range(n_layers)], dim=1)
    means = []
    for kind in kinds:
        rows = kind_mask(reference.kinds, kind)
        if not rows.any():
            raise ValueError(f"no reference events of kind {kind!r} for the {site} means")
        means.append(outputs[rows].mean(dim=0))
    return torch.stack(means)  # [kind, layer, d_model]


def component_summary(table: pd.DataFrame, top: int = 3) -> dict[str, dict]:
    """:func:`component_shares`'s table per kind: every layer together (the last cumulative
    share), the `top` single layers, the per-layer shares and the number of events."""
    out = {}
    for kind, rows in table.groupby("kind", sort=False):
        largest = rows.sort_values("single", ascending=False).head(top)
        out[kind] = {
            "all_layers": float(rows["cumulative"].iloc[-1]),
            "top": [[int(r.layer), float(r.single)] for r in largest.itertuples()],
            "single": [float(v) for v in rows["single"]],
            "cumulative": [float(v) for v in rows["cumulative"]],
            "n_events": int(rows["n_events"].iloc[0]),
        }
    return out


def component_shares(
    model: HookedModel, batch: EventBatch, reference: EventBatch, site: str = "hook_mlp_out"
) -> pd.DataFrame:
    """Per kind and layer: the share of the kind's mean clean margin lost when `site`'s output at
    the events is replaced by its per-kind reference mean, for that layer alone (`single`) and for
    layers 0..layer together (`cumulative`)."""
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    kinds = list(dict.fromkeys(batch.kinds))
    means = output_means(model, reference, site, kinds)
    n_layers = model.cfg.n_layers

    def replaced(sub: EventBatch, layers: Sequence[int]):
        kind_index = torch.tensor([kinds.index(k) for k in sub.kinds])
        rows = torch.arange(len(sub))

        def hook(layer):
            def fn(act, hook):
                act = act.clone()
                act[rows, sub.predict_positions] = means[kind_index, layer].to(act.dtype)
                return act

            return fn

        return [(f"blocks.{layer}.{site}", hook(layer)) for layer in layers]

    clean = chunked_margins(model, batch, lambda sub: [])
    out = []
    for kind in kinds:
        rows = kind_mask(batch.kinds, kind)
        sub = batch.select(rows)
        base = float(clean[rows].mean())
        if base <= 0:
            raise ValueError(f"the mean clean margin of the {kind!r} events is {base:.3g}")
        for layer in range(n_layers):
            single = chunked_margins(model, sub, lambda b, l=layer: replaced(b, [l]))
            upto = chunked_margins(model, sub, lambda b, l=layer: replaced(b, range(l + 1)))
            out.append(
                {
                    "kind": kind,
                    "site": site,
                    "layer": layer,
                    "single": (base - float(single.mean())) / base,
                    "cumulative": (base - float(upto.mean())) / base,
                    "n_events": len(sub),
                }
            )
    return pd.DataFrame(out)
