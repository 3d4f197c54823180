"""plotly figures of the characterisation, written as self-contained HTML (and PNG on request,
where kaleido works): each file carries plotly.js, so it opens offline on its own.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.events import EncodedExample
from mistill_lens.lens.hooks import Head


def head_map_figure(
    calibration: Calibration,
    circuits: Mapping[str, Sequence[Head]] | None = None,
    z_min: float | None = None,
    swept: Iterable[Head] | None = None,
) -> go.Figure:
    """Layer x head maps per event kind: raw mean effect (logits) next to the calibrated z-score.

    Both on diverging scales centred at zero, each with one scale shared by every kind (a z of 2
    is the same colour in every row); each kind's circuit heads are outlined, the z threshold is
    marked on the z colour bar; heads not swept (`swept` given) are grey, never a zero effect.
    Layer 0 is at the top, as in TransformerLens's and plotly's `imshow` maps."""
    kinds = calibration.kinds
    counts = dict(zip(kinds, calibration.n_events))
    n_layers, n_heads = calibration.null_mean.shape
    unswept = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    if swept is not None:
        unswept[:] = True
        for layer, head in swept:
            unswept[layer, head] = False
    raw = calibration.raw.masked_fill(unswept, float("nan"))
    z = calibration.z.masked_fill(unswept, float("nan"))
    raw_span = max(float(raw.nan_to_num(0).abs().max()), 1e-6)
    z_span = max(float(z.nan_to_num(0).abs().max()), z_min or 0.0, 1e-6)
    if z_min is not None:
        threshold = f", circuit z >= {z_min:g} outlined"
    else:  # a circuit chosen otherwise (by joint effect), or none
        threshold = ", circuit outlined" if circuits and any(circuits.values()) else ""
    titles = [
        f"{kind} (n={counts.get(kind, '?')} events): {what}"
        for kind in kinds
        for what in ("raw effect (logits)", "calibrated z vs null")
    ]
    fig = make_subplots(
        rows=len(kinds),
        cols=2,
        subplot_titles=titles,
        horizontal_spacing=0.2,
        vertical_spacing=0.5 / max(len(kinds), 1) / 2,
    )
    for row, kind in enumerate(kinds, start=1):
        k = calibration.kind_index(kind)
        for col, (values, axis) in enumerate(
            ((raw[k], "coloraxis"), (z[k], "coloraxis2")), start=1
        ):
            fig.add_trace(
                go.Heatmap(
                    z=[[None if v != v else v for v in line] for line in values.tolist()],
                    coloraxis=axis,
                    hovertemplate="L%{y}H%{x}: %{z:.3g}<extra>" + kind + "</extra>",
                ),
                row=row,
                col=col,
            )
            # each circuit head outlined by its own cell's edges (data coordinates), so the
            # outline sits on the cell at any number of layers and any figure size
            for layer, head in (circuits or {}).get(kind, []):
                fig.add_shape(
                    type="rect",
                    x0=head - 0.5,
                    x1=head + 0.5,
                    y0=layer - 0.5,
                    y1=layer + 0.5,
                    line=dict(color="black", width=2),
                    row=row,
                    col=col,
                )
            # fixed ranges: exactly the cells, no padding band that would read as "not swept"
            fig.update_xaxes(
                title_text="head", dtick=1, range=[-0.5, n_heads - 0.5], row=row, col=col
            )
            fig.update_yaxes(
                title_text="layer",
                range=[n_layers - 0.5, -0.5],
                tick0=0,
                dtick=1 if n_layers <= 16 else 5,
                row=row,
                col=col,
            )
    z_ticks = sorted({0.0, round(z_span, 1), round(-z_span, 1), *([z_min] if z_min else [])})
    fig.update_layout(
        title=f"Head effects per event kind ({calibration.n_null} null events{threshold}; grey: not swept)",
        coloraxis=dict(
            colorscale="RdBu_r",
            cmin=-raw_span,
            cmax=raw_span,
            colorbar=dict(title="logits", x=0.41, len=0.9),
        ),
        coloraxis2=dict(
            colorscale="RdBu_r",
            cmin=-z_span,
            cmax=z_span,
            colorbar=dict(
                title="z",
                x=1.02,
                len=0.9,
                tickvals=z_ticks,
                ticktext=[
                    f"{t:g} (threshold)" if z_min is not None and t == z_min else f"{t:g}"
                    for t in z_ticks
                ],
            ),
        ),
        plot_bgcolor="#bdbdbd",
        height=max(300, 14 * n_layers) * len(kinds) + 120,
        width=1100,  # room for the z colour bar's "(threshold)" label
    )
    return fig


def ablation_curve_figure(curve: pd.DataFrame) -> go.Figure:
    """Fraction of the clean margin kept vs number of heads ablated, by score vs random order."""
    fig = go.Figure()
    for (kind, order), rows in curve.groupby(["kind", "order"], sort=False):
        n = f" (n={int(rows['n_events'].iloc[0])})" if "n_events" in rows else ""
        fig.add_trace(
            go.Scatter(
                x=rows["n_ablated"],
                y=rows["fraction_kept"],
                mode="lines+markers",
                name=f"{kind}{n}, {order}",
                line=dict(dash="solid" if order == "by score" else "dot"),
            )
        )
    fig.update_layout(
        title="Margin vs heads ablated",
        xaxis_title="heads mean-ablated",
        yaxis_title="fraction of clean margin kept",
    )
    return fig


def attention_families_figure(
    families: pd.DataFrame, circuit: Iterable[Head] = (), top: int = 3
) -> go.Figure:
    """Attention mass to each target family as a multiple of uniform attention, for the circuit's
    heads and, per kind and family, the `top` heads with the largest ratio (every head when the
    model has few): where the circuit looks, beside the heads that look there most."""
    circuit = {tuple(h) for h in circuit}
    ratios = [c for c in families.columns if c.startswith("ratio_")]
    keep = pd.Series(
        [(l, h) in circuit for l, h in zip(families["layer"], families["head"])],
        index=families.index,
    )
    for _, rows in families.groupby("kind", sort=False):
        for column in ratios:
            keep[rows[column].nlargest(top).index] = True
    shown = families[keep]
    counts = shown["n_events"] if "n_events" in shown else [None] * len(shown)
    labels = [
        f"L{l}H{h}{'*' if (l, h) in circuit else ''} ({k}{'' if n is None else f', n={n}'})"
        for k, l, h, n in zip(shown["kind"], shown["layer"], shown["head"], counts)
    ]
    fig = go.Figure()
    for column in ratios:
        fig.add_trace(go.Bar(x=labels, y=shown[column], name=column.removeprefix("ratio_")))
    fig.update_layout(
        title=f"Attention to the region's candidates and to the near-miss mention (* circuit; "
        f"top {top} heads per kind and family)",
        yaxis_title="attention mass / uniform",
        barmode="group",
    )
    return fig


def elicitation_figure(curve: pd.DataFrame, kind: str = "region") -> go.Figure:
    """Held-out readout accuracy of the `kind` decision k tokens before it is written (best stage
    per k)."""
    fig = go.Figure()
    for method, rows in curve.groupby("method"):
        best = rows.loc[rows.groupby("k")["accuracy"].idxmax()]
        fig.add_trace(
            go.Scatter(
                x=best["k"],
                y=best["accuracy"],
                mode="lines+markers",
                name=method,
                text=best["stage_name"],
                hovertemplate="k=%{x}: %{y:.2f} at %{text}<extra></extra>",
            )
        )
    if len(curve):
        fig.add_hline(
            y=float(curve["chance"].iloc[0]), line_dash="dot", annotation_text="majority class"
        )
    held_out = (
        f" ({int(curve['n_held_out'].iloc[0])} held-out events)"
        if len(curve) and "n_held_out" in curve
        else ""
    )
    fig.update_layout(
        title=f"Early elicitation of the {kind} decision{held_out}",
        xaxis_title=f"tokens before the {kind} token (k)",
        yaxis_title="held-out accuracy",
        yaxis_range=[0, 1.05],
    )
    return fig


MEASURE_COLOURS = {"necessity": "#1f77b4", "sufficiency": "#ff7f0e"}
METHOD_DASHES = {"greedy": "solid", "mask": "dash", "single": "dashdot"}
METHOD_NAMES = {
    "greedy": "greedy search",
    "mask": "learned mask, top n",
    "single": "single-head ranking, top n",
}


def faithfulness_figure(faithful: Mapping[str, Mapping]) -> go.Figure:
    """Per kind (a ``summary.json`` ``faithful`` block): each search method's curves on the
    discovery events (the greedy search solid; a learned mask's and the single-head ranking's
    top-n sets dashed, when compared), the band random head sets of each size make on the same events (central 95 %
    of the draws, and their mean), and the found set measured on the validation events."""
    kinds = list(faithful)
    fig = make_subplots(
        rows=1,
        cols=len(kinds),
        shared_yaxes=True,
        subplot_titles=[
            f"{kind}: {faithful[kind]['size']} heads (n={faithful[kind]['n_events']} validation "
            "events)"
            for kind in kinds
        ],
    )
    for col, kind in enumerate(kinds, start=1):
        found = faithful[kind]
        curves = pd.DataFrame(found["curves"])
        band = pd.DataFrame(found.get("random_band", []))
        for measure, colour in MEASURE_COLOURS.items():
            legend = col == 1
            if len(band):
                rows = band[band["measure"] == measure]
                fig.add_trace(
                    go.Scatter(
                        x=[*rows["size"], *rows["size"][::-1]],
                        y=[*rows["high"], *rows["low"][::-1]],
                        fill="toself",
                        fillcolor=colour,
                        opacity=0.15,
                        line=dict(width=0),
                        name=f"{measure}: random sets (95 %, {int(rows['draws'].iloc[0])} draws)",
                        legendgroup=f"band {measure}",
                        showlegend=legend,
                        hoverinfo="skip",
                    ),
                    row=1,
                    col=col,
                )
                fig.add_trace(
                    go.Scatter(
                        x=rows["size"],
                        y=rows["mean"],
                        mode="lines",
                        line=dict(color=colour, dash="dot"),
                        name=f"{measure}: random sets, mean",
                        legendgroup=f"mean {measure}",
                        showlegend=legend,
                    ),
                    row=1,
                    col=col,
                )
            if "method" not in curves:  # a summary written before methods were compared
                curves["method"] = "greedy"
            for method, rows in curves[curves["measure"] == measure].groupby("method", sort=False):
                fig.add_trace(
                    go.Scatter(
                        x=rows["size"],
                        y=rows["value"],
                        mode="lines+markers",
                        line=dict(color=colour, dash=METHOD_DASHES.get(method, "solid")),
                        text=rows["heads"],
                        hovertemplate="%{x} heads: %{y:.2f}<br>%{text}<extra></extra>",
                        name=f"{measure}: {METHOD_NAMES.get(method, method)} (discovery)",
                        legendgroup=f"{method} {measure}",
                        showlegend=legend,
                    ),
                    row=1,
                    col=col,
                )
            low, high = found[f"{measure}_ci"]
            fig.add_trace(
                go.Scatter(
                    x=[found["size"]],
                    y=[found[measure]],
                    error_y=dict(
                        type="data",
                        array=[high - found[measure]],
                        arrayminus=[found[measure] - low],
                    ),
                    mode="markers",
                    marker=dict(color=colour, symbol="star", size=12),
                    name=f"{measure}: found set (validation, 95 % CI)",
                    legendgroup=f"found {measure}",
                    showlegend=legend,
                ),
                row=1,
                col=col,
            )
        fig.add_hline(y=found["target"], line_dash="dash", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="heads in the set", row=1, col=col)
    fig.update_yaxes(title_text="share of the margin (sufficiency: normalised)", row=1, col=1)
    fig.update_layout(title="Faithfulness of head sets: the search vs random sets of each size")
    return fig


def stability_figure(faithful: Mapping[str, Mapping]) -> go.Figure:
    """Per kind whose search was rerun on bootstrap resamples (a ``faithful`` block's
    ``stability``): how often each pool head was chosen, the heads of the set found on all the
    discovery examples in the kind's colour and the rest in grey; heads never chosen are left out
    (their count is in the title)."""
    kinds = [kind for kind in faithful if "stability" in faithful[kind]]
    titles = []
    for kind in kinds:
        stability = faithful[kind]["stability"]
        never = sum(share == 0 for share in stability["frequency"].values())
        titles.append(
            f"{kind}: {stability['resamples'] - stability['failed']} resamples "
            f"({never} of {len(stability['frequency'])} pool heads never chosen)"
        )
    fig = make_subplots(rows=len(kinds), cols=1, subplot_titles=titles, vertical_spacing=0.12)
    for row, kind in enumerate(kinds, start=1):
        found = {f"L{l}H{h}" for l, h in faithful[kind]["heads"]}
        chosen = {h: f for h, f in faithful[kind]["stability"]["frequency"].items() if f > 0}
        fig.add_trace(
            go.Bar(
                x=list(chosen),
                y=list(chosen.values()),
                marker_color=["#d62728" if head in found else "#7f7f7f" for head in chosen],
                hovertemplate="%{x}: chosen in %{y:.0%} of the resamples<extra></extra>",
                showlegend=False,
            ),
            row=row,
            col=1,
        )
        fig.update_yaxes(title_text="share of resamples", range=[0, 1.05], row=row, col=1)
    fig.update_layout(
        title="Selection stability: how often each head is in the found set (red: the set found "
        "on all discovery examples)",
        height=max(320, 280 * len(kinds)),
    )
    return fig


def components_figure(components: Mapping[str, Mapping[str, Mapping]]) -> go.Figure:
    """Per site (MLP outputs, attention outputs): each kind's share of the margin lost when a
    layer's output at the events is replaced by its mean, one layer at a time (bars) and for
    layers 0..l together (line)."""
    sites = list(components)
    fig = make_subplots(
        rows=1,
        cols=len(sites),
        shared_yaxes=True,
        subplot_titles=[f"{site} at the decision token" for site in sites],
    )
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
    for col, site in enumerate(sites, start=1):
        for index, (kind, shares) in enumerate(components[site].items()):
            colour = palette[index % len(palette)]
            layers = list(range(len(shares["single"])))
            label = f"{kind} (n={shares['n_events']})"
            fig.add_trace(
                go.Bar(
                    x=layers,
                    y=shares["single"],
                    marker_color=colour,
                    opacity=0.5,
                    name=f"{label}: one layer",
                    legendgroup=kind,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
            fig.add_trace(
                go.Scatter(
                    x=layers,
                    y=shares["cumulative"],
                    mode="lines",
                    line=dict(color=colour),
                    name=f"{label}: layers 0..l",
                    legendgroup=kind,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="layer", row=1, col=col)
    fig.update_yaxes(title_text="share of the mean clean margin lost", row=1, col=1)
    fig.update_layout(
        title="Layer outputs' shares of the margin (mean-replaced at the predicting position only: "
        "MLP work at earlier positions is not in these numbers)",
        barmode="group",
        height=450,
        width=1100,
    )
    return fig


def token_labels(encoded: EncodedExample) -> list[str]:
    """Each token's text from the example's character offsets, numbered so every label is unique
    (plotly merges equal category labels)."""
    return [
        f"{i}:{encoded.text[start:end].replace(chr(10), '⏎')}"
        for i, (start, end) in enumerate(encoded.offsets)
    ]


def event_margins_figure(
    encoded: EncodedExample, margins: Sequence[float], first: int | None = None
) -> go.Figure:
    """The example's tokens (from `first`, default the start of the output) with the decision
    margin of each event drawn at its token, coloured by kind: where the model decides, and how
    firmly (logit(chosen) - logit(contrast); below zero it prefers the contrast)."""
    labels = token_labels(encoded)
    first = encoded.prompt_tokens if first is None else first
    fig = go.Figure(
        go.Bar(
            x=labels[first:],
            y=[0.0] * (len(labels) - first),
            marker_color="#dddddd",
            showlegend=False,
            hoverinfo="x",
        )
    )
    for kind in dict.fromkeys(e.kind for e in encoded.events):
        rows = [(e, m) for e, m in zip(encoded.events, margins) if e.kind == kind]
        fig.add_trace(
            go.Bar(
                x=[labels[e.position] for e, _ in rows],
                y=[float(m) for _, m in rows],
                name=f"{kind} (n={len(rows)})",
                hovertemplate="%{x}: margin %{y:.2f}<extra>" + kind + "</extra>",
            )
        )
    fig.update_layout(
        title=f"Decision margins at the events of example {encoded.example_id} (tokens from {first})",
        xaxis=dict(
            title="token", tickangle=-60, categoryorder="array", categoryarray=labels[first:]
        ),
        yaxis_title="margin (logits)",
        barmode="overlay",
        height=420,
    )
    return fig


def attention_row_figure(
    encoded: EncodedExample, row: Sequence[float], query: int, title: str, first: int = 0
) -> go.Figure:
    """One attention row over the example's tokens, token-labelled: where a head looks from
    position `query` (the predicting position of an event); its five most attended tokens are
    marked and named."""
    labels = token_labels(encoded)[first : query + 1]
    values = [float(v) for v in list(row)[first : query + 1]]
    hover = "%{x}: %{y:.3f}<extra></extra>"
    # a bar per token is sub-pixel over a long context: there the row is a filled line
    fig = go.Figure(
        go.Bar(x=labels, y=values, hovertemplate=hover, showlegend=False)
        if len(labels) <= 200
        else go.Scatter(
            x=labels, y=values, mode="lines", fill="tozeroy", hovertemplate=hover, showlegend=False
        )
    )
    top = sorted(range(len(values)), key=lambda i: -values[i])[:5]
    fig.add_trace(
        go.Scatter(
            x=[labels[i] for i in top],
            y=[values[i] for i in top],
            mode="markers",
            hovertemplate=hover,
            showlegend=False,
        )
    )
    # named by arrows of staggered lengths: neighbouring top tokens of similar weight would
    # otherwise print their names over each other
    for rank, i in enumerate(top):
        fig.add_annotation(
            x=labels[i],
            y=values[i],
            text=labels[i],
            showarrow=True,
            arrowhead=0,
            ax=0,
            ay=-(18 + 16 * rank),
        )
    fig.update_layout(
        title=title,
        xaxis=dict(title=f"source token (query: {labels[-1]})", tickangle=-60),
        yaxis_title="attention",
        height=450,
        width=1000,
    )
    return fig


def with_warnings(fig: go.Figure, warnings: Sequence[str]) -> go.Figure:
    """`fig` with the run's recorded warnings printed under it: a figure read on its own (an HTML
    file passed around) keeps its caveats (too few events, null events or examples)."""
    if not warnings:
        return fig
    lines = "<br>".join(f"warning: {textwrap.shorten(w, 160)}" for w in warnings)
    fig.add_annotation(
        text=lines,
        xref="paper",
        yref="paper",
        x=0,
        y=0,
        yshift=-60,
        yanchor="top",
        xanchor="left",
        align="left",
        showarrow=False,
        font=dict(size=11, color="#b35900"),
    )
    bottom = 80 + 16 * len(warnings)
    fig.update_layout(margin=dict(b=bottom), height=(fig.layout.height or 450) + 16 * len(warnings))
    return fig


def write_figure(fig: go.Figure, path: Path, png: bool = False) -> list[Path]:
    """Write `path` (.html, self-contained: plotly.js inline, so the file opens offline on its own
    wherever it is copied) and, with `png`, the same name as .png where kaleido can render (it
    drives a local Chromium). Returns what was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs=True)
    written = [path]
    if png:
        try:
            fig.write_image(path.with_suffix(".png"))
            written.append(path.with_suffix(".png"))
        except (ImportError, ValueError, RuntimeError):
            pass  # no working kaleido here: HTML only
    return written
