"""A planted GPT-2 whose region decision is carried jointly by four heads, none decisive alone.

On the vocabulary, tokenizer and examples of `planted.py` (same exact-LayerNorm construction).
Each of the four layer-0 heads does two things:
- at "=" it attends to the flagged candidate region "R{b}*" and writes `JOINT_GAIN` onto the plain
  region token "R{b}": the region margin is 4 x JOINT_GAIN, each head carries a quarter of it;
- everywhere else it is a previous-token head copying with gain `COPY_GAIN`: ablating it moves the
  margins of non-decision tokens by much more than a quarter of the region margin, so a per-head
  calibrated z (effect above the null distribution) does not single any of them out.
Layer 1 is zero.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from planted import (
    D_MODEL,
    FILLERS,
    FLAGGED_REGIONS,
    N_CTX,
    N_HEADS,
    REGIONS,
    TOKEN_ID,
    exact_gpt2,
    planted_tokenizer,
)
from transformer_lens import TransformerBridge
from transformers import GPT2LMHeadModel

JOINT_GAIN = 0.75
COPY_GAIN = 4.0
JOINT_HEADS = [(0, h) for h in range(N_HEADS)]

_TRIGGER_SCORE = 120.0  # "=" finds the flagged region over the previous token (60)
_PREVIOUS_SCORE = 60.0
_DEFAULT_SCORE = 20.0


def joint_hf_model() -> GPT2LMHeadModel:
    model, token_dir, constant_dir, position_dir = exact_gpt2(n_layer=2)
    d_head = D_MODEL // N_HEADS
    q_scale = math.sqrt(d_head)

    def tok(name: str) -> torch.Tensor:
        return token_dir[TOKEN_ID[name]]

    def unit(index: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(index), d_head).double()

    trigger, default = d_head - 1, d_head - 2  # query/key units apart from the positional ones
    w_q = torch.zeros(D_MODEL, d_head, dtype=torch.float64)
    w_k = torch.zeros_like(w_q)
    w_v = torch.zeros_like(w_q)
    w_o = torch.zeros(d_head, D_MODEL, dtype=torch.float64)
    w_q += q_scale * _TRIGGER_SCORE * torch.outer(tok("="), unit(trigger))
    w_q += q_scale * _DEFAULT_SCORE * torch.outer(constant_dir, unit(default))
    w_k += torch.outer(tok("<bos>"), unit(default))
    for slot, (flagged, plain) in enumerate(zip(FLAGGED_REGIONS, REGIONS)):
        w_k += torch.outer(tok(flagged), unit(trigger))
        w_v += torch.outer(tok(flagged), unit(slot))
        w_o += JOINT_GAIN * torch.outer(unit(slot), tok(plain))
    for position in range(1, N_CTX):  # the query at p matches the key of p - 1
        w_q += q_scale * _PREVIOUS_SCORE * torch.outer(position_dir[position], unit(position - 1))
    for position in range(N_CTX):
        w_k += torch.outer(position_dir[position], unit(position))
    for slot, name in enumerate([*REGIONS, *FILLERS], start=len(REGIONS)):
        w_v += torch.outer(tok(name), unit(slot))
        w_o += COPY_GAIN * torch.outer(unit(slot), tok(name))

    with torch.no_grad():
        attn = model.transformer.h[0].attn
        # every head of layer 0 is the same joint head
        attn.c_attn.weight.copy_(
            torch.cat([w_q.repeat(1, N_HEADS), w_k.repeat(1, N_HEADS), w_v.repeat(1, N_HEADS)], 1)
        )
        attn.c_proj.weight.copy_(w_o.repeat(N_HEADS, 1))
    return model


def joint_bridge(directory: Path):
    tokenizer = planted_tokenizer(directory)
    bridge = TransformerBridge.boot_transformers(
        "planted-joint-gpt2",
        hf_model=joint_hf_model(),
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
    )
    return bridge, tokenizer
