"""The characterisation pipeline behind `mistill-lens characterize`, as one call that returns a
:class:`Characterization`.

From a hooked model and task examples with gold events: exact ablation sweeps of every head on
every decided event and on matched null events, attribution (and its rank correlation with exact
ablation), null calibration, the circuit per kind and its necessity / sufficiency / knock-in with
coverage, phase structure, head families, early elicitation. Everything is a deterministic function
of the model, the examples and the seed.

The only files touched are the resumable sweep tables and the faithfulness search's log, in
`sweep_dir` when one is given;
:mod:`mistill_lens.lens.outputs` writes a Characterization to a folder and reads it back.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.backends import (
    EngineFallbackWarning,
    EventModel,
    backend_for,
    backend_record,
    choose_backend,
    clean_margins,
    means_from_events,
)
from mistill_lens.lens.calibration import Calibration, calibrate, null_events
from mistill_lens.lens.circuits import (
    ablation_curve,
    attention_mass,
    circuit_report,
    event_attention_rows,
    family_targets,
    head_families,
    select_circuit,
)
from mistill_lens.lens.components import SITES, component_shares, component_summary
from mistill_lens.lens.contrasts import (
    contrast_log,
    freeze_contrasts,
    listed_contrasts,
    shared_positions,
)
from mistill_lens.lens.elicitation import (
    carrying_heads,
    elicitation_curve,
    elicitation_lead,
    split_by_example,
    top_heads,
)
from mistill_lens.lens.events import (
    DecisionEvent,
    EncodedExample,
    EventBatch,
    events_from_spans,
    kind_mask,
    make_event_batch,
)
from mistill_lens.lens.examples import example_name, own_id
from mistill_lens.lens.faithful_search import METHODS, MIN_RESAMPLES, Search, faithful_circuit
from mistill_lens.lens.fingerprint import StaleResultWarning, model_digest, value_digest
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    all_heads,
)
from mistill_lens.lens.margins import decided_rows
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.lens.results import (
    Characterization,
    CharacterizeConfig,
    ExampleView,
)
from mistill_lens.lens.run_folder import (
    ATTRIBUTION_FILE,
    CLEAN_MARGIN_FILE,
    CONTRAST_LOG,
    EVERY_MARGIN_FILE,
    MEANS_FILE,
    SEARCH_LOG,
)
from mistill_lens.lens.search_log import SearchLog
from mistill_lens.lens.sharding import sharded_sweep
from mistill_lens.lens.stage_file import kept_stage
from mistill_lens.lens.sweep import (
    ablation_sweep,
    effects_tensor,
    events_digest,
    means_digest,
    sweep_fingerprint,
)

REFERENCE_ID_OFFSET = 1_000_000  # reference examples get ids that cannot clash with analysed ones


def encode(
    examples: Sequence[Any], tokenizer: Tokenizer, first_id: int = 0
) -> list[EncodedExample]:
    """Each example's events on the tokenizer's tokens; a problem found there (a span that
    tokenizes differently in context, a chosen and contrast with the same token) is a ValueError
    naming the example (file, line and ``id`` when it has them)."""
    encoded = []
    for i, example in enumerate(examples):
        try:
            encoded.append(events_from_spans(example, tokenizer, first_id + i))
        except ValueError as err:
            raise ValueError(f"{example_name(example, i)}: {err}") from err
    return encoded


def check_context(
    model: HookedModel, examples: Sequence[Any], encoded: Sequence[EncodedExample], what: str
) -> None:
    """Every example fits the model's positions; else a ValueError naming the longest one."""
    lengths = [len(x.tokens) for x in encoded]
    if lengths and max(lengths) > model.cfg.n_ctx:
        longest = lengths.index(max(lengths))
        too_long = sum(n > model.cfg.n_ctx for n in lengths)
        raise ValueError(
            f"{too_long} of {len(encoded)} {what} are longer than the model's {model.cfg.n_ctx} "
            f"positions (the longest, {example_name(examples[longest], longest)}, is "
            f"{lengths[longest]} tokens): give shorter examples or a model with a longer context"
        )


def encode_checked(
    model: HookedModel, tokenizer: Tokenizer, examples: Sequence[Any], reference: Sequence[Any]
) -> tuple[list[EncodedExample], list[EncodedExample]]:
    """The analysed and reference examples encoded, each checked to fit the model: the checks a
    caller can run before it writes anything."""
    encoded = encode(examples, tokenizer)
    encoded_reference = encode(reference, tokenizer, first_id=REFERENCE_ID_OFFSET)
    check_context(model, examples, encoded, "examples")
    check_context(model, reference, encoded_reference, "reference examples")
    return encoded, encoded_reference


def choose_contrasts(
    model: HookedModel | EventModel,
    encoded: Sequence[EncodedExample],
    reference: Sequence[EncodedExample],
    rule: str,
    progress: bool = False,
    log_path: Path | None = None,
    stale: str = "error",
) -> tuple[list[EncodedExample], list[EncodedExample], dict[str, Any]]:
    """The analysed and reference examples with each event's contrast chosen by `rule`
    (lens/contrasts.py), and the record of it for the summary: the rule, per kind what the choice
    did on the analysed examples, and the tokens shared by events of several kinds. With
    `log_path` the clean margins that choose them are kept there, so a resumed run reads them
    instead of running the model again."""
    if rule == "strongest":
        hooked = backend_for(model).model
        log = contrast_log(log_path, hooked, stale)
        encoded, by_kind = freeze_contrasts(hooked, encoded, progress, log=log)
        reference, _ = freeze_contrasts(hooked, reference, progress, "reference contrasts", log)
    else:  # the listed contrast: named rivals are set aside
        encoded, reference = listed_contrasts(encoded), listed_contrasts(reference)
        by_kind = {}
    return (
        encoded,
        reference,
        {"rule": rule, "by_kind": by_kind, "shared_positions": shared_positions(encoded)},
    )


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


def characterize(
    model: HookedModel,
    tokenizer: Tokenizer,
    examples: Sequence[Any],
    reference_examples: Sequence[Any],
    config: CharacterizeConfig | None = None,
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
    config = CharacterizeConfig() if config is None else config
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


def _sweeps(
    model: HookedModel,
    batch: EventBatch,
    nulls: EventBatch,
    means,
    swept: list[Head],
    clean: Tensor,
    sweep_dir: Path | None,
    config: CharacterizeConfig,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The exact sweeps of the decided events and of the null events (resumable tables in
    `sweep_dir`), in one process or sharded over Ray."""

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

    return sweep_of(batch, "sweep.csv", clean), sweep_of(nulls, "sweep_null.csv")


def _attribution_table(batch: EventBatch, attribution: Tensor, exact: Tensor) -> pd.DataFrame:
    """attribution.csv: each event's attribution score beside its exact ablation effect, per head."""
    n_layers, n_heads = exact.shape[1:]
    return pd.DataFrame(
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


def chosen_circuits(
    calibration: Calibration, faithful: Mapping[str, dict], config: CharacterizeConfig
) -> dict[str, list[Head]]:
    """The run's circuit per kind and for all events (``"all"``), by `config.circuit`: the heads
    significant alone (z rule), or the sets the faithfulness search found (a kind it could not
    search has none; ``"all"`` is the set searched on all events together, not a union)."""
    if config.circuit == "z":
        return select_circuit(calibration, config.z_min, config.rel_min, config.max_heads_per_kind)
    return {
        kind: [tuple(h) for h in faithful[kind]["heads"]] if kind in faithful else []
        for kind in [*calibration.kinds, "all"]
    }


def _sample_warnings(
    batch: EventBatch, nulls: EventBatch, circuit: list[Head], config: CharacterizeConfig
) -> list[str]:
    """What the numbers rest on, said where it is thin: few events of a kind, few null events, or
    no circuit."""
    warned = [
        f"only {batch.kinds.count(kind)} decided {kind} events (fewer than {config.min_events_per_kind}): "
        "its circuit measures rest on very few events"
        for kind in dict.fromkeys(batch.kinds)
        if batch.kinds.count(kind) < config.min_events_per_kind
    ]
    if len(nulls) < config.min_null_events:
        warned.append(
            f"only {len(nulls)} null events (fewer than {config.min_null_events}): every head's z "
            "divides by their spread, so the z values and the circuit rest on very few"
        )
    if not circuit and config.circuit == "faithful":
        warned.append(
            "the faithfulness search found no circuit for all events together (see the faithful "
            "block's warnings and curves)"
        )
    elif not circuit:
        warned.append(
            f"no head passes z >= {config.z_min} with an effect above null of at least "
            f"{config.rel_min} x the strongest head's: the circuit is empty, so necessity, "
            "sufficiency and knock-in are not measured (see top_heads, or lower z_min; a "
            "mechanism spread over several heads is found by the faithfulness search, faithful_pool)"
        )
    return warned


def _families(
    model: HookedModel, batch: EventBatch, encoded, examples, near_miss_text
) -> pd.DataFrame:
    """Each head's attention mass on each family's target tokens (the region's candidate lines,
    the near-miss named earlier, ...) at the events, against the uniform baseline. A family with no
    target token at any event (a task whose events name no region) is left out, and with none left
    the table is empty (no families figure: a panel that does not apply is not drawn)."""
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
    applicable = [f for f in targets[0] if any(t[f] for t in targets)] if targets else []
    if applicable:
        masses = {
            family: attention_mass(model, batch, [t[family] for t in targets])
            for family in applicable
        }
        baselines = {
            family: torch.tensor(
                [len(t[family]) / (e.predict_position + 1) for t, e in zip(targets, batch.events)]
            )
            for family in masses
        }
        families = head_families(masses, batch.kinds, all_heads(model), baselines)
    return families


def _elicitation_warnings(elicitation: dict, curve, config: CharacterizeConfig) -> list[str]:
    """Early elicitation skipped, or read from fewer examples than the minimum."""
    warned: list[str] = []
    if curve is None and config.elicitation_kind is not None:
        warned.append(f"early elicitation skipped: {elicitation['skipped']}")
    elif curve is not None and elicitation["n_examples"] < config.min_elicitation_examples:
        warned.append(
            f"early elicitation rests on {elicitation['n_examples']} examples with a decided "
            f"{config.elicitation_kind} event (fewer than {config.min_elicitation_examples}): "
            "its lead and early heads are read from very few"
        )
    return warned


STAGE_NAMES = {
    MEANS_FILE: "reference means",
    EVERY_MARGIN_FILE: "clean margins of every gold event",
    CLEAN_MARGIN_FILE: "clean margins of the decided events",
    ATTRIBUTION_FILE: "attribution scores",
}


def _stage_keeper(model: HookedModel, run_dir: Path | None, stale: str):
    """`keep(name, fingerprint, compute)`: a stage's result kept in the run folder under `name`
    (lens/stage_file.py), fingerprinted by the model's weights and `fingerprint`; without a
    folder, computed each time."""
    if run_dir is None:
        return lambda name, fingerprint, compute: compute()
    weights = model_digest(model)

    def keep(name: str, fingerprint: dict[str, str], compute):
        return kept_stage(
            run_dir / name,
            {"model weights": weights, **fingerprint},
            compute,
            stale,
            what=STAGE_NAMES[name],
        )

    return keep


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
    encoded, reference = encode_checked(model, tokenizer, examples, reference_examples)
    encoded, reference, contrasts = choose_contrasts(
        model,
        encoded,
        reference,
        config.contrasts,
        config.progress,
        sweep_dir / CONTRAST_LOG if sweep_dir is not None else None,
        config.stale,
    )
    keep = _stage_keeper(model, sweep_dir, config.stale)
    means = keep(
        MEANS_FILE,
        {
            "reference": value_digest([asdict(x) for x in reference]),
            "options": value_digest([config.null_per_event, config.seed]),
        },
        lambda: reference_means(model, reference, config.null_per_event, config.seed, pad),
    )

    every_event = make_event_batch(encoded, pad_token_id=pad)
    every_margin = keep(
        EVERY_MARGIN_FILE,
        {"events": events_digest(every_event)},
        lambda: clean_margins(model, every_event),
    )
    decided = decided_rows(every_margin, config.min_margin)
    if len(decided) == 0:
        raise ValueError(
            f"the model decides none of the {len(every_event)} gold events its way: nothing to characterise"
        )
    batch = every_event.select(decided)
    clean = keep(  # the sweep, the circuit and the curve share it
        CLEAN_MARGIN_FILE, {"events": events_digest(batch)}, lambda: clean_margins(model, batch)
    )
    nulls = make_event_batch(
        encoded, null_events(encoded, batch.events, config.null_per_event, config.seed), pad
    )
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

    attribution = keep(
        ATTRIBUTION_FILE,
        {"events": events_digest(batch), "reference means": means_digest(means)},
        lambda: chunked_attribution(model, batch, means, config.attribution_batch_size),
    )
    swept = (
        all_heads(model)
        if config.sweep_top is None
        else top_heads(attribution.abs().mean(dim=0), config.sweep_top)
    )

    sweep, null_sweep = _sweeps(model, batch, nulls, means, swept, clean, sweep_dir, config)
    exact = effects_tensor(sweep, len(batch), n_layers, n_heads)  # NaN for heads not swept
    null_exact = effects_tensor(null_sweep, len(nulls), n_layers, n_heads)
    attribution_table = _attribution_table(batch, attribution, exact)

    calibration = calibrate(exact.nan_to_num(0.0), batch.kinds, null_exact.nan_to_num(0.0))
    searched: list[str] = []  # what the faithfulness search has to say
    faithful = _faithful(model, batch, means, exact, config, sweep_dir, searched)
    circuits = chosen_circuits(calibration, faithful, config)
    circuit = circuits["all"]

    warned = _sample_warnings(batch, nulls, circuit, config) + searched
    events = (
        circuit_report(model, batch, means, circuit, seed=config.seed, clean=clean).to_frame()
        if circuit
        else None
    )
    ids = [own_id(example) for example in examples]
    if events is not None and any(i is not None for i in ids):  # the examples' own names
        events.insert(1, "id", [ids[i] for i in events["example_id"]])

    families = _families(model, batch, encoded, examples, near_miss_text)

    components = (
        {
            site: component_summary(
                component_shares(model, batch, make_event_batch(reference, pad_token_id=pad), site)
            )
            for site in SITES
        }
        if config.components
        else {}
    )
    elicitation, curve = _elicitation(model, batch, circuits, region_candidates, config)
    warned += _elicitation_warnings(elicitation, curve, config)

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
        faithful=faithful,
        components=components,
        contrasts=contrasts,
        example=example_view(
            model, encoded, every_event, every_margin, decided.tolist(), circuits, calibration
        ),
    )


def _faithful(model, batch, means, exact, config, sweep_dir, warned: list[str]) -> dict:
    """Per kind and for all decided events: the head set found by its joint effect on
    `config.faithful_discovery` of the examples (seeded), reported on the rest. With `sweep_dir` the searches keep their
    steps in a log there (`SEARCH_LOG`) and an interrupted run resumes from it."""
    if config.faithful_pool is None:
        return {}
    log = SearchLog(
        sweep_dir / SEARCH_LOG if sweep_dir is not None else None,
        search_fingerprint(backend_for(model).model, batch, means, config),
        config.stale,
    )
    discovery = split_by_example(
        [e.example_id for e in batch.events], 1 - config.faithful_discovery, config.seed
    )
    found = {}
    for kind in [*dict.fromkeys(batch.kinds), "all"]:
        rows = (
            torch.ones(len(batch), dtype=torch.bool)
            if kind == "all"
            else kind_mask(batch.kinds, kind)
        )
        if not (rows & discovery).any() or not (rows & ~discovery).any():
            warned.append(
                f"faithful circuit of {kind!r} not searched: its events lie on one side of the "
                "discovery / validation split"
            )
            continue
        found[kind] = log.result(kind)
        if found[kind] is None:
            found[kind] = _faithful_kind(
                model,
                batch.select(rows & discovery),
                batch.select(rows & ~discovery),
                means,
                exact[rows & discovery],
                config,
                log,
                kind,
            )
            log.finish(kind, found[kind])
        failed = found[kind].get("stability", {}).get("failed", 0)
        if failed:
            warned.append(
                f"selection stability of {kind!r}: the search was undefined on {failed} of "
                f"{config.faithful_stability} resamples (mean clean margin not positive); its "
                "frequencies are shares of the rest"
            )
    if 0 < config.faithful_stability < MIN_RESAMPLES and found:
        warned.append(
            f"selection stability from {config.faithful_stability} bootstrap resamples, fewer "
            f"than {MIN_RESAMPLES}: its frequencies are coarse"
        )
    return found


def _faithful_kind(model, discovery, validation, means, effects, config, log, kind) -> dict:
    """One kind's faithful circuit (:func:`faithful_circuit` with the run's options)."""
    search = Search(
        config.faithful_method,
        config.faithful_max_size,
        config.faithful_target,
        config.faithful_mask_steps,
    )
    return faithful_circuit(
        model,
        discovery,
        validation,
        means,
        effects,
        pool_size=config.faithful_pool,
        search=search,
        seed=config.seed,
        random_draws=config.faithful_random_draws,
        stability=config.faithful_stability,
        compare=METHODS if config.faithful_compare else (),
        log=log,
        key=kind,
    )


def search_fingerprint(
    model: HookedModel, batch: EventBatch, means, config: CharacterizeConfig
) -> dict[str, str]:
    """What the faithfulness searches' steps depend on: the sweep's inputs (weights, events,
    reference means) and the options that choose the split, the pool and the search."""
    options = {k: v for k, v in asdict(config).items() if k.startswith("faithful_")}
    options["seed"] = config.seed
    return {**sweep_fingerprint(model, batch, means), "search options": value_digest(options)}


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
    n_examples = len({e.example_id for e in regions.events})
    curve = elicitation_curve(model, regions, candidates, config.ks, seed=config.seed)
    lead = {
        method: elicitation_lead(curve, method, config.elicitation_threshold)
        for method in ("probe", "logit_lens")
    }
    # the earliest position still readable (at least 2: k=1 is the decision position itself)
    k_early = max(2, lead["probe"])
    at_k = curve[(curve.method == "probe") & (curve.k == k_early)]
    if at_k.empty:
        return {"lead": lead, "curve": "elicitation.csv", "n_examples": n_examples}, curve
    stage = int(at_k.loc[at_k["accuracy"].idxmax(), "stage"])
    drops = carrying_heads(model, regions, k_early, stage, seed=config.seed)
    early = [h for h in top_heads(drops, max(1, len(late_heads))) if float(drops[h]) > 0]
    union = set(early) | set(late_heads)
    return {
        "lead": lead,
        "n_examples": n_examples,
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
