"""The command-line reference page (`docs/cli.md`), generated from the parser itself:
``python -m mistill_lens.cli.reference > docs/cli.md``. A test keeps the page equal to it."""

from __future__ import annotations

import os

WIDTH = "100"  # argparse wraps help to the terminal's width: fixed, so the page is stable


def reference_markdown() -> str:
    from mistill_lens.cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parser = build_parser()
        commands = parser._subparsers._group_actions[0].choices
        parts = [
            "# Command-line reference\n\n"
            "Generated from the parser (`python -m mistill_lens.cli.reference > docs/cli.md`); "
            "`tests/test_docs.py` checks it matches `--help`.\n\n```\n"
            + parser.format_help()
            + "```\n"
        ]
        for name, command in commands.items():
            parts.append(f"\n## `mistill-lens {name}`\n\n```\n{command.format_help()}```\n")
        return "".join(parts)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


if __name__ == "__main__":
    print(reference_markdown(), end="")
