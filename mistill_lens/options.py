"""Numeric options, checked once: the same rule and the same message in every command and config.

Counts where zero means nothing (examples, steps, batch sizes) are at least 1; seeds are integers
in ``0 .. SEED_MAX``; rates are positive. Configs call :func:`check_options` in
``__post_init__``; the command line's argparse types (:mod:`mistill_lens.cli.arguments`) are
built from the same checks.
"""

from __future__ import annotations

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
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def non_negative_float(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return float(value)


def open_share(name: str, value: Any) -> float:
    """A share strictly between 0 and 1 (a split that leaves both sides something)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not 0 < value < 1
    ):
        raise ValueError(f"{name} must be a share strictly between 0 and 1, got {value!r}")
    return float(value)


positive = at_least(1)
non_negative = at_least(0)


def check_options(obj: Any, **checks: Callable[[str, Any], Any]) -> None:
    """Apply ``checks[field](field, value)`` to the named fields of ``obj`` (None is left alone)."""
    for name, check in checks.items():
        value = getattr(obj, name)
        if value is not None:
            check(name, value)
