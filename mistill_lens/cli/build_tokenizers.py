"""The ``build-tokenizers`` command: the shipped teacher and student tokenizers, rebuilt."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "build-tokenizers", help="rebuild the shipped teacher and student tokenizers"
    )
    parser.add_argument(
        "--out",
        required=True,
        help="folder for teacher_tokenizer/ and student_tokenizer/ (new or empty; "
        "the shipped ones live in mistill_lens/assets)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from mistill_lens.runs import claim_run_dir
    from mistill_lens.task.build_tokenizers import build_and_save

    build_and_save(claim_run_dir(args.out, "build-tokenizers"))
    print(json.dumps({"out": args.out}))
