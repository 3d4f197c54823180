"""Training from scratch on prompt -> reasoning + codes, with the loss on the output only.

Examples stream from the task generator: example ``i`` of a run is a function of the seed and
``i`` alone, so a resumed run sees exactly the batches an uninterrupted one would.
Checkpoints (weights, optimizer state, step) are written atomically every
``checkpoint_every`` steps and at the end; rerunning the same command resumes.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from mistill_lens import options, task
from mistill_lens.lens.fingerprint import StaleResultError, check_fingerprint, value_digest
from mistill_lens.models.checkpoints import (
    BASE_MODELS,
    METADATA_FILE,
    CheckpointError,
    base_tokenizer,
    base_weights_digest,
    is_adapter_checkpoint,
    load_adapter,
    load_base_model,
    load_hf_model,
    read_metadata,
    resolve,
    save_checkpoint,
    teacher_config,
    weights_digest,
)
from mistill_lens.models.lora import fresh_adapter
from mistill_lens.models.students import (
    build_student,
    context_length,
    family_tokenizer,
    student_config,
)
from mistill_lens.models.tokenizers import prompt_token_ids, teacher_tokenizer
from mistill_lens.options import check_options
from mistill_lens.runs import (
    STAGING_DIR,
    claim_run_dir,
    finish_interrupted_commit,
    legacy_run,
    verify_manifest,
)

TRAINING_STATE_FILE = "training_state.pt"
TRAIN_FORMAT = "train-v1"  # bump when the training state's layout or meaning changes
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


def claim_checkpoint_dir(out_dir: str | Path, kind: str) -> Path:
    """`out_dir` as the checkpoint folder of a `kind` run (new, empty, or that run's own)."""
    # a distillation run also holds its evaluation and the student's characterisation
    owned = (*CHECKPOINT_FILES, "evaluation.json", "characterization")
    return claim_run_dir(out_dir, kind, legacy_run([TRAINING_STATE_FILE, METADATA_FILE], owned))


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

    @property
    def role(self) -> str:
        return "teacher" if self.student is None else "student"


def encode(
    tokenizer: PreTrainedTokenizerFast, prompt: str, output: str
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt + output + end-of-text, and which of them are training targets.

    The prompt is encoded on its own, exactly as it is at generation time.
    """
    prompt_ids = prompt_token_ids(tokenizer, prompt)
    output_ids = tokenizer(output, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + output_ids, [False] * len(prompt_ids) + [True] * len(output_ids)


def event_token_mask(tokenizer: PreTrainedTokenizerFast, example: task.Example) -> list[bool]:
    """Which positions of ``encode(tokenizer, example.prompt, example.output)`` hold a gold decision."""
    n_prompt = len(prompt_token_ids(tokenizer, example.prompt))
    offsets = tokenizer(example.output, add_special_tokens=False, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    spans = [(e.start - len(example.prompt), e.end - len(example.prompt)) for e in example.events]
    in_event = [
        any(start < end_ and end > start_ for start_, end_ in spans) for start, end in offsets
    ]
    return [False] * n_prompt + in_event + [False]


EncodedExample = tuple[list[int], list[bool], list[bool] | None]


def encode_example(
    tokenizer: PreTrainedTokenizerFast, example: task.Example, with_events: bool
) -> EncodedExample:
    """``encode`` of the example, and (``with_events``) its decision-event mask."""
    ids, targets = encode(tokenizer, example.prompt, example.output)
    return ids, targets, event_token_mask(tokenizer, example) if with_events else None


# Set in each data worker before its first batch (fork start: inherited, never pickled).
_WORKER_JOB: tuple | None = None


def training_example(config: TrainConfig, index: int) -> task.Example:
    """Example `index` of the run's training stream (a function of the seed and the index)."""
    return task.example_at(
        config.seed,
        "train",
        index,
        universe_size=config.universe_size,
        k=config.k,
        max_mentions=config.max_mentions,
    )


def _encode_batch(indices: range) -> list[EncodedExample]:
    config, tokenizer = _WORKER_JOB
    return [
        encode_example(tokenizer, training_example(config, i), config.event_weight != 1.0)
        for i in indices
    ]


def training_batches(
    config: TrainConfig, tokenizer: PreTrainedTokenizerFast, start_step: int, workers: int = 0
):
    """The encoded batches of steps ``start_step .. config.steps - 1``, in order. Batch ``s`` holds
    examples ``s * batch_size ..`` of the training stream whatever ``workers`` is: with workers,
    a few batches are made ahead in other processes while the model trains on the current one."""
    global _WORKER_JOB
    _WORKER_JOB = (config, tokenizer)
    steps = range(start_step, config.steps)
    batch = config.batch_size

    def indices(step: int) -> range:
        return range(step * batch, (step + 1) * batch)

    if workers == 0:
        for step in steps:
            yield _encode_batch(indices(step))
        return
    import multiprocessing

    ahead = 4 * workers
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pending = [pool.apply_async(_encode_batch, (indices(s),)) for s in steps[:ahead]]
        for n, step in enumerate(steps):
            if n + ahead < len(steps):
                pending.append(pool.apply_async(_encode_batch, (indices(steps[n + ahead]),)))
            yield pending[n].get()
            pending[n] = None  # done with: let it be freed


def collate(
    encoded: list[tuple[list[int], list[bool]]], pad_id: int
) -> tuple[
    Int[torch.Tensor, "batch pos"], Bool[torch.Tensor, "batch pos"], Bool[torch.Tensor, "batch pos"]
]:
    """Right-padded ids, attention mask, and target mask."""
    width = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.bool)
    targets = torch.zeros((len(encoded), width), dtype=torch.bool)
    for row, (token_ids, target) in enumerate(encoded):
        ids[row, : len(token_ids)] = torch.tensor(token_ids)
        attention[row, : len(token_ids)] = True
        targets[row, : len(target)] = torch.tensor(target)
    return ids, attention, targets


def target_logits(
    model: PreTrainedModel,
    ids: Int[torch.Tensor, "batch pos"],
    targets: Bool[torch.Tensor, "batch pos"],
    attention: Bool[torch.Tensor, "batch pos"] | None = None,
) -> tuple[Float[torch.Tensor, "target vocab"], Int[torch.Tensor, " target"]]:
    """The logits that predict each target token, and those tokens, in row order. The
    unembedding runs only where there is a target (a full-vocabulary row per position would
    be 262,144 columns for Gemma)."""
    if hasattr(model, "get_base_model"):  # a peft model: its adapters sit inside the wrapped model
        model = model.get_base_model()
    mask = None if attention is None else attention.long()
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    predicts_target = targets[:, 1:]
    logits = model.get_output_embeddings()(hidden[:, :-1][predicts_target])
    return logits, ids[:, 1:][predicts_target]


def output_loss(
    model: PreTrainedModel,
    ids: Int[torch.Tensor, "batch pos"],
    attention: Bool[torch.Tensor, "batch pos"],
    targets: Bool[torch.Tensor, "batch pos"],
    weights: Float[torch.Tensor, "batch pos"] | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy over target tokens (weighted mean if ``weights`` is given)."""
    logits, labels = target_logits(model, ids, targets, attention)
    if weights is None:
        return torch.nn.functional.cross_entropy(logits.float(), labels)
    token_weights = weights[:, 1:][targets[:, 1:]]
    per_token = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    return (per_token * token_weights).sum() / token_weights.sum()


def make_optimizer(config, parameters: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, as every run here trains (betas 0.9 / 0.98)."""
    return torch.optim.AdamW(
        parameters, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98)
    )


def run_steps(
    config,
    optimizer: torch.optim.Optimizer,
    parameters: list[torch.nn.Parameter],
    step: int,
    elapsed: float,
    loss_at: Callable[[int], tuple[torch.Tensor, dict[str, str]]],
    save: Callable[[int, float], dict],
    *,
    desc: str,
    progress: bool = True,
) -> dict:
    """The one optimisation loop, from `step` to `config.steps`: learning-rate schedule, the loss
    of the step (`loss_at(step)` returns it and what the progress bar shows), a NaN guard,
    gradient clipping at 1, and a checkpoint (`save(step, elapsed)`, returning the metadata) every
    `config.checkpoint_every` steps and at the end. Returns the last checkpoint's metadata."""
    metadata = None
    bar = tqdm(total=config.steps, initial=step, desc=desc, disable=not progress, file=sys.stderr)
    while step < config.steps:
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        loss, shown = loss_at(step)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        elapsed += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(**shown)
        if step % config.checkpoint_every == 0 or step == config.steps:
            metadata = save(step, elapsed)
    bar.close()
    return metadata if metadata is not None else save(step, elapsed)


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def role_tokenizer(config: TrainConfig) -> PreTrainedTokenizerFast:
    if config.base is not None:
        return base_tokenizer(config.base)
    return teacher_tokenizer() if config.student is None else family_tokenizer(config.student)


def build_model(config: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """The model at step 0: `init_from`'s weights, a LoRA adapter on a pretrained base, or a fresh
    initialisation, all seeded by `config.seed`."""
    torch.manual_seed(config.seed)
    if config.base is not None:
        return _lora_model(config)
    if config.init_from is not None:
        model, init_tokenizer = load_hf_model(config.init_from)
        if init_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise CheckpointError(
                f"init_from {config.init_from} was trained with another tokenizer"
            )
        return model
    hf_config = fresh_config(config, tokenizer)
    if config.student is not None:
        return build_student(hf_config, config.seed, attn_implementation="sdpa")
    return GPT2LMHeadModel(hf_config)


def fresh_config(config: TrainConfig, tokenizer: PreTrainedTokenizerFast):
    """The Hugging Face config of a freshly initialised teacher or base student."""
    if config.student is not None:
        return student_config(
            config.student,
            len(tokenizer),
            tokenizer.eos_token_id,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_embd=config.n_embd,
        )
    return teacher_config(
        len(tokenizer),
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
        eos_token_id=tokenizer.eos_token_id,
    )


def learned_positions(config: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> int | None:
    """How many positions the trained model has if they are learned weights (GPT-2), else None
    (rotary positions run at any length)."""
    if config.base is not None:
        return None
    if config.init_from is not None:
        if not (resolve(config.init_from) / "config.json").is_file():
            return None  # loading it names what is missing
        hf_config = AutoConfig.from_pretrained(resolve(config.init_from))
    else:
        hf_config = fresh_config(config, tokenizer)
    return hf_config.n_positions if isinstance(hf_config, GPT2Config) else None


def too_long(n_tokens: int, context: int, config: TrainConfig) -> ValueError:
    return ValueError(
        f"a training example of {n_tokens} tokens exceeds the model's {context} positions "
        f"(K = {config.k}, up to {config.max_mentions} mentions): give a smaller k or "
        "max_mentions, or train a model with rotary positions (base='smollm2', or a Llama "
        "student)"
    )


def check_examples_fit(config: TrainConfig, tokenizer: PreTrainedTokenizerFast, n: int = 16):
    """Refuse, before anything is written, a run whose first examples exceed a model's learned
    positions (the loop checks every batch too: a rare longer example is refused when it comes)."""
    context = learned_positions(config, tokenizer)
    if context is None:
        return
    for i in range(n):
        length = len(encode_example(tokenizer, training_example(config, i), False)[0])
        if length > context:
            raise too_long(length, context, config)


def _lora_model(config: TrainConfig, resume_from: Path | None = None):
    """The pretrained base with a trainable LoRA adapter: fresh (seeded), or the adapter of
    `resume_from` / `config.init_from` (a LoRA checkpoint of the same base)."""
    base, _ = load_base_model(config.base, attn_implementation="sdpa")
    source = resume_from if resume_from is not None else config.init_from
    if source is not None:
        if not is_adapter_checkpoint(source):
            raise CheckpointError(
                f"init_from {source} is not a LoRA checkpoint of base {config.base!r}"
            )
        return load_adapter(resolve(source), base, trainable=True)
    return fresh_adapter(base, config.lora_r, config.seed)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_fingerprint(config: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> dict[str, str]:
    """Inputs of a training run beyond its configuration: the state format, the tokenizer, and the
    weights it started from."""
    return {
        "format": TRAIN_FORMAT,
        "tokenizer": value_digest(tokenizer.get_vocab()),
        "init weights": weights_digest(config.init_from)
        if config.init_from is not None
        else "fresh",
        "base weights": base_weights_digest(config.base) if config.base is not None else "none",
    }


def _resume(out_dir: Path, config: TrainConfig, tokenizer: PreTrainedTokenizerFast):
    state = load_training_state(out_dir, train_fingerprint(config, tokenizer))
    if state is None:
        return None
    saved = TrainConfig(**state["config"])
    if saved != config:
        differing = [
            f.name for f in fields(TrainConfig) if getattr(saved, f.name) != getattr(config, f.name)
        ]
        raise CheckpointError(
            f"{out_dir} holds a run with a different configuration ({', '.join(differing)}); "
            "use another output folder (out_dir) or the same options"
        )
    model = (
        _lora_model(config, resume_from=out_dir)
        if config.base is not None
        else load_hf_model(out_dir)[0]
    )
    model.train()
    return model, state


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU; an unavailable device is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


def train(
    config: TrainConfig,
    out_dir: str | Path,
    *,
    command: str = "",
    progress: bool = True,
    device: str = "cpu",
    data_workers: int = 0,
) -> dict:
    """Train (or resume) a teacher or base student; returns the metadata written next to the weights.

    ``device`` and ``data_workers`` are not part of the configuration: a run may resume on another
    machine (the same seed gives the same data; numerics differ between devices, and a GPU trains
    with bfloat16 autocast). ``data_workers`` processes make the next batches while a step runs.
    """
    if data_workers < 0:
        raise ValueError(f"data_workers must be 0 or more, got {data_workers}")
    target = resolve_device(device)
    tokenizer = role_tokenizer(config)
    check_examples_fit(config, tokenizer)
    out_dir = claim_checkpoint_dir(out_dir, "train")
    _seed_everything(config.seed)
    resumed = _resume(out_dir, config, tokenizer)
    if resumed is None:
        model, step, elapsed, losses = build_model(config, tokenizer), 0, 0.0, []
    else:
        model, state = resumed
        step, elapsed, losses = state["step"], state["elapsed_s"], state["losses"]
    model.to(target)
    model.train()
    parameters = [
        p for p in model.parameters() if p.requires_grad
    ]  # a LoRA run trains its adapter only
    optimizer = make_optimizer(config, parameters)
    if resumed is not None:
        optimizer.load_state_dict(resumed[1]["optimizer"])
        torch.set_rng_state(resumed[1]["torch_rng"])

    batches = training_batches(config, tokenizer, step, data_workers)
    n_params = sum(p.numel() for p in parameters)

    def save(step: int, elapsed: float) -> dict:
        metadata = {
            "role": config.role,
            "command": command,
            "config": asdict(config),
            "step": step,
            "n_params": n_params,
            "n_params_total": sum(p.numel() for p in model.parameters()),
            "train_time_s": round(elapsed, 1),
            "final_loss": losses[-1] if losses else None,
            "torch": torch.__version__,
            "device": target.type,
            "precision": "bf16-autocast" if target.type == "cuda" else "fp32",
        }
        if config.init_from is not None:
            metadata["init_from"] = read_metadata(config.init_from)
        state = {
            "config": asdict(config),
            "fingerprint": train_fingerprint(config, tokenizer),
            "step": step,
            "elapsed_s": elapsed,
            "losses": losses,
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        save_checkpoint(
            model.cpu(), tokenizer, out_dir, metadata, training_state={TRAINING_STATE_FILE: state}
        )
        model.to(target)
        return metadata

    # bfloat16 matrix products on a GPU (the weights and optimizer stay float32)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=target.type == "cuda")

    def loss_at(step: int) -> tuple[torch.Tensor, dict[str, str]]:
        encoded = next(batches)
        ids, attention, targets = (
            t.to(target) for t in collate([(e[0], e[1]) for e in encoded], tokenizer.pad_token_id)
        )
        if ids.shape[1] > context_length(model):
            raise too_long(ids.shape[1], context_length(model), config)
        weights = None
        if config.event_weight != 1.0:
            is_event = torch.zeros_like(targets)
            for row, (_, _, mask) in enumerate(encoded):
                is_event[row, : len(mask)] = torch.tensor(mask)
            weights = (1.0 + (config.event_weight - 1.0) * is_event.float()).to(target)
        with autocast:
            loss = output_loss(model, ids, attention, targets, weights)
        losses.append(round(loss.item(), 5))
        return loss, {"loss": f"{loss.item():.4f}"}

    desc = f"train {config.role if config.student is None else 'student ' + config.student}"
    try:
        return run_steps(
            config,
            optimizer,
            parameters,
            step,
            elapsed,
            loss_at,
            save,
            desc=desc,
            progress=progress,
        )
    finally:
        batches.close()  # stops the data workers
