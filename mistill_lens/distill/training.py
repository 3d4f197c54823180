"""Student training: CoT loss on the teacher's outputs + lambda x attention loss at decision events.

The CoT baseline is the same code with lambda = 0: the attention loss is still computed (and
logged, so both objectives report how far the student's attention is from the target) but
weighted by zero, so data, order, seeds and updates are those of the CoT run exactly. The
teacher is only read, under ``no_grad``, to build the targets before training starts.
It runs in the one training loop (:func:`mistill_lens.training.loop.run_steps`) and resumes like
:func:`mistill_lens.training.loop.train`: weights, optimizer state and step are committed every
``checkpoint_every`` steps and at the end; rerunning the same command resumes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

import torch

from mistill_lens import options, task
from mistill_lens.distill import OBJECTIVES
from mistill_lens.distill.attention import (
    DistillItem,
    attention_kl,
    collate_items,
    heads_in_layers,
    pattern_recorder,
    pooled_attention,
    student_item,
)
from mistill_lens.lens.backends import choose_backend
from mistill_lens.lens.fingerprint import value_digest
from mistill_lens.lens.hooks import Head, n_layers_heads, validate_heads
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.models.checkpoints import (
    CheckpointError,
    load_hf_model,
    read_metadata,
    save_checkpoint,
    to_bridge,
    weights_digest,
)
from mistill_lens.models.students import (
    DEFAULT_CONTEXT,
    autocast,
    build_student,
    context_length,
    exportable,
    family_tokenizer,
    load_base_student,
    precision_dtype,
    student_architecture,
    student_config,
    with_context,
)
from mistill_lens.options import check_options
from mistill_lens.training.loop import (
    RUN_OPTION_CHECKS,
    TRAINING_STATE_FILE,
    claim_checkpoint_dir,
    encode,
    load_training_state,
    make_optimizer,
    output_loss,
    run_steps,
)


@dataclass(frozen=True)
class DistillConfig:
    family: str = "llama"
    objective: str = "mistill"
    precision: str = "fp32-master"
    seed: int = 0
    steps: int = 300
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    attention_weight: float = 1.0  # lambda for the mistill objective (cot: always 0)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 96
    n_kv_head: int | None = None
    # Heads pooled in the student: whole layers, or explicit (layer, head) pairs; neither: the
    # default of `student_heads`.
    student_layers: tuple[int, ...] | None = None
    student_head_set: tuple[Head, ...] | None = None
    n_ctx: int | None = None  # the student's positions (None: the family's DEFAULT_CONTEXT)
    checkpoint_every: int = 100
    teacher: str = ""  # weights digest: a resumed run must use the same teacher and data
    n_train: int = 0
    data_seed: int = 0
    # A base student's folder (`train --role student`) to start from instead of a fresh
    # initialisation; the architecture fields above must then be that student's.
    student_init: str | None = None

    def __post_init__(self):
        family_tokenizer(self.family)
        if self.n_ctx is None:  # resolved here, so the recorded configuration holds the number
            object.__setattr__(self, "n_ctx", DEFAULT_CONTEXT[self.family])
        check_options(
            self,
            **RUN_OPTION_CHECKS,
            attention_weight=options.non_negative_float,
            n_kv_head=options.positive,
            n_ctx=options.positive,
            n_train=options.non_negative,
            data_seed=options.seed,
        )
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; expected one of {OBJECTIVES}")
        precision_dtype(self.precision)
        if self.student_layers is not None and self.student_head_set is not None:
            raise ValueError(
                "give the student's pooled heads either as layers or as a head set, not both"
            )

    @property
    def effective_weight(self) -> float:
        return self.attention_weight if self.objective == "mistill" else 0.0

    def student_heads(
        self, teacher_shape: tuple[int, int] | None = None, teacher_heads: Sequence[Head] = ()
    ) -> list[Head]:
        """The student heads whose attention is pooled. Default: for a same-family student of the
        teacher's shape (`teacher_shape` = its layers, heads), the teacher's own head positions
        (`teacher_heads`): the homologous heads; otherwise every head of the upper half of the layers.
        Pooling many student heads toward a one-head target collapses a same-family student
        (docs/distill.md), while supervising the homologous head transfers the mechanism."""
        if self.student_head_set is not None:
            return [tuple(head) for head in self.student_head_set]
        if self.student_layers is not None:
            return heads_in_layers(self.n_head, list(self.student_layers))
        if self.family == "gpt2" and teacher_shape == (self.n_layer, self.n_head) and teacher_heads:
            return sorted(set(teacher_heads))
        return heads_in_layers(self.n_head, list(range(self.n_layer // 2, self.n_layer)))


def distillation_items(
    examples: Sequence[task.Example],
    teacher: HookedModel,
    teacher_tokenizer: Tokenizer,
    student_tokenizer: Tokenizer,
    heads_by_kind: Mapping[str, Sequence[Head]],
    n_ctx: int,
) -> tuple[list[DistillItem], int]:
    """Items for every example that fits the student's context, and how many did not fit. The
    teacher's attention rows come from the InterventionEngine where it supports the teacher."""
    # each example's clean pass serves its own events only: keep no more than one (the full
    # forward, where the engine cannot run, gives the same rows at T^2 memory)
    teacher, _ = choose_backend(teacher, engine=True, cache_bytes=0)
    items, too_long = [], 0
    for index, example in enumerate(examples):
        if len(encode(student_tokenizer, example.prompt, example.output)[0]) > n_ctx:
            too_long += 1
            continue
        items.append(
            student_item(
                example, index, teacher, teacher_tokenizer, student_tokenizer, heads_by_kind, n_ctx
            )
        )
    if not items:
        raise ValueError(
            f"none of the {len(examples)} distillation examples fits the student's {n_ctx}-token "
            "context: give the student a longer one (a fresh student or a Llama base student: "
            "DistillConfig.n_ctx), or distil at a smaller K"
        )
    return items, too_long


def batch_indices(step: int, batch_size: int, n_items: int, seed: int) -> list[int]:
    """Item indices of a step: a fresh seeded permutation per epoch, so order depends on (seed, step) only."""
    indices = []
    for slot in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(slot, n_items)
        order = torch.randperm(
            n_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)
        )
        indices.append(int(order[offset]))
    return indices


def tail_mean(values: Sequence[float], fraction: float = 0.1) -> float | None:
    """Mean of the last ``fraction`` of ``values`` (at least one), None when empty."""
    if not values:
        return None
    tail = values[-max(1, int(len(values) * fraction)) :]
    return round(sum(tail) / len(tail), 5)


def student_losses(
    student_hf, student_bridge, batch, heads: Sequence[Head], precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CoT loss, attention loss) of one batch from one forward pass of the bridged student."""
    store: dict[int, torch.Tensor] = {}
    with (
        student_bridge.hooks(fwd_hooks=pattern_recorder([layer for layer, _ in heads], store)),
        autocast(precision),
    ):
        cot = output_loss(student_hf, batch.ids, batch.attention, batch.targets)
        pooled = pooled_attention(store, heads, batch.query_positions)
    return cot, attention_kl(pooled, batch.attention_targets, batch.event_mask)


DISTILL_FORMAT = "distill-v1"  # bump when the training state's layout or meaning changes


def distill_fingerprint(
    config: DistillConfig,
    examples: Sequence[task.Example],
    heads_by_kind: Mapping[str, Sequence[Head]],
) -> dict[str, str]:
    """Inputs of a distillation run beyond its configuration (which names the teacher's weights):
    the state format, the training examples with the teacher's outputs and events, the teacher
    head sets that make the attention targets, and the base student's weights."""
    return {
        "format": DISTILL_FORMAT,
        "examples": value_digest([asdict(e) for e in examples]),
        "teacher heads": value_digest(
            {k: sorted(map(list, v)) for k, v in sorted(heads_by_kind.items())}
        ),
        "student init weights": weights_digest(config.student_init)
        if config.student_init
        else "fresh",
    }


def _resume(out_dir: Path, config: DistillConfig, fingerprint: dict[str, str]):
    state = load_training_state(out_dir, fingerprint)
    if state is None:
        return None
    head_set = state["config"].get("student_head_set")
    saved = DistillConfig(
        **{
            **state["config"],
            "student_layers": _tuple(state["config"]["student_layers"]),
            "student_head_set": None if head_set is None else tuple(tuple(h) for h in head_set),
        }
    )
    if saved != config:
        differing = [
            f.name
            for f in fields(DistillConfig)
            if getattr(saved, f.name) != getattr(config, f.name)
        ]
        raise CheckpointError(
            f"{out_dir} holds a distillation run with a different configuration ({', '.join(differing)}); "
            "use another output folder (out_dir) or the same options"
        )
    model, _ = load_hf_model(
        out_dir, dtype=precision_dtype(config.precision), attn_implementation="eager"
    )
    return model, state


def _tuple(value):
    return tuple(value) if value is not None else None


def initial_student(config: DistillConfig):
    """The student before its first step: the base student of ``config.student_init``, or a fresh
    initialisation (seeded by ``config.seed``), in the run's precision."""
    dtype = precision_dtype(config.precision)
    if config.student_init is not None:
        student = with_context(
            load_base_student(config.student_init, config.family, dtype), config.n_ctx
        )
        architecture = student_architecture(student)
        differing = {k: v for k, v in architecture.items() if getattr(config, k) != v}
        if differing:
            raise CheckpointError(
                f"student_init {config.student_init} has architecture {differing}, "
                "unlike the run's configuration"
            )
        return student
    tokenizer = family_tokenizer(config.family)
    hf_config = student_config(
        config.family,
        len(tokenizer),
        tokenizer.eos_token_id,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        n_kv_head=config.n_kv_head,
        n_ctx=config.n_ctx,
    )
    return build_student(hf_config, config.seed).to(dtype)


def distill(
    config: DistillConfig,
    teacher: HookedModel,
    teacher_tokenizer: Tokenizer,
    examples: Sequence[task.Example],
    heads_by_kind: Mapping[str, Sequence[Head]],
    out_dir: str | Path,
    *,
    command: str = "",
    extra_metadata: Mapping | None = None,
    progress: bool = True,
) -> dict:
    """Train (or resume) a student on `examples` (prompts with the teacher's outputs and events).

    `teacher` is a TransformerBridge, `heads_by_kind` its characterised head set per event kind.
    Returns the metadata written next to the weights.
    """
    out_dir = claim_checkpoint_dir(out_dir, "distill")
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    tokenizer = family_tokenizer(config.family)
    dtype = precision_dtype(config.precision)
    torch.manual_seed(config.seed)
    fingerprint = distill_fingerprint(config, examples, heads_by_kind)
    resumed = _resume(out_dir, config, fingerprint)
    if resumed is None:
        student = initial_student(config)
        step, elapsed, log = 0, 0.0, {"loss": [], "cot": [], "attention": []}
    else:
        student, state = resumed
        step, elapsed, log = state["step"], state["elapsed_s"], state["log"]
    # Counted before bridging: the GPT-2 bridge adds split q/k/v copies of the fused attention
    # weights (the fused one then gets no gradient), which would inflate the count.
    n_params = sum(p.numel() for p in student.parameters())
    bridge = to_bridge(student, tokenizer, dtype=dtype)
    bridge.train()
    heads = validate_heads(
        bridge,
        config.student_heads(
            n_layers_heads(teacher),
            [head for kind_heads in heads_by_kind.values() for head in kind_heads],
        ),
    )
    if resumed is not None:
        trained_with = [tuple(h) for h in read_metadata(out_dir).get("student_heads", heads)]
        if trained_with != list(heads):
            raise CheckpointError(
                f"{out_dir} was trained pooling student heads {trained_with}, this run would pool "
                f"{list(heads)} (a changed default?): give student_head_set to match, or use another "
                "output folder (out_dir)"
            )
    items, too_long = distillation_items(
        examples, teacher, teacher_tokenizer, tokenizer, heads_by_kind, context_length(student)
    )
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, parameters)
    if resumed is not None:
        optimizer.load_state_dict(resumed[1]["optimizer"])
    n_events = sum(len(item.query_positions) for item in items)
    run_warnings = []
    if n_events == 0:
        message = (
            f"the {len(items)} distillation examples hold no teacher decision event, so the attention loss "
            "has nothing to supervise"
        )
        if config.effective_weight > 0:
            raise ValueError(
                f"{message}: a MISTILL run would be exactly the CoT run; give more examples (n_train)"
            )
        run_warnings.append(message)
    elif 2 * sum(bool(item.query_positions) for item in items) <= len(items):
        with_events = sum(bool(item.query_positions) for item in items)
        run_warnings.append(
            f"only {with_events} of {len(items)} distillation examples hold a teacher decision event "
            f"({n_events} events): most batches hold none, so the attention loss supervises few steps"
        )
    if too_long:
        run_warnings.append(
            f"{too_long} of {len(examples)} distillation examples exceed the student's context and "
            "were left out"
        )

    def save(step: int, elapsed: float) -> dict:
        metadata = {
            "role": "student",
            "command": command,
            "config": asdict(config),
            "step": step,
            "n_params": n_params,
            "train_time_s": round(elapsed, 1),
            "final_loss": log["loss"][-1] if log["loss"] else None,
            "final_cot_loss": log["cot"][-1] if log["cot"] else None,
            # Batches without an event log no attention loss (None). One batch is noisy: the mean
            # over the last tenth of the logged steps compares objectives; the CoT run logs it
            # too, unweighted.
            "final_attention_loss": next(
                (v for v in reversed(log["attention"]) if v is not None), None
            ),
            "attention_loss_tail": tail_mean([v for v in log["attention"] if v is not None]),
            "warnings": run_warnings,
            "n_items": len(items),
            "n_events": n_events,
            "n_too_long": too_long,
            "student_heads": [list(h) for h in heads],
            "teacher_heads": {kind: [list(h) for h in hs] for kind, hs in heads_by_kind.items()},
            "torch": torch.__version__,
            **dict(extra_metadata or {}),
            **({"student_init": read_metadata(config.student_init)} if config.student_init else {}),
        }
        state = {
            "config": asdict(config),
            "fingerprint": fingerprint,
            "step": step,
            "elapsed_s": elapsed,
            "log": log,
            "optimizer": optimizer.state_dict(),
        }
        save_checkpoint(
            exportable(student),
            tokenizer,
            out_dir,
            metadata,
            training_state={TRAINING_STATE_FILE: state},
        )
        return metadata

    def loss_at(step: int) -> tuple[torch.Tensor, dict[str, str]]:
        batch = collate_items(
            [items[i] for i in batch_indices(step, config.batch_size, len(items), config.seed)],
            tokenizer.pad_token_id,
        )
        cot, attention = student_losses(student, bridge, batch, heads, config.precision)
        loss = cot + config.effective_weight * attention
        has_events = bool(batch.event_mask.any())
        for name, value in (
            ("loss", loss),
            ("cot", cot),
            ("attention", attention if has_events else None),
        ):
            log[name].append(None if value is None else round(value.item(), 5))
        return loss, {
            "cot": f"{cot.item():.3f}",
            "att": f"{attention.item():.3f}" if has_events else "-",
        }

    return run_steps(
        config,
        optimizer,
        parameters,
        step,
        elapsed,
        loss_at,
        save,
        desc=f"distill {config.family}/{config.objective}",
        progress=progress,
    )
