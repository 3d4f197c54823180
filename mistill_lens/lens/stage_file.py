"""A characterisation stage's result kept in its run folder with the fingerprint of its inputs, so
that a rerun reads it back instead of computing it again.

Why: before the sweeps, whose tables resume row by row, an n = 150 characterisation of the default
teacher spends ~25 min on one core computing the reference means and the clean margins (an engine
pass per example, twice where the cache cannot hold them all) and then the attribution: an
interruption there cost all of it. Each such stage writes one file (``torch.save`` of
``{"fingerprint", "value"}``, replaced atomically) and is read back only when its fingerprint (the
model's weights, the examples and events, the options that change the value) is the current one;
otherwise it is refused (``stale="error"``) or recomputed with a
:class:`~mistill_lens.lens.fingerprint.StaleResultWarning` (``stale="recompute"``), never mixed in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import torch

from mistill_lens.lens.fingerprint import check_stale, resumable

T = TypeVar("T")
STAGE_FORMAT = "1"


def kept_stage(
    path: str | Path | None,
    fingerprint: Mapping[str, str],
    compute: Callable[[], T],
    stale: str = "error",
    what: str = "stage result",
) -> T:
    """The value `compute` returns, read from `path` when a run with the same `fingerprint` wrote
    it there, else computed and written (no `path`: computed, nothing kept)."""
    check_stale(stale)
    if path is None:
        return compute()
    path = Path(path)
    current = {"format": STAGE_FORMAT, **fingerprint}
    if path.is_file():
        stored = torch.load(path, weights_only=False, map_location="cpu")
        if resumable(stored.get("fingerprint"), current, f"{what} {path}", stale):
            return stored["value"]
    value = compute()
    partial = path.with_name(path.name + ".partial")
    torch.save({"fingerprint": current, "value": value}, partial)
    os.replace(partial, path)  # a reader never sees half a file, even if killed here
    return value
