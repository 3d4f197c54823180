"""Training from scratch on prompt -> reasoning + codes, with the loss on the output only.

The one optimisation loop (`run_steps`, distillation's too), its loss, optimizer and learning-rate
schedule, and `train`, which runs it for teachers and base students. Checkpoints (weights,
optimizer state, step) are written atomically every ``checkpoint_every`` steps and at the end;
rerunning the same command resumes.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from mistill_lens.lens.fingerprint import value_digest
from mistill_lens.models.checkpoints import (
    CheckpointError,
    base_weights_digest,
    load_hf_model,
    read_metadata,
    save_checkpoint,
    weights_digest,
)
from mistill_lens.models.precision import compute_context, compute_mode, legacy_compute
from mistill_lens.models.students import context_length
from mistill_lens.training.checkpoint_state import (
    TRAINING_STATE_FILE,
    claim_checkpoint_dir,
    load_training_state,
)
from mistill_lens.training.config import TrainConfig
from mistill_lens.training.data import collate, training_batches
from mistill_lens.training.models import (
    build_model,
    check_examples_fit,
    lora_model,
    role_tokenizer,
    too_long,
)

TRAIN_FORMAT = "train-v1"  # bump when the training state's layout or meaning changes


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
        lora_model(config, resume_from=out_dir)
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
    with bfloat16 autocast whatever ``config.precision`` says). ``data_workers`` processes make the next batches while a step runs.
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
    # [first step, compute mode] per stretch of the run (it may move between machines); older
    # states: the rule of their time
    compute = (
        [list(c) for c in resumed[1]["compute_by_step"]]
        if resumed is not None and "compute_by_step" in resumed[1]
        else ([[0, legacy_compute(target.type, config.precision)]] if resumed is not None else [])
    )
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
            "precision": "bf16-autocast" if target.type == "cuda" else config.precision,
            "compute_by_step": compute,
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
            "compute_by_step": compute,
        }
        save_checkpoint(
            model.cpu(), tokenizer, out_dir, metadata, training_state={TRAINING_STATE_FILE: state}
        )
        model.to(target)
        return metadata

    # bfloat16 matrix products on a GPU, and with fp32-master on a CPU that has bf16 units (the
    # weights and the optimizer stay float32); a resumed run records each change of machine
    mode = compute_mode(target.type, config.precision)
    autocast = compute_context(target.type, mode)
    if not compute or compute[-1][1] != mode:
        compute.append([step, mode])

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
