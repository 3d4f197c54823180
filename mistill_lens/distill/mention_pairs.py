"""MISTILL vs CoT within a seed, mention by mention: both arms of a seed decode the same held-out
prompts, so each mention is answered by both, and the difference in region and near-miss accuracy
can be tested on the mentions instead of on a handful of seeds.

Mentions of one example are not independent (a generation that derails loses all of them), so
the unit of the test is the example: the difference of its correct mentions between the arms,
sign-flipped per example (a paired permutation test clustered by example). Pooled over seeds,
each (seed, example) is one unit: different runs, so independent given the prompts."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mistill_lens.distill.significance import sign_flip_p_value

OUTCOMES = ("near_miss", "region")
ALL_SEEDS = "all"


def _per_example(per_mention: list[dict], outcome: str) -> pd.Series:
    """Correct mentions per example, indexed by (example, mention) order checked by the caller."""
    frame = pd.DataFrame(per_mention)
    return frame.groupby("example")[outcome].sum()


def _keys(per_mention: list[dict]) -> list[tuple[int, int]]:
    return [(int(m["example"]), int(m["mention"])) for m in per_mention]


def _seed_pairs(runs: pd.DataFrame) -> list[tuple[object, list[dict], list[dict]]]:
    """(seed, CoT mentions, MISTILL mentions) for each seed where both arms recorded theirs on the
    same prompts; a seed whose arms were decoded on different prompts is refused."""
    pairs = []
    for seed, records in runs.groupby("seed", sort=True):
        arms = {}
        for _, row in records.iterrows():
            mentions = row.get("per_mention")
            if isinstance(mentions, list) and mentions:
                arms[row["objective"]] = row
        if not {"cot", "mistill"} <= set(arms):
            continue
        cot, mistill = arms["cot"], arms["mistill"]
        same = (
            _keys(cot.per_mention) == _keys(mistill.per_mention)
            and cot.get("n_eval") == mistill.get("n_eval")
            and cot.get("eval_seed") == mistill.get("eval_seed")
        )
        if not same:
            raise ValueError(
                f"the CoT and MISTILL runs of seed {seed} ({cot['run']}, {mistill['run']}) were "
                "scored on different held-out prompts (n_eval, eval_seed or mentions differ): "
                "evaluate both with the same --n and --seed"
            )
        pairs.append((seed, cot.per_mention, mistill.per_mention))
    return pairs


def _row(family, precision, seed, outcome, cot, mistill, differences) -> dict:
    n_mentions = int(sum(len(c) for c in cot))
    cot_correct = int(sum(sum(m[outcome] for m in c) for c in cot))
    mistill_correct = int(sum(sum(m[outcome] for m in c) for c in mistill))
    return {
        "family": family,
        "precision": precision,
        "seed": seed,
        "outcome": outcome,
        "n_examples": len(differences),
        "n_mentions": n_mentions,
        "cot_acc": cot_correct / n_mentions,
        "mistill_acc": mistill_correct / n_mentions,
        "difference": (mistill_correct - cot_correct) / n_mentions,
        "mistill_only": int(
            sum(
                m[outcome] and not c[outcome]
                for cc, mm in zip(cot, mistill)
                for c, m in zip(cc, mm)
            )
        ),
        "cot_only": int(
            sum(
                c[outcome] and not m[outcome]
                for cc, mm in zip(cot, mistill)
                for c, m in zip(cc, mm)
            )
        ),
        "p_value": sign_flip_p_value(differences) if np.any(differences) else 1.0,
    }


def mention_comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """Per family x precision x outcome (near-miss, region): per seed whose both arms recorded
    their mentions, and pooled over those seeds (seed ``"all"``), the two arms' accuracy on the
    same mentions, the mentions only one arm got right, and the two-sided p-value of a sign-flip
    test over examples. Empty where no run recorded its mentions."""
    if "per_mention" not in frame:
        return pd.DataFrame()
    rows = []
    for (family, precision), runs in frame.groupby(["family", "precision"], sort=True):
        pairs = _seed_pairs(runs)
        for outcome in OUTCOMES:
            pooled_cot, pooled_mistill, pooled_differences = [], [], []
            for seed, cot, mistill in pairs:
                differences = (_per_example(mistill, outcome) - _per_example(cot, outcome)).tolist()
                rows.append(_row(family, precision, seed, outcome, [cot], [mistill], differences))
                pooled_cot.append(cot)
                pooled_mistill.append(mistill)
                pooled_differences += differences
            if len(pairs) > 1:
                rows.append(
                    _row(
                        family,
                        precision,
                        ALL_SEEDS,
                        outcome,
                        pooled_cot,
                        pooled_mistill,
                        pooled_differences,
                    )
                )
    return pd.DataFrame(rows)
