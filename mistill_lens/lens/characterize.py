"""The characterisation pipeline behind `mistill-lens characterize`, as one call that returns a
:class:`Characterization`.

From a hooked model and task examples with gold events: exact ablation sweeps of every head on
every decided event and on matched null events, attribution (and its rank correlation with exact
ablation), null calibration, the circuit per kind and its necessity / sufficiency / knock-in with
coverage, phase structure, head families, early elicitation. Everything is a deterministic function
of the model, the examples and the seed.

The only files touched are the resumable sweep tables, in `sweep_dir` when one is given;
:mod:`mistill_lens.lens.outputs` writes a Characterization to a folder and reads it back.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens import options
from mistill_lens.lens.backends import (
    EngineFallbackWarning,
    backend_for,
    backend_record,
    choose_backend,
    means_from_events,
)
from mistill_lens.lens.calibration import Calibration, calibrate, null_events
from mistill_lens.lens.circuits import (
    ablation_curve,
    attention_mass,
    circuit_measures,
    circuit_report,
    event_attention_rows,
    family_targets,
    head_families,
    phase_structure,
    select_circuit,
)
from mistill_lens.lens.elicitation import (
    carrying_heads,
    elicitation_curve,
    elicitation_lead,
    top_heads,
)
from mistill_lens.lens.events import (
    DecisionEvent,
    EncodedExample,
    EventBatch,
    decided_rows,
    events_from_spans,
    make_event_batch,
)
from mistill_lens.lens.fingerprint import StaleResultWarning
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    all_heads,
)
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.lens.sharding import sharded_sweep
from mistill_lens.lens.sweep import (
    ablation_sweep,
    clean_margins,
    effects_tensor,
)
from mistill_lens.options import check_options

REFERENCE_ID_OFFSET = 1_000_000  # reference examples get ids that cannot clash with analysed ones
MEASURES = ("necessity", "sufficiency", "knock_in")


@dataclass
class CharacterizeConfig:
    seed: int = 0
    null_per_event: int = 1
    z_min: float = 3.0
    rel_min: float = 0.1
    max_heads_per_kind: int | None = None
    thresholds: dict[str, float] = field(
        default_factory=lambda: {"necessity": 0.5, "sufficiency": 0.5, "knock_in": 0.5}
    )
    ks: tuple[int, ...] = tuple(range(1, 9))
    elicitation_threshold: float = 0.5
    min_margin: float = 0.0
    attribution_batch_size: int = 8
    curve_points: int = 8  # ablation-curve points per order (each is one forward pass)
    # Exact-sweep only the N heads with the largest mean |attribution| (None: every head). For big
    # models on CPU: attribution screens every head in one backward pass, exact ablation confirms
    # the top N; heads not swept enter calibration with zero effect, so they are never selected.
    sweep_top: int | None = None
    progress: bool = True
    # A sweep table in the output folder computed from other inputs (model, events, reference
    # means): "error" refuses to resume it, "recompute" discards it and sweeps again (recorded).
    stale: str = "error"
    # Fewer decided events of a kind than this: its measures are reported with a warning.
    min_events_per_kind: int = 5
    # The event kind whose early readout is measured (the ICD task: "region"); None skips it.
    elicitation_kind: str | None = None
    # Run the interventions on the InterventionEngine (exact, at decode cost); False: one full
    # forward per intervention (the reference path). A model the engine does not support falls
    # back to the full forward with a recorded warning.
    engine: bool = True
    # Shard the exact sweeps' examples over Ray: "local" starts a local instance, any other value
    # is a cluster address; None runs them in this process.
    ray: str | None = None
    shards: int = 2

    def __post_init__(self):
        check_options(
            self,
            seed=options.seed,
            null_per_event=options.positive,
            attribution_batch_size=options.positive,
            shards=options.positive,
            curve_points=options.positive,
            sweep_top=options.positive,
            min_events_per_kind=options.non_negative,
        )
        if self.stale not in ("error", "recompute"):
            raise ValueError(f"stale must be 'error' or 'recompute', got {self.stale!r}")


def encode(
    examples: Sequence[Any], tokenizer: Tokenizer, first_id: int = 0
) -> list[EncodedExample]:
    return [
        events_from_spans(example, tokenizer, first_id + i) for i, example in enumerate(examples)
    ]


def reference_means(
    model: HookedModel,
    reference: Sequence[EncodedExample],
    null_per_event: int,
    seed: int,
    pad_token_id: int,
) -> HeadMeans:
    """Exact per-class means from real runs on separate reference examples: one class per event
    kind (at its predicting position) plus the null class."""
    events = [e for x in reference for e in x.events]
    nulls = null_events(reference, events, per_event=null_per_event, seed=seed)
    return means_from_events(model, make_event_batch(reference, events + nulls, pad_token_id))


def chunked_attribution(
    model: HookedModel, batch: EventBatch, means: HeadMeans, batch_size: int
) -> Float[Tensor, "event layer head"]:
    """Attribution scores: on the full forward one forward + backward per chunk of `batch_size`
    events (memory stays bounded); on the engine, single-position passes."""
    return backend_for(model, batch_size).attribution(batch, means)


def rank_correlation(a: Tensor, b: Tensor) -> float:
    """Spearman correlation of two flat tensors (average ranks for ties)."""
    pairs = pd.DataFrame(
        {"a": a.flatten().tolist(), "b": b.flatten().tolist()}
    ).dropna()  # NaN: head not swept
    ranks = pairs.rank()
    return float(ranks["a"].corr(ranks["b"]))


@dataclass
class ExampleView:
    """One analysed example token by token, for token-labelled figures: the clean margin at each of
    its gold events, and one deciding head's attention row at one of them (positions 0..query)."""

    example: EncodedExample
    margins: list[float]  # per event of `example`, in its order
    head: Head
    event: int  # index into example.events of the event whose attention row is kept
    row: list[float]

    @property
    def query(self) -> int:
        return self.example.events[self.event].predict_position

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ExampleView":
        example = dict(data["example"])
        example["offsets"] = [tuple(o) for o in example["offsets"]]
        example["events"] = [
            DecisionEvent(**{**e, "contrast_tokens": tuple(e["contrast_tokens"])})
            for e in example["events"]
        ]
        return cls(
            example=EncodedExample(**example),
            margins=list(data["margins"]),
            head=tuple(data["head"]),
            event=int(data["event"]),
            row=list(data["row"]),
        )


def example_view(
    model: HookedModel,
    encoded: Sequence[EncodedExample],
    every_event: EventBatch,
    margins: Float[Tensor, "event"],
    decided: Sequence[int],
    circuits: Mapping[str, list[Head]],
    calibration: Calibration,
) -> ExampleView:
    """The view of the first example with a decided near-miss event (else the first decided event
    of any kind): its events' clean margins, and the attention row there of the kind's top
    circuit head (the kind's top head by z when its circuit is empty)."""
    kinds = [every_event.events[i].kind for i in decided]
    row = decided[kinds.index("near_miss")] if "near_miss" in kinds else decided[0]
    chosen = every_event.events[row]
    example = next(x for x in encoded if x.example_id == chosen.example_id)
    own = [i for i, e in enumerate(every_event.events) if e.example_id == chosen.example_id]
    kind_index = calibration.kinds.index(chosen.kind)
    z = calibration.z[kind_index].nan_to_num(float("-inf"))
    head = (circuits.get(chosen.kind) or [divmod(int(z.argmax()), z.shape[1])])[0]
    layer, head_index = head
    pattern = event_attention_rows(model, every_event.select([row]), [layer])[layer]
    return ExampleView(
        example=example,
        margins=[float(margins[i]) for i in own],
        head=(int(layer), int(head_index)),
        event=own.index(row),
        row=pattern[0, head_index, : chosen.predict_position + 1].tolist(),
    )


@dataclass
class Characterization:
    """What a characterisation found, as objects a notebook or the distiller reads directly.

    Tables (pandas): `attribution` (per decided event x head: attribution and exact effect; exact
    is NaN for heads not swept), `sweep` / `null_sweep` (the exact sweeps), `events` (per decided
    event: necessity, sufficiency, knock-in of the circuit; None when the circuit is empty),
    `families`, `ablation_curve`, `elicitation_curve` (None when skipped). :meth:`summary` is the
    `summary.json` of the command; :mod:`mistill_lens.lens.outputs` writes and reads all of it."""

    config: CharacterizeConfig
    calibration: Calibration
    circuits: dict[str, list[Head]]  # per event kind, ranked by z; "all": their union, sorted
    attribution: pd.DataFrame
    sweep: pd.DataFrame
    null_sweep: pd.DataFrame
    events: pd.DataFrame | None
    families: pd.DataFrame
    ablation_curve: pd.DataFrame
    elicitation: dict[str, Any]
    elicitation_curve: pd.DataFrame | None
    n_examples: int
    n_events: int  # gold events; the decided ones are the rows of `attribution` per head
    n_null_events: int
    warnings: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)  # e.g. the command line
    example: ExampleView | None = None  # one example token by token (token-labelled figures)

    @property
    def circuit(self) -> list[Head]:
        return self.circuits["all"]

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.calibration.kinds

    @property
    def n_decided_events(self) -> int:
        return int(sum(self.calibration.n_events))

    @property
    def swept_heads(self) -> set[Head]:
        """The heads the exact sweep covered (every head, unless `config.sweep_top` chose)."""
        return {(int(l), int(h)) for l, h in zip(self.sweep.layer, self.sweep["head"])}

    @property
    def n_heads_swept(self) -> int:
        return len(self.swept_heads)

    def measures(self) -> dict[str, dict[str, Any]]:
        """Per kind: necessity, sufficiency and knock-in of the circuit (means over events, None
        when the circuit is empty), coverage, the kind's event count and circuit."""
        measured = (
            circuit_measures(self.events, self.config.thresholds) if self.events is not None else {}
        )
        out = {}
        for kind, n in zip(self.kinds, self.calibration.n_events):
            out[kind] = {
                **{m: None for m in MEASURES},
                "coverage": None,
                "n_events": n,
                "circuit": [list(h) for h in self.circuits[kind]],
            }
            out[kind].update(measured.get(kind, {}))
        return out

    def median_recovery(self, kind: str = "near_miss") -> float | None:
        """(median necessity + median knock-in) / 2 over `kind`'s events: robust to an event whose
        clean margin is barely positive. 0 when the circuit is empty (it carries nothing), None
        when no `kind` event was decided."""
        if not self.circuit:
            return 0.0
        rows = self.events[self.events.kind == kind]
        if rows.empty:
            return None
        knock_in = rows.knock_in.median()  # NaN rows (no donor pair) are skipped
        return float((rows.necessity.median() + (0.0 if math.isnan(knock_in) else knock_in)) / 2)

    def spearman(self) -> dict[str, float]:
        """Rank correlation of attribution with exact ablation, over all and per kind."""

        def correlation(rows: pd.DataFrame) -> float:
            return rank_correlation(
                torch.tensor(rows.attribution.to_numpy()), torch.tensor(rows.exact.to_numpy())
            )

        frame = self.attribution
        return {
            "all": correlation(frame),
            **{k: correlation(frame[frame.kind == k]) for k in self.kinds},
        }

    def family_of_circuit_heads(self) -> dict[str, str]:
        """`"L{layer}H{head}/{kind}"` -> attention family, for the circuit's heads."""
        if self.families.empty:
            return {}
        circuit = set(self.circuit)
        table = self.families
        return {
            f"L{l}H{h}/{k}": family
            for k, l, h, family in zip(table.kind, table.layer, table["head"], table.family)
            if (l, h) in circuit
        }

    def heads_table(self) -> dict[str, list[dict]]:
        """Per kind (and "all") the circuit's heads with their z, effect above null and raw effect
        (per kind under "all"), and the head's null mean and std: `heads.json`."""
        calibration = self.calibration

        def describe(kind: str, heads: list[Head]) -> list[dict]:
            rows = []
            for layer, head in heads:
                entry = {"layer": layer, "head": head}
                for k in [kind] if kind != "all" else calibration.kinds:
                    i = calibration.kind_index(k)
                    prefix = "" if kind != "all" else f"{k}_"
                    entry.update(
                        {
                            f"{prefix}z": float(calibration.z[i, layer, head]),
                            f"{prefix}above_null": float(calibration.above_null[i, layer, head]),
                            f"{prefix}raw": float(calibration.raw[i, layer, head]),
                        }
                    )
                entry.update(
                    null_mean=float(calibration.null_mean[layer, head]),
                    null_std=float(calibration.null_std[layer, head]),
                )
                rows.append(entry)
            return rows

        return {kind: describe(kind, heads) for kind, heads in self.circuits.items()}

    def summary(self) -> dict[str, Any]:
        """The key numbers as one JSON-ready dict (`summary.json`): per kind at the top level
        (`summary["region"]["necessity"]`), then families, elicitation, config and provenance."""
        calibration = self.calibration
        n_layers, n_heads = calibration.null_mean.shape
        summary: dict[str, Any] = {
            "warnings": list(self.warnings),
            "circuit_size": len(self.circuit),
            "n_heads_total": n_layers * n_heads,
            "n_heads_swept": self.n_heads_swept,
            "circuit": [list(h) for h in self.circuit],
            "n_examples": self.n_examples,
            "n_events": self.n_events,
            "n_decided_events": self.n_decided_events,
            "n_null_events": self.n_null_events,
            "null_std_floor": calibration.std_floor,
            "thresholds": self.config.thresholds,
            "attribution_vs_ablation_spearman": self.spearman(),
            "phase_structure": phase_structure(calibration, self.circuits),
            # the strongest heads per kind whether or not they pass selection: what to look at
            # when the circuit is empty or when choosing --z-min
            "top_heads": {
                kind: [
                    {
                        "layer": l,
                        "head": h,
                        "z": float(calibration.z[k, l, h]),
                        "raw": float(calibration.raw[k, l, h]),
                    }
                    for l, h in top_heads(calibration.z[k], 5)
                ]
                for k, kind in enumerate(calibration.kinds)
            },
            **self.measures(),
        }
        if not self.families.empty:
            summary["families"] = self.family_of_circuit_heads()
        summary["elicitation"] = self.elicitation
        summary["config"] = asdict(self.config)
        summary.update(self.provenance)
        return summary


def characterize(
    model: HookedModel,
    tokenizer: Tokenizer,
    examples: Sequence[Any],
    reference_examples: Sequence[Any],
    config: CharacterizeConfig = CharacterizeConfig(),
    *,
    sweep_dir: str | Path | None = None,
    region_candidates: Sequence[int] | None = None,
    near_miss_text: Callable[[Any, DecisionEvent], str | None] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Characterization:
    """Run the whole characterisation; returns a :class:`Characterization`.

    `examples` / `reference_examples` carry `prompt`, `output` and gold `events`; means come from
    the reference runs. With `sweep_dir` the exact sweeps are resumable tables there
    (`sweep.csv`, `sweep_null.csv`, each with its fingerprint); without it they stay in memory.
    `region_candidates` (token ids: the readout classes of early elicitation) default to every
    token chosen or contrasted at a `config.elicitation_kind` event here. `near_miss_text(example,
    event)` names the text an event's near-miss family looks back at (a task's reader).
    `provenance` (e.g. the command) is kept with the result; its `warnings`, if any, join the
    pipeline's.
    """
    if not examples:
        raise ValueError(
            "no examples to characterise: give at least one example with decision events"
        )
    if not reference_examples:
        raise ValueError("no reference examples: the mean-ablation means need at least one")
    torch.manual_seed(config.seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, fallback = choose_backend(model, config.engine)
        result = _characterize(
            model,
            tokenizer,
            examples,
            reference_examples,
            Path(sweep_dir) if sweep_dir is not None else None,
            config,
            region_candidates,
            near_miss_text,
        )
    for warning in caught:  # ours go into the result, anyone else's back to the caller
        if issubclass(warning.category, (StaleResultWarning, EngineFallbackWarning)):
            result.warnings.append(str(warning.message))
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    extra = dict(provenance or {})
    result.warnings.extend(extra.pop("warnings", []))  # the caller's own, beside the pipeline's
    result.provenance = {"backend": backend_record(model, fallback), **extra}
    return result


def _characterize(
    model: HookedModel,
    tokenizer: Tokenizer,
    examples,
    reference_examples,
    sweep_dir: Path | None,
    config: CharacterizeConfig,
    region_candidates,
    near_miss_text,
) -> Characterization:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encoded = encode(examples, tokenizer)
    reference = encode(reference_examples, tokenizer, first_id=REFERENCE_ID_OFFSET)
    means = reference_means(model, reference, config.null_per_event, config.seed, pad)

    every_event = make_event_batch(encoded, pad_token_id=pad)
    every_margin = clean_margins(model, every_event)
    decided = decided_rows(every_margin, config.min_margin)
    if len(decided) == 0:
        raise ValueError(
            f"the model decides none of the {len(every_event)} gold events its way: nothing to characterise"
        )
    batch = every_event.select(decided)
    clean = clean_margins(model, batch)  # the sweep, the circuit and the curve share it
    nulls = make_event_batch(
        encoded, null_events(encoded, batch.events, config.null_per_event, config.seed), pad
    )
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

    attribution = chunked_attribution(model, batch, means, config.attribution_batch_size)
    swept = (
        all_heads(model)
        if config.sweep_top is None
        else top_heads(attribution.abs().mean(dim=0), config.sweep_top)
    )

    def sweep_of(events: EventBatch, name: str, clean=None) -> pd.DataFrame:
        out_path = sweep_dir / name if sweep_dir is not None else None
        if config.ray is not None:  # the examples sharded over Ray tasks, each on the engine
            if out_path is None:
                raise ValueError("a sweep sharded over Ray needs a sweep_dir for its shard tables")
            return sharded_sweep(
                model.model,
                events,
                means,
                out_path,
                heads=swept,
                shards=config.shards,
                address=None if config.ray == "local" else config.ray,
                stale=config.stale,
            )
        return ablation_sweep(
            model,
            events,
            means,
            out_path,
            heads=swept,
            progress=config.progress,
            stale=config.stale,
            clean=clean,
        )

    sweep = sweep_of(batch, "sweep.csv", clean)
    null_sweep = sweep_of(nulls, "sweep_null.csv")
    exact = effects_tensor(sweep, len(batch), n_layers, n_heads)  # NaN for heads not swept
    null_exact = effects_tensor(null_sweep, len(nulls), n_layers, n_heads)
    attribution_table = pd.DataFrame(
        [
            {
                "event_row": e,
                "kind": batch.kinds[e],
                "layer": l,
                "head": h,
                "attribution": float(attribution[e, l, h]),
                "exact": float(exact[e, l, h]),
            }
            for e in range(len(batch))
            for l in range(n_layers)
            for h in range(n_heads)
        ]
    )

    calibration = calibrate(exact.nan_to_num(0.0), batch.kinds, null_exact.nan_to_num(0.0))
    circuits = select_circuit(calibration, config.z_min, config.rel_min, config.max_heads_per_kind)
    circuit = circuits["all"]

    warned = [
        f"only {batch.kinds.count(kind)} decided {kind} events (fewer than {config.min_events_per_kind}): "
        "its circuit measures rest on very few events"
        for kind in dict.fromkeys(batch.kinds)
        if batch.kinds.count(kind) < config.min_events_per_kind
    ]
    if not circuit:
        warned.append(
            f"no head passes z >= {config.z_min}: the circuit is empty, so necessity, sufficiency and "
            "knock-in are not measured (see top_heads, or lower z_min)"
        )
    events = (
        circuit_report(model, batch, means, circuit, seed=config.seed, clean=clean).to_frame()
        if circuit
        else None
    )

    by_id = {x.example_id: x for x in encoded}
    targets = [
        family_targets(
            by_id[e.example_id],
            e,
            near_miss_text(examples[e.example_id], e) if near_miss_text else None,
        )
        for e in batch.events
    ]
    families = pd.DataFrame()
    if targets:
        masses = {
            family: attention_mass(model, batch, [t[family] for t in targets])
            for family in targets[0]
        }
        baselines = {
            family: torch.tensor(
                [len(t[family]) / (e.predict_position + 1) for t, e in zip(targets, batch.events)]
            )
            for family in masses
        }
        families = head_families(masses, batch.kinds, all_heads(model), baselines)

    elicitation, curve = _elicitation(model, batch, circuits, region_candidates, config)
    if curve is None and config.elicitation_kind is not None:
        warned.append(f"early elicitation skipped: {elicitation['skipped']}")

    ranked = sorted(all_heads(model), key=lambda h: -float(calibration.z[:, h[0], h[1]].max()))
    return Characterization(
        config=config,
        calibration=calibration,
        circuits=circuits,
        attribution=attribution_table,
        sweep=sweep,
        null_sweep=null_sweep,
        events=events,
        families=families,
        ablation_curve=ablation_curve(
            model,
            batch,
            means,
            ranked,
            seed=config.seed,
            max_points=config.curve_points,
            clean=clean,
        ),
        elicitation=elicitation,
        elicitation_curve=curve,
        n_examples=len(encoded),
        n_events=len(every_event),
        n_null_events=len(nulls),
        warnings=warned,
        example=example_view(
            model, encoded, every_event, every_margin, decided.tolist(), circuits, calibration
        ),
    )


def _elicitation(
    model: HookedModel,
    batch: EventBatch,
    circuits: Mapping[str, list[Head]],
    region_candidates,
    config: CharacterizeConfig,
) -> tuple[dict, pd.DataFrame | None]:
    """Readout summary of `config.elicitation_kind` events (lead in tokens, the early head set vs
    the late set, that kind's circuit) and the readout curve; the curve is None when skipped."""
    kind = config.elicitation_kind
    if kind is None:
        return {"skipped": "no elicitation_kind configured"}, None
    late_heads = circuits.get(kind, [])
    regions = batch.of_kind(kind) if kind in batch.kinds else None
    if regions is None or len({e.example_id for e in regions.events}) < 4:
        return {"skipped": f"fewer than 4 examples with a decided {kind} event"}, None
    candidates = region_candidates or sorted(
        {int(t) for t in regions.chosen} | {int(t) for t in regions.contrast[:, 0]}
    )
    curve = elicitation_curve(model, regions, candidates, config.ks, seed=config.seed)
    lead = {
        method: elicitation_lead(curve, method, config.elicitation_threshold)
        for method in ("probe", "logit_lens")
    }
    # the earliest position still readable (at least 2: k=1 is the decision position itself)
    k_early = max(2, lead["probe"])
    at_k = curve[(curve.method == "probe") & (curve.k == k_early)]
    if at_k.empty:
        return {"lead": lead, "curve": "elicitation.csv"}, curve
    stage = int(at_k.loc[at_k["accuracy"].idxmax(), "stage"])
    drops = carrying_heads(model, regions, k_early, stage, seed=config.seed)
    early = [h for h in top_heads(drops, max(1, len(late_heads))) if float(drops[h]) > 0]
    union = set(early) | set(late_heads)
    return {
        "lead": lead,
        "k_early": k_early,
        "stage": stage,
        "stage_name": at_k.loc[at_k["accuracy"].idxmax(), "stage_name"],
        "accuracy_at_k_early": float(at_k["accuracy"].max()),
        "early_heads": [list(h) for h in early],
        "late_heads": [list(h) for h in late_heads],
        "early_late_overlap": len(set(early) & set(late_heads)) / len(union) if union else None,
        "early_mean_layer": sum(l for l, _ in early) / len(early) if early else None,
        "late_mean_layer": sum(l for l, _ in late_heads) / len(late_heads) if late_heads else None,
    }, curve
