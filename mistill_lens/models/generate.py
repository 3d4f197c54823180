"""Greedy decoding: the one decoder module.

* :func:`greedy_tokens`: token ids in, prompt + continuation out, for a plain Hugging Face model
  (its KV cache) or a TransformerBridge (one full forward per token: TransformerLens 4.3's bridged
  attention never writes into transformers' cache, so cached decoding through a bridge emits
  garbage after the first token; the full forward is exact and runs any hooks the caller has
  attached).
* :func:`greedy_text`: a prompt string in, the continuation string out (the task's evaluation and
  the teacher's distillation data).
* :func:`verified_greedy`: a bridge's own greedy tokens and its logits over them, drafted by an
  unbridged copy of the same weights (its KV cache) and verified by one bridge forward.
"""

from __future__ import annotations

from typing import Callable, Collection

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedModel

from mistill_lens.lens.model_types import LanguageModel, Tokenizer
from mistill_lens.models.tokenizers import prompt_token_ids


def model_device(model: LanguageModel) -> torch.device:
    """Where the model's weights are (the CPU for a model without parameters)."""
    weight = next(iter(model.parameters()), None)
    return weight.device if weight is not None else torch.device("cpu")


def _is_bridge(model: LanguageModel) -> bool:
    return not isinstance(model, PreTrainedModel)


@torch.no_grad()
def greedy_tokens(
    model: LanguageModel,
    input_ids: Int[Tensor, "batch prompt_pos"],
    max_new_tokens: int,
    stop_token_ids: Collection[int] = (),
) -> Int[Tensor, "batch total_pos"]:
    """Greedy decoding; returns prompt and continuation. A row that has stopped is filled with a
    stop token (a bridge row repeats its own), so rows stay aligned; decoding ends when every row
    has stopped. Prompts in one batch must have equal length (no padding is applied)."""
    if not _is_bridge(model):
        stops = sorted(stop_token_ids)
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=stops[0] if stops else None,
        )
    tokens = input_ids.to(model.cfg.device)
    stop_ids = torch.tensor(sorted(stop_token_ids), dtype=tokens.dtype, device=tokens.device)
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for _ in range(max_new_tokens):
        next_token = model(tokens)[:, -1, :].argmax(dim=-1)
        next_token = torch.where(finished, tokens[:, -1], next_token)
        tokens = torch.cat([tokens, next_token[:, None]], dim=1)
        finished |= torch.isin(next_token, stop_ids)
        if finished.all():
            break
    return tokens


def greedy_text(
    model: LanguageModel, tokenizer: Tokenizer, prompt: str, max_new_tokens: int
) -> str:
    """Greedy continuation of ``prompt`` up to end-of-text (special tokens dropped). The prompt is
    encoded on its own, exactly as in training (:func:`prompt_token_ids`)."""
    if not _is_bridge(model):
        return greedy_texts(model, tokenizer, [prompt], max_new_tokens)[0]
    ids = torch.tensor([prompt_token_ids(tokenizer, prompt)])
    context = model.cfg.n_ctx
    room = context - ids.shape[1]
    if room <= 0:
        raise ValueError(
            f"prompt of {ids.shape[1]} tokens does not fit the model's {context}-token context"
        )
    tokens = greedy_tokens(model, ids, min(max_new_tokens, room), [tokenizer.eos_token_id])
    return tokenizer.decode(tokens[0, ids.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def greedy_texts(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int = 1,
    on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """``greedy_text`` of each prompt, decoded ``batch_size`` at a time on the model's device.

    Prompts of similar length go together and are left-padded (the attention mask hides the
    padding and positions count from each prompt's first token), so a batch costs about one
    decode; greedy tokens can differ from one-by-one decoding only where two logits tie to the
    last float bits. ``on_batch(n)`` is called after each batch of ``n`` prompts."""
    if _is_bridge(model):
        raise TypeError("greedy_texts decodes a Hugging Face model; for a bridge use greedy_text")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    context = model.config.max_position_embeddings
    for ids in encoded:
        if len(ids) >= context:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the model's {context}-token context"
            )
    stop = tokenizer.eos_token_id
    device = model_device(model)
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    texts: list[str] = [""] * len(prompts)
    for first in range(0, len(order), batch_size):
        rows = order[first : first + batch_size]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), stop, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, i in enumerate(rows):
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        tokens = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=min(max_new_tokens, context - width),
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=stop,
        )
        for row, i in enumerate(rows):
            texts[i] = tokenizer.decode(tokens[row, width:], skip_special_tokens=True)
        if on_batch is not None:
            on_batch(len(rows))
    return texts


@torch.no_grad()
def verified_greedy(
    bridge: TransformerBridge,
    prompt_ids: Int[Tensor, "1 prompt_pos"],
    max_new_tokens: int,
    stop_token_ids: Collection[int],
    draft: PreTrainedModel | None = None,
) -> tuple[Int[Tensor, "1 total_pos"], Float[Tensor, "total_pos vocab"]]:
    """Greedy tokens of the bridge and the bridge's logits over them.

    Without ``draft``: one full bridge forward per new token (no KV cache). With ``draft`` (a
    transformers model with the same weights, not bridged): the draft proposes the continuation
    with its KV cache, a bridge forward checks every proposed token against its own argmax, and
    decoding resumes from the first disagreement with the bridge's token.
    """
    stops = set(stop_token_ids)
    tokens = prompt_ids
    n_prompt = prompt_ids.shape[1]
    while True:
        n_done = tokens.shape[1] - n_prompt
        finished = n_done >= max_new_tokens or (n_done > 0 and int(tokens[0, -1]) in stops)
        if not finished and draft is not None:
            stop_list = sorted(stops) or None
            tokens = draft.generate(
                tokens,
                attention_mask=torch.ones_like(tokens),
                do_sample=False,
                max_new_tokens=max_new_tokens - n_done,
                eos_token_id=stop_list,
                pad_token_id=stop_list[0] if stop_list else None,
            )
        elif not finished:
            tokens = torch.cat([tokens, bridge(tokens)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
            continue
        logits = bridge(tokens)[0]
        greedy = logits[n_prompt - 1 : -1].argmax(dim=-1)
        disagree = (greedy != tokens[0, n_prompt:]).nonzero()
        if len(disagree) == 0:
            return tokens, logits
        first = int(disagree[0])
        tokens = torch.cat([tokens[:, : n_prompt + first], greedy[first].view(1, 1)], dim=1)
