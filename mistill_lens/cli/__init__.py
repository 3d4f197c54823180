"""The ``mistill-lens`` command line: one module per command, each with the same shape,
``add_parser(subparsers)`` and ``run(args)``; this module only lists them, parses and reports
errors. Building the parser imports nothing heavy (a usage error answers at once)."""

from __future__ import annotations

import argparse
import sys
import warnings

from mistill_lens.cli import (
    bench,
    build_tokenizers,
    characterize,
    data,
    demo,
    distill,
    distill_report,
    evaluate,
    report,
    train,
)
from mistill_lens.cli.arguments import DefaultsShown

COMMANDS = (
    data,
    train,
    evaluate,
    build_tokenizers,
    characterize,
    bench,
    report,
    distill,
    distill_report,
    demo,
)
"""In the order ``--help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mistill-lens",
        description="Characterise and distil label-selection mechanisms in hooked language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = DefaultsShown
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(
        argv
    )  # imports nothing heavy: --no-progress acts before torch loads
    prefix = f"mistill-lens {args.command}"
    if getattr(args, "no_progress", False):
        _silence_loading_bars()

    def show_warning(message, category, filename, lineno, file=None, line=None):
        # imported here: the module needs torch, which a usage error should not wait for
        from mistill_lens.lens.fingerprint import StaleResultWarning

        if issubclass(category, StaleResultWarning):
            print(f"{prefix}: warning: {message}", file=sys.stderr)
        else:
            default_show_warning(message, category, filename, lineno, file, line)

    default_show_warning = warnings.showwarning
    warnings.showwarning = show_warning
    try:
        args.func(args)
    except KeyboardInterrupt:
        hint = getattr(args, "resume_hint", None)
        done = f"{hint}; rerun the same command to resume" if hint else "nothing partial was kept"
        print(f"{prefix}: interrupted: {done}", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        if type(err).__name__ == "EngineMismatch":  # the library names its parameter, we our flag
            message = f"{message}; on the command line: --no-engine"
        print(f"{prefix}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from err
    finally:
        warnings.showwarning = default_show_warning


def _silence_loading_bars() -> None:
    """--no-progress: no bars from transformers or the hub while models load, as well as ours."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF loader uses a plain tqdm bar
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    main()
