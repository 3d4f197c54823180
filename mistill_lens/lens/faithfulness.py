"""Circuits found by what they do: head *sets* judged by their joint effect on the margin.

A decision is often carried by several heads that add up or back each other up, none of which
passes a per-head test (``circuits.select_heads``: calibrated z per head). Here a set is judged as a
set, by exact mean-ablation:

* **necessity** of a set C: the share of the clean margin its joint ablation removes,
  ``(mean m(M) - mean m(M \\ C)) / mean m(M)``; grown greedily by forward addition (each step adds
  the pool head whose addition removes the most);
* **sufficiency** of a set C: what is left with every head outside C ablated, normalised by the
  all-ablated baseline as faithfulness measures in the field are (MIB's circuit localisation
  track), ``(mean m(C) - mean m(empty)) / (mean m(M) - mean m(empty))``; found by backward pruning
  from the pool (each step removes the head whose removal keeps the most), since from an empty set
  the first additions carry no signal.

:func:`ranking_curve` measures the top-n sets of any ranking of the heads (a learned mask's, the
single-head effects') with the same measures, so methods are compared on the same curves.

Both are ratios of mean margins over the events, not means of per-event ratios, which explode
where a denominator is near zero. Candidates are restricted to a pool (e.g. the heads with the
largest single-head effects), whose size is part of the result; each step evaluates all its
candidate sets in one batched call on the model's backend (on the engine, every (set, event) pair
is a single-position recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from mistill_lens.lens.backends import backend_for
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.hooks import (
    Head,
    HeadMeans,
    as_head,
    head_mask,
    n_layers_heads,
    validate_heads,
)
from mistill_lens.lens.model_types import HookedModel
from mistill_lens.lens.search_log import SearchLog, in_memory

BAND_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # set sizes of the random baseline band
MEASURES = ("necessity", "sufficiency")


@dataclass(frozen=True)
class FaithfulnessCurve:
    """A search's path. ``sets[i]`` is the head set after step i and ``values[i]`` its measure:
    for the greedy search, growing sets for necessity (the empty set first) and shrinking sets for
    sufficiency (the whole pool first); for a ranking (:func:`ranking_curve`), its top-n sets."""

    measure: str  # "necessity" | "sufficiency"
    sets: tuple[tuple[Head, ...], ...]
    values: tuple[float, ...]
    pool_size: int
    n_events: int
    method: str = "greedy"  # what chose the sets: the greedy search, or a ranking's name

    def smallest(self, target: float) -> tuple[Head, ...] | None:
        """The smallest set on the path whose measure reaches `target` (None: none does)."""
        reaching = [s for s, v in zip(self.sets, self.values) if v >= target]
        return min(reaching, key=len) if reaching else None

    def to_rows(self) -> list[dict]:
        return [
            {
                "method": self.method,
                "measure": self.measure,
                "size": len(heads),
                "value": value,
                "heads": " ".join(f"L{l}H{h}" for l, h in heads),
            }
            for heads, value in zip(self.sets, self.values)
        ]


def mean_set_margins(
    model, batch: EventBatch, means: HeadMeans, sets: Sequence[Sequence[Head]], keep: bool
) -> list[float]:
    """Mean margin over the events with each head set jointly mean-ablated (`keep`: every head
    *but* the set ablated), all sets in one batched call on the model's backend."""
    masks = torch.stack([head_mask(model, heads) for heads in sets])
    if keep:
        masks = ~masks
    return backend_for(model).set_margins(batch, means, masks).mean(dim=1).tolist()


def mean_clean_margin(model, batch: EventBatch, means: HeadMeans) -> float:
    """The mean clean margin, refusing a batch on which a share of it means nothing."""
    if len(batch) == 0:
        raise ValueError("no events to search a circuit on: give at least one decided event")
    (clean,) = mean_set_margins(model, batch, means, [[]], keep=False)
    return positive_clean(clean, len(batch))


def positive_clean(clean: float, n_events: int) -> float:
    if clean <= 0:
        raise ValueError(
            f"the mean clean margin of these {n_events} events is {clean:.3g}: a share of it "
            "means nothing; search on events the model decides its way (decided_rows)"
        )
    return clean


def check_baseline_gap(clean: float, empty: float) -> None:
    """Refuse events on which ablating every head leaves the mean margin where it was: a share of
    the gap between the two (normalised sufficiency) means nothing there."""
    if abs(clean - empty) < 1e-6 * max(abs(clean), 1.0):
        raise ValueError(
            "ablating every head leaves the mean margin where it was: sufficiency (normalised by "
            "that baseline) is undefined for these events"
        )


def necessity_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    pool: Sequence[Head],
    max_size: int | None = None,
    progress: bool = False,
    log: SearchLog | None = None,
    key: str = "necessity",
) -> FaithfulnessCurve:
    """Greedy forward addition over `pool` (up to `max_size` heads): at each step the head whose
    joint ablation with those already chosen removes the largest share of the mean clean margin.
    Steps already in `log` under `key` are replayed, not recomputed; new ones are recorded."""
    pool = validate_heads(model, pool)
    clean = mean_clean_margin(model, batch, means)
    log = log or in_memory()
    chosen: list[Head] = []
    sets, values = [()], [0.0]
    steps = len(pool) if max_size is None else min(max_size, len(pool))
    done = log.steps(key)
    for step in tqdm(range(steps), desc="necessity search", disable=not progress):
        if step < len(done):
            head, value = as_head(done[step]["head"]), done[step]["value"]
        else:
            candidates = [c for c in pool if c not in chosen]
            sets_tried = [[*chosen, c] for c in candidates]
            left = mean_set_margins(model, batch, means, sets_tried, keep=False)
            best = min(range(len(candidates)), key=left.__getitem__)
            head, value = candidates[best], (clean - left[best]) / clean
            log.record(key, {"head": list(head), "value": value})
        chosen.append(head)
        sets.append(tuple(chosen))
        values.append(value)
    return FaithfulnessCurve("necessity", tuple(sets), tuple(values), len(pool), len(batch))


def sufficiency_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    pool: Sequence[Head],
    min_size: int = 1,
    progress: bool = False,
    log: SearchLog | None = None,
    key: str = "sufficiency",
) -> FaithfulnessCurve:
    """Greedy backward pruning from `pool` (every head outside it ablated throughout) down to
    `min_size` heads: at each step the head whose removal keeps the most of the margin.
    Values are normalised: 1 = the whole model's mean margin, 0 = every head ablated.
    Steps already in `log` under `key` are replayed, not recomputed; new ones are recorded."""
    pool = validate_heads(model, pool)
    log = log or in_memory()
    clean = mean_clean_margin(model, batch, means)
    empty, whole = mean_set_margins(model, batch, means, [[], list(pool)], keep=True)
    check_baseline_gap(clean, empty)

    def normalised(margin: float) -> float:
        return (margin - empty) / (clean - empty)

    kept = list(pool)
    sets, values = [tuple(kept)], [normalised(whole)]
    steps = max(len(pool) - min_size, 0)
    done = log.steps(key)
    for step in tqdm(range(steps), desc="sufficiency search", disable=not progress):
        if step < len(done):
            head, value = as_head(done[step]["head"]), done[step]["value"]
        else:
            sets_tried = [[h for h in kept if h != c] for c in kept]
            without = mean_set_margins(model, batch, means, sets_tried, keep=True)
            drop = max(range(len(kept)), key=without.__getitem__)
            head, value = kept[drop], normalised(without[drop])
            log.record(key, {"head": list(head), "value": value})
        kept.remove(head)
        sets.append(tuple(kept))
        values.append(value)
    return FaithfulnessCurve("sufficiency", tuple(sets), tuple(values), len(pool), len(batch))


def random_head_sets(
    n_layers: int, n_heads: int, sizes: Sequence[int], draws: int, seed: int
) -> list[tuple[Head, ...]]:
    """`draws` head sets of each size in `sizes`, drawn uniformly without replacement among all
    heads (seeded), size-major."""
    generator = torch.Generator().manual_seed(seed)
    total = n_layers * n_heads
    return [
        tuple(
            sorted(
                (int(i) // n_heads, int(i) % n_heads)
                for i in torch.randperm(total, generator=generator)[:size]
            )
        )
        for size in sizes
        for _ in range(draws)
    ]


def random_band(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    sizes: Sequence[int],
    draws: int = 20,
    seed: int = 0,
    clean_and_none: tuple[float, float] | None = None,
) -> list[dict]:
    """The baseline a found set must beat: necessity and normalised sufficiency (as the greedy
    curves measure them) of `draws` random head sets of each size, all in one batched call per
    measure. One row per (measure, set): ``measure``, ``size``, ``draw``, ``value``, ``heads``.
    `clean_and_none`: the events' mean clean margin and mean margin with every head ablated, when
    the caller has them already (else measured here)."""
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    n_layers, n_heads = n_layers_heads(model)
    sizes = sorted({size for size in sizes if 1 <= size <= n_layers * n_heads})
    if not sizes:
        raise ValueError(f"no set size in 1..{n_layers * n_heads} among {list(sizes)}")
    sets = random_head_sets(n_layers, n_heads, sizes, draws, seed)
    if clean_and_none is None:
        clean = mean_clean_margin(model, batch, means)
        empty, *kept = mean_set_margins(model, batch, means, [(), *sets], keep=True)
    else:
        clean, empty = positive_clean(clean_and_none[0], len(batch)), clean_and_none[1]
        kept = mean_set_margins(model, batch, means, sets, keep=True)
    ablated = mean_set_margins(model, batch, means, sets, keep=False)
    rows = []
    for index, (heads, left, alone) in enumerate(zip(sets, ablated, kept)):
        for measure, value in (
            ("necessity", (clean - left) / clean),
            ("sufficiency", (alone - empty) / (clean - empty)),
        ):
            rows.append(
                {
                    "measure": measure,
                    "size": len(heads),
                    "draw": index % draws,
                    "value": value,
                    "heads": " ".join(f"L{l}H{h}" for l, h in heads),
                }
            )
    return rows


def band_summary(rows: Sequence[dict]) -> list[dict]:
    """Per measure and size of :func:`random_band`'s rows: the mean and the central 95 % of the
    draws (2.5th and 97.5th percentiles)."""
    groups: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        groups.setdefault((row["measure"], row["size"]), []).append(row["value"])
    return [
        {
            "measure": measure,
            "size": size,
            "draws": len(values),
            "mean": float(np.mean(values)),
            "low": float(np.percentile(values, 2.5)),
            "high": float(np.percentile(values, 97.5)),
        }
        for (measure, size), values in sorted(groups.items())
    ]


def beyond_chance(found: float, random_values: Sequence[float]) -> float:
    """One-sided permutation-style p of a found set's measure against random sets of its size:
    (1 + #random at least as high) / (1 + #random)."""
    return (1 + sum(v >= found for v in random_values)) / (1 + len(random_values))


def effect_pool(effects: Float[Tensor, "event layer head"], size: int) -> list[Head]:
    """The `size` heads with the largest mean single-head effect (an exact sweep's, or
    attribution's): the search's candidates."""
    mean = effects.nan_to_num(0.0).mean(dim=0)
    order = mean.flatten().argsort(descending=True)[:size]
    n_heads = mean.shape[1]
    return sorted((int(i) // n_heads, int(i) % n_heads) for i in order)


def ranked_heads(
    scores: Float[Tensor, "layer head"], pool: Sequence[Head] | None = None
) -> list[Head]:
    """Heads by descending score (ties in head order), among `pool` when given."""
    n_heads = scores.shape[1]
    order = scores.flatten().argsort(stable=True, descending=True)
    heads = [(int(i) // n_heads, int(i) % n_heads) for i in order]
    if pool is None:
        return heads
    candidates = set(pool)
    return [h for h in heads if h in candidates]


def ranking_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    ranking: Sequence[Head],
    measure: str,
    max_size: int = 32,
    method: str = "ranking",
) -> FaithfulnessCurve:
    """The exact `measure` of the top-n heads of `ranking` for n = 0 (necessity) or 1
    (sufficiency) up to `max_size`, every set in one batched call: a mask's (or any ranking's)
    curve, comparable point for point with the greedy search's."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; expected one of {MEASURES}")
    ranking = [as_head(h) for h in ranking]
    if len(set(ranking)) != len(ranking):
        raise ValueError(f"a ranking names each head once; {ranking} repeats some")
    validate_heads(model, ranking)  # in range (it returns them sorted: the order is ours)
    backend = backend_for(model)
    clean = mean_clean_margin(backend, batch, means)
    first = 0 if measure == "necessity" else 1
    sets = [tuple(ranking[:n]) for n in range(first, min(max_size, len(ranking)) + 1)]
    if measure == "necessity":
        left = mean_set_margins(backend, batch, means, sets, keep=False)
        values = [(clean - m) / clean for m in left]
    else:
        empty, *kept = mean_set_margins(backend, batch, means, [(), *sets], keep=True)
        values = [(m - empty) / (clean - empty) for m in kept]
    return FaithfulnessCurve(measure, tuple(sets), tuple(values), len(ranking), len(batch), method)
