"""Fingerprints: short digests of everything a resumable result depends on.

A resumable artefact (a sweep table, a training state, a distillation cache) stores the
fingerprint of its inputs: a flat ``{name: digest}`` mapping such as the model's weights, the
events, the reference means, the options that change its numbers and the version of its own
format. Resuming compares the stored fingerprint with the current one and names every input
that changed (:func:`check_fingerprint`), so a result is never silently mixed with another
run's.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor


class StaleResultError(ValueError):
    """A stored result was computed from other inputs than the current run's."""


class StaleResultWarning(UserWarning):
    """A stored result computed from other inputs was discarded and recomputed."""


def _update(digest, tensor: Tensor) -> None:
    tensor = tensor.detach().cpu().contiguous()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_digest(*tensors: Tensor) -> str:
    """Digest of the tensors' dtypes, shapes and bytes, in order."""
    digest = hashlib.sha256()
    for tensor in tensors:
        _update(digest, tensor)
    return digest.hexdigest()[:16]


def model_digest(model: torch.nn.Module) -> str:
    """Digest of every parameter and buffer of ``model`` (by name): changes when any weight does."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        _update(digest, tensor)
    return digest.hexdigest()[:16]


def value_digest(value: Any) -> str:
    """Digest of a JSON-serialisable value (options, token lists, head sets)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_fingerprint(
    stored: Mapping[str, str] | None, current: Mapping[str, str], what: str
) -> None:
    """Raise :class:`StaleResultError` naming each input of ``what`` that differs (or that the
    stored fingerprint lacks)."""
    if stored is None:
        raise StaleResultError(
            f"{what} has no fingerprint of its inputs (written by an older version), so "
            "whether it belongs to this run cannot be checked"
        )
    changed = sorted(
        name for name in set(stored) | set(current) if stored.get(name) != current.get(name)
    )
    if changed:
        raise StaleResultError(
            f"{what} belongs to another run: its {', '.join(changed)} differ from this run's"
        )


STALE_CHOICES = ("error", "recompute")


def check_stale(stale: str) -> None:
    """Refuse a `stale` policy other than "error" (refuse a stored result of other inputs) and
    "recompute" (discard it, warn, compute afresh)."""
    if stale not in STALE_CHOICES:
        raise ValueError(f"stale must be 'error' or 'recompute', got {stale!r}")


def resumable(
    stored: Mapping[str, str] | None,
    current: Mapping[str, str],
    what: str,
    stale: str,
    remedy: str = "remove it, or recompute (stale='recompute') to replace it",
) -> bool:
    """Whether a stored result of ``what`` with fingerprint ``stored`` may be resumed by a run
    whose fingerprint is ``current``. When it belongs to other inputs: ``stale="error"`` raises
    :class:`StaleResultError` naming the inputs that differ and the `remedy`;
    ``stale="recompute"`` warns (:class:`StaleResultWarning`) and returns False, so the caller
    discards it. The one place where every resumable artefact makes that choice."""
    check_stale(stale)
    try:
        check_fingerprint(stored, current, what)
    except StaleResultError as error:
        if stale == "error":
            raise StaleResultError(f"{error}; {remedy}") from None
        # stacklevel 3: the warning points at the caller's caller (the API the user called)
        warnings.warn(f"{error}: recomputed", StaleResultWarning, stacklevel=3)
        return False
    return True


def fingerprint_path(path: str | Path) -> Path:
    """Where the fingerprint of the file ``path`` is stored: ``NAME.fingerprint.json`` beside it."""
    path = Path(path)
    return path.with_name(path.name + ".fingerprint.json")


def read_fingerprint(path: str | Path) -> dict[str, str] | None:
    sidecar = fingerprint_path(path)
    return json.loads(sidecar.read_text()) if sidecar.is_file() else None


def write_fingerprint(path: str | Path, fingerprint: Mapping[str, str]) -> None:
    fingerprint_path(path).write_text(
        json.dumps(dict(fingerprint), indent=2, sort_keys=True) + "\n"
    )
