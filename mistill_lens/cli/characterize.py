"""The ``characterize`` command: a checkpoint on the ICD task, SmolLM2 zero-shot, or a user's own
examples (``--examples FILE.jsonl``, any task: :mod:`mistill_lens.lens.examples`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Mapping

from mistill_lens.lens.characterize import Characterization, CharacterizeConfig, characterize
from mistill_lens.lens.outputs import prepare_output, write_characterization

DEFAULT_N = 12


def _config(args: argparse.Namespace, **overrides) -> CharacterizeConfig:
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
        components=args.components,
    )
    return replace(config, **overrides)


def _command() -> str:
    return "mistill-lens " + shlex.join(sys.argv[1:])


def _finish(result: Characterization, out: str | Path) -> dict:
    """Write the characterisation's files and print one JSON line: the circuit, and where the
    files and figures are."""
    out = write_characterization(result, out)
    summary = result.summary()
    shown = {k: summary[k] for k in ("circuit_size", "n_heads_total", "circuit", "warnings")}
    print(
        json.dumps({**shown, "out": str(out), "head_maps": str(out / "figures" / "head_maps.html")})
    )
    return summary


def run_task(args: argparse.Namespace, task_config: Mapping[str, Any]) -> dict:
    """A checkpoint (or ``default``) on the ICD task's examples."""
    from mistill_lens.models.checkpoints import load_model
    from mistill_lens.task.characterize import characterize_task, task_examples

    bridge, tokenizer = load_model(args.model)
    examples, reference = task_examples(
        args.n or DEFAULT_N, args.seed, args.split, task_config, args.n_reference
    )
    check_k_fits(bridge.cfg.n_ctx, tokenizer, examples + reference, args, task_config)
    provenance = {
        "command": _command(),
        "model": str(args.model),
        "split": args.split,
        "task_config": dict(task_config),
    }
    out = prepare_output(args.out)
    result = characterize_task(
        bridge, tokenizer, examples, reference, _config(args), sweep_dir=out, provenance=provenance
    )
    return _finish(result, out)


def check_k_fits(n_ctx, tokenizer, examples, args, task_config) -> None:
    """Refuse, before any folder is written, a K whose examples exceed the model's positions,
    naming the largest K that fits."""
    from mistill_lens.task.characterize import largest_fitting_k, longest_example

    longest = longest_example(examples, tokenizer)
    if longest <= n_ctx:
        return
    fitting = largest_fitting_k(n_ctx, tokenizer, len(examples), args.seed, args.split, task_config)
    raise ValueError(
        f"--k {task_config['k']}: the longest example is {longest} tokens and the model reads "
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
    from mistill_lens.lens.examples import read_examples
    from mistill_lens.models.checkpoints import load_model

    examples = read_examples(args.examples)
    reference = read_examples(args.reference) if args.reference else examples
    bridge, tokenizer = load_model(args.model)
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
    result = characterize(
        bridge, tokenizer, examples, reference, _config(args), sweep_dir=out, provenance=provenance
    )
    return _finish(result, out)


def write_generations(examples, path: Path) -> None:
    rows = [
        {**asdict(e), "correct": e.correct, "region_correct": e.region_correct} for e in examples
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def run_smollm2(args: argparse.Namespace, task_config: Mapping[str, Any]) -> dict:
    """``--model smollm2``: zero-shot replies of SmolLM2 to task examples (and to separate
    reference examples for the means), then the same pipeline as a checkpoint."""
    from mistill_lens.task import zero_shot
    from mistill_lens.task.characterize import characterize_task, task_examples

    out_dir = prepare_output(args.out)
    bridge, tokenizer, draft = zero_shot.load_smollm2_with_draft()
    n = args.n or zero_shot.SMOLLM2_DEFAULT_N
    examples, reference = task_examples(
        n,
        args.seed,
        args.split,
        task_config,
        args.n_reference or max(n, zero_shot.SMOLLM2_MIN_REFERENCE),
    )
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
        "task_config": dict(task_config),
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
