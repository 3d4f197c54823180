"""Numeric options, checked once: the same rule and the same message in every command and config.

Counts where zero means nothing (examples, steps, batch sizes) are at least 1; seeds are integers
in ``0 .. SEED_MAX``; rates are positive. Configs call :func:`check_options` in
``__post_init__``; the command line uses the argparse types built from the same checks.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

SEED_MAX = 2**31 - 1


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def at_least(minimum: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if _integer(name, value) < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {value}")
        return value
    return check


def seed(name: str, value: Any) -> int:
    if not 0 <= _integer(name, value) <= SEED_MAX:
        raise ValueError(f"{name} must be between 0 and {SEED_MAX}, got {value}")
    return value


def positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def non_negative_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


positive = at_least(1)
non_negative = at_least(0)


def check_options(obj: Any, **checks: Callable[[str, Any], Any]) -> None:
    """Apply ``checks[field](field, value)`` to the named fields of ``obj`` (None is left alone)."""
    for name, check in checks.items():
        value = getattr(obj, name)
        if value is not None:
            check(name, value)


def cli_type(check: Callable[[str, Any], Any], parse: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the text and applies ``check`` (argparse then reports
    ``mistill-lens CMD: error: argument --x: <message>`` and exits 2)."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if parse is int else 'a number'}, got {text!r}")
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
