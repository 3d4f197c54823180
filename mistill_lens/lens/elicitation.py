"""Early elicitation: can the region be read out k tokens before the region token is written?

For every region event at token r and k = 1..8, the residual stream at position r - k is read at
every stage (`resid_pre` of each layer, then the final `resid_post`), by the logit lens
(final LayerNorm + unembedding, restricted to the region candidates) and by a linear probe trained
on one split of the examples and scored on a held-out split. `carrying_heads` then asks which
heads carry the readout (mean-ablation at r - k), to compare with the late, decision-time circuit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import einops
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from mistill_lens.lens.backends import backend_for, residual_stages
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.hooks import (
    Head,
    HookPair,
    all_heads,
    mean_ablation_hooks,
)
from mistill_lens.lens.model_types import HookedModel

DEFAULT_KS = tuple(range(1, 9))


def early_positions(
    batch: EventBatch, ks: Sequence[int]
) -> tuple[Int[Tensor, "k event"], Bool[Tensor, "k event"]]:
    """Position r - k of each row's region token r, and whether it exists (r - k >= 0)."""
    region = batch.predict_positions + 1
    positions = torch.stack([region - k for k in ks])
    return positions.clamp(min=0), positions >= 0


def at_positions(batch: EventBatch, positions: Int[Tensor, "event"]) -> EventBatch:
    """The rows of `batch` read at `positions` instead of their predicting positions (earlier
    positions of the same contexts)."""
    return EventBatch(batch.tokens, positions, batch.chosen, batch.contrast, batch.events)


@torch.no_grad()
def residuals_before(
    model: HookedModel,
    batch: EventBatch,
    ks: Sequence[int] = DEFAULT_KS,
    hooks_for: Callable[[EventBatch], Sequence[HookPair]] | None = None,
) -> Float[Tensor, "k stage event d_model"]:
    """Residual stream at r - k for every k and stage, from one forward pass (rows with r - k < 0
    hold position 0: mask them with `early_positions`). `hooks_for(b)` builds hooks for the rows
    read at r - k (``b.predict_positions`` is r - k); on an InterventionEngine, single-position
    recomputations instead of the forward."""
    positions, _ = early_positions(batch, ks)
    return backend_for(model).residuals_at(batch, positions, hooks_for)


@torch.no_grad()
def logit_lens_correct(
    model: HookedModel,
    residuals: Float[Tensor, "... d_model"],
    labels: Int[Tensor, "..."],
    candidate_ids: Sequence[int],
) -> Bool[Tensor, "..."]:
    """Whether the final LayerNorm + unembedding of each residual ranks the label first among the candidates."""
    candidates = torch.tensor(list(candidate_ids))
    logits = model.unembed(model.ln_final(residuals))[..., candidates]
    return candidates[logits.argmax(dim=-1)] == labels


def split_by_example(
    example_ids: Sequence[int], held_out_fraction: float, seed: int
) -> Bool[Tensor, "event"]:
    """True for training rows. Whole examples go to one side, so no example is in both."""
    unique = sorted(set(example_ids))
    random.Random(seed).shuffle(unique)
    n_held = max(1, round(held_out_fraction * len(unique)))
    if n_held >= len(unique):
        raise ValueError(f"{len(unique)} examples cannot give both a training and a held-out split")
    held = set(unique[:n_held])
    return torch.tensor([i not in held for i in example_ids])


@dataclass
class LinearProbe:
    """Multinomial logistic regression on centred, globally scaled features."""

    classes: Tensor  # label value of each output column
    mean: Tensor
    std: Tensor
    weight: Tensor
    bias: Tensor

    def logits(self, features: Float[Tensor, "n d"]) -> Float[Tensor, "n cls"]:
        return ((features - self.mean) / self.std) @ self.weight + self.bias

    def predict(self, features: Float[Tensor, "n d"]) -> Tensor:
        return self.classes[self.logits(features).argmax(dim=-1)]

    def margins(
        self, features: Float[Tensor, "n d"], labels: Int[Tensor, "n"]
    ) -> Float[Tensor, "n"]:
        """Logit of the true class minus the best other (-inf logit for labels the probe never saw)."""
        logits = self.logits(features)
        known = self.classes[None, :] == labels[:, None]
        true = torch.where(known, logits, torch.full_like(logits, float("-inf"))).max(dim=-1).values
        other = (
            torch.where(known, torch.full_like(logits, float("-inf")), logits).max(dim=-1).values
        )
        return true - other


def train_probe(
    features: Float[Tensor, "n d"],
    labels: Int[Tensor, "n"],
    weight_decay: float = 1e-3,
    max_iter: int = 100,
) -> LinearProbe:
    """Fit a probe by L-BFGS (deterministic on CPU)."""
    features = features.double()
    classes, targets = labels.unique(return_inverse=True)
    # one global scale, not per dimension: per-dimension scaling would blow numerical noise in
    # unused residual directions up to unit variance
    mean = features.mean(dim=0)
    std = (features - mean).pow(2).mean().sqrt().clamp(min=1e-6).expand_as(mean)
    x = (features - mean) / std
    weight = torch.zeros(x.shape[1], len(classes), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(len(classes), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [weight, bias], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe"
    )

    def closure():
        optimiser.zero_grad()
        loss = (
            torch.nn.functional.cross_entropy(x @ weight + bias, targets)
            + weight_decay * weight.pow(2).sum()
        )
        loss.backward()
        return loss

    with torch.enable_grad():
        optimiser.step(closure)
    return LinearProbe(
        classes, mean.float(), std.float(), weight.detach().float(), bias.detach().float()
    )


def elicitation_curve(
    model: HookedModel,
    batch: EventBatch,
    candidate_ids: Sequence[int],
    ks: Sequence[int] = DEFAULT_KS,
    held_out_fraction: float = 0.3,
    seed: int = 0,
) -> pd.DataFrame:
    """Readout accuracy of the decision (the ICD task: the region) at r - k, per k and stage, on
    held-out examples: columns k, stage, stage_name, method ("logit_lens" | "probe"), accuracy,
    chance, n_train, n_held_out. `batch` holds events of one kind (e.g. ``batch.of_kind("region")``)."""
    if len(set(batch.kinds)) != 1:
        raise ValueError(
            f"early elicitation reads events of one kind; this batch has {sorted(set(batch.kinds))}: "
            "pass batch.of_kind(KIND)"
        )
    residuals = residuals_before(model, batch, ks)
    _, valid = early_positions(batch, ks)
    train = split_by_example([e.example_id for e in batch.events], held_out_fraction, seed)
    labels = batch.chosen
    stages = residual_stages(model)
    majority = float((labels[~train] == labels[train].mode().values).float().mean())
    rows = []
    for ki, k in enumerate(ks):
        fit, held = train & valid[ki], ~train & valid[ki]
        if fit.sum() < 2 or held.sum() < 1:
            continue
        for si, stage in enumerate(stages):
            lens = logit_lens_correct(model, residuals[ki, si, held], labels[held], candidate_ids)
            probe = train_probe(residuals[ki, si, fit], labels[fit])
            probe_correct = probe.predict(residuals[ki, si, held]) == labels[held]
            for method, correct in (("logit_lens", lens), ("probe", probe_correct)):
                rows.append(
                    {
                        "k": k,
                        "stage": si,
                        "stage_name": stage,
                        "method": method,
                        "accuracy": float(correct.float().mean()),
                        "chance": majority,
                        "n_train": int(fit.sum()),
                        "n_held_out": int(held.sum()),
                    }
                )
    return pd.DataFrame(rows)


def elicitation_lead(curve: pd.DataFrame, method: str = "probe", threshold: float = 0.5) -> int:
    """Largest k such that, for every k' <= k, some stage reads the region with held-out accuracy
    >= threshold (0: not even at the token before)."""
    best = curve[curve.method == method].groupby("k")["accuracy"].max()
    lead = 0
    for k in sorted(best.index):
        if k != lead + 1 or best[k] < threshold:
            break
        lead = k
    return lead


def carrying_heads(
    model: HookedModel,
    batch: EventBatch,
    k: int,
    stage: int,
    held_out_fraction: float = 0.3,
    seed: int = 0,
) -> Float[Tensor, "layer head"]:
    """Mean drop (held-out rows) of a probe's margin for the true region at stage `stage`, position
    r - k, when each head is mean-ablated at r - k (mean over those positions of all rows)."""
    positions, valid = early_positions(batch, [k])
    positions, valid = positions[0], valid[0]
    train = split_by_example([e.example_id for e in batch.events], held_out_fraction, seed)
    rows = valid.nonzero().flatten()
    sub = batch.select(rows)
    positions, train = positions[rows], train[rows]

    def early_class(b: EventBatch) -> Tensor:  # class 0 at the rows' read positions (r - k)
        classes = torch.full(b.tokens.shape, -1, dtype=torch.long)
        classes[torch.arange(len(b)), b.predict_positions] = 0
        return classes

    # the means at the read positions on the model's backend (on the engine, from its clean passes:
    # a full forward over these rows would hold every row's full-vocabulary logits at once)
    read = at_positions(sub, positions)
    read.events = [replace(event, kind="early") for event in read.events]
    means = backend_for(model).head_means(read, ("early",))
    clean = residuals_before(model, sub, [k])[0, stage]

    probe = train_probe(clean[train], sub.chosen[train])
    held = ~train
    clean_margin = probe.margins(clean[held], sub.chosen[held])
    finite = torch.isfinite(clean_margin)  # held-out regions the probe never saw have no margin
    drops = torch.zeros(model.cfg.n_layers, model.cfg.n_heads)
    # stage s is the residual before layer s: heads in layers >= s cannot move it
    for layer, head in [(l, h) for l, h in all_heads(model) if l < stage]:
        ablated = residuals_before(
            model,
            sub,
            [k],
            lambda b, head=(layer, head): mean_ablation_hooks(model, [head], means, early_class(b)),
        )[0, stage]
        margin = probe.margins(ablated[held], sub.chosen[held])
        drops[layer, head] = (clean_margin[finite] - margin[finite]).mean()
    return drops


def top_heads(scores: Float[Tensor, "layer head"], n: int) -> list[Head]:
    """The n heads with the largest scores, largest first."""
    flat = einops.rearrange(scores, "l h -> (l h)")
    order = flat.argsort(descending=True)[:n]
    n_heads = scores.shape[1]
    return [(int(i) // n_heads, int(i) % n_heads) for i in order]
