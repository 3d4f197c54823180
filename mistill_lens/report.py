"""One self-contained HTML report over runs: the figures, the numbers behind them, their sample
sizes, and the command lines and seeds that made them.

A run is a characterisation folder (``characterize``: its ``summary.json`` and tables) or a
distilled student (``distill``: its ``evaluation.json`` and ``mistill.json``). The page carries
plotly.js once, inline: it opens with no other file beside it and no network.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
from pathlib import Path
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from mistill_lens.distill.evaluation import EVALUATION_FILE
from mistill_lens.lens.outputs import SUMMARY, characterization_figures, read_characterization
from mistill_lens.lens.results import Characterization
from mistill_lens.runs import claim_run_dir

REPORT_FILE = "index.html"
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
table { border-collapse: collapse; margin: .8em 0; } td, th { border: 1px solid #ccc;
padding: .25em .6em; text-align: right; } th { background: #f3f3f3; } td:first-child,
th:first-child { text-align: left; } pre { background: #f6f6f6; padding: .6em; overflow-x: auto; }
.warning { color: #a40; } .figure { margin: 1em 0; }
"""
MEASURES = ("necessity", "sufficiency", "knock_in")


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path) -> Path:
    """Write ``index.html`` in `out_dir` (a new, empty or earlier report folder) over `run_dirs`;
    returns its path."""
    if not run_dirs:
        raise ValueError("no runs given: pass characterisation or distillation folders")
    sections = [_section(Path(run)) for run in run_dirs]
    out_dir = claim_run_dir(out_dir, "report")
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>mistill_lens report</title>"
        f"<style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body>"
        f"<h1>mistill_lens report</h1><p>{len(sections)} run(s), written {stamp}.</p>"
        + "".join(sections)
        + "</body></html>"
    )
    path = out_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path


def _section(run: Path) -> str:
    if (run / SUMMARY).is_file():
        return characterization_section(read_characterization(run), run)
    if (run / EVALUATION_FILE).is_file():
        return _distill_section(run)
    raise FileNotFoundError(
        f"{run} is neither a finished characterisation (no {SUMMARY}) nor an evaluated "
        f"distillation (no {EVALUATION_FILE}): give folders written by `mistill-lens characterize` "
        "or `mistill-lens distill`"
    )


def characterization_section(found: Characterization, run: Path | str) -> str:
    """The characterisation's key numbers, warnings, figures and provenance as HTML."""
    summary = found.summary()
    n_layers, n_heads = found.calibration.null_mean.shape
    circuit = ", ".join(f"L{l}H{h}" for l, h in found.circuit) or "none"
    rows = [
        [
            kind,
            measures["n_events"],
            ", ".join(f"L{l}H{h}" for l, h in measures["circuit"]) or "-",
            *(_number(measures[m]) for m in MEASURES),
            *(_number((measures["coverage"] or {}).get(m)) for m in MEASURES),
        ]
        for kind, measures in found.measures().items()
    ]
    measures_table = _table(
        [
            "kind",
            "decided events",
            "own circuit (z rule, this kind alone)",
            *(f"{m} of the global circuit" for m in MEASURES),
            *(f"coverage ({m})" for m in MEASURES),
        ],
        rows,
    ) + (_measures_note(circuit) if found.circuit else "")
    facts = _table(
        ["", ""],
        [
            [
                "circuit (all kinds)",
                f"{circuit} ({len(found.circuit)} of {n_layers * n_heads} heads)",
            ],
            [
                "examples / gold events / decided / null",
                f"{found.n_examples} / {found.n_events} / "
                f"{found.n_decided_events} / {found.n_null_events}",
            ],
            ["heads swept exactly", found.n_heads_swept],
            ["z threshold", found.config.z_min],
            ["attribution vs exact ablation (Spearman)", _number(found.spearman()["all"])],
            ["seed", found.config.seed],
        ],
    )
    figures = characterization_figures(found).values()
    warnings = "".join(f"<li class='warning'>{html.escape(w)}</li>" for w in found.warnings)
    command = summary.get("command", "(not recorded: a characterisation run from Python)")
    return (
        f"<h2>Characterisation: {html.escape(str(run))}</h2>"
        f"<p>Model {html.escape(str(summary.get('model', '?')))}.</p>"
        + facts
        + measures_table
        + (_faithful_table(found.faithful) if found.faithful else "")
        + (f"<ul>{warnings}</ul>" if warnings else "<p>No warnings.</p>")
        + "".join(_figure(fig) for fig in figures)
        + f"<p>Command:</p><pre>{html.escape(command)}</pre>"
        + f"<details><summary>summary.json</summary><pre>{html.escape(json.dumps(summary, indent=1))}</pre></details>"
    )


def _faithful_table(faithful: dict) -> str:
    """Per kind (and all events), each searched method's set on the validation examples: size,
    necessity, normalised sufficiency and coverage with their 95 % intervals, and the p against
    random sets of the method's size where the run drew them."""

    def with_ci(result: dict, measure: str) -> str:
        low_high = result.get(f"{measure}_ci")
        interval = f" [{_number(low_high[0])}, {_number(low_high[1])}]" if low_high else ""
        return f"{_number(result.get(measure))}{interval}"

    rows = []
    for kind, found in faithful.items():
        methods = found.get("methods") or {found["method"]: found}
        for method, result in methods.items():
            chosen = method == found["method"]
            random = found.get("random_same_size", {}) if chosen else {}
            rows.append(
                [
                    kind,
                    method + (" (the run's)" if chosen and len(methods) > 1 else ""),
                    ", ".join(f"L{l}H{h}" for l, h in result["heads"]) or "-",
                    result["size"],
                    *(with_ci(result, m) for m in ("necessity", "sufficiency", "coverage")),
                    *(_number(random.get(m, {}).get("p")) for m in ("necessity", "sufficiency")),
                    f"{found['n_examples_discovery']} / {found['n_examples_validation']}",
                    found["n_events"],
                ]
            )
    return (
        "<h3>Faithful circuits (found by joint effect, measured on held-out examples)</h3>"
        + _table(
            [
                "kind",
                "method",
                "set",
                "size",
                "necessity [95 % CI]",
                "sufficiency, normalised [95 % CI]",
                "coverage [95 % CI]",
                "p vs random sets (necessity)",
                "p vs random sets (sufficiency)",
                "examples: discovery / validation",
                "validation events",
            ],
            rows,
        )
        + "<p class='note'>Each set is searched on the discovery examples and measured on the "
        "validation examples. Necessity and sufficiency are ratios of mean margins over the "
        "validation events (sufficiency normalised by the all-heads-ablated margin); coverage is "
        "the share of validation examples whose margin the set removes at least 0.8 of; intervals "
        "are bootstrap over examples. Only the run's method has random sets drawn; '-' there.</p>"
    )


def _measures_note(circuit: str) -> str:
    """What the per-kind numbers are of, and why a fraction can pass 1."""
    return (
        "<p class='note'>Necessity, sufficiency and knock-in are measured for the global circuit "
        f"({html.escape(circuit)}: the union of the kinds' own circuits) on each kind's decided "
        "events (means over events); necessity and sufficiency are fractions of the event's clean "
        "margin; a kind whose own circuit is '-' "
        "has no head of its own and is read on the global set. A fraction above 1 is not an "
        "error: necessity above 1 means mean-ablating the circuit flips the decision (removes more "
        "than the whole margin); sufficiency above 1 means the circuit alone gives a larger margin "
        "than the full model (the other heads work against the choice); knock-in is the fraction "
        "of the gap between the donor's margin for its choice and the recipient's margin for it "
        "that writing the donor's circuit activations into the recipient closes, so above 1 it "
        "overshoots: the recipient then prefers the donor's choice more than the donor did. "
        "Coverage is the fraction of examples at or above each "
        "measure's threshold.</p>"
    )


def _distill_section(run: Path) -> str:
    evaluation = json.loads((run / EVALUATION_FILE).read_text())
    metadata_path = run / "mistill.json"
    metadata = json.loads(metadata_path.read_text()) if metadata_path.is_file() else {}
    keys = [
        "family",
        "objective",
        "precision",
        "seed",
        "steps",
        "code_f1",
        "near_miss_acc",
        "n_eval",
        "causal_recovery",
        "causal_recovery_median",
        "n_characterize",
        "attention_loss_tail",
    ]
    table = _table(keys, [[_number(evaluation.get(k)) for k in keys]])
    section = (
        f"<h2>Distilled student: {html.escape(str(run))}</h2>{table}"
        f"<p>Student circuit: {html.escape(str(evaluation.get('circuit')))}.</p>"
        f"<p>Command:</p><pre>{html.escape(str(metadata.get('command', '(not recorded)')))}</pre>"
    )
    if (run / "characterization" / SUMMARY).is_file():
        section += characterization_section(
            read_characterization(run / "characterization"), run / "characterization"
        )
    return section


def _figure(fig: go.Figure) -> str:
    return f"<div class='figure'>{fig.to_html(full_html=False, include_plotlyjs=False)}</div>"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _number(value: Any) -> Any:
    if isinstance(value, float):
        return "n/a" if value != value else f"{value:.3g}"
    return "-" if value is None else value
