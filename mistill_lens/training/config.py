"""What a training run is configured with: `TrainConfig` (teachers and base students), and the
option checks that every run of the one loop shares with `DistillConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mistill_lens import options, task
from mistill_lens.models import TRAIN_PRECISIONS
from mistill_lens.models.checkpoints import BASE_MODELS
from mistill_lens.options import check_options

# The options every run of `run_steps` has (TrainConfig, DistillConfig), checked the same way.
RUN_OPTION_CHECKS = {
    "seed": options.seed,
    "steps": options.positive,
    "batch_size": options.positive,
    "lr": options.positive_float,
    "warmup_steps": options.non_negative,
    "weight_decay": options.non_negative_float,
    "n_layer": options.positive,
    "n_head": options.positive,
    "n_embd": options.positive,
    "checkpoint_every": options.positive,
}


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 3000
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    universe_size: int = task.DEFAULT_UNIVERSE_SIZE
    k: int = task.DEFAULT_K
    max_mentions: int = task.DEFAULT_MAX_MENTIONS
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    checkpoint_every: int = 250
    # Start from these weights instead of a fresh initialisation (continued training).
    init_from: str | None = None
    # Loss weight of the decision-event tokens (region, within, near-miss) relative to the
    # other output tokens: they are ~3% of the targets but carry the selection itself.
    event_weight: float = 1.0
    # None: the GPT-2 teacher. A student family ("llama", "gpt2"): a base student of that
    # architecture and tokenizer, trained on the references, for `distill --student-init`.
    student: str | None = None
    # A pretrained base ("smollm2") fine-tuned with a LoRA adapter of this rank on every attention
    # and MLP projection, instead of a model trained from scratch (n_layer/n_head/n_embd unused).
    base: str | None = None
    lora_r: int = 16
    precision: str = "fp32"  # one of TRAIN_PRECISIONS

    def __post_init__(self):
        check_options(
            self,
            **RUN_OPTION_CHECKS,
            universe_size=options.positive,
            k=options.positive,
            max_mentions=options.positive,
            event_weight=options.positive_float,
            lora_r=options.positive,
        )
        if self.base is not None and self.student is not None:
            raise ValueError(
                "a LoRA run on a pretrained base (base) is a teacher: it takes no student family"
            )
        if self.base is not None and self.base not in BASE_MODELS:
            raise ValueError(f"unknown base model {self.base!r}; expected one of {BASE_MODELS}")
        if self.precision not in TRAIN_PRECISIONS:
            raise ValueError(
                f"unknown precision {self.precision!r}; expected one of {TRAIN_PRECISIONS}"
            )

    @property
    def role(self) -> str:
        return "teacher" if self.student is None else "student"
