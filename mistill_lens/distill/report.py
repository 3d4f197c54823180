"""The results table over runs: per student family x objective x precision, mean and std over
seeds of causal recovery and task accuracy, with a plotly figure; and MISTILL vs CoT paired by
seed (same data, order and initialisation: the seed is the unit of replication)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from mistill_lens.distill.evaluation import EVALUATION_FILE, median_recovery
from mistill_lens.distill.mention_pairs import mention_comparison
from mistill_lens.distill.significance import sign_flip_p_value
from mistill_lens.lens.plot import write_figure
from mistill_lens.models.precision import legacy_compute
from mistill_lens.runs import claim_run_dir, legacy_run
from mistill_lens.training.checkpoint_state import TRAINING_STATE_FILE

CELL = ["family", "objective", "precision"]
METRICS = ["causal_recovery", "code_f1", "near_miss_acc"]
# Reported next to the mean recovery: robust to an event whose clean margin is barely positive.
MEDIAN = "causal_recovery_median"
# Plotted and in the JSON next to METRICS: whether the student's attention at events moved to the
# teacher's (training KL over the last tenth of steps; logged by both objectives).
ATTENTION = "attention_loss_tail"
EXTRA = [
    MEDIAN,
    "recovery_ablation",
    "recovery_knock_in",
    "recovery_knock_in_pooled",
    ATTENTION,
    "train_time_s",
]
# A student counts in a comparison only where its CoT run can do the task: held-out code_f1 and
# near-miss accuracy at least this, on at least GATE_MIN_EVAL examples. Below it a cell stays in
# the tables, marked.
GATE = {"code_f1": 0.5, "near_miss_acc": 0.5}
GATE_MIN_EVAL = 50
CURVE_FILE = "training_curve.csv"  # a run's losses by step, where its training state is not kept
CURVE_WINDOW = 25  # steps averaged per point of a training curve


def training_curve(run_dir: str | Path, window: int = CURVE_WINDOW) -> pd.DataFrame | None:
    """A run's training curve: per `window` steps, the mean CoT loss and the mean attention KL at
    the events (logged by both objectives; steps whose batch holds no event are left out), from
    its training state, or from the ``training_curve.csv`` a shipped or recorded run carries (None:
    neither). Columns: step (the window's last), cot, attention."""
    run_dir = Path(run_dir)
    if (run_dir / CURVE_FILE).is_file():
        return pd.read_csv(run_dir / CURVE_FILE)
    state_file = run_dir / TRAINING_STATE_FILE
    if not state_file.is_file():
        return None
    log = torch.load(state_file, weights_only=False, map_location="cpu")["log"]
    rows = []
    for start in range(0, len(log["cot"]), window):
        attention = [a for a in log["attention"][start : start + window] if a is not None]
        rows.append(
            {
                "step": min(start + window, len(log["cot"])),
                "cot": float(np.mean(log["cot"][start : start + window])),
                "attention": float(np.mean(attention)) if attention else None,
            }
        )
    return pd.DataFrame(rows)


def curves_figure(curves: dict[str, pd.DataFrame]) -> go.Figure:
    """Training curves by run (label: family / objective / precision / seed): CoT loss and the
    attention KL at the events, side by side."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=[
            f"CoT loss (mean per {CURVE_WINDOW} steps)",
            "attention KL at the events (both objectives log it)",
        ],
    )
    for label, curve in curves.items():
        for col, column in enumerate(("cot", "attention"), start=1):
            fig.add_trace(
                go.Scatter(
                    x=curve["step"],
                    y=curve[column],
                    mode="lines",
                    name=label,
                    legendgroup=label,
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="step")
    fig.update_layout(title="Training curves", height=450, width=1100)
    return fig


def load_evaluations(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    rows = []
    for run in run_dirs:
        path = Path(run) / EVALUATION_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{run} has no {EVALUATION_FILE}: run `mistill-lens distill` on it to completion"
            )
        row = json.loads(path.read_text())
        if (
            MEDIAN not in row
        ):  # evaluated before the median was recorded: same figure, from its per-event table
            row[MEDIAN] = median_recovery(Path(run) / "characterization")
        rows.append(row)
    if not rows:
        raise ValueError("no runs given")
    return pd.DataFrame(rows)


def passes_gate(row: pd.Series) -> bool:
    """Whether one evaluated run reaches the quality gate (:data:`GATE`, on enough examples)."""
    return int(row.get("n_eval", 0)) >= GATE_MIN_EVAL and all(
        row.get(metric) is not None and float(row[metric]) >= floor
        for metric, floor in GATE.items()
    )


def gate_by_cell(frame: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Per (family, precision): "passed" when every CoT run of it passes the gate, "failed" when
    one does not, "no cot run" without one."""
    gates = {}
    for (family, precision), runs in frame.groupby(["family", "precision"], sort=True):
        cot = runs[runs.objective == "cot"]
        if cot.empty:
            gates[(family, precision)] = "no cot run"
        else:
            passed = all(passes_gate(row) for _, row in cot.iterrows())
            gates[(family, precision)] = "passed" if passed else "failed"
    return gates


def summarise(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: n seeds, and mean / std (over seeds; 0 for a single seed) of each metric."""
    columns = [c for c in METRICS + EXTRA if c in frame]
    numeric = frame[CELL + ["seed"] + columns].copy()
    numeric[columns] = numeric[columns].astype(float)
    grouped = numeric.groupby(CELL, sort=True)
    table = grouped[columns].agg(["mean", "std"])
    table.columns = [f"{metric}_{stat}" for metric, stat in table.columns]
    table = table.fillna({c: 0.0 for c in table.columns if c.endswith("_std")})
    table.insert(
        0, "seeds", grouped["seed"].apply(lambda s: ",".join(str(int(x)) for x in sorted(s)))
    )
    table.insert(0, "n_seeds", grouped["seed"].nunique())
    table = table.reset_index()
    gates = gate_by_cell(frame)
    table.insert(3, "gate", [gates[(r.family, r.precision)] for r in table.itertuples()])
    return table


def paired_comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """Per family x precision x metric: MISTILL minus CoT over the seeds both objectives ran, with
    how many seeds MISTILL is higher and the sign-flip p-value."""
    rows = []
    metrics = [m for m in METRICS + [MEDIAN] if m in frame]
    for (family, precision), runs in frame.groupby(["family", "precision"], sort=True):
        for metric in metrics:
            pivot = runs.pivot_table(
                index="seed", columns="objective", values=metric, aggfunc="first"
            )
            if not {"cot", "mistill"} <= set(pivot.columns):
                continue
            both = pivot[["cot", "mistill"]].astype(float).dropna()
            if both.empty:
                continue
            if metric == metrics[0]:
                check_pairs(runs, both.index)
            diff = both.mistill - both.cot
            rows.append(
                {
                    "family": family,
                    "precision": precision,
                    "metric": metric,
                    "n_pairs": len(both),
                    "cot_mean": both.cot.mean(),
                    "mistill_mean": both.mistill.mean(),
                    "difference_mean": diff.mean(),
                    "mistill_higher": int((diff > 0).sum()),
                    "p_value": sign_flip_p_value(diff.tolist()),
                }
            )
    return pd.DataFrame(rows)


def check_pairs(runs: pd.DataFrame, seeds) -> None:
    """The CoT and MISTILL runs of each seed must have seen the same data in the same order from
    the same initial weights (each run records digests of both when it starts)."""
    if "paired" not in runs:
        return
    for seed in seeds:
        records = runs[runs.seed == seed]
        digests = {json.dumps(p, sort_keys=True) for p in records.paired if isinstance(p, dict)}
        if len(digests) > 1:
            raise ValueError(
                f"the runs of seed {seed} ({', '.join(map(str, records.run))}) started from "
                "different data or initial weights, so they are not a pair: rerun them with the "
                "same teacher, data options and student options"
            )
        computes = {_compute(row) for _, row in records.iterrows()}
        if len(computes) > 1:
            raise ValueError(
                f"the runs of seed {seed} ({', '.join(map(str, records.run))}) computed in "
                f"{' and '.join(sorted(computes))}, so they are not a pair: train both arms on "
                "machines alike in bf16 units (models/precision.py)"
            )


def _compute(row: pd.Series) -> str:
    """What a run computed in, by its record or, before it was recorded, the rule of its time."""
    recorded = row.get("compute")
    return recorded if isinstance(recorded, str) else legacy_compute("cpu", row.get("precision"))


def _reported(table: pd.DataFrame) -> list[str]:
    optional = [MEDIAN, ATTENTION]
    return METRICS + [
        m for m in optional if f"{m}_mean" in table and table[f"{m}_mean"].notna().any()
    ]


def report_json(table: pd.DataFrame) -> dict:
    out = {}
    for _, row in table.iterrows():
        key = "/".join(str(row[c]) for c in CELL)
        out[key] = {
            "n_seeds": int(row["n_seeds"]),
            "gate": row["gate"],
            **{
                f"{m}_{s}": (None if pd.isna(row[f"{m}_{s}"]) else round(float(row[f"{m}_{s}"]), 4))
                for m in _reported(table)
                for s in ("mean", "std")
            },
        }
    return out


def markdown_table(table: pd.DataFrame) -> str:
    def cell(value) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)
    ]
    return "\n".join(lines) + "\n"


def report_figure(table: pd.DataFrame) -> go.Figure:
    """Per metric: bars per family/precision, CoT vs MISTILL side by side, std over seeds as error bars."""
    metrics = _reported(table)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=metrics)
    for objective, color in (("cot", "#7f7f7f"), ("mistill", "#d62728")):
        rows = table[table.objective == objective]
        labels = [f"{f}/{p}" for f, p in zip(rows.family, rows.precision)]
        for col, metric in enumerate(metrics, start=1):
            fig.add_trace(
                go.Bar(
                    x=labels,
                    y=rows[f"{metric}_mean"],
                    name=objective,
                    legendgroup=objective,
                    showlegend=col == 1,
                    marker_color=color,
                    error_y=dict(type="data", array=rows[f"{metric}_std"].tolist()),
                    text=[f"n={n}" for n in rows.n_seeds],
                    textposition="inside",  # seeds behind each bar
                ),
                row=1,
                col=col,
            )
    fig.update_layout(
        barmode="group",
        title="MISTILL vs CoT distillation (mean ± std over seeds)",
        height=420,
        width=280 * len(metrics),
    )
    return fig


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> dict:
    """Write ``runs.csv``, ``table.csv``, ``paired.csv``, ``table.md``, ``figure.html``, where the
    runs recorded their mentions ``mentions.csv`` (`mention_comparison`) and, where the runs'
    training logs are at hand, ``training_curves.html``; returns the JSON summary."""
    out_dir = claim_run_dir(
        out_dir,
        "distill-report",
        legacy_run(
            ["runs.csv", "table.md"],
            [
                "table.csv",
                "paired.csv",
                "figure.html",
                "figure.png",
                "plotly.min.js",
                "training_curves.html",
            ],
        ),
    )
    frame = load_evaluations(run_dirs)
    frame.drop(columns=["per_mention"], errors="ignore").to_csv(out_dir / "runs.csv", index=False)
    table = summarise(frame)
    table.to_csv(out_dir / "table.csv", index=False)
    paired = paired_comparison(frame)
    paired.to_csv(out_dir / "paired.csv", index=False)
    mentions = mention_comparison(frame)
    if len(mentions):
        mentions.to_csv(out_dir / "mentions.csv", index=False)
    (out_dir / "table.md").write_text(
        markdown_table(table)
        + (
            "\nMISTILL vs CoT, paired by seed (sign-flip permutation p-value):\n\n"
            + markdown_table(paired)
            if len(paired)
            else ""
        )
        + (
            "\nMISTILL vs CoT within a seed, on the same held-out mentions (sign-flip p-value "
            "over examples; pooled: over every seed's examples):\n\n" + markdown_table(mentions)
            if len(mentions)
            else ""
        )
    )
    write_figure(report_figure(table), out_dir / "figure.html")
    curves = {
        f"{row.family}/{row.objective}/{row.precision}/seed {row.seed}": curve
        for run, (_, row) in zip(run_dirs, frame.iterrows())
        for curve in [training_curve(run)]
        if curve is not None
    }
    if curves:
        write_figure(curves_figure(curves), out_dir / "training_curves.html")
    return report_json(table)
