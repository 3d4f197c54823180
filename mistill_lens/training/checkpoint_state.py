"""A run's checkpoint folder and the training state in it, shared by `train` and `distill`:
claiming the folder for a run, and reading its state back to resume only when its files are intact
and it was trained from the same inputs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mistill_lens.lens.fingerprint import StaleResultError, check_fingerprint
from mistill_lens.models.checkpoints import METADATA_FILE, CheckpointError
from mistill_lens.runs import (
    STAGING_DIR,
    check_run_dir,
    claim_run_dir,
    finish_interrupted_commit,
    legacy_run,
    verify_manifest,
)

TRAINING_STATE_FILE = "training_state.pt"
# Every file a checkpoint folder holds: a folder of only these, with a training state, is a run
# written before run markers existed.
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "mistill.json",
    "manifest.json",
    "adapter_model.safetensors",
    "adapter_config.json",
    "README.md",
    TRAINING_STATE_FILE,
    STAGING_DIR,
)


# a distillation run also holds its evaluation and the student's characterisation
_legacy_checkpoint = legacy_run(
    [TRAINING_STATE_FILE, METADATA_FILE],
    (*CHECKPOINT_FILES, "evaluation.json", "characterization"),
)


def claim_checkpoint_dir(out_dir: str | Path, kind: str) -> Path:
    """`out_dir` as the checkpoint folder of a `kind` run (new, empty, or that run's own)."""
    return claim_run_dir(out_dir, kind, _legacy_checkpoint)


def check_checkpoint_dir(out_dir: str | Path, kind: str) -> None:
    """Refuse `out_dir` where :func:`claim_checkpoint_dir` would, writing nothing (a command
    refuses a bad folder before any work; the run claims it once, when it starts)."""
    check_run_dir(out_dir, kind, _legacy_checkpoint)


def load_training_state(out_dir: Path, fingerprint: dict[str, str]) -> dict | None:
    """The saved training state of `out_dir` (None when it holds none yet), after checking that
    its files are intact and that it was trained from the same inputs (`fingerprint`)."""
    finish_interrupted_commit(out_dir)
    state_path = out_dir / TRAINING_STATE_FILE
    if not state_path.is_file():
        return None
    verify_manifest(out_dir)
    state = torch.load(state_path, weights_only=False, map_location="cpu")
    try:
        check_fingerprint(state.get("fingerprint"), fingerprint, f"the training state in {out_dir}")
    except StaleResultError as err:
        raise CheckpointError(f"{err}; use another output folder (out_dir)") from err
    return state
