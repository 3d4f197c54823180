"""What a characterisation is configured with and what it finds, as types: the configuration
(:class:`CharacterizeConfig`), the result (:class:`Characterization`, with ``summary()`` =
``summary.json``) and one example token by token (:class:`ExampleView`). The pipeline that makes a
result is :mod:`mistill_lens.lens.characterize`; :mod:`mistill_lens.lens.outputs` writes and reads
one; readers of a result (the report, the distiller) need only this module."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import pandas as pd
import torch
from torch import Tensor

from mistill_lens import options
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.circuits import circuit_measures, phase_structure
from mistill_lens.lens.contrasts import check_contrast_rule
from mistill_lens.lens.elicitation import top_heads
from mistill_lens.lens.events import DecisionEvent, EncodedExample
from mistill_lens.lens.faithful_search import METHODS
from mistill_lens.lens.fingerprint import check_stale
from mistill_lens.lens.hooks import Head
from mistill_lens.options import check_options

MEASURES = ("necessity", "sufficiency", "knock_in")


CIRCUIT_RULES = ("z", "faithful")


@dataclass(frozen=True)
class CharacterizeConfig:
    """How a characterisation runs (frozen: change a copy with ``dataclasses.replace``)."""

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
    # The minimum-count rule: below each count a number is still reported, with a recorded
    # warning. Decided events of a kind (its circuit measures), null events (every head's z
    # divides by their spread), examples with a decided elicitation event (the readout's lead).
    min_events_per_kind: int = 20
    min_null_events: int = 30
    min_elicitation_examples: int = 10
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
    # Search head sets by their joint effect (lens/faithfulness.py) on `faithful_discovery` of
    # the examples (a share, whole examples, seeded) and report them on the rest: the candidates are the `faithful_pool` heads with the largest
    # single-head effects (None: no search), sets grow up to `faithful_max_size` heads, and the
    # target is the necessity and normalised sufficiency to reach; `faithful_random_draws` random
    # head sets per size are the baseline (0: none); `faithful_stability` bootstrap resamples of
    # the discovery examples rerun the search to say how often each pool head is chosen (0: none).
    # `faithful_method` searches (lens/faithful_search.py: greedy, a learned mask of
    # `faithful_mask_steps` steps, or the single-head ranking); `faithful_compare` runs all three
    # on the same pool and events and records each one's set and curves.
    faithful_pool: int | None = None
    faithful_max_size: int = 32
    faithful_target: float = 0.8
    faithful_random_draws: int = 20
    faithful_stability: int = 0
    faithful_method: str = "greedy"
    faithful_compare: bool = False
    faithful_mask_steps: int = 100
    faithful_discovery: float = 0.5
    # The layer outputs' shares of the margin (lens/components.py: each layer's hook_mlp_out and
    # hook_attn_out at the events replaced by its per-kind reference mean, alone and cumulatively):
    # "are the decisions made by heads or by MLPs at the decision token?"
    components: bool = False
    # What each event's margin is measured against (lens/contrasts.py): "strongest", the rival
    # the model ranks highest at its clean run among those the data names, frozen; "listed", the
    # data's one listed contrast. Events whose data names no rivals use their listed contrast.
    contrasts: str = "strongest"
    # Which head sets are the run's circuits, for its measures, figures and every consumer
    # (MISTILL's head sets, a student's recovery): "z", the heads significant alone (z >= z_min);
    # "faithful", the sets the faithfulness search finds by joint effect (needs faithful_pool).
    circuit: str = "z"

    def __post_init__(self):
        # each config holds its own copies: a dict shared with another config (a default, the
        # one it was replaced from) would change both when edited
        object.__setattr__(self, "thresholds", dict(self.thresholds))
        object.__setattr__(self, "ks", tuple(self.ks))
        check_options(
            self,
            seed=options.seed,
            null_per_event=options.positive,
            attribution_batch_size=options.positive,
            shards=options.positive,
            curve_points=options.positive,
            sweep_top=options.positive,
            min_events_per_kind=options.non_negative,
            min_null_events=options.non_negative,
            min_elicitation_examples=options.non_negative,
            faithful_pool=options.positive,
            faithful_max_size=options.positive,
            faithful_random_draws=options.non_negative,
            faithful_stability=options.non_negative,
            faithful_mask_steps=options.positive,
            faithful_discovery=options.open_share,
        )
        if not 0 < self.faithful_target <= 1:
            raise ValueError(
                f"faithful_target must be a share of the margin in (0, 1], got {self.faithful_target}"
            )
        if self.faithful_method not in METHODS:
            raise ValueError(
                f"faithful_method must be one of {METHODS}, got {self.faithful_method!r}"
            )
        check_contrast_rule(self.contrasts)
        if self.circuit not in CIRCUIT_RULES:
            raise ValueError(f"circuit must be one of {CIRCUIT_RULES}, got {self.circuit!r}")
        if self.circuit == "faithful" and self.faithful_pool is None:
            raise ValueError(
                "circuit='faithful' needs the faithfulness search: set faithful_pool (the number "
                "of candidate heads, e.g. 40)"
            )
        check_stale(self.stale)


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
    # per kind and "all": the smallest head set found by its joint effect on discovery examples,
    # measured on validation examples (lens/faithfulness.faithful_circuit); empty: not searched
    faithful: dict[str, Any] = field(default_factory=dict)
    # per site (hook_mlp_out, hook_attn_out) and kind: the layer outputs' shares of the margin
    # (lens/components.component_summary); empty: not measured
    components: dict[str, Any] = field(default_factory=dict)
    # how the events' contrasts were chosen: the rule, per kind what the choice did, and the
    # tokens shared by events of several kinds (lens/contrasts.py)
    contrasts: dict[str, Any] = field(default_factory=dict)

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
        when the circuit is empty), knock-in pooled over events (sum of gains / sum of gaps),
        coverage, the kind's event count and circuit."""
        measured = (
            circuit_measures(self.events, self.config.thresholds) if self.events is not None else {}
        )
        out = {}
        for kind, n in zip(self.kinds, self.calibration.n_events):
            out[kind] = {
                **{m: None for m in MEASURES},
                "knock_in_pooled": None,
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
        if self.faithful:
            summary["faithful"] = self.faithful
        if self.components:
            summary["components"] = self.components
        if self.contrasts:
            summary["contrasts"] = self.contrasts
        summary["elicitation"] = self.elicitation
        summary["config"] = asdict(self.config)
        summary.update(self.provenance)
        return summary
