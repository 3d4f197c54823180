"""A :class:`~mistill_lens.lens.characterize.Characterization` and its folder, both ways.

Files of a characterisation folder: the resumable sweeps `sweep.csv`, `sweep_null.csv` (with their
fingerprints; written by the sweep itself while it runs), and what :func:`write_characterization`
derives: `attribution.csv`, `calibration.csv`, `events.csv` (per-event circuit measures, when the
circuit is not empty), `families.csv`, `elicitation.csv`, `ablation_curve.csv`, `heads.json`,
`figures/*.html` and, last, `summary.json` (its presence means the folder is complete).
:func:`read_characterization` rebuilds the object from them.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import torch

from mistill_lens.lens import plot
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.results import Characterization, CharacterizeConfig, ExampleView
from mistill_lens.lens.run_folder import EXAMPLE_FILE, RESUMABLE_FILES, SUMMARY, prepare_output
from mistill_lens.lens.sweep import read_table


def write_characterization(result: Characterization, out_dir: str | Path) -> Path:
    """Write `result`'s tables, `heads.json`, figures and, last, `summary.json` into `out_dir`
    (claimed as a characterisation folder; earlier derived files are replaced)."""
    out_dir = prepare_output(out_dir)
    write_results(result, out_dir)
    return out_dir


def write_results(result: Characterization, out_dir: Path) -> dict:
    """:func:`write_characterization` into a folder :func:`prepare_output` has already claimed and
    cleared (a command claims its folder once, when its run starts); returns the summary written.
    A sweep table the run's own sweep left in place (same rows, with its fingerprint) is kept as
    it is, not written a second time."""
    tables = {
        "sweep.csv": result.sweep,
        "sweep_null.csv": result.null_sweep,
        "attribution.csv": result.attribution,
        "calibration.csv": result.calibration.to_frame(),
        "events.csv": result.events,
        "families.csv": result.families if not result.families.empty else None,
        "elicitation.csv": result.elicitation_curve,
        "ablation_curve.csv": result.ablation_curve,
    }
    for name in RESUMABLE_FILES:
        if _sweep_in_place(out_dir / name, tables[name]):
            del tables[name]
    for name, table in tables.items():
        if table is not None:
            table.to_csv(out_dir / name, index=False)
    (out_dir / "heads.json").write_text(json.dumps(result.heads_table(), indent=2))
    if result.example is not None:
        (out_dir / EXAMPLE_FILE).write_text(json.dumps(result.example.to_json()))
    (out_dir / "figures").mkdir()
    for name, figure in characterization_figures(result).items():
        plot.write_figure(figure, out_dir / "figures" / f"{name}.html")
    summary = result.summary()
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def characterization_figures(result: Characterization) -> dict[str, go.Figure]:
    """The characterisation's figures by name: head maps and the ablation curve, the attention
    families, the early-elicitation curve, the faithfulness curves and selection stability where
    the run made them; each with the run's warnings printed under it."""
    figures = {
        "head_maps": plot.head_map_figure(
            result.calibration,
            result.circuits,
            result.config.z_min if result.config.circuit == "z" else None,
            result.swept_heads,
        ),
        "ablation_curve": plot.ablation_curve_figure(result.ablation_curve),
    }
    if not result.families.empty:
        figures["attention_families"] = plot.attention_families_figure(
            result.families, result.circuit
        )
    if result.elicitation_curve is not None:
        figures["elicitation"] = plot.elicitation_figure(
            result.elicitation_curve, result.config.elicitation_kind or "region"
        )
    if result.faithful:
        figures["faithfulness"] = plot.faithfulness_figure(result.faithful)
        if any("stability" in found for found in result.faithful.values()):
            figures["stability"] = plot.stability_figure(result.faithful)
    if result.components:
        figures["components"] = plot.components_figure(result.components)
    view = result.example
    if view is not None:
        figures["example_margins"] = plot.event_margins_figure(view.example, view.margins)
        layer, head = view.head
        event = view.example.events[view.event]
        figures["example_attention"] = plot.attention_row_figure(
            view.example,
            view.row,
            view.query,
            f"L{layer}H{head}'s attention from the token that predicts the {event.kind} decision "
            f"{event.chosen!r} (vs {event.contrast!r}), example {view.example.example_id}",
        )
    return {name: plot.with_warnings(fig, result.warnings) for name, fig in figures.items()}


def _sweep_in_place(path: Path, table: pd.DataFrame) -> bool:
    """Whether `path` already holds `table` as its finished sweep (with its fingerprint). A table
    there that is not `table` came from another run: its fingerprint goes, so that the table
    written now is never resumed as that run's."""
    fingerprint = path.with_name(path.name + ".fingerprint.json")
    if not fingerprint.exists():
        return False
    if path.exists() and read_table(path).equals(table):
        return True
    fingerprint.unlink()
    return False


def read_characterization(out_dir: str | Path) -> Characterization:
    """The :class:`Characterization` written to `out_dir` by :func:`write_characterization`."""
    out_dir = Path(out_dir)
    if not (out_dir / SUMMARY).is_file():
        raise FileNotFoundError(
            f"{out_dir} holds no finished characterisation (no {SUMMARY}): run "
            "`mistill-lens characterize` into it to completion"
        )
    summary = _read_summary(out_dir / SUMMARY)
    known = {f.name for f in fields(CharacterizeConfig)}
    config = CharacterizeConfig(**{k: v for k, v in summary["config"].items() if k in known})
    per_kind = {  # a kind's block names its circuit and events (the config names a rule)
        k: v
        for k, v in summary.items()
        if isinstance(v, dict) and {"circuit", "n_events"} <= set(v)
    }
    calibration = _read_calibration(
        read_table(out_dir / "calibration.csv"),
        std_floor=summary.get("null_std_floor", 1e-2),
        n_events={kind: measures["n_events"] for kind, measures in per_kind.items()},
        n_null=summary["n_null_events"],
    )
    circuits = {kind: [tuple(h) for h in per_kind[kind]["circuit"]] for kind in calibration.kinds}
    circuits["all"] = [tuple(h) for h in summary["circuit"]]

    def table(name: str, missing: pd.DataFrame | None = None) -> pd.DataFrame | None:
        return read_table(out_dir / name) if (out_dir / name).is_file() else missing

    result = Characterization(
        config=config,
        calibration=calibration,
        circuits=circuits,
        attribution=table("attribution.csv"),
        sweep=table("sweep.csv"),
        null_sweep=table("sweep_null.csv"),
        events=table("events.csv"),
        families=table("families.csv", missing=pd.DataFrame()),
        ablation_curve=table("ablation_curve.csv"),
        elicitation=summary["elicitation"],
        elicitation_curve=table("elicitation.csv"),
        n_examples=summary["n_examples"],
        n_events=summary["n_events"],
        n_null_events=summary["n_null_events"],
        warnings=summary["warnings"],
        faithful=summary.get("faithful", {}),
        components=summary.get("components", {}),
        contrasts=summary.get("contrasts", {}),
        example=ExampleView.from_json(json.loads((out_dir / EXAMPLE_FILE).read_text()))
        if (out_dir / EXAMPLE_FILE).is_file()
        else None,
    )
    own = result.summary()  # without provenance: what is left in the file is the caller's
    result.provenance = {k: v for k, v in summary.items() if k not in own}
    return result


# What read_characterization needs from summary.json beyond the per-kind entries.
SUMMARY_KEYS = (
    "config",
    "circuit",
    "n_null_events",
    "elicitation",
    "n_examples",
    "n_events",
    "warnings",
)


def _read_summary(path: Path) -> dict:
    """summary.json, or an error naming the file and what is wrong with it."""
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{path} is not readable JSON ({err}): the characterisation was cut short or the file "
            "was edited; run `mistill-lens characterize` into the folder again"
        ) from None
    missing = [key for key in SUMMARY_KEYS if not isinstance(summary, dict) or key not in summary]
    if missing:
        raise ValueError(
            f"{path} lacks {missing}: it is not a characterisation's summary (or an incomplete "
            "one); run `mistill-lens characterize` into the folder again"
        )
    return summary


def _read_calibration(
    frame: pd.DataFrame, std_floor: float, n_events: dict[str, int], n_null: int
) -> Calibration:
    kinds = tuple(dict.fromkeys(frame.kind))
    n_layers, n_heads = int(frame.layer.max()) + 1, int(frame["head"].max()) + 1

    def grid(rows: pd.DataFrame, column: str) -> torch.Tensor:
        rows = rows.sort_values(["layer", "head"])
        return torch.tensor(rows[column].to_numpy(), dtype=torch.float32).reshape(n_layers, n_heads)

    first = frame[frame.kind == kinds[0]]
    return Calibration(
        kinds,
        torch.stack([grid(frame[frame.kind == kind], "raw") for kind in kinds]),
        grid(first, "null_mean"),
        grid(first, "null_std"),
        std_floor,
        tuple(n_events[kind] for kind in kinds),
        n_null,
    )
