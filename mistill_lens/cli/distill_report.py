"""The ``distill-report`` command: the table and figures over distillation runs (the gate marked per
cell)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "distill-report", help="table and figure over distillation runs; prints a JSON summary last"
    )
    parser.add_argument(
        "--runs", nargs="+", required=True, help="student run folders (each with evaluation.json)"
    )
    parser.add_argument(
        "--out", required=True, help="report folder (new, empty, or an earlier report's)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from mistill_lens.distill.report import write_report

    summary = write_report(args.runs, args.out)
    print(json.dumps(summary))
    return summary
