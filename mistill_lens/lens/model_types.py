"""What the lens runs on, as types: a hooked model and a tokenizer (a leaf module: it names no
backend, so every module can import it)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Union, runtime_checkable

from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@runtime_checkable
class HookedModel(Protocol):
    """A model the hook functions run on: TransformerLens 4's ``TransformerBridge`` (or a
    ``HookedTransformer``), or a backend that stands in for one (the InterventionEngine, the full
    forward of :mod:`mistill_lens.lens.backends`): its ``cfg`` (``n_layers``, ``n_heads``,
    ``d_head``, ...) and hook points by name."""

    cfg: Any

    def run_with_hooks(self, *args: Any, fwd_hooks: Sequence[Any] = (), **kwargs: Any) -> Any: ...


class StandsIn:
    """A backend that stands in for its hooked model anywhere in the lens: what it does not answer
    itself (cfg, hook_dict, run_with_hooks, state_dict, ...) is its ``model``'s."""

    model: Any

    def __getattr__(self, name: str):
        if name == "model":  # not set yet (unpickling, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A full forward of the model (dunder methods are not reached through __getattr__)."""
        return self.model(*args, **kwargs)


# A Hugging Face tokenizer (a fast one where character spans are mapped to tokens).
Tokenizer = PreTrainedTokenizerBase
# Decoding and the engine also take the plain Hugging Face model.
LanguageModel = Union[TransformerBridge, PreTrainedModel]
