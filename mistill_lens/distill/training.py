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

import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from mistill_lens import options, task
from mistill_lens.distill import OBJECTIVES
from mistill_lens.distill.attention import (
    DistillItem,
    attention_kl,
    collate_items,
    event_attention,
    heads_in_layers,
    residual_recorder,
    student_item,
)
from mistill_lens.lens.adapters import Adapter, adapter_for
from mistill_lens.lens.backends import choose_backend
from mistill_lens.lens.fingerprint import tensor_digest, value_digest
from mistill_lens.lens.hooks import Head, checked_heads, n_layers_heads
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.models import FAMILIES
from mistill_lens.models.checkpoints import (
    BASE_MODELS,
    CheckpointError,
    adapter_base_name,
    adapter_rank,
    base_tokenizer,
    base_weights_digest,
    is_adapter_checkpoint,
    load_adapter,
    load_base_model,
    load_hf_model,
    read_metadata,
    resolve,
    save_checkpoint,
    weights_digest,
)
from mistill_lens.models.lora import AdapterExport, fresh_adapter
from mistill_lens.models.precision import compute_context, compute_mode, legacy_compute
from mistill_lens.models.students import (
    DEFAULT_CONTEXT,
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
from mistill_lens.training.checkpoint_state import (
    TRAINING_STATE_FILE,
    claim_checkpoint_dir,
    load_training_state,
)
from mistill_lens.training.config import RUN_OPTION_CHECKS
from mistill_lens.training.data import encode
from mistill_lens.training.loop import make_optimizer, output_loss, run_steps

# Students train with memory-efficient attention: the attention loss reads only the event rows,
# computed apart (`event_attention`), so no layer materialises its [pos, pos] pattern.
TRAINING_ATTENTION = "sdpa"

# A pretrained student's positions are rotary (SmolLM2 reads 8,192, Gemma 3 32,768): 4,096 holds
# any K = 64 example with four mentions in either tokenizer.
PRETRAINED_CONTEXT = 4096
ARCHITECTURE_FIELDS = ("n_layer", "n_head", "n_embd", "n_kv_head")


@dataclass(frozen=True)
class DistillConfig:
    # A tiny student family trained from scratch (FAMILIES: "llama", "gpt2") or a pretrained base
    # fine-tuned with a LoRA adapter (BASE_MODELS: "smollm2", "gemma3").
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
    # For a pretrained student: a LoRA checkpoint of the same base (e.g. a shared warm-up).
    student_init: str | None = None
    lora_r: int = 16  # a pretrained student's LoRA rank; 0: full fine-tuning

    def __post_init__(self):
        if self.family not in FAMILIES + BASE_MODELS:
            raise ValueError(
                f"unknown student {self.family!r}; expected a tiny family {FAMILIES} or a "
                f"pretrained base {BASE_MODELS}"
            )
        if self.pretrained:  # its architecture is the base's: none of the fresh-student sizes
            for name in ARCHITECTURE_FIELDS:
                object.__setattr__(self, name, None)
        if self.n_ctx is None:  # resolved here, so the recorded configuration holds the number
            object.__setattr__(self, "n_ctx", DEFAULT_CONTEXT.get(self.family, PRETRAINED_CONTEXT))
        check_options(
            self,
            **RUN_OPTION_CHECKS,
            attention_weight=options.non_negative_float,
            n_kv_head=options.positive,
            n_ctx=options.positive,
            n_train=options.non_negative,
            data_seed=options.seed,
            lora_r=options.non_negative,
        )
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; expected one of {OBJECTIVES}")
        precision_dtype(self.precision)
        if self.student_layers is not None and self.student_head_set is not None:
            raise ValueError(
                "give the student's pooled heads either as layers or as a head set, not both"
            )

    @property
    def pretrained(self) -> bool:
        return self.family in BASE_MODELS

    @property
    def lora(self) -> bool:
        """Whether the student trains a LoRA adapter (a pretrained student with lora_r > 0)."""
        return self.pretrained and self.lora_r > 0

    @property
    def effective_weight(self) -> float:
        return self.attention_weight if self.objective == "mistill" else 0.0

    def student_heads(
        self,
        student_shape: tuple[int, int],
        teacher_shape: tuple[int, int] | None = None,
        teacher_heads: Sequence[Head] = (),
    ) -> list[Head]:
        """The student heads whose attention is pooled. Default: for a same-family student
        (`teacher_shape` given: the teacher's layers, heads) of the teacher's shape
        (`student_shape`), the teacher's own head positions (`teacher_heads`): the homologous
        heads; otherwise every head of the upper half of the layers. Pooling many student heads
        toward a one-head target collapses a same-family student (docs/distill.md), while
        supervising the homologous head transfers the mechanism."""
        n_layer, n_head = student_shape
        if self.student_head_set is not None:
            return [tuple(head) for head in self.student_head_set]
        if self.student_layers is not None:
            return heads_in_layers(n_head, list(self.student_layers))
        if teacher_shape == student_shape and teacher_heads:
            return sorted(set(teacher_heads))
        return heads_in_layers(n_head, list(range(n_layer // 2, n_layer)))


def same_family(student: PreTrainedModel, teacher: HookedModel) -> bool:
    """Whether the student (a Hugging Face model) is of the teacher's architecture (its Hugging
    Face model class)."""
    return type(student).__name__ == teacher.cfg.architecture


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


def cached_items(
    cache_dir: Path | None,
    inputs: Mapping[str, str],
    build: Callable[[], tuple[list[DistillItem], int]],
    tokenizer: Tokenizer,
) -> tuple[list[DistillItem], int]:
    """``build()``, or its result saved in `cache_dir` under a name made of everything it depends
    on (`inputs`: the examples, the teacher's weights and head sets; the student's tokenizer and
    context). A file that cannot be read back is rebuilt."""
    if cache_dir is None:
        return build()
    key = value_digest(
        {
            **{k: v for k, v in inputs.items() if k != "student init weights"},
            "format": ITEMS_FORMAT,
            "tokenizer": value_digest(tokenizer.get_vocab()),
        }
    )
    path = cache_dir / f"items-{key[:16]}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, weights_only=False)
            return [DistillItem(**item) for item in saved["items"]], saved["too_long"]
        except (OSError, RuntimeError, KeyError, TypeError, EOFError) as err:
            warnings.warn(
                f"distillation items cache {path} unreadable ({err}): rebuilt", stacklevel=2
            )
    items, too_long = build()
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save({"items": [asdict(item) for item in items], "too_long": too_long}, partial)
    partial.replace(path)  # whole or absent: a crash leaves no half-written cache
    return items, too_long


def items_digest(items: Sequence[DistillItem], config: DistillConfig) -> str:
    """Digest of the training data as the run sees it: every item's tokens, targets and attention
    targets, and the order of the items over all steps."""
    order = [
        batch_indices(step, config.batch_size, len(items), config.seed)
        for step in range(config.steps)
    ]
    tokens = value_digest([[item.ids, item.target_mask, item.query_positions] for item in items])
    targets = tensor_digest(*(t for item in items for t in item.attention_targets))
    return value_digest({"tokens": tokens, "attention targets": targets, "order": order})


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
    student_hf, adapter: Adapter, batch, heads: Sequence[Head], precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CoT loss, attention loss) of one batch from one forward pass of the student (`adapter`:
    the adapter of its Hugging Face model, through which the event rows are computed)."""
    store: dict[int, torch.Tensor] = {}
    with (
        residual_recorder(adapter, [layer for layer, _ in heads], store),
        compute_context("cpu", compute_mode("cpu", precision)),
    ):
        cot = output_loss(student_hf, batch.ids, batch.attention, batch.targets)
        pooled = event_attention(adapter, store, heads, batch.query_positions)
    return cot, attention_kl(pooled, batch.attention_targets, batch.event_mask)


# bump when the training state's layout or meaning changes (v3: students train with
# memory-efficient attention, the event rows computed apart)
DISTILL_FORMAT = "distill-v3"
ITEMS_FORMAT = "distill-v2"  # bump when the cached items' layout or meaning changes


def examples_digest(examples: Sequence[task.Example]) -> str:
    """Digest of the training examples as distillation uses them: texts, outputs and events with
    their listed contrasts. Named rivals are left out: they choose a characterisation's contrasts,
    never a distillation target, so runs and item caches made before events named rivals stay
    valid (and a CoT / MISTILL pair started on either side of that change stays paired)."""
    rows = []
    for example in examples:
        row = asdict(example)
        for event in row["events"]:
            del event["rivals"]
        rows.append(row)
    return value_digest(rows)


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
        "examples": examples_digest(examples),
        "teacher heads": value_digest(
            {k: sorted(map(list, v)) for k, v in sorted(heads_by_kind.items())}
        ),
        "student init weights": weights_digest(config.student_init)
        if config.student_init
        else "fresh",
        **({"base weights": base_weights_digest(config.family)} if config.pretrained else {}),
    }


def _resume(out_dir: Path, config: DistillConfig, fingerprint: dict[str, str]):
    state = load_training_state(out_dir, fingerprint)
    if state is None:
        return None
    _check_compute(out_dir, config, state)
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
    if config.pretrained:
        return pretrained_student(config, resume_from=out_dir), state
    model, _ = load_hf_model(
        out_dir, dtype=precision_dtype(config.precision), attn_implementation=TRAINING_ATTENTION
    )
    return model, state


def _check_compute(out_dir: Path, config: DistillConfig, state: dict) -> None:
    """A run resumes only in the compute it started in: the precision comparison (bf16 weights vs
    fp32 master weights under bf16 autocast) would otherwise mix numerics within one run."""
    started = state.get("compute", legacy_compute("cpu", config.precision))
    here = compute_mode("cpu", config.precision)
    if started != here:
        raise CheckpointError(
            f"{out_dir} was trained computing in {started}, and this machine would go on in "
            f"{here} (bf16 autocast needs a CPU with bf16 units, AMX-bf16 or AVX512-bf16; "
            "without them bf16 products run ~800x slower): resume it on a machine like the one "
            "it started on, or start it again in another output folder (out_dir)"
        )


def _tuple(value):
    return tuple(value) if value is not None else None


def student_tokenizer(config: DistillConfig) -> Tokenizer:
    """A pretrained student reads its base's own tokenizer; a tiny family its shipped one."""
    return base_tokenizer(config.family) if config.pretrained else family_tokenizer(config.family)


def pretrained_student(config: DistillConfig, resume_from: Path | None = None):
    """The pretrained base in the run's precision, with a trainable LoRA adapter (a peft model) or
    whole (``lora_r`` 0: full fine-tuning): resumed from `resume_from` (an interrupted run), started
    from ``config.student_init`` (a LoRA checkpoint of the same base, merged first for full
    fine-tuning), or fresh (the adapter seeded by ``config.seed``)."""
    dtype = precision_dtype(config.precision)
    if resume_from is not None and not config.lora:
        return load_hf_model(resume_from, dtype=dtype, attn_implementation=TRAINING_ATTENTION)[0]
    base, _ = load_base_model(config.family, dtype=dtype, attn_implementation=TRAINING_ATTENTION)
    source = resume_from if resume_from is not None else config.student_init
    if source is None:
        student = fresh_adapter(base, config.lora_r, config.seed) if config.lora else base
    else:
        path = resolve(source)
        if not is_adapter_checkpoint(path) or adapter_base_name(path) != config.family:
            raise CheckpointError(
                f"student_init {source} is not a LoRA checkpoint of base {config.family!r}"
            )
        rank = adapter_rank(path)
        if config.lora and rank != config.lora_r:
            raise CheckpointError(
                f"student_init {source} holds a rank-{rank} adapter, the run asks for lora_r "
                f"{config.lora_r}: give lora_r={rank} (or 0 to fine-tune the merged model fully)"
            )
        student = load_adapter(path, base, trainable=config.lora)
        if not config.lora:
            student = student.merge_and_unload()
    return student.to(dtype)  # peft keeps adapters in float32 over a bf16 base: bf16 trains bf16


def initial_student(config: DistillConfig):
    """The student before its first step: a pretrained base with a LoRA adapter, the base student
    of ``config.student_init``, or a fresh initialisation (seeded by ``config.seed``), in the run's
    precision."""
    if config.pretrained:
        return pretrained_student(config)
    dtype = precision_dtype(config.precision)
    if config.student_init is not None:
        student = with_context(
            load_base_student(config.student_init, config.family, dtype), config.n_ctx
        )
        student.config._attn_implementation = TRAINING_ATTENTION
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
    return build_student(hf_config, config.seed, TRAINING_ATTENTION).to(dtype)


def _data_warnings(
    items: Sequence, n_events: int, too_long: int, n_examples: int, config: DistillConfig
) -> list[str]:
    """What the distillation data lacks: events for the attention loss (an error for a MISTILL
    run, which would otherwise be the CoT run), or examples that did not fit the student."""
    run_warnings: list[str] = []
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
            f"{too_long} of {n_examples} distillation examples exceed the student's context and "
            "were left out"
        )
    return run_warnings


def _student_heads(
    config: DistillConfig, hf_student, adapter, teacher, heads_by_kind, resumed, out_dir: Path
) -> list[Head]:
    """The student heads whose attention is pooled (homologous to the teacher's for a same-family
    student of its shape), and on a resumed run the same ones it was trained with."""
    shape = (adapter.n_layers, adapter.n_heads)
    heads = checked_heads(
        config.student_heads(
            shape,
            n_layers_heads(teacher) if same_family(hf_student, teacher) else None,
            [head for kind_heads in heads_by_kind.values() for head in kind_heads],
        ),
        *shape,
    )
    if resumed is not None:
        trained_with = [tuple(h) for h in read_metadata(out_dir).get("student_heads", heads)]
        if trained_with != list(heads):
            raise CheckpointError(
                f"{out_dir} was trained pooling student heads {trained_with}, this run would pool "
                f"{list(heads)} (a changed default?): give student_head_set to match, or use another "
                "output folder (out_dir)"
            )
    return heads


def distill(
    config: DistillConfig,
    teacher: HookedModel,
    teacher_tokenizer: Tokenizer,
    examples: Sequence[task.Example],
    heads_by_kind: Mapping[str, Sequence[Head]],
    out_dir: str | Path,
    *,
    cache_dir: str | Path | None = None,
    command: str = "",
    extra_metadata: Mapping | None = None,
    progress: bool = True,
) -> dict:
    """Train (or resume) a student on `examples` (prompts with the teacher's outputs and events).

    `teacher` is a TransformerBridge, `heads_by_kind` its characterised head set per event kind.
    The items (the student's sequences and the teacher's attention targets: one teacher pass per
    example) are kept in `cache_dir` when given, so the runs of a grid and a resumed run share
    them. Returns the metadata written next to the weights.
    """
    out_dir = claim_checkpoint_dir(out_dir, "distill")
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    tokenizer = student_tokenizer(config)
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
    n_params = sum(p.numel() for p in student.parameters() if p.requires_grad)
    n_params_total = sum(p.numel() for p in student.parameters())
    # a peft student is read through its wrapped model, adapters included
    hf_student = student.get_base_model() if config.lora else student
    adapter = adapter_for(hf_student)
    student.train()
    heads = _student_heads(config, hf_student, adapter, teacher, heads_by_kind, resumed, out_dir)
    n_ctx = config.n_ctx if config.pretrained else context_length(student)
    items, too_long = cached_items(
        None if cache_dir is None else Path(cache_dir),
        {**fingerprint, "teacher": config.teacher, "n_ctx": str(n_ctx)},
        lambda: distillation_items(
            examples, teacher, teacher_tokenizer, tokenizer, heads_by_kind, n_ctx
        ),
        tokenizer,
    )
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, parameters)
    if resumed is not None:
        optimizer.load_state_dict(resumed[1]["optimizer"])
    # what the CoT and MISTILL runs of one seed must share, recorded when the run starts
    paired = (
        resumed[1]["paired"]
        if resumed is not None
        else {
            "initial weights": tensor_digest(*(p.detach() for p in parameters)),
            "data": items_digest(items, config),
        }
    )
    n_events = sum(len(item.query_positions) for item in items)
    compute = compute_mode("cpu", config.precision)  # checked equal to a resumed run's
    run_warnings = _data_warnings(items, n_events, too_long, len(examples), config)

    def save(step: int, elapsed: float) -> dict:
        metadata = {
            "role": "student",
            "command": command,
            "config": asdict(config),
            "step": step,
            "n_params": n_params,
            "n_params_total": n_params_total,
            **({"base": config.family} if config.pretrained else {}),
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
            "paired": paired,
            "teacher_heads": {kind: [list(h) for h in hs] for kind, hs in heads_by_kind.items()},
            "torch": torch.__version__,
            "compute": compute,
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
            "paired": paired,
            "compute": compute,
        }
        save_checkpoint(
            AdapterExport(student) if config.lora else exportable(student),
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
        cot, attention = student_losses(student, adapter, batch, heads, config.precision)
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
