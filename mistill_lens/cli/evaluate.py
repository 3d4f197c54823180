"""The ``evaluate`` command: greedy decoding of a split and the task metrics."""

from __future__ import annotations

import argparse
import json

from mistill_lens.cli.arguments import POSITIVE_INT, SEED, SEED_HELP, add_task_options, task_config
from mistill_lens.task_defaults import SPLITS


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "evaluate", help="greedy-decode a split and print the task metrics as JSON"
    )
    parser.add_argument(
        "--model",
        default="default",
        help="checkpoint folder, 'default' (the shipped K = 64 teacher) or 'tiny' (the GPT-2 one)",
    )
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="heldout",
        help="examples whose gold codes are from this split (held-out: never gold in training)",
    )
    parser.add_argument(
        "--n", type=POSITIVE_INT, default=100, help="examples to decode (default 100)"
    )
    parser.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("example stream"))
    parser.add_argument(
        "--save-outputs", default=None, help="also write the generations to this new .jsonl file"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when available)"
    )
    parser.add_argument(
        "--batch-size",
        type=POSITIVE_INT,
        default=1,
        help="prompts decoded together, left-padded (default 1; larger on a GPU; a batch's "
        "greedy outputs can differ from one-by-one decoding in the last float bits)",
    )
    add_task_options(parser, defaults_from_model=True)
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from mistill_lens.models.registry import check_model_spec

    check_model_spec(args.model)  # before the heavy imports below
    from mistill_lens import task
    from mistill_lens.models.checkpoints import load_hf_model, read_metadata
    from mistill_lens.runs import claim_output_file
    from mistill_lens.task.metrics import evaluate
    from mistill_lens.training.loop import resolve_device

    config = task_config(args, read_metadata(args.model).get("config"))
    if args.save_outputs:
        path = claim_output_file(args.save_outputs, "--save-outputs file")
    model, tokenizer = load_hf_model(args.model)
    model.to(resolve_device(args.device))
    examples = task.generate_examples(args.n, args.seed, args.split, **config)
    scores, outputs = evaluate(
        model,
        tokenizer,
        examples,
        config["universe_size"],
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    if args.save_outputs:
        path.write_text(
            "".join(
                json.dumps({"id": e.id, "generated": o}) + "\n" for e, o in zip(examples, outputs)
            )
        )
    scores.update(split=args.split, seed=args.seed, **config)
    print(json.dumps(scores))
    return scores
