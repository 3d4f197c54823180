"""argparse types from the option checks of :mod:`mistill_lens.options`: one rule and one message
for a value given on the command line and in a config."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from mistill_lens.options import non_negative, non_negative_float, positive, positive_float, seed


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
