"""Shipping a distilled student in the package: its LoRA adapter, its training record and the
teacher-forced scores it gives on a few held-out examples, recorded so that a fresh clone can
check that the adapter it loads is the one that was evaluated.

``python benchmarks/distill/ship_student.py RUN_DIR DEST`` (a finished ``distill`` run with a LoRA
student; ``DEST`` a new folder, e.g. ``mistill_lens/assets/students/smollm2-cot-fp32-master-0``).
The base weights stay in their package; the tokenizer is the base's (not copied: a LoRA
checkpoint without one loads its base's). The optimizer state is left behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from mistill_lens import task
from mistill_lens.distill.evaluation import EVALUATION_FILE
from mistill_lens.distill.report import CURVE_FILE, training_curve
from mistill_lens.models.checkpoints import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    METADATA_FILE,
    CheckpointError,
    is_adapter_checkpoint,
    load_hf_model,
    read_metadata,
)
from mistill_lens.runs import OutputError, commit_staged, staging_dir, verify_manifest
from mistill_lens.task.metrics import teacher_forced_events

REFERENCE_FILE = "reference_scores.json"
# the examples the record is taken on: few (the check runs in the test suite), held out
REFERENCE_EXAMPLES = {"n": 3, "seed": 7, "split": "heldout"}


def reference_scores(spec: str | Path, k: int, max_mentions: int) -> dict:
    """Teacher-forced scores (per decision kind: n, accuracy, loss, mean margin) of the model at
    `spec` on the reference examples of the task at `k` / `max_mentions`."""
    model, tokenizer = load_hf_model(spec)
    examples = task.generate_examples(
        REFERENCE_EXAMPLES["n"],
        REFERENCE_EXAMPLES["seed"],
        REFERENCE_EXAMPLES["split"],
        k=k,
        max_mentions=max_mentions,
    )
    return {
        "examples": {**REFERENCE_EXAMPLES, "k": k, "max_mentions": max_mentions},
        "teacher_forced": teacher_forced_events(model, tokenizer, examples),
    }


def ship_student(run_dir: str | Path, dest: str | Path) -> Path:
    """Copy the finished LoRA student of `run_dir` into the new folder `dest` with its record
    (``mistill.json``, ``evaluation.json`` when the run was evaluated, its training curve) and its
    reference scores; the files are committed together, with a manifest."""
    run_dir, dest = Path(run_dir), Path(dest)
    if not is_adapter_checkpoint(run_dir):
        raise CheckpointError(f"{run_dir} holds no LoRA adapter: only adapter students ship")
    verify_manifest(run_dir)
    metadata = read_metadata(run_dir)
    if metadata.get("role") != "student":
        raise CheckpointError(f"{run_dir} is not a distillation run (role {metadata.get('role')})")
    if metadata["step"] != metadata["config"]["steps"]:
        raise CheckpointError(
            f"{run_dir} stopped at step {metadata['step']} of {metadata['config']['steps']}: "
            "finish the run (rerun its command) before shipping it"
        )
    if dest.exists():
        raise OutputError(f"{dest} already exists: ship into a new folder")
    names = [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, METADATA_FILE]
    names += [EVALUATION_FILE] if (run_dir / EVALUATION_FILE).is_file() else []
    dest.mkdir(parents=True)
    staging = staging_dir(dest)
    for name in names:
        shutil.copyfile(run_dir / name, staging / name)
    training_curve(run_dir).to_csv(staging / CURVE_FILE, index=False)
    record = reference_scores(run_dir, metadata["task"]["k"], metadata["task"]["max_mentions"])
    (staging / REFERENCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    commit_staged(dest)
    return dest
