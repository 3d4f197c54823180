"""After training: characterise each student afresh and measure its causal recovery.

The student's heads are found by the characterisation pipeline
(:func:`mistill_lens.lens.characterize.characterize`) on held-out examples, never assumed from the
teacher. Causal recovery of the contrastive decision = the mean, over decided near-miss
events, of the fraction of the student's margin its found circuit (the union over event kinds,
as the characterisation reports it) carries, by exact mean-ablation (necessity) and by knock-in
transfer; ``causal_recovery`` is the mean of the two. Per-event fractions are ratios to the
clean margin, so one event with a barely positive margin can dominate that mean (a fraction of
-10); ``causal_recovery_median`` takes the median over events of each measure instead.
A student whose characterisation selects no heads carries none of it (recovery 0); one that
decides no gold event its way has no recovery to measure (None).

Recovery is read so that it can fail (`recovery_controls`): the found near-miss circuit's mean
necessity beside that of random head sets of its size (its chance level, with a p-value) and
that of its heads that were not supervised. MISTILL trains the supervised heads to attend at
exactly these events, so those heads can move the margin without deciding anything.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from mistill_lens import task
from mistill_lens.lens.backends import choose_backend, clean_margins
from mistill_lens.lens.characterize import REFERENCE_ID_OFFSET, encode, reference_means
from mistill_lens.lens.circuits import necessity
from mistill_lens.lens.events import kind_mask, make_event_batch
from mistill_lens.lens.hooks import Head, all_heads
from mistill_lens.lens.margins import decided_rows
from mistill_lens.lens.outputs import (
    SUMMARY,
    prepare_output,
    read_characterization,
    write_characterization,
)
from mistill_lens.lens.results import CharacterizeConfig
from mistill_lens.models.checkpoints import load_hf_model, load_model, read_metadata
from mistill_lens.task.characterize import characterize_task, task_examples
from mistill_lens.task.metrics import evaluate

EVALUATION_FILE = "evaluation.json"


def causal_recovery(measures_by_kind: Mapping[str, dict], kind: str = "near_miss") -> dict:
    """Recovery figures of one event kind from a characterisation's per-kind measures
    (:meth:`Characterization.measures`, or the per-kind entries of its summary)."""
    measures = measures_by_kind.get(kind) or {}
    if not measures.get("n_events"):
        return {
            "causal_recovery": None,
            "recovery_ablation": None,
            "recovery_knock_in": None,
            "recovery_knock_in_pooled": None,
            "n_events": 0,
        }
    ablation = measures.get("necessity")
    knock_in = measures.get("knock_in")
    # the knock-in's gains over its gaps summed across events: no event with a tiny gap can carry
    # it as one can carry the mean of ratios (None: a characterisation from before it existed)
    pooled = measures.get("knock_in_pooled")
    if ablation is None:  # no heads selected: the found set carries nothing
        ablation, knock_in, pooled = 0.0, 0.0, 0.0
    knock_in = 0.0 if knock_in is None or knock_in != knock_in else knock_in  # NaN: no donor pair
    pooled = 0.0 if pooled is not None and pooled != pooled else pooled  # NaN, as knock_in
    return {
        "causal_recovery": (ablation + knock_in) / 2,
        "recovery_ablation": ablation,
        "recovery_knock_in": knock_in,
        "recovery_knock_in_pooled": pooled,
        "n_events": measures["n_events"],
        "near_miss_circuit": measures.get("circuit", []),
    }


N_RANDOM_SETS = 50  # random head sets of the found circuit's size: the chance level of recovery


def recovery_controls(
    model,
    tokenizer,
    examples,
    reference,
    circuit: Sequence[Head],
    supervised: Sequence[Head],
    config: CharacterizeConfig,
    kind: str = "near_miss",
    n_random: int = N_RANDOM_SETS,
) -> dict:
    """Whether the found circuit's recovery (mean necessity over the decided `kind` events) means
    anything: the same measure for `n_random` random head sets of its size (seeded by
    ``config.seed``; p = the share of them at least as high, with one added to both counts), and
    for the found heads that were not supervised (MISTILL trains the supervised heads to attend at
    exactly these events, so they can move the margin without deciding anything)."""
    model, _ = choose_backend(model, config.engine)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    encoded = encode(examples, tokenizer)
    means = reference_means(
        model,
        encode(reference, tokenizer, first_id=REFERENCE_ID_OFFSET),
        config.null_per_event,
        config.seed,
        pad,
    )
    every_event = make_event_batch(encoded, pad_token_id=pad)
    batch = every_event.select(decided_rows(clean_margins(model, every_event), config.min_margin))
    batch = batch.select(kind_mask(batch.kinds, kind).nonzero().flatten())
    if not circuit or len(batch) == 0:
        return {"recovery_controls": None}
    clean = clean_margins(model, batch)

    def recovery(heads) -> float:
        return float(necessity(model, batch, means, heads, clean).mean())

    rng = random.Random(config.seed)
    every_head = all_heads(model)
    found = recovery(circuit)
    chance = [recovery(rng.sample(every_head, len(circuit))) for _ in range(n_random)]
    unsupervised = [head for head in circuit if head not in set(map(tuple, supervised))]
    return {
        "recovery_controls": {
            "kind": kind,
            "n_events": len(batch),
            "circuit": [list(h) for h in circuit],
            "found": found,
            "random_mean": sum(chance) / len(chance),
            "random_95th": sorted(chance)[int(0.95 * (len(chance) - 1))],
            "n_random": n_random,
            "p_found_vs_random": (1 + sum(c >= found for c in chance)) / (1 + len(chance)),
            "unsupervised_heads": [list(h) for h in unsupervised],
            "unsupervised": recovery(unsupervised) if unsupervised else None,
        }
    }


def median_recovery(characterization_dir: str | Path, kind: str = "near_miss") -> float | None:
    """:meth:`Characterization.median_recovery` of the characterisation written in
    `characterization_dir`; None when it did not finish."""
    if not (Path(characterization_dir) / SUMMARY).is_file():
        return None
    return read_characterization(characterization_dir).median_recovery(kind)


def check_scores_match(scores: Mapping, n_eval: int, seed: int, task_config: Mapping) -> None:
    """Refuse an ``evaluate`` record made on other prompts than `evaluate_run` would score."""
    wanted = {"split": "heldout", "n": n_eval, "seed": seed}
    wanted.update((key, task_config[key]) for key in ("universe_size", "k", "max_mentions"))
    differ = {key: (scores.get(key), value) for key, value in wanted.items()}
    differ = {key: pair for key, pair in differ.items() if pair[0] != pair[1]}
    if differ:
        said = ", ".join(
            f"{key} {got!r} (wanted {value!r})" for key, (got, value) in differ.items()
        )
        raise ValueError(
            f"the given scores were made on other prompts: {said}; evaluate on the held-out "
            "split with the same n, seed and task, or pass no scores"
        )


def evaluate_run(
    run_dir: str | Path,
    task_config: dict,
    *,
    n_eval: int = 50,
    n_characterize: int = 24,
    seed: int = 0,
    progress: bool = True,
    characterize_config: CharacterizeConfig | None = None,
    scores: Mapping | None = None,
) -> dict:
    """Task metrics on held-out prompts and causal recovery; written to ``evaluation.json``.
    `scores`: an ``evaluate`` record of this model on the same held-out prompts (split, n and
    seed), used in place of generating them again (the generation is most of the cost)."""
    run_dir = Path(run_dir)
    if scores is None:
        model, tokenizer = load_hf_model(run_dir)  # fp32 compute; bf16 weights are exact in fp32
        heldout = task.generate_examples(n_eval, seed, "heldout", **task_config)
        scores, _ = evaluate(
            model, tokenizer, heldout, task_config["universe_size"], progress=progress
        )
    else:
        check_scores_match(scores, n_eval, seed, task_config)
    bridge, tokenizer = load_model(run_dir)
    examples, reference = task_examples(n_characterize, seed + 1, "heldout", task_config)
    # The characterisation folder is this run's own: after more training its sweeps are stale and redone.
    config = replace(
        characterize_config or CharacterizeConfig(seed=seed, progress=progress), stale="recompute"
    )
    result = {
        "run": str(run_dir),
        **{k: scores[k] for k in ("code_f1", "near_miss_acc", "region_acc", "exact_match")},
        # each mention's outcomes, for a comparison of two runs mention by mention (older
        # evaluate records lack them)
        **({"per_mention": scores["per_mention"]} if "per_mention" in scores else {}),
        "n_eval": n_eval,
        "eval_seed": seed,
        "n_characterize": n_characterize,
        "z_min": config.z_min,
        "circuit": config.circuit,  # the rule of the found circuit whose recovery is read
    }
    out = prepare_output(run_dir / "characterization")
    try:
        characterization = characterize_task(
            bridge, tokenizer, examples, reference, config, sweep_dir=out
        )
        write_characterization(characterization, out)
        result.update(
            causal_recovery(characterization.measures()),
            causal_recovery_median=characterization.median_recovery(),
            circuit=[list(h) for h in characterization.circuit],
            warnings=characterization.warnings,
        )
        supervised = read_metadata(run_dir).get("student_heads", [])
        result.update(
            recovery_controls(
                bridge,
                tokenizer,
                examples,
                reference,
                characterization.circuits.get("near_miss", []),
                [tuple(h) for h in supervised],
                config,
            )
        )
    except ValueError as err:  # e.g. the student decides no gold event its way
        result.update(
            causal_recovery({}), causal_recovery_median=None, characterization_error=str(err)
        )
    metadata = read_metadata(run_dir)
    result.update(
        {k: metadata["config"][k] for k in ("family", "objective", "precision", "seed")},
        train_time_s=metadata.get("train_time_s"),
        steps=metadata.get("step"),
        attention_loss_tail=metadata.get("attention_loss_tail"),
        paired=metadata.get("paired"),
        compute=metadata.get("compute"),  # None: recorded before compute was (models/precision)
    )
    (run_dir / EVALUATION_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
