"""plotly figures of the characterisation, written as HTML (and PNG where kaleido works).

All HTML files in one folder share one `plotly.min.js` written beside them, so the figures open
offline without repeating the 4 MB bundle in every file.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from mistill_lens.lens.calibration import Calibration


def head_map_figure(calibration: Calibration) -> go.Figure:
    """Layer x head maps per event kind: raw mean effect next to the calibrated z-score."""
    kinds = calibration.kinds
    counts = dict(zip(kinds, calibration.n_events))
    titles = [
        f"{kind} (n={counts.get(kind, '?')}): {what}"
        for kind in kinds
        for what in ("raw effect (logits)", "calibrated (z vs null)")
    ]
    fig = make_subplots(rows=len(kinds), cols=2, subplot_titles=titles, horizontal_spacing=0.12)
    for row, kind in enumerate(kinds, start=1):
        k = calibration.kind_index(kind)
        for col, (values, scale) in enumerate(
            ((calibration.raw[k], "Blues"), (calibration.z[k], "RdBu_r")), start=1
        ):
            fig.add_trace(
                go.Heatmap(
                    z=values.tolist(),
                    colorscale=scale,
                    zmid=0 if col == 2 else None,
                    colorbar=dict(
                        len=1 / len(kinds),
                        y=1 - (row - 0.5) / len(kinds),
                        x=0.45 if col == 1 else 1.0,
                    ),
                    hovertemplate="layer %{y}, head %{x}: %{z:.3g}<extra></extra>",
                ),
                row=row,
                col=col,
            )
            fig.update_xaxes(title_text="head", row=row, col=col)
            fig.update_yaxes(title_text="layer", row=row, col=col)
    fig.update_layout(
        title=f"Head scores per event kind ({calibration.n_null} null events)",
        height=320 * len(kinds),
        width=900,
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


def attention_families_figure(families: pd.DataFrame) -> go.Figure:
    """Attention mass of each circuit head to each target family, as a multiple of uniform attention."""
    fig = go.Figure()
    counts = families["n_events"] if "n_events" in families else [None] * len(families)
    labels = [
        f"L{l}H{h} ({k}{'' if n is None else f', n={n}'})"
        for k, l, h, n in zip(families["kind"], families["layer"], families["head"], counts)
    ]
    for column in [c for c in families.columns if c.startswith("ratio_")]:
        fig.add_trace(go.Bar(x=labels, y=families[column], name=column.removeprefix("ratio_")))
    fig.update_layout(
        title="Attention to the region's candidates and to the near-miss mention",
        yaxis_title="attention mass / uniform",
        barmode="group",
    )
    return fig


def elicitation_figure(curve: pd.DataFrame) -> go.Figure:
    """Held-out readout accuracy of the region k tokens before it is written (best stage per k)."""
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
        title=f"Early elicitation of the region{held_out}",
        xaxis_title="tokens before the region token (k)",
        yaxis_title="held-out accuracy",
        yaxis_range=[0, 1.05],
    )
    return fig


def write_figure(fig: go.Figure, path: Path) -> list[Path]:
    """Write `path` (.html) and, if kaleido can render, the same name as .png. Returns what was written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bundle = path.parent / "plotly.min.js"
    if not bundle.exists():
        bundle.write_text(get_plotlyjs(), encoding="utf-8")
    fig.write_html(path, include_plotlyjs="directory")
    written = [path]
    try:
        fig.write_image(path.with_suffix(".png"))
        written.append(path.with_suffix(".png"))
    except (ImportError, ValueError, RuntimeError):
        pass  # no working kaleido here: HTML only
    return written
