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

Both are ratios of mean margins over the events, not means of per-event ratios, which explode
where a denominator is near zero. Candidates are restricted to a pool (e.g. the heads with the
largest single-head effects), whose size is part of the result; each step evaluates all its
candidate sets in one batched call on the model's backend (on the engine, every (set, event) pair
is a single-position recomputation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from mistill_lens.lens.backends import backend_for
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.hooks import Head, HeadMeans, head_mask, n_layers_heads, validate_heads
from mistill_lens.lens.model_types import HookedModel

BOOTSTRAP = 1000  # resamples of the validation examples per confidence interval
BAND_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # set sizes of the random baseline band
COVERAGE_FLOOR = 0.8  # an example is covered when the set removes at least this share of its margin
MIN_RESAMPLES = (
    10  # fewer bootstrap resamples than this make a selection frequency a recorded warning
)


@dataclass(frozen=True)
class FaithfulnessCurve:
    """A greedy search's path. ``sets[i]`` is the head set after step i and ``values[i]`` its
    measure: growing sets for necessity (the empty set first), shrinking sets for sufficiency (the
    whole pool first)."""

    measure: str  # "necessity" | "sufficiency"
    sets: tuple[tuple[Head, ...], ...]
    values: tuple[float, ...]
    pool_size: int
    n_events: int

    def smallest(self, target: float) -> tuple[Head, ...] | None:
        """The smallest set on the path whose measure reaches `target` (None: none does)."""
        reaching = [s for s, v in zip(self.sets, self.values) if v >= target]
        return min(reaching, key=len) if reaching else None

    def to_rows(self) -> list[dict]:
        return [
            {
                "measure": self.measure,
                "size": len(heads),
                "value": value,
                "heads": " ".join(f"L{l}H{h}" for l, h in heads),
            }
            for heads, value in zip(self.sets, self.values)
        ]


def _mean_margins(
    model, batch: EventBatch, means: HeadMeans, sets: Sequence[Sequence[Head]], keep: bool
) -> list[float]:
    """Mean margin over the events with each head set jointly mean-ablated (`keep`: every head
    *but* the set ablated), all sets in one batched call on the model's backend."""
    masks = torch.stack([head_mask(model, heads) for heads in sets])
    if keep:
        masks = ~masks
    return backend_for(model).set_margins(batch, means, masks).mean(dim=1).tolist()


def _clean(model, batch: EventBatch, means: HeadMeans) -> float:
    """The mean clean margin, refusing a batch on which a share of it means nothing."""
    if len(batch) == 0:
        raise ValueError("no events to search a circuit on: give at least one decided event")
    (clean,) = _mean_margins(model, batch, means, [[]], keep=False)
    return _positive(clean, len(batch))


def _positive(clean: float, n_events: int) -> float:
    if clean <= 0:
        raise ValueError(
            f"the mean clean margin of these {n_events} events is {clean:.3g}: a share of it "
            "means nothing; search on events the model decides its way (decided_rows)"
        )
    return clean


def necessity_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    pool: Sequence[Head],
    max_size: int | None = None,
    progress: bool = False,
) -> FaithfulnessCurve:
    """Greedy forward addition over `pool` (up to `max_size` heads): at each step the head whose
    joint ablation with those already chosen removes the largest share of the mean clean margin."""
    pool = validate_heads(model, pool)
    clean = _clean(model, batch, means)
    chosen: list[Head] = []
    sets, values = [()], [0.0]
    steps = len(pool) if max_size is None else min(max_size, len(pool))
    for _ in tqdm(range(steps), desc="necessity search", disable=not progress):
        candidates = [c for c in pool if c not in chosen]
        left = _mean_margins(model, batch, means, [[*chosen, c] for c in candidates], keep=False)
        best = min(range(len(candidates)), key=left.__getitem__)
        chosen.append(candidates[best])
        sets.append(tuple(chosen))
        values.append((clean - left[best]) / clean)
    return FaithfulnessCurve("necessity", tuple(sets), tuple(values), len(pool), len(batch))


def sufficiency_curve(
    model: HookedModel,
    batch: EventBatch,
    means: HeadMeans,
    pool: Sequence[Head],
    min_size: int = 1,
    progress: bool = False,
) -> FaithfulnessCurve:
    """Greedy backward pruning from `pool` (every head outside it ablated throughout) down to
    `min_size` heads: at each step the head whose removal keeps the most of the margin.
    Values are normalised: 1 = the whole model's mean margin, 0 = every head ablated."""
    pool = validate_heads(model, pool)
    clean = _clean(model, batch, means)
    empty, whole = _mean_margins(model, batch, means, [[], list(pool)], keep=True)
    if abs(clean - empty) < 1e-6 * max(abs(clean), 1.0):
        raise ValueError(
            "ablating every head leaves the mean margin where it was: sufficiency (normalised by "
            "that baseline) is undefined for these events"
        )

    def normalised(margin: float) -> float:
        return (margin - empty) / (clean - empty)

    kept = list(pool)
    sets, values = [tuple(kept)], [normalised(whole)]
    steps = max(len(pool) - min_size, 0)
    for _ in tqdm(range(steps), desc="sufficiency search", disable=not progress):
        without = _mean_margins(
            model, batch, means, [[h for h in kept if h != c] for c in kept], keep=True
        )
        drop = max(range(len(kept)), key=without.__getitem__)
        del kept[drop]
        sets.append(tuple(kept))
        values.append(normalised(without[drop]))
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
        clean = _clean(model, batch, means)
        empty, *kept = _mean_margins(model, batch, means, [(), *sets], keep=True)
    else:
        clean, empty = _positive(clean_and_none[0], len(batch)), clean_and_none[1]
        kept = _mean_margins(model, batch, means, sets, keep=True)
    ablated = _mean_margins(model, batch, means, sets, keep=False)
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


def _ratio_ci(
    numerators: np.ndarray, denominators: np.ndarray, example_ids: Sequence[int], seed: int
) -> tuple[float, tuple[float, float]]:
    """sum(numerators) / sum(denominators) over the events, with a 95 % bootstrap interval over
    examples (whole examples resampled: an example's events are not independent)."""
    ids = np.asarray(example_ids)
    unique = np.unique(ids)
    index = {e: np.flatnonzero(ids == e) for e in unique}
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(BOOTSTRAP):
        rows = np.concatenate([index[e] for e in rng.choice(unique, len(unique))])
        denominator = denominators[rows].sum()
        if denominator != 0:
            ratios.append(numerators[rows].sum() / denominator)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(numerators.sum() / denominators.sum()), (float(low), float(high))


def _search(
    model, batch: EventBatch, means: HeadMeans, pool: Sequence[Head], max_size: int, target: float
) -> tuple[FaithfulnessCurve, FaithfulnessCurve, list[Head]]:
    """Both greedy searches over `pool` and the set they find: the union of their smallest sets
    reaching `target` (the whole explored path of a search that does not reach it)."""
    necessity = necessity_curve(model, batch, means, pool, max_size)
    sufficiency = sufficiency_curve(model, batch, means, pool)
    found = set(necessity.smallest(target) or necessity.sets[-1])
    found |= set(sufficiency.smallest(target) or sufficiency.sets[0])
    return necessity, sufficiency, sorted(found)


def resample_examples(batch: EventBatch, generator: np.random.Generator) -> EventBatch:
    """A bootstrap resample of `batch`: as many whole examples as it holds, drawn with replacement
    (an example drawn twice contributes its events twice; events of one example are not
    independent, so they are never drawn apart)."""
    ids = np.asarray([e.example_id for e in batch.events])
    unique = np.unique(ids)
    drawn = generator.choice(unique, len(unique))
    return batch.select(np.concatenate([np.flatnonzero(ids == e) for e in drawn]))


def selection_frequencies(
    model: HookedModel,
    discovery: EventBatch,
    means: HeadMeans,
    pool: Sequence[Head],
    max_size: int = 32,
    target: float = 0.8,
    resamples: int = 10,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """How stable the found set is: the search (both greedy curves over the fixed `pool`) rerun on
    `resamples` bootstrap resamples of the discovery examples, and how often each pool head is in
    the set found. ``frequency`` maps every pool head ("L{l}H{h}") to its share of the resamples,
    most often chosen first; ``sizes`` lists the found sets' sizes; ``failed`` counts resamples on
    which the search was undefined (a non-positive mean clean margin), left out of the shares."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    pool = validate_heads(model, pool)
    generator = np.random.default_rng(seed)
    counts: Counter = Counter()
    sizes, failed = [], 0
    for _ in tqdm(range(resamples), desc="selection stability", disable=not progress):
        sample = resample_examples(discovery, generator)
        try:
            *_, heads = _search(model, sample, means, pool, max_size, target)
        except ValueError:  # this resample's margin is not positive: no share of it means anything
            failed += 1
            continue
        counts.update(heads)
        sizes.append(len(heads))
    done = max(resamples - failed, 1)
    frequency = sorted(((counts[h] / done, h) for h in pool), key=lambda fh: (-fh[0], fh[1]))
    return {
        "resamples": resamples,
        "failed": failed,
        "sizes": sizes,
        "frequency": {f"L{l}H{h}": share for share, (l, h) in frequency},
    }


def _random_baselines(
    model, discovery, validation, means, heads, max_size, found_values, clean_and_none, draws, seed
) -> dict:
    """Random head sets as the baseline of a found set: the band of every :data:`BAND_SIZES` size
    up to the search's on the discovery events, and sets of the found size on the validation
    events, with a one-sided p per measure (`clean_and_none`: the validation events' mean clean
    and all-ablated margins, already measured)."""
    sizes = [size for size in BAND_SIZES if size <= max(max_size, len(heads))]
    band = random_band(model, discovery, means, sizes, draws, seed)
    same = random_band(
        model, validation, means, [len(heads)], draws, seed + 1, clean_and_none=clean_and_none
    )
    return {
        "random_band": band_summary(band),
        "random_same_size": {
            measure: {
                "mean": float(np.mean(values)),
                "p": beyond_chance(found_values[measure], values),
            }
            for measure in found_values
            for values in [[r["value"] for r in same if r["measure"] == measure]]
        }
        | {"draws": draws, "size": len(heads)},
    }


def faithful_circuit(
    model: HookedModel,
    discovery: EventBatch,
    validation: EventBatch,
    means: HeadMeans,
    effects: Float[Tensor, "event layer head"],
    pool_size: int = 40,
    max_size: int = 32,
    target: float = 0.8,
    seed: int = 0,
    random_draws: int = 20,
    stability: int = 0,
) -> dict:
    """The smallest head set found on `discovery` events that is necessary and sufficient at
    `target` (the union of the two searches' smallest sets; the whole explored path when neither
    reaches it), measured on the disjoint `validation` events with bootstrap CIs over examples.
    `effects` ([discovery event, layer, head], an exact sweep's or attribution's) choose the pool.
    With `random_draws`, random head sets are the baseline: a band at :data:`BAND_SIZES` on the
    discovery events (beside the curves) and, on the validation events, sets of the found size
    (a p-value for each measure). With `stability` > 0, the search is rerun on that many bootstrap
    resamples of the discovery examples (:func:`selection_frequencies`, the pool fixed)."""
    shared = {e.example_id for e in discovery.events} & {e.example_id for e in validation.events}
    if shared:
        raise ValueError(
            f"examples {sorted(shared)[:5]} are in both the discovery and the validation events: "
            "a circuit must be reported on examples it was not found on"
        )
    pool = effect_pool(effects, pool_size)
    necessity, sufficiency, heads = _search(model, discovery, means, pool, max_size, target)
    chosen = head_mask(model, heads)
    # no head, the set, every head but the set, every head ablated
    masks = torch.stack([torch.zeros_like(chosen), chosen, ~chosen, torch.ones_like(chosen)])
    margins = backend_for(model).set_margins(validation, means, masks)
    clean, ablated, kept, none = (m.double().numpy() for m in margins)
    ids = [e.example_id for e in validation.events]
    necessity_value, necessity_ci = _ratio_ci(clean - ablated, clean, ids, seed)
    sufficiency_value, sufficiency_ci = _ratio_ci(kept - none, clean - none, ids, seed)
    covered = [
        (clean[rows] - ablated[rows]).sum() / clean[rows].sum() >= COVERAGE_FLOOR
        for rows in (np.flatnonzero(np.asarray(ids) == e) for e in dict.fromkeys(ids))
    ]
    random = (
        _random_baselines(
            model,
            discovery,
            validation,
            means,
            heads,
            max_size,
            {"necessity": necessity_value, "sufficiency": sufficiency_value},
            (float(clean.mean()), float(none.mean())),
            random_draws,
            seed,
        )
        if random_draws
        else {}
    )
    stable = {}
    if stability:
        stable["stability"] = selection_frequencies(
            model, discovery, means, pool, max_size, target, stability, seed + 2
        )
    return {
        "heads": [list(h) for h in heads],
        "size": len(heads),
        "necessity": necessity_value,
        "necessity_ci": list(necessity_ci),
        "sufficiency": sufficiency_value,
        "sufficiency_ci": list(sufficiency_ci),
        "coverage": float(np.mean(covered)),
        "n_events": len(validation),
        "n_examples_discovery": len({e.example_id for e in discovery.events}),
        "n_examples_validation": len(set(ids)),
        "pool_size": len(pool),
        "target": target,
        "curves": necessity.to_rows() + sufficiency.to_rows(),
        **random,
        **stable,
    }
