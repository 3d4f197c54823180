"""The paired sign-flip permutation test: the p-value of a mean paired difference of 0, used over
seeds (MISTILL vs CoT, `report`) and over examples (mention by mention, `mention_pairs`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

EXACT_PAIRS_MAX = 16  # up to 2^16 sign patterns enumerated; beyond, a seeded Monte Carlo sample
MONTE_CARLO_FLIPS = 100_000


def sign_flip_p_value(differences: Sequence[float], seed: int = 0) -> float:
    """Two-sided p-value of a paired sign-flip permutation test of mean difference 0: the share of
    sign patterns whose |sum| is at least the observed one (exact for few pairs)."""
    d = np.asarray(differences, dtype=float)
    if d.size == 0 or np.isnan(d).any():
        raise ValueError(
            f"paired differences must be a non-empty list of numbers, got {list(differences)}"
        )
    if d.size <= EXACT_PAIRS_MAX:
        signs = 1 - 2 * ((np.arange(2**d.size)[:, None] >> np.arange(d.size)) & 1)
    else:
        signs = np.random.default_rng(seed).choice([-1, 1], size=(MONTE_CARLO_FLIPS, d.size))
    return float(np.mean(np.abs(signs @ d) >= abs(d.sum()) - 1e-12))
