"""LoRA adapters on pretrained bases: a fresh seeded adapter, and the adapter of a model that
TransformerBridge has adapted in place, written as a plain peft checkpoint.

TransformerBridge wraps each module of the Hugging Face model it is given and renames the
wrapped module's parameters (``..._original_component...``), so peft's own ``save_pretrained`` on
a bridged model would write keys no base model has. ``AdapterExport`` writes the adapter under
the names of the unbridged model, which ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from mistill_lens.models.students import BRIDGE_KEY_PART

# Every attention and MLP projection of a Llama- or Gemma-style decoder.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fresh_adapter(base, rank: int, seed: int):
    """``base`` with a new trainable LoRA adapter of ``rank`` on :data:`LORA_TARGETS` (alpha =
    2 x rank, no dropout), its initial weights a function of ``seed``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    with warnings.catch_warnings():  # peft calls a transformers API that transformers 5 deprecates
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(base, lora)


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the unbridged model's names (what peft saves and loads)."""
    from peft import get_peft_model_state_dict

    return {
        key.replace(BRIDGE_KEY_PART, ""): value.detach().clone()
        for key, value in get_peft_model_state_dict(peft_model).items()
    }


class AdapterExport:
    """What :func:`mistill_lens.models.checkpoints.save_checkpoint` writes for a LoRA student: its
    adapter config and weights, whether or not the model is bridged."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        from mistill_lens.models.checkpoints import ADAPTER_WEIGHTS_FILE

        folder = Path(folder)
        self.peft_model.peft_config["default"].save_pretrained(str(folder))
        save_file(adapter_state(self.peft_model), str(folder / ADAPTER_WEIGHTS_FILE))
