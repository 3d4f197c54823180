"""The interventions as composable TransformerLens hooks.

Every factory returns a list of `(hook_name, fn)` pairs keyed on standard hook names
(`transformer_lens.utilities.get_act_name`), so any combination goes into one
`model.run_with_hooks(tokens, fwd_hooks=[*a, *b])` call on a `TransformerBridge` (or any hooked
model). Hook functions never look at `hook.name`: in TL 4 it is the canonical, not the alias name.

Per-head activations are read and written at `blocks.{l}.attn.hook_z` [batch, pos, head, d_head].
The reference means that ablations write are computed here too; running a model with these hooks
for the events' margins (and their gradient) is :mod:`mistill_lens.lens.margins`.
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities import get_act_name

from mistill_lens.lens.events import EventBatch, position_class_names, row_chunks
from mistill_lens.lens.model_types import HookedModel

Head = tuple[int, int]
HookFn = Callable[[Tensor, object], Tensor]
HookPair = tuple[str, HookFn]
HooksFor = Callable[[EventBatch], Sequence[HookPair]]  # the hooks for a batch of event rows


def z_hook_name(layer: int) -> str:
    return get_act_name("z", layer)


def check_hook_names(model: HookedModel, names: Iterable[str]) -> None:
    """Raise a KeyError naming every hook name the model does not have."""
    unknown = sorted(set(names) - set(model.hook_dict))
    if unknown:
        examples = [n for n in model.hook_dict if n.endswith("hook_z")][:2]
        raise KeyError(f"unknown hook name(s) {unknown}; this model has e.g. {examples}")


def n_layers_heads(model: HookedModel) -> tuple[int, int]:
    return model.cfg.n_layers, model.cfg.n_heads


def all_heads(model: HookedModel) -> list[Head]:
    n_layers, n_heads = n_layers_heads(model)
    return [(layer, head) for layer in range(n_layers) for head in range(n_heads)]


def validate_heads(
    model: HookedModel, heads: Iterable[Head], allow_empty: bool = False
) -> list[Head]:
    """Sorted unique heads, with clear errors for out-of-range indices and empty sets."""
    return checked_heads(heads, *n_layers_heads(model), allow_empty=allow_empty)


def checked_heads(
    heads: Iterable[Head], n_layers: int, n_heads: int, allow_empty: bool = False
) -> list[Head]:
    """`validate_heads` for a model of `n_layers` x `n_heads` known by its shape alone."""
    unique = sorted(set(map(as_head, heads)))
    if not unique and not allow_empty:
        raise ValueError("empty head set: nothing to intervene on")
    bad = [(l, h) for l, h in unique if not (0 <= l < n_layers and 0 <= h < n_heads)]
    if bad:
        raise IndexError(
            f"heads {bad} out of range for a model with {n_layers} layers x {n_heads} heads"
        )
    return unique


_HEAD_NAME = re.compile(r"^L(\d+)H(\d+)$", re.IGNORECASE)


def as_head(value) -> Head:
    """A head as ``(layer, head)``, from a pair of integers or a name as every figure writes it
    (``"L29H1"``)."""
    if isinstance(value, str):
        match = _HEAD_NAME.match(value.strip())
        if match is None:
            raise ValueError(f"head {value!r} is not a name like 'L29H1' (layer 29, head 1)")
        return int(match.group(1)), int(match.group(2))
    try:
        layer, head = value
    except (TypeError, ValueError):
        raise TypeError(f"a head is (layer, head) or a name like 'L29H1', got {value!r}") from None
    return _index(layer, "layer"), _index(head, "head")


def _index(value, what: str) -> int:
    """An integer index (int, numpy or 0-d torch integer); a float such as 0.7 is an error, never
    truncated to 0."""
    if isinstance(value, Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{what} index must be an integer, got {value!r}")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} index must be an integer, got {value!r}")
    return int(value)


def head_mask(model: HookedModel, heads: Iterable[Head]) -> Tensor:
    """Bool [layer, head] mask of `heads`."""
    n_layers, n_heads = n_layers_heads(model)
    mask = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    for layer, head in map(as_head, heads):
        mask[layer, head] = True
    return mask


def _check_z(act: Tensor, n_heads: int, batch_pos: tuple[int, int] | None, what: str) -> None:
    if act.ndim != 4 or act.shape[2] != n_heads:
        raise ValueError(
            f"{what}: expected hook_z activations [batch, pos, {n_heads}, d_head], got {tuple(act.shape)}"
        )
    if batch_pos is not None and tuple(act.shape[:2]) != batch_pos:
        raise ValueError(
            f"{what}: activations are [batch, pos] = {tuple(act.shape[:2])} but positions were given for {batch_pos}"
        )


# --- reference means -------------------------------------------------------------------------


@dataclass
class HeadMeans:
    """Exact mean of every head's hook_z over reference positions, one mean per position class."""

    class_names: tuple[str, ...]
    means: Float[Tensor, "cls layer head d_head"]
    counts: Int[Tensor, "cls"]

    def __repr__(self) -> str:
        n_classes, n_layers, n_heads, d_head = self.means.shape
        counts = dict(zip(self.class_names, self.counts.tolist()))
        return (
            f"HeadMeans({n_layers} layers x {n_heads} heads x d_head {d_head}; reference "
            f"positions per class {counts})"
        )

    def class_index(self, name: str) -> int:
        if name not in self.class_names:
            raise KeyError(
                f"no reference mean for position class {name!r}; have {self.class_names}"
            )
        index = self.class_names.index(name)
        if int(self.counts[index]) == 0:
            raise ValueError(f"position class {name!r} had no reference positions")
        return index


# The working memory one full forward of a batch of rows may take. Eager attention's scores and
# pattern (heads x T^2 floats each, one layer at a time) dominate at long contexts; the batch's
# row count follows this budget, never a fixed number.
MEMORY_BUDGET_BYTES = 1 << 30


def rows_within_budget(
    model: HookedModel, width: int, budget_bytes: int = MEMORY_BUDGET_BYTES
) -> int:
    """How many rows of `width` tokens one forward of `model` may hold within `budget_bytes`: two
    [heads, T, T] float32 tensors of one layer's attention and a dozen [T, d_model] activations
    per row (at least one row)."""
    per_row = 4 * (2 * model.cfg.n_heads * width * width + 12 * width * model.cfg.d_model)
    return max(1, budget_bytes // per_row)


class _Read(Exception):
    """Raised right after the last activation a forward is run for has been read: the later
    layers and the unembedding (full-vocabulary logits at every position: 262,144 columns for
    Gemma) would be computed for nothing."""


def run_reading(
    model: HookedModel, tokens: Int[Tensor, "batch pos"], hooks: Sequence[HookPair], last: str
) -> None:
    """Run `model` on `tokens` with `hooks` (which read activations) and stop the forward as soon
    as hook point `last` has run. The hooks are removed either way."""

    def stop(act: Tensor, hook) -> None:
        raise _Read

    try:
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=[*hooks, (last, stop)])
    except _Read:
        pass


def collect_z(
    model: HookedModel, tokens: Int[Tensor, "batch pos"], extra_hooks: Sequence[HookPair] = ()
) -> Float[Tensor, "layer batch pos head d_head"]:
    """Every layer's hook_z from one forward pass (with any hooks already applied), which stops
    after the last layer's hook_z."""
    names = [z_hook_name(layer) for layer in range(model.cfg.n_layers)]
    store: dict[str, Tensor] = {}

    def saver(name: str) -> HookFn:
        def save(act: Tensor, hook) -> Tensor:
            store[name] = act.detach().clone()
            return act

        return save

    run_reading(model, tokens, [*extra_hooks, *[(n, saver(n)) for n in names]], names[-1])
    return torch.stack([store[name] for name in names])


def event_position_classes(
    batch: EventBatch, class_names: Sequence[str] | None = None
) -> Int[Tensor, "event pos"]:
    """Class index of each row's predicting position (its event kind's index in `class_names`;
    default: `position_class_names` of the batch's kinds); -1 everywhere else. Pass the names of
    the means you intervene with (`means.class_names`) when the batch may lack some of their kinds."""
    names = list(position_class_names(batch.kinds) if class_names is None else class_names)
    missing = sorted(set(batch.kinds) - set(names))
    if missing:
        raise KeyError(f"event kinds {missing} have no position class among {names}")
    classes = torch.full(batch.tokens.shape, -1, dtype=torch.long)
    rows = torch.arange(len(batch))
    classes[rows, batch.predict_positions] = torch.tensor([names.index(k) for k in batch.kinds])
    return classes


def compute_head_means(
    model: HookedModel,
    tokens: Int[Tensor, "batch pos"],
    position_class: Int[Tensor, "batch pos"],
    class_names: Sequence[str],
    batch_size: int | None = None,
) -> HeadMeans:
    """Exact per-class means of hook_z over the positions of real reference runs (-1 = unused);
    `position_class` indexes `class_names`. Each layer's sums are added as its hook_z is computed
    (no [layer, batch, pos, ...] stack) and each forward stops after the last layer; rows go
    `batch_size` at a time (default: as many as :data:`MEMORY_BUDGET_BYTES` allows)."""
    if tokens.shape != position_class.shape:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and position classes {tuple(position_class.shape)} differ"
        )
    if int(position_class.max()) >= len(class_names):
        raise IndexError(
            f"position class {int(position_class.max())} has no name among {list(class_names)}"
        )
    n_layers, n_heads = n_layers_heads(model)
    sums = torch.zeros(len(class_names), n_layers, n_heads, model.cfg.d_head, dtype=torch.float64)
    counts = torch.zeros(len(class_names), dtype=torch.long)
    rows_per_forward = batch_size or rows_within_budget(model, tokens.shape[1])
    for rows in row_chunks(tokens.shape[0], rows_per_forward):
        classes = position_class[rows.start : rows.stop]
        one_hot = torch.nn.functional.one_hot(classes.clamp(min=0), len(class_names)).double()
        one_hot = one_hot * (classes >= 0).unsqueeze(-1)

        def add(layer: int) -> HookFn:
            def hook(z: Tensor, hook) -> Tensor:  # sums in float64: exact enough
                sums[:, layer] += einops.einsum(one_hot, z.double(), "b p c, b p h d -> c h d")
                return z

            return hook

        hooks = [(z_hook_name(layer), add(layer)) for layer in range(n_layers)]
        run_reading(model, tokens[rows.start : rows.stop], hooks, z_hook_name(n_layers - 1))
        counts += one_hot.sum(dim=(0, 1)).long()
    return class_means(class_names, sums, counts)


def class_means(class_names: Sequence[str], sums: Tensor, counts: Tensor) -> HeadMeans:
    """HeadMeans from float64 per-class sums [cls, layer, head, d_head] and position counts."""
    means = sums / counts.clamp(min=1).double().view(-1, 1, 1, 1)
    return HeadMeans(tuple(class_names), means.to(torch.float32), counts)


# --- mean ablation ---------------------------------------------------------------------------


def _check_means(model: HookedModel, means: HeadMeans, position_class: Tensor) -> None:
    """The means fit the model, and every class used in `position_class` has a reference mean."""
    n_layers, n_heads = n_layers_heads(model)
    if means.means.shape[1:3] != (n_layers, n_heads):
        raise ValueError(
            f"means are for {tuple(means.means.shape[1:3])} layers x heads, model has {(n_layers, n_heads)}"
        )
    used = position_class[position_class >= 0].unique()
    if len(used) and int(used.max()) >= len(means.class_names):
        raise IndexError(f"position class {int(used.max())} has no reference mean")
    for index in used.tolist():
        means.class_index(
            means.class_names[index]
        )  # raises if that class had no reference positions


def _mean_replacement(
    layer_means: Tensor, heads: Tensor, position_class: Tensor, n_heads: int, what: str
) -> HookFn:
    """A hook_z function writing `layer_means` [cls, head, d_head] (class of each position) into
    the heads `heads` selects: a [head] mask for every row, or a [batch, head] mask per row."""
    rows_heads = heads if heads.ndim == 2 else heads[None]

    def ablate(act: Tensor, hook) -> Tensor:
        _check_z(act, n_heads, tuple(position_class.shape), what)
        replacement = layer_means.to(act.dtype)[
            position_class.clamp(min=0)
        ]  # [batch, pos, head, d_head]
        where = (position_class >= 0)[:, :, None, None] & rows_heads[:, None, :, None]
        return torch.where(where, replacement, act)

    return ablate


def _mean_ablation_pairs(
    model: HookedModel, heads: list[Head], means: HeadMeans, position_class: Tensor
) -> list[HookPair]:
    _check_means(model, means, position_class)
    n_heads = n_layers_heads(model)[1]
    mask = head_mask(model, heads)
    return [
        (
            z_hook_name(layer),
            _mean_replacement(
                means.means[:, layer], mask[layer], position_class, n_heads, "mean ablation"
            ),
        )
        for layer in sorted({layer for layer, _ in heads})
    ]


def mean_ablation_hooks(
    model: HookedModel,
    heads: Iterable[Head],
    means: HeadMeans,
    position_class: Int[Tensor, "batch pos"],
) -> list[HookPair]:
    """Replace the heads' hook_z with the exact reference mean of each position's class.

    `position_class[b, p]` indexes `means.class_names` (-1: leave that position alone).
    """
    return _mean_ablation_pairs(model, validate_heads(model, heads), means, position_class)


def row_head_ablation_hooks(
    model: HookedModel,
    layer: int,
    row_heads: Int[Tensor, "batch"],
    means: HeadMeans,
    position_class: Int[Tensor, "batch pos"],
) -> list[HookPair]:
    """Mean-ablate head `row_heads[b]` of `layer` in row b (at its classed positions): many
    single-head ablations in one pass, one per row (a sweep over a layer's heads)."""
    n_heads = n_layers_heads(model)[1]
    validate_heads(model, [(layer, int(h)) for h in row_heads.unique()])
    if row_heads.shape[0] != position_class.shape[0]:
        raise ValueError(
            f"{row_heads.shape[0]} row heads for a batch of {position_class.shape[0]} rows"
        )
    _check_means(model, means, position_class)
    heads = torch.nn.functional.one_hot(row_heads, n_heads).bool()  # [batch, head]
    return [
        (
            z_hook_name(layer),
            _mean_replacement(
                means.means[:, layer], heads, position_class, n_heads, "row head ablation"
            ),
        )
    ]


def row_set_ablation_hooks(
    model: HookedModel,
    masks: Bool[Tensor, "batch layer head"],
    means: HeadMeans,
    position_class: Int[Tensor, "batch pos"],
) -> list[HookPair]:
    """Mean-ablate head set `masks[b]` in row b (at its classed positions): many joint ablations
    of different head sets in one pass, one set per row (a circuit search's candidates)."""
    n_layers, n_heads = n_layers_heads(model)
    if masks.shape[1:] != (n_layers, n_heads) or masks.shape[0] != position_class.shape[0]:
        raise ValueError(
            f"row masks of shape {tuple(masks.shape)} for a batch of {position_class.shape[0]} "
            f"rows on a model of {n_layers} layers x {n_heads} heads"
        )
    _check_means(model, means, position_class)
    return [
        (
            z_hook_name(layer),
            _mean_replacement(
                means.means[:, layer], masks[:, layer], position_class, n_heads, "row set ablation"
            ),
        )
        for layer in range(n_layers)
        if masks[:, layer].any()
    ]


def gated_ablation_hooks(
    model: HookedModel,
    gates: Float[Tensor, "layer head"],
    means: HeadMeans,
    position_class: Int[Tensor, "batch pos"],
) -> list[HookPair]:
    """Partial mean-ablation: at the classed positions each head's hook_z becomes
    ``z + gate * (mean - z)``, so gate 0 leaves the head as it is and gate 1 mean-ablates it
    (:func:`mean_ablation_hooks`). Differentiable in `gates`: a learned mask optimises them."""
    n_layers, n_heads = n_layers_heads(model)
    if gates.shape != (n_layers, n_heads):
        raise ValueError(
            f"gates of shape {tuple(gates.shape)} on a model of {n_layers} layers x {n_heads} heads"
        )
    _check_means(model, means, position_class)

    def blend(layer: int) -> HookFn:
        def hook(act: Tensor, hook) -> Tensor:
            _check_z(act, n_heads, tuple(position_class.shape), "gated ablation")
            mean = means.means[:, layer].to(act.dtype)[position_class.clamp(min=0)]
            at_event = (position_class >= 0)[:, :, None, None].to(act.dtype)
            gate = gates[layer].to(act.dtype)[None, None, :, None]
            return act + at_event * gate * (mean - act)

        return hook

    return [(z_hook_name(layer), blend(layer)) for layer in range(n_layers)]


def ablate_all_but_hooks(
    model: HookedModel,
    keep: Iterable[Head],
    means: HeadMeans,
    position_class: Int[Tensor, "batch pos"],
) -> list[HookPair]:
    """Mean-ablate every head except `keep` (sufficiency). Keeping every head gives no hooks;
    keeping none ablates every head (the model's margin with no head's own contribution)."""
    kept = set(validate_heads(model, keep, allow_empty=True))
    others = [h for h in all_heads(model) if h not in kept]
    return _mean_ablation_pairs(model, others, means, position_class) if others else []


# --- knock-in --------------------------------------------------------------------------------


def knock_in_hooks(
    model: HookedModel,
    heads: Iterable[Head],
    source_values: Float[Tensor, "layer batch head d_head"],
    target_positions: Int[Tensor, "batch"],
) -> list[HookPair]:
    """Write the heads' activations from a source run into row b of this run at `target_positions[b]`.

    `source_values[:, b]` holds the source example's hook_z at *its* aligned event position (see
    `gather_at_positions`): alignment is by event, since the two contexts differ in length.
    """
    heads = validate_heads(model, heads)
    n_layers, n_heads = n_layers_heads(model)
    if source_values.shape[0] != n_layers or source_values.shape[2] != n_heads:
        raise ValueError(
            f"source values {tuple(source_values.shape)} are not [layer={n_layers}, batch, head={n_heads}, d_head]"
        )
    if source_values.shape[1] != target_positions.shape[0]:
        raise ValueError("one source activation per target row is needed")
    if len(target_positions) and int(target_positions.min()) < 0:
        raise IndexError(
            f"knock-in target positions {target_positions.tolist()} include negative positions; "
            "give positions counted from the start of the context"
        )
    mask = head_mask(model, heads)
    rows = torch.arange(target_positions.shape[0])
    pairs = []
    for layer in sorted({layer for layer, _ in heads}):

        def knock_in(act: Tensor, hook, layer=layer) -> Tensor:
            _check_z(act, n_heads, None, "knock-in")
            if act.shape[0] != len(rows) or int(target_positions.max()) >= act.shape[1]:
                raise IndexError(
                    f"knock-in targets {target_positions.tolist()} outside activations {tuple(act.shape[:2])}"
                )
            current = act[rows, target_positions]  # [batch, head, d_head]
            written = torch.where(
                mask[layer][None, :, None], source_values[layer].to(act.dtype), current
            )
            patched = act.clone()
            patched[rows, target_positions] = written
            return patched

        pairs.append((z_hook_name(layer), knock_in))
    return pairs


def gather_at_positions(
    z: Float[Tensor, "layer batch pos head d_head"],
    rows: Int[Tensor, "n"],
    positions: Int[Tensor, "n"],
) -> Float[Tensor, "layer n head d_head"]:
    """hook_z of source row `rows[i]` at `positions[i]`, ready for `knock_in_hooks`."""
    if len(positions) and (int(positions.max()) >= z.shape[2] or int(positions.min()) < 0):
        raise IndexError(
            f"source positions {positions.tolist()} outside a context of length {z.shape[2]} "
            f"(valid: 0..{z.shape[2] - 1}; negative positions are not counted from the end)"
        )
    return z[:, rows, positions]


# --- attribution -----------------------------------------------------------------------------


@dataclass
class AttributionStore:
    """Filled by `attribution_hooks` during a forward pass: activations and zero leaves per layer."""

    activations: dict[int, Tensor] = field(default_factory=dict)
    leaves: dict[int, Tensor] = field(default_factory=dict)


def attribution_hooks(model: HookedModel, store: AttributionStore) -> list[HookPair]:
    """Add a zero leaf to every layer's hook_z; d(output)/d(leaf) is then d(output)/d(hook_z).

    Why a zero leaf: it puts every head of every layer into one backward pass without requiring
    gradients on the weights or detaching anything upstream.
    """
    pairs = []
    for layer in range(model.cfg.n_layers):

        def add_leaf(act: Tensor, hook, layer=layer) -> Tensor:
            leaf = torch.zeros_like(act, requires_grad=True)
            store.activations[layer] = act.detach()
            store.leaves[layer] = leaf
            return act + leaf

        pairs.append((z_hook_name(layer), add_leaf))
    return pairs
