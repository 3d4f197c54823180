"""The teacher side of a distillation: its task (as recorded in its checkpoint) and its
characterised circuits, found once on validation examples and kept in a cache folder."""

from __future__ import annotations

from pathlib import Path

from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.lens.outputs import (
    SUMMARY,
    prepare_output,
    read_characterization,
    write_characterization,
)
from mistill_lens.lens.results import Characterization, CharacterizeConfig
from mistill_lens.models.checkpoints import CheckpointError, read_metadata, weights_digest
from mistill_lens.task.characterize import characterize_task, task_examples

TASK_KEYS = ("universe_size", "k", "max_mentions")


def teacher_task_config(teacher_dir: Path) -> dict:
    """The task the teacher in `teacher_dir` was trained on (universe size, K, mentions)."""
    if not Path(teacher_dir).is_dir():
        raise CheckpointError(
            f"teacher folder {teacher_dir} does not exist (give a checkpoint folder, or 'default')"
        )
    config = read_metadata(teacher_dir).get("config", {})
    missing = [k for k in TASK_KEYS if k not in config]
    if missing:
        raise ValueError(
            f"teacher {teacher_dir} records no task configuration ({missing}) in its mistill.json"
        )
    return {k: config[k] for k in TASK_KEYS}


def teacher_characterization(
    teacher: HookedModel,
    teacher_tokenizer: Tokenizer,
    teacher_dir: Path,
    task_config: dict,
    cache_dir: Path,
    n: int,
    config: CharacterizeConfig,
) -> tuple[Characterization, Path]:
    """The teacher's characterisation on `n` validation examples and its folder, run once per
    circuit rule (`config.circuit`: z at `config.z_min`, or faithful from `config.faithful_pool`
    candidates) and kept in `cache_dir` (an interrupted one resumes its sweeps; a finished one is
    read back)."""
    rule = f"z{config.z_min:g}" if config.circuit == "z" else f"faithful{config.faithful_pool}"
    out = cache_dir / f"teacher-{weights_digest(teacher_dir)}-n{n}-{rule}-characterization"
    if (out / SUMMARY).is_file():  # written last: the characterisation finished
        return read_characterization(out), out
    examples, reference = task_examples(n, 0, "validation", task_config)
    prepare_output(out)
    result = characterize_task(
        teacher,
        teacher_tokenizer,
        examples,
        reference,
        config,
        sweep_dir=out,
    )
    return result, write_characterization(result, out)
