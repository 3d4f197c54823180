"""The model a training run trains, and its tokenizer, by role: a fresh teacher or base student,
continued training from `init_from`, or a LoRA adapter on a pretrained base; and the check that
the run's examples fit the model's learned positions.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from mistill_lens.models.checkpoints import (
    CheckpointError,
    base_tokenizer,
    is_adapter_checkpoint,
    load_adapter,
    load_base_model,
    load_hf_model,
    resolve,
    teacher_config,
)
from mistill_lens.models.lora import fresh_adapter
from mistill_lens.models.students import build_student, family_tokenizer, student_config
from mistill_lens.models.tokenizers import teacher_tokenizer
from mistill_lens.training.config import TrainConfig
from mistill_lens.training.data import encode_example, training_example


def role_tokenizer(config: TrainConfig) -> PreTrainedTokenizerFast:
    if config.base is not None:
        return base_tokenizer(config.base)
    return teacher_tokenizer() if config.student is None else family_tokenizer(config.student)


def build_model(config: TrainConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """The model at step 0: `init_from`'s weights, a LoRA adapter on a pretrained base, or a fresh
    initialisation, all seeded by `config.seed`."""
    torch.manual_seed(config.seed)
    if config.base is not None:
        return lora_model(config)
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


def lora_model(config: TrainConfig, resume_from: Path | None = None):
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
