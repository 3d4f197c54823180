"""The one way a Hugging Face causal LM becomes a TransformerLens 4 ``TransformerBridge``."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from mistill_lens.lens.model_types import Tokenizer

# Model types whose configs (from a GGUF file or a fresh config) leave `architectures` empty while
# TransformerLens 4.3 maps the architecture name: what to tell it.
_ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}


_UNBRIDGEABLE = ("Unsupported architecture", "Could not determine supported architecture")


class UnsupportedArchitecture(ValueError):
    """A model whose architecture TransformerLens cannot bridge, so its heads cannot be hooked."""


def to_bridge(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
):
    """Wrap a Hugging Face model in a TransformerBridge (it adapts ``model`` in place: deep-copy it
    first if you need the unbridged model too). ``name`` labels the bridge (default: the model
    type); with ``hf_model`` given, TransformerLens reads its config and never calls the hub.

    The bridge gets its own copy of the tokenizer: TransformerLens 4.3 edits the tokenizer it is
    given, and a second bridge on the same object fails with ``KeyError: 'name_or_path'``.
    """
    from transformer_lens import TransformerBridge

    if not model.config.architectures and model.config.model_type in _ARCHITECTURES:
        model.config.architectures = [_ARCHITECTURES[model.config.model_type]]
    try:
        bridge = TransformerBridge.boot_transformers(
            name or model.config.model_type,
            hf_model=model,
            tokenizer=copy.deepcopy(tokenizer),
            device="cpu",
            dtype=dtype,
        )
    except ValueError as err:
        # TransformerLens's two refusals: an architecture it names, or a config naming none it knows
        if not any(text in str(err) for text in _UNBRIDGEABLE):
            raise
        from importlib.metadata import version

        architecture = (model.config.architectures or [type(model).__name__])[0]
        raise UnsupportedArchitecture(
            f"{architecture}: TransformerLens {version('transformer-lens')} has no bridge for this "
            "architecture, so its heads cannot be hooked; bridged causal LMs include "
            "LlamaForCausalLM, GPT2LMHeadModel, Gemma3ForCausalLM, Qwen2ForCausalLM and "
            "MistralForCausalLM"
        ) from err
    bridge.eval()
    return bridge
