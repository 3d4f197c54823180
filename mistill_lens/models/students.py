"""Student models: a cross-family Llama (student tokenizer) and a same-family smaller GPT-2
(the teacher's tokenizer), trained as Hugging Face models and wrapped in TransformerBridge.

TransformerBridge adapts the Hugging Face module in place (its state-dict keys change), so a
checkpoint is written from a fresh model of the same config loaded with the trained tensors.
"""

from __future__ import annotations

import torch
from transformers import (
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from mistill_lens.models import FAMILIES, PRECISIONS
from mistill_lens.models.checkpoints import teacher_config
from mistill_lens.models.tokenizers import student_tokenizer, teacher_tokenizer

BRIDGE_KEY_PART = "._original_component"
# Positions of a fresh student. A Llama's are rotary (computed, free): 2,048 holds a K = 64 example
# with four mentions (up to ~1,900 student tokens). A GPT-2's are learned weights, so its context
# stays at the 1,024 its recorded runs used (a longer one would change their initialisation).
DEFAULT_CONTEXT = {"llama": 2048, "gpt2": 1024}


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The cross-family student uses the other tokenizer; the same-family one shares the teacher's."""
    if family not in FAMILIES:
        raise ValueError(f"unknown student family {family!r}; expected one of {FAMILIES}")
    return student_tokenizer() if family == "llama" else teacher_tokenizer()


def default_kv_heads(n_head: int) -> int:
    """Grouped KV heads of the Llama student: two query heads share one key/value head."""
    return max(1, n_head // 2)


def student_config(
    family: str,
    vocab_size: int,
    eos_token_id: int,
    *,
    n_layer: int,
    n_head: int,
    n_embd: int,
    n_kv_head: int | None = None,
    n_ctx: int | None = None,
):
    """A fresh student's Hugging Face config; ``n_ctx`` defaults to the family's `DEFAULT_CONTEXT`."""
    if family in DEFAULT_CONTEXT and n_ctx is None:
        n_ctx = DEFAULT_CONTEXT[family]
    if family == "llama":
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=n_embd,
            intermediate_size=int(8 * n_embd / 3 + 7) // 8 * 8,
            num_hidden_layers=n_layer,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv_head or default_kv_heads(n_head),
            max_position_embeddings=n_ctx,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            hidden_act="silu",
            tie_word_embeddings=True,
            attention_dropout=0.0,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
        )
    if family == "gpt2":
        return teacher_config(
            vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            n_positions=n_ctx,
            eos_token_id=eos_token_id,
        )
    raise ValueError(f"unknown student family {family!r}; expected one of {FAMILIES}")


def build_student(config, seed: int, attn_implementation: str = "eager") -> PreTrainedModel:
    """A freshly initialised student. Distillation wraps it in the bridge, which computes attention
    itself, so HF stays ``eager`` there; plain training (a base student) may use ``sdpa``."""
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if isinstance(config, LlamaConfig) else GPT2LMHeadModel)(config)
    model.config._attn_implementation = attn_implementation
    return model


def context_length(model: PreTrainedModel) -> int:
    return int(model.config.max_position_embeddings)


def with_context(model: PreTrainedModel, n_ctx: int) -> PreTrainedModel:
    """``model`` reading up to ``n_ctx`` positions. A Llama's rotary positions are computed, not
    learned, so its context is a config value and may grow (beyond the lengths it was trained on,
    which a run's metadata records); a GPT-2's positions are learned weights and cannot."""
    if n_ctx <= context_length(model):
        return model
    if not isinstance(model.config, LlamaConfig):
        raise ValueError(
            f"a GPT-2 student has {context_length(model)} learned positions and cannot read "
            f"{n_ctx}: start from a Llama student or from a fresh GPT-2 student"
        )
    model.config.max_position_embeddings = n_ctx
    return model


def precision_dtype(precision: str) -> torch.dtype:
    """Weight dtype: bf16 weights, or fp32 master weights (compute under bf16 autocast where the
    CPU has bf16 units: `models.precision.compute_mode`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def exportable(bridged: PreTrainedModel) -> PreTrainedModel:
    """A plain Hugging Face model with the bridged model's current weights (for save_pretrained)."""
    fresh = type(bridged)(bridged.config).to(bridged.dtype)
    trained = {
        key.replace(BRIDGE_KEY_PART, ""): value for key, value in bridged.state_dict().items()
    }
    missing = [key for key in fresh.state_dict() if key not in trained]
    if missing:
        raise KeyError(f"bridged student lacks weights {missing[:4]}")
    fresh.load_state_dict({key: trained[key] for key in fresh.state_dict()})
    return fresh.eval()


def student_architecture(model: PreTrainedModel) -> dict:
    """The `DistillConfig` architecture fields of a Hugging Face student (``n_kv_head`` None: the default grouping)."""
    config = model.config
    if isinstance(config, LlamaConfig):
        n_kv_head = config.num_key_value_heads
        return {
            "n_layer": config.num_hidden_layers,
            "n_head": config.num_attention_heads,
            "n_embd": config.hidden_size,
            "n_kv_head": None
            if n_kv_head == default_kv_heads(config.num_attention_heads)
            else n_kv_head,
            "n_ctx": config.max_position_embeddings,
        }
    return {
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_kv_head": None,
        "n_ctx": config.n_positions,
    }


def load_base_student(path, family: str, dtype: torch.dtype) -> PreTrainedModel:
    """A base student (``train --role student``) to start distillation from, checked against `family`."""
    from mistill_lens.models.checkpoints import CheckpointError, load_hf_model

    model, tokenizer = load_hf_model(path, dtype=dtype, attn_implementation="eager")
    expected = LlamaForCausalLM if family == "llama" else GPT2LMHeadModel
    if not isinstance(model, expected):
        raise CheckpointError(
            f"student_init {path} holds a {type(model).__name__}, not a {family} student"
        )
    if tokenizer.get_vocab() != family_tokenizer(family).get_vocab():
        raise CheckpointError(
            f"student_init {path} was trained with another tokenizer than the {family} student's"
        )
    return model
