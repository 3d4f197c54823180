"""The ``data`` command: task examples with their gold decision events, as JSONL."""

from __future__ import annotations

import argparse
import json

from mistill_lens.cli.arguments import POSITIVE_INT, SEED, SEED_HELP, add_task_options, task_config
from mistill_lens.task_defaults import SPLITS


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "data", help="write task examples with their gold decision events as JSONL"
    )
    parser.add_argument("--n", type=POSITIVE_INT, required=True, help="number of examples")
    parser.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("example stream"))
    parser.add_argument(
        "--split", choices=SPLITS, default="train", help="train, validation or held-out codes"
    )
    parser.add_argument(
        "--out", required=True, help="output .jsonl file (a new file: never overwritten)"
    )
    add_task_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from mistill_lens import task
    from mistill_lens.runs import claim_output_file

    config = task_config(args)
    claim_output_file(args.out, "output file")
    examples = task.generate_examples(args.n, args.seed, args.split, **config)
    task.write_jsonl(examples, args.out)
    n_events = sum(len(e.events) for e in examples)
    print(json.dumps({"out": str(args.out), "n": len(examples), "events": n_events}))
