"""What every command's parser shares: argparse types from the option checks of
:mod:`mistill_lens.options` (one rule and one message for a value given on the command line and in
a config), the task options, the help formatter, and parsing one command on its own."""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any, Callable

from mistill_lens.options import (
    SEED_MAX,
    non_negative,
    non_negative_float,
    open_share,
    positive,
    positive_float,
    seed,
)


def cli_type(
    check: Callable[[str, Any], Any], parse: Callable[[str], Any] = int
) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the text and applies ``check`` (argparse then reports
    ``mistill-lens CMD: error: argument --x: <message>`` and exits 2)."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if parse is int else 'a number'}, got {text!r}"
            )
        try:
            return check("value", value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from err

    return convert


POSITIVE_INT = cli_type(positive)
NON_NEGATIVE_INT = cli_type(non_negative)
SEED = cli_type(seed)
POSITIVE_FLOAT = cli_type(positive_float, float)
NON_NEGATIVE_FLOAT = cli_type(non_negative_float, float)
SHARE = cli_type(open_share, float)

SEED_HELP = "{} seed, 0-" + str(SEED_MAX) + " (default 0)"


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def add_task_options(parser: argparse.ArgumentParser, *, defaults_from_model: bool = False) -> None:
    """--universe-size, --k, --max-mentions; for a trained model they default to its training values."""
    from mistill_lens.task_defaults import DEFAULT_K, DEFAULT_MAX_MENTIONS, DEFAULT_UNIVERSE_SIZE

    options = (
        ("--universe-size", DEFAULT_UNIVERSE_SIZE, "codes in the label universe, up to 12536"),
        ("--k", DEFAULT_K, "candidates in context, at least 3 x --max-mentions + 1"),
        ("--max-mentions", DEFAULT_MAX_MENTIONS, "most conditions per summary, 1-4"),
    )
    for flag, default, description in options:
        if defaults_from_model:
            parser.add_argument(
                flag,
                type=POSITIVE_INT,
                default=None,
                help=f"{description} (default: the model's training value)",
            )
        else:
            parser.add_argument(
                flag, type=POSITIVE_INT, default=default, help=f"{description} (default {default})"
            )


def task_config(args: argparse.Namespace, model_config: dict | None = None) -> dict:
    """Task options from the command line, else the model's training values, else the defaults."""
    from mistill_lens import task
    from mistill_lens.task.icd import DEFAULT_UNIVERSE_SIZE

    fallback = {
        "universe_size": DEFAULT_UNIVERSE_SIZE,
        "k": task.DEFAULT_K,
        "max_mentions": task.DEFAULT_MAX_MENTIONS,
        **(model_config or {}),
    }
    config = {
        name: getattr(args, name) if getattr(args, name) is not None else fallback[name]
        for name in ("universe_size", "k", "max_mentions")
    }
    task.check_task_config(**config)
    return config


def parse_command(command: ModuleType, argv: list[str]) -> argparse.Namespace:
    """``argv`` (the command's name first) parsed by that one command module's parser, as the full
    command line would parse it: how one command runs another (the demo) without the registry."""
    parser = argparse.ArgumentParser(prog="mistill-lens")
    command.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
