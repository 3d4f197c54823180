"""Where a command may write, and how it replaces its own files without touching anyone else's.

A command writes only into a folder that is new, empty, or marked as a run of the same command
(the marker file ``.mistill-run.json``, written when the folder is claimed). Anything else is
refused before any work, with a message naming the folder and what is in it: mistill-lens never
deletes or overwrites what it did not write. Single output files are never overwritten.

Checkpoints are replaced file by file through a staging folder inside the run folder: every
file is written there first, then a commit record, then each file is moved into place. A crash
before the commit record leaves the previous checkpoint untouched; a crash after it is rolled
forward the next time the folder is used (:func:`finish_interrupted_commit`). Only the files of
the checkpoint are ever replaced; other files in the folder stay as they are.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

MARKER_FILE = ".mistill-run.json"
STAGING_DIR = ".staging"
COMMIT_FILE = "COMMIT.json"
MANIFEST_FILE = "manifest.json"


class OutputError(ValueError):
    """An output path a command refuses to write to (someone else's folder or file)."""


def _describe(entries: list[str], limit: int = 6) -> str:
    shown = ", ".join(entries[:limit])
    return shown + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def check_run_dir(
    path: str | Path, kind: str, recognise_legacy: Callable[[Path], bool] | None = None
) -> bool:
    """Raise :class:`OutputError` where :func:`claim_run_dir` would refuse ``path``, writing
    nothing (so a command can refuse a bad folder before any work and claim it only once the
    work can start). True when the folder is already marked as a ``kind`` run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(
            f"output folder {path} is an existing file; give a new or empty folder "
            f"(or a previous `{kind}` run's folder)"
        )
    marker = path / MARKER_FILE
    if marker.is_file():
        recorded = _read_marker(marker)
        if recorded != kind:
            raise OutputError(
                f"output folder {path} holds a `{recorded}` run, not a `{kind}` run; "
                "choose a new or empty folder"
            )
        return True
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        if entries and not (recognise_legacy is not None and recognise_legacy(path)):
            raise OutputError(
                f"output folder {path} is not empty and is not a mistill-lens `{kind}` run (it holds "
                f"{_describe(entries)}); choose a new or empty folder: mistill-lens only writes into "
                "folders it created"
            )
    return False


def claim_run_dir(
    path: str | Path, kind: str, recognise_legacy: Callable[[Path], bool] | None = None
) -> Path:
    """The folder ``path`` as a run folder of command ``kind``, created and marked if new or empty.

    An existing folder is accepted when its marker names the same ``kind`` (a rerun resumes), or,
    for folders written before markers existed, when ``recognise_legacy(path)`` says it holds
    such a run (it is then marked). Raises :class:`OutputError` otherwise.
    """
    path = Path(path)
    if check_run_dir(path, kind, recognise_legacy):
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER_FILE).write_text(
        json.dumps(
            {
                "kind": kind,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            },
            indent=2,
        )
        + "\n"
    )
    return path


def _read_marker(marker: Path) -> str:
    try:
        return str(json.loads(marker.read_text())["kind"])
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise OutputError(
            f"run marker {marker} is unreadable ({err}); this folder was not written by "
            "this version of mistill-lens: choose a new or empty folder"
        ) from err


def legacy_run(required: Iterable[str], owned: Iterable[str]) -> Callable[[Path], bool]:
    """A test for folders written before markers: it holds every ``required`` name and nothing but
    ``owned`` names (hidden entries count too)."""
    required, owned = set(required), set(owned) | set(required)

    def recognise(path: Path) -> bool:
        names = {p.name for p in path.iterdir()}
        return required <= names and names <= owned

    return recognise


def claim_output_file(path: str | Path, what: str) -> Path:
    """A new output file: refused if it exists (file or folder); its parent folder is created."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; give the path of a new file")
    if path.exists():
        raise OutputError(
            f"{what} {path} already exists; remove it or give another path "
            "(mistill-lens does not overwrite files)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --- checkpoint commits ------------------------------------------------------------------------


def staging_dir(run_dir: Path) -> Path:
    """An empty staging folder inside ``run_dir`` (a stale, uncommitted one is discarded)."""
    finish_interrupted_commit(run_dir)
    staging = run_dir / STAGING_DIR
    staging.mkdir(parents=True)
    return staging


def commit_staged(run_dir: Path) -> list[str]:
    """Move every staged file into ``run_dir``: record the commit (with a manifest of digests,
    written into the folder too), then replace the files one by one. Returns the committed names."""
    staging = run_dir / STAGING_DIR
    names = sorted(p.name for p in staging.iterdir() if p.is_file())
    manifest = {name: file_digest(staging / name) for name in names}
    (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    commit = staging / COMMIT_FILE
    tmp = commit.with_suffix(".tmp")
    tmp.write_text(json.dumps([*names, MANIFEST_FILE]))
    os.replace(tmp, commit)  # the commit point
    _roll_forward(run_dir)
    return names


def _roll_forward(run_dir: Path) -> None:
    staging = run_dir / STAGING_DIR
    for name in json.loads((staging / COMMIT_FILE).read_text()):
        if (staging / name).exists():
            os.replace(staging / name, run_dir / name)
    shutil.rmtree(staging)


def finish_interrupted_commit(run_dir: str | Path) -> None:
    """Complete a checkpoint commit that a crash interrupted, or discard an uncommitted staging
    folder (the previous checkpoint is then intact)."""
    staging = Path(run_dir) / STAGING_DIR
    if not staging.is_dir():
        return
    if (staging / COMMIT_FILE).is_file():
        _roll_forward(Path(run_dir))
    else:
        shutil.rmtree(staging)


def verify_manifest(run_dir: str | Path) -> None:
    """Raise ``OutputError`` if a file listed in the folder's manifest is missing or has changed."""
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        return
    manifest = json.loads(path.read_text())
    bad = [
        name
        for name, digest in manifest.items()
        if not (run_dir / name).is_file() or file_digest(run_dir / name) != digest
    ]
    if bad:
        raise OutputError(
            f"checkpoint {run_dir}: {', '.join(bad)} missing or changed since it was written "
            "(truncated or edited); it cannot be resumed from"
        )
