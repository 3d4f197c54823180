"""What the lens runs on, as types: a hooked model and a tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from mistill_lens.lens.engine import InterventionEngine

# A model the hook functions run on: a TransformerLens 4 bridge, or the InterventionEngine around
# one (it takes the same hooks, at event positions).
HookedModel = Union[TransformerBridge, "InterventionEngine"]
# A Hugging Face tokenizer (a fast one where character spans are mapped to tokens).
Tokenizer = PreTrainedTokenizerBase
# Decoding and the engine also take the plain Hugging Face model.
LanguageModel = Union[TransformerBridge, PreTrainedModel]
