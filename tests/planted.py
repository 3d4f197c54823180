"""Tiny GPT-2 models with hand-set weights in which known heads do the deciding.

Why this construction is exact: every embedding and every head output lives in an orthonormal
basis orthogonal to the all-ones vector, and every LayerNorm has a huge epsilon with a matching
gain, so each LayerNorm is the identity to float32 precision. The residual stream is then a sum of
known vectors and every margin below is a closed-form number.

Layer 0 heads:
- DECIDER (head 0): at "=" it attends to the flagged candidate region "R{b}*" and writes
  `REGION_GAIN` onto the plain region token "R{b}" (the region decision).
- GENERIC (head 1): a previous-token head; copies the previous token with gain `GENERIC_GAIN`
  everywhere (it helps the region decision because the reasoning mentions the region right before
  "=", and it helps every alternating filler token just as much: calibration must discount it).
- WITHIN (head 2): at a plain region token it attends to the flagged suffix "s{y}*" and writes
  `WITHIN_GAIN` onto "s{y}" (the within decision).
- head 3 and all of layer 1 are zero.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens import TransformerBridge
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

N_REGIONS = 6
N_SUFFIXES = 4
N_FILLERS = 12
N_FILLER_TOKENS = 8
N_LISTED_REGIONS = 4
N_LISTED_SUFFIXES = 3
N_CTX = 24
D_MODEL = 128
N_HEADS = 4
N_LAYERS = 2

REGION_GAIN = 2.0
GENERIC_GAIN = 4.0
WITHIN_GAIN = 3.0
DECIDER, GENERIC, WITHIN, DEAD = (0, 0), (0, 1), (0, 2), (0, 3)

_MATCH_SCORE = 60.0  # attention logit for the wanted key
_DEFAULT_SCORE = 20.0  # attention logit for BOS when the query is idle

REGIONS = [f"R{i}" for i in range(N_REGIONS)]
FLAGGED_REGIONS = [f"R{i}*" for i in range(N_REGIONS)]
SUFFIXES = [f"s{i}" for i in range(N_SUFFIXES)]
FLAGGED_SUFFIXES = [f"s{i}*" for i in range(N_SUFFIXES)]
FILLERS = [f"f{i}" for i in range(N_FILLERS)]
VOCAB = ["<bos>", "<eos>", "=", *REGIONS, *FLAGGED_REGIONS, *SUFFIXES, *FLAGGED_SUFFIXES, *FILLERS]
TOKEN_ID = {token: index for index, token in enumerate(VOCAB)}


def planted_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A whitespace word-level fast tokenizer (with offsets), saved and reloaded from `directory`
    because TransformerBridge re-reads tokenizers by their `name_or_path`."""
    backend = Tokenizer(models.WordLevel(TOKEN_ID, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<eos>",
        pad_token="<eos>",
    )
    tokenizer.save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def _residual_basis() -> torch.Tensor:
    """Orthonormal rows, all orthogonal to the all-ones vector (so LayerNorm's centring is a no-op)."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(D_MODEL, D_MODEL, generator=generator, dtype=torch.float64)
    matrix[:, 0] = 1.0
    q, _ = torch.linalg.qr(matrix)
    return q[:, 1:].T.contiguous()  # [D_MODEL - 1, D_MODEL]


def exact_gpt2(n_layer: int) -> tuple[GPT2LMHeadModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A zeroed GPT-2 on the planted vocabulary whose LayerNorms are the identity, with tokens and
    positions embedded on orthonormal directions; returns it and the (token, constant, position)
    directions, for the caller to plant heads with."""
    config = GPT2Config(
        vocab_size=len(VOCAB),
        n_positions=N_CTX,
        n_embd=D_MODEL,
        n_layer=n_layer,
        n_head=N_HEADS,
        layer_norm_epsilon=1e10,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config).eval()
    basis = _residual_basis()
    token_dir = basis[: len(VOCAB)]
    constant_dir = basis[len(VOCAB)]
    position_dir = basis[len(VOCAB) + 1 : len(VOCAB) + 1 + N_CTX]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.transformer.wte.weight.copy_(token_dir + constant_dir)
        model.transformer.wpe.weight.copy_(position_dir)
        for norm in [
            model.transformer.ln_f,
            *(b.ln_1 for b in model.transformer.h),
            *(b.ln_2 for b in model.transformer.h),
        ]:
            norm.weight.fill_(1e5)  # sqrt(epsilon): LayerNorm(x) == x - mean(x) == x
    return model, token_dir, constant_dir, position_dir


def planted_hf_model() -> GPT2LMHeadModel:
    model, token_dir, constant_dir, position_dir = exact_gpt2(N_LAYERS)
    d_head = D_MODEL // N_HEADS
    q_scale = math.sqrt(d_head)  # undo GPT-2's 1/sqrt(d_head) score scaling

    def tok(name: str) -> torch.Tensor:
        return token_dir[TOKEN_ID[name]]

    def unit(index: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(index), d_head).double()

    w_q = torch.zeros(N_HEADS, D_MODEL, d_head, dtype=torch.float64)
    w_k = torch.zeros_like(w_q)
    w_v = torch.zeros_like(w_q)
    w_o = torch.zeros(N_HEADS, d_head, D_MODEL, dtype=torch.float64)

    def plant_selector(
        head: int, triggers: list[str], keys: list[str], outputs: list[str], gain: float
    ) -> None:
        for trigger in triggers:
            w_q[head] += q_scale * _MATCH_SCORE * torch.outer(tok(trigger), unit(0))
        w_q[head] += q_scale * _DEFAULT_SCORE * torch.outer(constant_dir, unit(1))
        w_k[head] += torch.outer(tok("<bos>"), unit(1))
        for slot, (key, output) in enumerate(zip(keys, outputs)):
            w_k[head] += torch.outer(tok(key), unit(0))
            w_v[head] += torch.outer(tok(key), unit(slot))
            w_o[head] += gain * torch.outer(unit(slot), tok(output))

    plant_selector(DECIDER[1], ["="], FLAGGED_REGIONS, REGIONS, REGION_GAIN)
    plant_selector(WITHIN[1], REGIONS, FLAGGED_SUFFIXES, SUFFIXES, WITHIN_GAIN)
    # GENERIC: query at position p matches the key of position p-1
    for position in range(1, N_CTX):
        w_q[GENERIC[1]] += (
            q_scale * _MATCH_SCORE * torch.outer(position_dir[position], unit(position - 1))
        )
    for position in range(N_CTX):
        w_k[GENERIC[1]] += torch.outer(position_dir[position], unit(position))
    for slot, name in enumerate([*REGIONS, *FILLERS]):
        w_v[GENERIC[1]] += torch.outer(tok(name), unit(slot))
        w_o[GENERIC[1]] += GENERIC_GAIN * torch.outer(unit(slot), tok(name))

    with torch.no_grad():
        attn = model.transformer.h[0].attn

        def to_columns(w):
            return w.permute(1, 0, 2).reshape(D_MODEL, D_MODEL)  # [d_model, head*d_head]

        attn.c_attn.weight.copy_(
            torch.cat([to_columns(w_q), to_columns(w_k), to_columns(w_v)], dim=1)
        )
        attn.c_proj.weight.copy_(w_o.reshape(D_MODEL, D_MODEL))
    return model


def planted_bridge(directory: Path) -> tuple[TransformerBridge, PreTrainedTokenizerFast]:
    tokenizer = planted_tokenizer(directory)
    bridge = TransformerBridge.boot_transformers(
        "planted-gpt2",
        hf_model=planted_hf_model(),
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
    )
    return bridge, tokenizer


def planted_examples(n: int, seed: int) -> list[dict]:
    """Examples in the task's format: prompt, output and gold events with character spans."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        listed_regions = rng.sample(range(N_REGIONS), N_LISTED_REGIONS)
        chosen_region, contrast_region = listed_regions[0], listed_regions[1]
        rng.shuffle(listed_regions)
        listed_suffixes = rng.sample(range(N_SUFFIXES), N_LISTED_SUFFIXES)
        chosen_suffix, contrast_suffix = listed_suffixes[0], listed_suffixes[1]
        rng.shuffle(listed_suffixes)
        first_filler, second_filler = rng.sample(range(N_FILLERS), 2)
        prompt_tokens = ["<bos>"]
        prompt_tokens += [
            FLAGGED_REGIONS[r] if r == chosen_region else REGIONS[r] for r in listed_regions
        ]
        prompt_tokens += [
            FLAGGED_SUFFIXES[s] if s == chosen_suffix else SUFFIXES[s] for s in listed_suffixes
        ]
        fillers = [
            FILLERS[first_filler if i % 2 == 0 else second_filler] for i in range(N_FILLER_TOKENS)
        ]
        prompt = " ".join(prompt_tokens)
        head = prompt + " " + " ".join(fillers) + f" {REGIONS[chosen_region]} = "
        region_start = len(head)
        within_start = region_start + len(REGIONS[chosen_region]) + 1
        output = head[len(prompt) :] + f"{REGIONS[chosen_region]} {SUFFIXES[chosen_suffix]} <eos>"
        examples.append(
            {
                "prompt": prompt,
                "output": output,
                "events": [
                    {
                        "kind": "region",
                        "start": region_start,
                        "end": region_start + len(REGIONS[chosen_region]),
                        "chosen": REGIONS[chosen_region],
                        "contrast": REGIONS[contrast_region],
                        "mention": 0,
                        "region": REGIONS[chosen_region],
                    },
                    {
                        "kind": "within",
                        "start": within_start,
                        "end": within_start + len(SUFFIXES[chosen_suffix]),
                        "chosen": SUFFIXES[chosen_suffix],
                        "contrast": SUFFIXES[contrast_suffix],
                        "mention": 0,
                        "region": REGIONS[chosen_region],
                    },
                ],
            }
        )
    return examples
