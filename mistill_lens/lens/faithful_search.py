"""The faithful circuit of a set of events: found on one half of the examples, reported on the
other.

:func:`faithful_circuit` runs a search method on the discovery events (the greedy searches of
:mod:`mistill_lens.lens.faithfulness`, the learned mask of :mod:`mistill_lens.lens.learned_mask`, or
a ranking by single-head effect), takes the smallest set reaching the target in necessity and in
normalised sufficiency, and measures it on the disjoint validation events with bootstrap intervals
over examples, against random head sets of its size; :func:`selection_frequencies` reruns the
search on bootstrap resamples of the discovery examples to say how stable the choice is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from mistill_lens.lens.backends import backend_for
from mistill_lens.lens.events import EventBatch
from mistill_lens.lens.faithfulness import (
    BAND_SIZES,
    MEASURES,
    FaithfulnessCurve,
    band_summary,
    beyond_chance,
    effect_pool,
    necessity_curve,
    random_band,
    ranked_heads,
    ranking_curve,
    sufficiency_curve,
)
from mistill_lens.lens.hooks import Head, HeadMeans, as_head, head_mask, validate_heads
from mistill_lens.lens.learned_mask import learn_mask
from mistill_lens.lens.model_types import HookedModel
from mistill_lens.lens.search_log import SearchLog, in_memory

BOOTSTRAP = 1000  # resamples of the validation examples per confidence interval
COVERAGE_FLOOR = 0.8  # an example is covered when the set removes at least this share of its margin
MIN_RESAMPLES = 10  # fewer bootstrap resamples make a selection frequency a recorded warning
METHODS = ("greedy", "mask", "single")


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


@dataclass(frozen=True)
class Search:
    """How a circuit is searched among a pool of candidate heads: `method` is ``greedy`` (forward
    addition for necessity, backward pruning for sufficiency: :mod:`~mistill_lens.lens.faithfulness`),
    ``mask`` (a learned mask per measure, `mask_steps` steps: :mod:`~mistill_lens.lens.learned_mask`)
    or ``single`` (heads ranked by their mean single-head effect); sets grow up to `max_size`
    heads, and the found set is the union of the smallest sets reaching `target` in necessity and
    normalised sufficiency (the largest explored set of a measure that does not reach it)."""

    method: str = "greedy"
    max_size: int = 32
    target: float = 0.8
    mask_steps: int = 100

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown search method {self.method!r}; expected one of {METHODS}")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be a share of the margin in (0, 1], got {self.target}")
        for name in ("max_size", "mask_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def curves(
        self,
        model: HookedModel,
        batch: EventBatch,
        means: HeadMeans,
        effects: Float[Tensor, "event layer head"],
        pool: Sequence[Head],
        log: SearchLog | None = None,
        key: str = "",
    ) -> tuple[FaithfulnessCurve, FaithfulnessCurve]:
        """The necessity and sufficiency curves of this method on `batch`, over `pool`. With
        `log`, the greedy steps and the learned masks' rankings are kept under keys that start
        with `key`, and those already there are reused."""
        log = log or in_memory()
        where = f"{key}/{self.method}"
        if self.method == "greedy":
            return (
                necessity_curve(
                    model, batch, means, pool, self.max_size, log=log, key=f"{where}/necessity"
                ),
                sufficiency_curve(model, batch, means, pool, log=log, key=f"{where}/sufficiency"),
            )
        if self.method == "single":
            ranking = ranked_heads(effects.nan_to_num(0.0).mean(dim=0), pool)
            rankings = dict.fromkeys(MEASURES, ranking)
        else:
            rankings = {
                measure: self._mask_ranking(model, batch, means, pool, measure, log, where)
                for measure in MEASURES
            }
        necessity, sufficiency = (
            ranking_curve(model, batch, means, rankings[m], m, self.max_size, self.method)
            for m in MEASURES
        )
        return necessity, sufficiency

    def _mask_ranking(
        self, model, batch, means, pool, measure: str, log: SearchLog, where: str
    ) -> list[Head]:
        """The pool ranked by a learned mask's gates for `measure` (kept in `log` under `where`
        once learned: learning it is the method's cost)."""
        key = f"{where}/{measure}"
        stored = log.result(key)
        if stored is None:
            stored = ranked_heads(learn_mask(model, batch, means, measure, self.mask_steps), pool)
            log.finish(key, [list(h) for h in stored])
        return [as_head(h) for h in stored]

    def found(self, curves: Sequence[FaithfulnessCurve]) -> list[Head]:
        """The union of the curves' smallest sets reaching the target."""
        heads: set[Head] = set()
        for curve in curves:
            heads |= set(curve.smallest(self.target) or max(curve.sets, key=len))
        return sorted(heads)


def resample_rows(batch: EventBatch, generator: np.random.Generator) -> np.ndarray:
    """The rows of a bootstrap resample of `batch`: as many whole examples as it holds, drawn with
    replacement (an example drawn twice contributes its events twice; events of one example are
    not independent, so they are never drawn apart)."""
    ids = np.asarray([e.example_id for e in batch.events])
    unique = np.unique(ids)
    drawn = generator.choice(unique, len(unique))
    return np.concatenate([np.flatnonzero(ids == e) for e in drawn])


def selection_frequencies(
    model: HookedModel,
    discovery: EventBatch,
    means: HeadMeans,
    effects: Float[Tensor, "event layer head"],
    pool: Sequence[Head],
    search: Search = Search(),
    resamples: int = 10,
    seed: int = 0,
    progress: bool = False,
    log: SearchLog | None = None,
    key: str = "stability",
) -> dict:
    """How stable the found set is: `search` rerun on `resamples` bootstrap resamples of the
    discovery examples (their events and `effects` rows; the `pool` fixed), and how often each
    pool head is in the set found. ``frequency`` maps every pool head ("L{l}H{h}") to its share
    of the resamples, most often chosen first; ``sizes`` lists the found sets' sizes; ``failed``
    counts resamples on which the search was undefined (a non-positive mean clean margin), left
    out of the shares. With `log`, each resample's outcome is kept under `key` and reused."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    pool = validate_heads(model, pool)
    log = log or in_memory()
    generator = np.random.default_rng(seed)
    counts: Counter = Counter()
    sizes, failed = [], 0
    done = log.steps(key)
    for i in tqdm(range(resamples), desc="selection stability", disable=not progress):
        rows = resample_rows(discovery, generator)  # drawn every time: the stream stays the same
        if i < len(done):
            outcome = done[i]["heads"]
        else:
            outcome = _resample_outcome(
                model, discovery.select(rows), means, effects[rows], pool, search
            )
            log.record(key, {"heads": outcome})
        if outcome is None:  # this resample's margin is not positive: no share of it means anything
            failed += 1
            continue
        heads = [as_head(h) for h in outcome]
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


def _resample_outcome(model, batch, means, effects, pool, search: Search) -> list | None:
    """The set `search` finds on one resample, or None where it is undefined there."""
    try:
        return [list(h) for h in search.found(search.curves(model, batch, means, effects, pool))]
    except ValueError:
        return None


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


def _validated(
    model,
    validation: EventBatch,
    means: HeadMeans,
    sets: dict,
    clean_and_none: tuple[np.ndarray, np.ndarray],
    seed: int,
) -> dict:
    """Each method's found set with its measures on the validation events
    (:func:`validation_measures`; one batched call for every set). `clean_and_none`: the
    validation events' clean and all-ablated margins, already measured by the caller."""
    clean, none = clean_and_none
    masks = [head_mask(model, heads) for heads in sets.values()]
    margins = (
        backend_for(model)
        .set_margins(validation, means, torch.stack([*masks, *[~m for m in masks]]))
        .double()
    )
    ids = [e.example_id for e in validation.events]
    return {
        method: {
            "heads": [list(h) for h in heads],
            "size": len(heads),
            **validation_measures(clean, ablated.numpy(), kept.numpy(), none, ids, seed),
        }
        for (method, heads), ablated, kept in zip(
            sets.items(), margins[: len(sets)], margins[len(sets) :]
        )
    }


def validation_measures(
    clean: np.ndarray,
    ablated: np.ndarray,
    kept: np.ndarray,
    none: np.ndarray,
    example_ids: Sequence[int],
    seed: int,
) -> dict:
    """A set's necessity and normalised sufficiency as ratios of mean margins over the events
    (`clean`: no head ablated; `ablated`: the set; `kept`: every head but the set; `none`: every
    head), and its coverage: the share of examples whose margin the set removes at least
    :data:`COVERAGE_FLOOR` of; each with a 95 % bootstrap interval over examples."""
    ids = np.asarray(example_ids)
    necessity, necessity_ci = _ratio_ci(clean - ablated, clean, ids, seed)
    sufficiency, sufficiency_ci = _ratio_ci(kept - none, clean - none, ids, seed)
    per_example = {e: np.flatnonzero(ids == e) for e in dict.fromkeys(ids.tolist())}
    covered = np.array(
        [
            float((clean[rows] - ablated[rows]).sum() / clean[rows].sum() >= COVERAGE_FLOOR)
            for rows in per_example.values()
        ]
    )
    _, coverage_ci = _ratio_ci(covered, np.ones_like(covered), np.arange(len(covered)), seed)
    return {
        "necessity": necessity,
        "necessity_ci": list(necessity_ci),
        "sufficiency": sufficiency,
        "sufficiency_ci": list(sufficiency_ci),
        "coverage": float(covered.mean()),
        "coverage_ci": list(coverage_ci),
    }


def faithful_circuit(
    model: HookedModel,
    discovery: EventBatch,
    validation: EventBatch,
    means: HeadMeans,
    effects: Float[Tensor, "event layer head"],
    pool_size: int = 40,
    search: Search = Search(),
    seed: int = 0,
    random_draws: int = 20,
    stability: int = 0,
    compare: Sequence[str] = (),
    log: SearchLog | None = None,
    key: str = "",
) -> dict:
    """The smallest head set `search` finds on `discovery` events that is necessary and
    sufficient at its target, measured on the disjoint `validation` events with bootstrap CIs
    over examples. `effects` ([discovery event, layer, head], an exact sweep's or attribution's)
    choose the pool. With `random_draws`, random head sets are the baseline: a band at
    :data:`BAND_SIZES` on the discovery events (beside the curves) and, on the validation events,
    sets of the found size (a p-value for each measure). With `stability` > 0, the search is rerun
    on that many bootstrap resamples of the discovery examples (:func:`selection_frequencies`).
    `compare` names other methods run on the same pool and events: their curves join the
    result's and ``methods`` holds every method's set with its validation measures. With `log`
    (a :class:`~mistill_lens.lens.search_log.SearchLog`), the searches' steps are kept under keys
    that start with `key` and an interrupted search resumes from them."""
    shared = {e.example_id for e in discovery.events} & {e.example_id for e in validation.events}
    if shared:
        raise ValueError(
            f"examples {sorted(shared)[:5]} are in both the discovery and the validation events: "
            "a circuit must be reported on examples it was not found on"
        )
    pool = effect_pool(effects, pool_size)
    curves, sets = [], {}
    for method in dict.fromkeys([search.method, *compare]):
        ran = replace(search, method=method).curves(
            model, discovery, means, effects, pool, log=log, key=key
        )
        curves += ran
        sets[method] = replace(search, method=method).found(ran)
    heads = sets[search.method]
    chosen = head_mask(model, heads)
    # no head, the set, every head but the set, every head ablated
    masks = torch.stack([torch.zeros_like(chosen), chosen, ~chosen, torch.ones_like(chosen)])
    margins = backend_for(model).set_margins(validation, means, masks)
    clean, ablated, kept, none = (m.double().numpy() for m in margins)
    ids = [e.example_id for e in validation.events]
    measured = validation_measures(clean, ablated, kept, none, ids, seed)
    random = (
        _random_baselines(
            model,
            discovery,
            validation,
            means,
            heads,
            search.max_size,
            {"necessity": measured["necessity"], "sufficiency": measured["sufficiency"]},
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
            model,
            discovery,
            means,
            effects,
            pool,
            search,
            stability,
            seed + 2,
            log=log,
            key=f"{key}/stability",
        )
    return {
        "heads": [list(h) for h in heads],
        "size": len(heads),
        **measured,
        "n_events": len(validation),
        "n_examples_discovery": len({e.example_id for e in discovery.events}),
        "n_examples_validation": len(set(ids)),
        "pool_size": len(pool),
        "target": search.target,
        "method": search.method,
        "methods": _validated(model, validation, means, sets, (clean, none), seed),
        "curves": [row for curve in curves for row in curve.to_rows()],
        **random,
        **stable,
    }
