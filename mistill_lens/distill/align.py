"""Cross-tokenizer alignment through character spans.

A distribution over one tokenizer's tokens (the teacher's attention over its source positions)
is moved onto another tokenizer's tokens of the same text: each source token's mass is split
over the target tokens its characters overlap, in proportion to the overlap, and the result is
renormalised over the target positions that exist (the student's context).
"""

from __future__ import annotations

from typing import Sequence

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from mistill_lens.lens.model_types import Tokenizer

Offsets = Sequence[tuple[int, int]]


def require_offsets(tokenizer: Tokenizer, what: str = "tokenizer") -> None:
    """Raise a clear error for a tokenizer that cannot give character offsets (a slow one)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{what} {type(tokenizer).__name__} gives no character offsets (return_offsets_mapping needs a fast, "
            "Rust-backed tokenizer): MISTILL aligns tokenizers through character spans"
        )


def _spans(offsets: Offsets) -> Tensor:
    spans = torch.as_tensor([tuple(o) for o in offsets], dtype=torch.long).reshape(-1, 2)
    if len(spans) and bool((spans[:, 1] < spans[:, 0]).any()):
        raise ValueError("character offsets with end before start")
    return spans


def overlap_matrix(
    source_offsets: Offsets, target_offsets: Offsets
) -> Float[Tensor, "source target"]:
    """Share of each source token's mass that goes to each target token.

    Entry (i, j) = overlap(i, j) / max(len(i), total overlap of i): a source token tiled by target
    tokens gives all its mass away; one half outside the target span keeps half back (dropped);
    where target spans overlap each other (byte pieces of one character) the row still sums to
    one. Zero-length source tokens (special tokens) have no characters and carry no mass across.
    """
    source, target = _spans(source_offsets), _spans(target_offsets)
    start = torch.maximum(source[:, None, 0], target[None, :, 0])
    end = torch.minimum(source[:, None, 1], target[None, :, 1])
    overlap = (end - start).clamp(min=0).double()
    length = (source[:, 1] - source[:, 0]).double()
    denominator = torch.maximum(length, overlap.sum(dim=1)).clamp(min=1.0)
    return overlap / denominator[:, None]


def transfer_mass(
    mass: Float[Tensor, "... source"],
    source_offsets: Offsets,
    target_offsets: Offsets,
    renormalise: bool = True,
) -> Float[Tensor, "... target"]:
    """Move `mass` over source tokens onto target tokens by character overlap (then renormalise)."""
    if mass.shape[-1] != len(source_offsets):
        raise ValueError(
            f"mass over {mass.shape[-1]} source tokens but {len(source_offsets)} source offsets"
        )
    if bool((mass < 0).any()):
        raise ValueError("attention mass must be non-negative")
    matrix = overlap_matrix(source_offsets, target_offsets).to(
        mass.dtype if mass.is_floating_point() else torch.float64
    )
    moved = einops.einsum(mass.to(matrix.dtype), matrix, "... s, s t -> ... t")
    if not renormalise:
        return moved
    total = moved.sum(dim=-1, keepdim=True)
    if bool((total <= 0).any()):
        raise ValueError(
            "no attention mass lands on the target tokens: the source positions with mass share no characters "
            "with the target context"
        )
    return moved / total
