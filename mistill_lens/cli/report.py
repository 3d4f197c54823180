"""The ``report`` command: one self-contained HTML report over characterisation and distillation
folders."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "report",
        help="one self-contained HTML report (figures, numbers, sample sizes, commands) over "
        "characterisation and distillation folders",
    )
    parser.add_argument(
        "--runs", nargs="+", required=True, help="characterize or distill output folders"
    )
    parser.add_argument(
        "--out", required=True, help="report folder (new, empty or an earlier report)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from mistill_lens.report import write_report

    path = write_report(args.runs, args.out)
    print(json.dumps({"report": str(path), "runs": len(args.runs)}))
