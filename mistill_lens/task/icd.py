"""The ICD-10-CM label universe: codes, regions and near-misses from `simple-icd-10-cm`.

A *region* is the 3-character ICD-10-CM category (``I21``); a code is its region plus a
within-region suffix (``I21.4`` = ``I21`` + ``.4``). Eligible codes are billable leaves with a
1-2 character suffix whose category has at least two such leaves, so every code has a sibling
(12,536 codes in 1,274 categories in the April 2026 tabular list). Near-misses of a code are its
siblings and the codes named in the excludes notes of the code and of its category.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

import simple_icd_10_cm as cm

from mistill_lens.task_defaults import DEFAULT_UNIVERSE_SIZE  # noqa: F401  (the task's default)

MAX_SUFFIX_LEN = 2

# "(E08.-)", "(P70.2)", "(O24.4-)", "(I22.-)": a code or code prefix inside parentheses.
_EXCLUDES_REF = re.compile(r"\(([A-Z]\d[0-9A-Z](?:\.[0-9A-Z]{0,4})?)-?\)")


def region_of(code: str) -> str:
    return code.split(".")[0]


def suffix_of(code: str) -> str:
    """The within-region part of a code, with its dot: ``I21.4`` -> ``.4``."""
    region, _, rest = code.partition(".")
    if not rest:
        raise ValueError(f"code {code!r} has no within-region part")
    return "." + rest


def _stable_rank(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def eligible_codes_by_region() -> dict[str, tuple[str, ...]]:
    """All eligible codes of the tabular list, grouped by region (category), in list order."""
    by_region: dict[str, list[str]] = defaultdict(list)
    for code in cm.get_all_codes(with_dots=True):
        if "." not in code or not cm.is_leaf(code):
            continue
        if len(code.split(".")[1]) <= MAX_SUFFIX_LEN:
            by_region[region_of(code)].append(code)
    return {r: tuple(codes) for r, codes in by_region.items() if len(codes) >= 2}


def _excludes_prefixes(code: str) -> list[str]:
    """Code prefixes named in the excludes1/excludes2 notes of ``code`` and its category."""
    notes: list[str] = []
    for item in (code, region_of(code)):
        notes += cm.get_excludes1(item) + cm.get_excludes2(item)
    prefixes: list[str] = []
    for note in notes:
        for ref in _EXCLUDES_REF.findall(note):
            ref = ref.rstrip(".")
            if region_of(ref) != region_of(code) and ref not in prefixes:
                prefixes.append(ref)
    return prefixes


@dataclass(frozen=True)
class Universe:
    """A set of whole regions of eligible codes, with descriptions and near-miss relations."""

    codes: tuple[str, ...]
    regions: tuple[str, ...]
    description: dict[str, str] = field(repr=False)
    codes_in_region: dict[str, tuple[str, ...]] = field(repr=False)
    _excludes_cache: dict[str, tuple[str, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __contains__(self, code: str) -> bool:
        return code in self.description

    def __len__(self) -> int:
        return len(self.codes)

    def check_code(self, code: str) -> str:
        if code not in self.description:
            raise KeyError(f"unknown code {code!r}: not in this {len(self)}-code universe")
        return code

    def siblings(self, code: str) -> tuple[str, ...]:
        self.check_code(code)
        return tuple(c for c in self.codes_in_region[region_of(code)] if c != code)

    def excludes_codes(self, code: str) -> tuple[str, ...]:
        """One universe code per excludes-note reference of ``code`` (same suffix if it exists)."""
        self.check_code(code)
        if code not in self._excludes_cache:
            picked: list[str] = []
            for prefix in _excludes_prefixes(code):
                matches = [
                    c
                    for c in self.codes_in_region.get(region_of(prefix), ())
                    if c.startswith(prefix)
                ]
                if not matches:
                    continue
                same_suffix = [c for c in matches if suffix_of(c) == suffix_of(code)]
                choice = (same_suffix or matches)[0]
                if choice not in picked:
                    picked.append(choice)
            self._excludes_cache[code] = tuple(picked)
        return self._excludes_cache[code]

    def near_misses(self, code: str) -> tuple[str, ...]:
        """Siblings first, then excludes-note codes: the close alternatives a coder must reject."""
        return self.siblings(code) + tuple(
            c for c in self.excludes_codes(code) if c not in self.siblings(code)
        )

    def near_miss_relation(self, code: str, near_miss: str) -> str:
        if near_miss in self.siblings(code):
            return "sibling"
        if near_miss in self.excludes_codes(code):
            return "excludes"
        raise ValueError(f"{near_miss!r} is neither a sibling nor an excludes code of {code!r}")


@functools.lru_cache(maxsize=8)
def load_universe(size: int = DEFAULT_UNIVERSE_SIZE) -> Universe:
    """The smallest set of whole regions with at least ``size`` codes, in a fixed hashed order.

    Regions named in the excludes notes of a chosen region are pulled in with it, so that
    excludes near-misses exist inside the universe. Deterministic: no seed is involved.
    """
    by_region = eligible_codes_by_region()
    n_eligible = sum(len(c) for c in by_region.values())
    if not 1 <= size <= n_eligible:
        raise ValueError(
            f"universe size must be between 1 and {n_eligible} eligible codes, got {size}"
        )
    chosen: dict[str, None] = {}
    n_codes = 0
    for region in sorted(by_region, key=_stable_rank):
        if n_codes >= size:
            break
        pending = [region]
        while pending and n_codes < size:
            r = pending.pop(0)
            if r in chosen or r not in by_region:
                continue
            chosen[r] = None
            n_codes += len(by_region[r])
            for code in by_region[r]:
                pending += [region_of(p) for p in _excludes_prefixes(code)]
    regions = tuple(sorted(chosen))
    codes = tuple(c for r in regions for c in by_region[r])
    return Universe(
        codes=codes,
        regions=regions,
        description={c: cm.get_description(c) for c in codes},
        codes_in_region={r: by_region[r] for r in regions},
    )


def is_heldout_code(code: str) -> bool:
    """The fixed 1-in-5 partition of codes whose examples form the held-out split."""
    return int(_stable_rank("heldout:" + code), 16) % 5 == 0
