"""How one position runs through a decoder layer, per architecture: the engine's adapters.

The :class:`~mistill_lens.lens.engine.InterventionEngine` recomputes single positions through a
model's layers. Everything it needs to know about an architecture is one :class:`Adapter`: the
queries, keys and values of a residual (with the architecture's norms and rotary positions), which
earlier keys a layer lets a position see (causal, or a sliding window), the attention's and the
MLP's contributions to the residual (with any post-norms), and the unembedding (with any logit
soft-capping). A new family is one subclass registered in :data:`ADAPTERS`; the engine checks
every adapter against the model's own forward before it is trusted (``InterventionEngine.check``).
"""

from __future__ import annotations

import einops
import torch
from torch import Tensor
from transformers import PreTrainedModel


class EngineUnsupported(ValueError):
    """The request needs the full forward (a hook the engine cannot apply, an unknown model)."""


class Adapter:
    """One architecture's layer arithmetic at single positions, on a Hugging Face model.

    Shapes: residuals ``x`` are [n, d_model]; queries [n, head, d_head]; keys and values
    [n, kv_head, d_head]; ``z`` (hook_z) [n, head, d_head]; ``positions`` [n] (absolute)."""

    n_layers: int
    n_heads: int
    d_head: int
    # whether the residual-stream hook points (hook_resid_pre / _post, hook_attn_out, hook_mlp_out)
    # mean here what they mean on the model's bridge: the engine applies them only then
    residual_hooks: bool = True

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def layer_module(self, layer: int) -> torch.nn.Module:
        """The decoder layer whose first input is the residual entering it."""
        raise NotImplementedError

    def z_module(self, layer: int) -> torch.nn.Module:
        """The module whose input is the layer's hook_z (flattened over heads)."""
        raise NotImplementedError

    def qkv(self, layer: int, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def scaling(self, layer: int) -> float:
        raise NotImplementedError

    def window(self, layer: int) -> int | None:
        """A sliding window: position p sees keys t with p - window < t <= p (None: all t <= p)."""
        return None

    def attn_out(self, layer: int, z: Tensor) -> Tensor:
        """The attention's contribution to the residual, from hook_z."""
        raise NotImplementedError

    def mlp_out(self, layer: int, x: Tensor) -> Tensor:
        """The MLP's contribution to the residual, from the residual after the attention."""
        raise NotImplementedError

    def unembed(self, x: Tensor) -> Tensor:
        raise NotImplementedError


class LlamaAdapter(Adapter):
    """Llama, Mistral and Qwen2: RMSNorm before attention and MLP, rotary positions, grouped
    key/value heads."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        config = model.config
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.d_head = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads

    def layer_module(self, layer):
        return self.model.model.layers[layer]

    def z_module(self, layer):
        return self.layer_module(layer).self_attn.o_proj

    def _project(self, layer: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values [n, head, 1, d] of the normalised residual h [n, 1, d_model]."""
        attn = self.layer_module(layer).self_attn
        return tuple(
            einops.rearrange(proj(h), "n s (h d) -> n h s d", d=self.d_head)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )

    def _rotate(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = self.model.model.rotary_emb(v, positions[:, None])
        return apply_rotary_pos_emb(q, k, cos, sin)

    def qkv(self, layer, x, positions):
        h = self.layer_module(layer).input_layernorm(x[:, None, :])
        q, k, v = self._project(layer, h)
        q, k = self._rotate(layer, q, k, v, positions)
        return q[:, :, 0], k[:, :, 0], v[:, :, 0]

    def scaling(self, layer):
        return self.layer_module(layer).self_attn.scaling

    def window(self, layer):
        window = getattr(self.layer_module(layer).self_attn, "sliding_window", None)
        return int(window) if window else None

    def attn_out(self, layer, z):
        return self.z_module(layer)(einops.rearrange(z, "n h d -> n (h d)"))

    def mlp_out(self, layer, x):
        block = self.layer_module(layer)
        return block.mlp(block.post_attention_layernorm(x))

    def unembed(self, x):
        return self.model.lm_head(self.model.model.norm(x))


class Gemma3Adapter(LlamaAdapter):
    """Gemma 3 (text): QK-norm, queries scaled by ``query_pre_attn_scalar``, norms after the
    attention and after the MLP, rotary buffers per layer type (local and global), sliding-window
    layers, optional final-logit soft-capping (transformers' Gemma 3 does not apply the config's
    attention soft-capping, so neither does this). The scaled embedding lives in the clean pass
    only. With post-norms, where a bridge puts hook_attn_out / hook_mlp_out (before or after the
    norm) is not checked yet: those hook points run on the full forward."""

    residual_hooks = False

    def _rotate(self, layer, q, k, v, positions):
        from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

        layer_type = self.model.config.layer_types[layer]
        cos, sin = self.model.model.rotary_emb(v, positions[:, None], layer_type)
        return apply_rotary_pos_emb(q, k, cos, sin)

    def qkv(self, layer, x, positions):
        attn = self.layer_module(layer).self_attn
        h = self.layer_module(layer).input_layernorm(x[:, None, :])
        q, k, v = self._project(layer, h)
        q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rotate(layer, q, k, v, positions)
        return q[:, :, 0], k[:, :, 0], v[:, :, 0]

    def attn_out(self, layer, z):
        block = self.layer_module(layer)
        return block.post_attention_layernorm(super().attn_out(layer, z))

    def mlp_out(self, layer, x):
        block = self.layer_module(layer)
        return block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))

    def unembed(self, x):
        logits = super().unembed(x)
        cap = self.model.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class GPT2Adapter(Adapter):
    """GPT-2: LayerNorm before attention and MLP, learned positions (in the clean pass only)."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        config = model.config
        self.n_layers = config.n_layer
        self.n_heads = config.n_head
        self.d_head = config.n_embd // config.n_head
        if getattr(config, "reorder_and_upcast_attn", False):
            raise EngineUnsupported("GPT-2 with reorder_and_upcast_attn is not supported")

    def layer_module(self, layer):
        return self.model.transformer.h[layer]

    def z_module(self, layer):
        return self.layer_module(layer).attn.c_proj

    def qkv(self, layer, x, positions):
        block = self.layer_module(layer)
        q, k, v = block.attn.c_attn(block.ln_1(x)).split(self.n_heads * self.d_head, dim=-1)
        split = "n (h d) -> n h d"
        return tuple(einops.rearrange(t, split, d=self.d_head) for t in (q, k, v))

    def scaling(self, layer):
        return self.layer_module(layer).attn.scaling

    def attn_out(self, layer, z):
        return self.z_module(layer)(einops.rearrange(z, "n h d -> n (h d)"))

    def mlp_out(self, layer, x):
        block = self.layer_module(layer)
        return block.mlp(block.ln_2(x))

    def unembed(self, x):
        return self.model.lm_head(self.model.transformer.ln_f(x))


# Hugging Face model types -> adapter. Gemma 3's text model reports `gemma3_text`.
ADAPTERS: dict[str, type[Adapter]] = {
    "llama": LlamaAdapter,
    "mistral": LlamaAdapter,
    "qwen2": LlamaAdapter,
    "gemma3_text": Gemma3Adapter,
    "gpt2": GPT2Adapter,
}


def adapter_for(model: PreTrainedModel) -> Adapter:
    """The adapter of `model`'s architecture; EngineUnsupported names the supported types."""
    model_type = model.config.model_type
    if model_type not in ADAPTERS:
        raise EngineUnsupported(
            f"no engine adapter for model type {model_type!r} (supported: {sorted(ADAPTERS)})"
        )
    return ADAPTERS[model_type](model)
