"""Synthetic clinical coding on the real ICD-10-CM hierarchy, with exact gold decision events.

An example is a prompt (a short discharge summary with 1-4 codable conditions, negated and
filler findings, then ``K`` candidate lines ``code: description``) and an output (a reasoning
trace: per mention the region, a near-miss named and rejected with a reason, the code; then
the final code list). The generator records every decision in the output as an
:class:`~mistill_lens.lens.examples.SpanEvent` with character offsets into ``prompt + output``.

Splits: ``train`` and ``validation`` draw gold codes from the 4/5 of codes outside the fixed
held-out partition (:func:`mistill_lens.task.icd.is_heldout_code`); ``heldout`` draws gold codes only
from that partition, so held-out scores measure in-context selection, not memorisation.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from mistill_lens.lens.examples import SpanEvent, span_event
from mistill_lens.lens.examples import read_jsonl as read_jsonl_rows
from mistill_lens.task.icd import (
    DEFAULT_UNIVERSE_SIZE,
    Universe,
    is_heldout_code,
    load_universe,
    region_of,
    suffix_of,
)
from mistill_lens.task_defaults import DEFAULT_K, DEFAULT_MAX_MENTIONS, SPLITS  # noqa: F401

EVENT_KINDS = ("region", "within", "near_miss")

PROMPT_HEADER = "Summary: "
CANDIDATES_HEADER = "\nCandidates:\n"
REASONING_HEADER = "Reasoning:\n"
CODES_HEADER = "Codes: "

POSITIVE_TEMPLATES = (
    "Admitted with {}.",
    "Course complicated by {}.",
    "Found to have {}.",
    "History notable for {}.",
    "Assessment: {}.",
    "Treated for {}.",
)
NEGATED_TEMPLATES = ("No evidence of {}.", "Ruled out {}.", "Negative for {}.")
FILLER_SENTENCES = (
    "Vitals stable on discharge.",
    "Tolerating a regular diet.",
    "Follow up with primary care in two weeks.",
    "Ambulating without assistance.",
    "Pain controlled on oral medication.",
    "Family at bedside.",
    "Discharged home in good condition.",
    "Labs otherwise unremarkable.",
)
REJECTION_REASONS = {
    "sibling": "same region, different condition",
    "excludes": "excluded by the notes of {}",
}
# One trace line per coded mention; the parser below is its inverse.
TRACE_LINE = (
    "- {mention} => region {region} ; near-miss {near_miss} rejected: {reason} ; code {code}\n"
)
_TRACE_LINE_RE = re.compile(
    r"^- (?P<mention>.*?) => region (?P<region>\S+) ; near-miss (?P<near_miss>\S+) rejected: "
    r"(?P<reason>.*?) ; code (?P<code>\S+)$"
)


@dataclass(frozen=True)
class Mention:
    text: str
    code: str
    near_miss: str
    relation: str


@dataclass(frozen=True)
class Example:
    id: str
    split: str
    prompt: str
    output: str
    gold_codes: tuple[str, ...]
    candidates: tuple[str, ...]
    mentions: tuple[Mention, ...]
    events: tuple[SpanEvent, ...]
    negated_codes: tuple[str, ...] = field(default=())

    @property
    def text(self) -> str:
        return self.prompt + self.output

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> "Example":
        return cls(
            id=row["id"],
            split=row["split"],
            prompt=row["prompt"],
            output=row["output"],
            gold_codes=tuple(row["gold_codes"]),
            candidates=tuple(row["candidates"]),
            mentions=tuple(Mention(**m) for m in row["mentions"]),
            events=tuple(span_event(e) for e in row["events"]),
            negated_codes=tuple(row.get("negated_codes", ())),
        )


def near_miss_named(example: "Example", event) -> str | None:
    """The near-miss code named for an event's mention (the ICD task's reader for the
    near-miss head family); None for an event outside the example's mentions."""
    mentions = getattr(example, "mentions", None)
    return (
        mentions[event.mention].near_miss
        if mentions and 0 <= event.mention < len(mentions)
        else None
    )


def mention_wording(description: str) -> str:
    """Clinical wording of a condition: the real description in lower case."""
    return description.lower()


def candidate_line(code: str, universe: Universe) -> str:
    return f"{code}: {mention_wording(universe.description[code])}\n"


def render_prompt(
    summary_sentences: list[str], candidates: Iterable[str], universe: Universe
) -> str:
    if not summary_sentences:
        raise ValueError("empty summary: an example needs at least one summary sentence")
    candidates = list(candidates)
    if not candidates:
        raise ValueError("empty candidate list")
    lines = "".join(candidate_line(universe.check_code(c), universe) for c in candidates)
    return (
        PROMPT_HEADER + " ".join(summary_sentences) + CANDIDATES_HEADER + lines + REASONING_HEADER
    )


def _first_in(order: Iterable[str], pool: Iterable[str]) -> str | None:
    pool = set(pool)
    return next((c for c in order if c in pool), None)


def _draw_distinct(universe: Universe, rng: random.Random, n: int, accept) -> list[str]:
    """``n`` distinct universe codes that ``accept`` admits, by rejection (the universe is large)."""
    if n > len(universe) // 2:
        pool = [c for c in universe.codes if accept(c)]
        return rng.sample(pool, n)
    drawn: list[str] = []
    while len(drawn) < n:
        code = rng.choice(universe.codes)
        if accept(code) and code not in drawn:
            drawn.append(code)
    return drawn


def _check_gold(universe: Universe, gold_codes: list[str]) -> None:
    """Gold codes that make a well-posed example: known, distinct, from distinct regions, none
    another's near-miss."""
    if not gold_codes:
        raise ValueError("empty summary: gold_codes must name at least one condition to code")
    for code in gold_codes:
        universe.check_code(code)
    if len(set(gold_codes)) != len(gold_codes):
        raise ValueError(f"duplicate gold codes: {gold_codes}")
    if len({region_of(c) for c in gold_codes}) != len(gold_codes):
        raise ValueError(f"gold codes must come from distinct regions: {gold_codes}")
    for code in gold_codes:
        clash = set(universe.near_misses(code)) & set(gold_codes)
        if clash:
            raise ValueError(
                f"gold code {code} has another gold code as a near-miss: {sorted(clash)}"
            )


def _draw_candidates(
    universe: Universe, gold_codes: list[str], k: int, rng: random.Random, n_negated: int
) -> tuple[list[str], list[str]]:
    """The `k` shuffled candidates (the gold codes, their planted near-misses, negated codes and
    fillers) and the negated codes among them."""
    # The planted near-miss (an excludes code a third of the time when one exists) and one
    # more sibling, so that every mention has a within-region contrast in context.
    required: list[str] = list(gold_codes)
    for code in gold_codes:
        excludes = [c for c in universe.excludes_codes(code) if c not in required]
        siblings = [c for c in universe.siblings(code) if c not in required]
        n_siblings = 2
        if excludes and rng.random() < 1 / 3:
            required.append(rng.choice(excludes))
            n_siblings = 1
        required += rng.sample(siblings, min(n_siblings, len(siblings)))
    if k < len(required):
        raise ValueError(
            f"K={k} candidates is smaller than the {len(required)} this gold set needs "
            f"({len(gold_codes)} gold codes plus their near-misses)"
        )
    blocked = set(required) | {c for g in gold_codes for c in universe.near_misses(g)}
    gold_regions = {region_of(c) for c in gold_codes}
    negated = _draw_distinct(
        universe,
        rng,
        min(n_negated, k - len(required)),
        lambda c: c not in blocked and region_of(c) not in gold_regions,
    )
    taken = set(required) | set(negated)
    # A region decision needs a contrast: at least one candidate outside the gold regions.
    has_other_region = any(region_of(c) not in gold_regions for c in taken)
    if not has_other_region and k == len(taken):
        raise ValueError(
            f"K={k} candidates leaves no room for a candidate outside the gold regions "
            f"(the region decision's contrast); use K >= {len(taken) + 1}"
        )
    outside = (
        []
        if has_other_region
        else _draw_distinct(
            universe, rng, 1, lambda c: c not in taken and region_of(c) not in gold_regions
        )
    )
    taken |= set(outside)
    candidates = (
        required
        + negated
        + outside
        + _draw_distinct(universe, rng, k - len(taken), lambda c: c not in taken)
    )
    rng.shuffle(candidates)
    return candidates, negated


def _mention_events(
    universe: Universe,
    candidates: list[str],
    code: str,
    near_miss: str,
    relation: str,
    index: int,
    base: int,
    line: str,
) -> list[SpanEvent]:
    """The region, within and near-miss decisions of one trace line that starts at character
    `base` of prompt + output."""
    region = region_of(code)
    events: list[SpanEvent] = []
    region_start = base + line.index(" => region ") + len(" => region ")
    code_start = base + line.rindex(" ; code ") + len(" ; code ")
    suffix_start = code_start + len(region)
    region_contrast = region_of(
        _first_in(candidates, [c for c in candidates if region_of(c) != region])
    )
    within_rival = (
        _first_in(candidates, [c for c in universe.siblings(code) if c != near_miss]) or near_miss
    )
    # Every competitor in context, for contrasts the model picks (lens/contrasts.py): the other
    # regions among the candidates; the region's other codes but the near-miss, which is the
    # near-miss event's own contrast (none left: the within event has no rival of its own).
    region_rivals = tuple(dict.fromkeys(region_of(c) for c in candidates if region_of(c) != region))
    siblings = set(universe.siblings(code)) - {near_miss}
    within_rivals = tuple(dict.fromkeys(suffix_of(c) for c in candidates if c in siblings))
    events.append(
        SpanEvent(
            "region",
            region_start,
            region_start + len(region),
            region,
            region_contrast,
            region=region,
            mention=index,
            rivals=region_rivals,
        )
    )
    events.append(
        SpanEvent(
            "within",
            suffix_start,
            suffix_start + len(suffix_of(code)),
            suffix_of(code),
            suffix_of(within_rival),
            region=region,
            mention=index,
            rivals=within_rivals,
        )
    )
    if relation == "sibling":
        events.append(
            SpanEvent(
                "near_miss",
                suffix_start,
                suffix_start + len(suffix_of(code)),
                suffix_of(code),
                suffix_of(near_miss),
                region=region,
                mention=index,
            )
        )
    else:
        events.append(
            SpanEvent(
                "near_miss",
                code_start,
                code_start + len(region),
                region,
                region_of(near_miss),
                region=region,
                mention=index,
            )
        )
    return events


def build_example(
    universe: Universe,
    gold_codes: list[str],
    k: int,
    rng: random.Random,
    *,
    example_id: str = "",
    split: str = "train",
    n_negated: int = 1,
    n_filler: int = 1,
) -> Example:
    """One example coding exactly ``gold_codes`` with ``k`` shuffled candidates.

    The trace names, for each mention, the first candidate (in list order) that is a
    near-miss of the gold code, so the reference output is a deterministic function of the
    prompt.
    """
    _check_gold(universe, gold_codes)
    candidates, negated = _draw_candidates(universe, gold_codes, k, rng, n_negated)

    # (sentence, the gold code it states or None), shuffled together.
    statements = [
        (rng.choice(POSITIVE_TEMPLATES).format(mention_wording(universe.description[c])), c)
        for c in gold_codes
    ]
    statements += [
        (rng.choice(NEGATED_TEMPLATES).format(mention_wording(universe.description[c])), None)
        for c in negated
    ]
    statements += [(s, None) for s in rng.sample(FILLER_SENTENCES, n_filler)]
    rng.shuffle(statements)
    # Mentions are coded in the order the summary states them.
    ordered_gold = [c for _, c in statements if c is not None]

    prompt = render_prompt([s for s, _ in statements], candidates, universe)
    output = ""
    mentions: list[Mention] = []
    events: list[SpanEvent] = []
    for index, code in enumerate(ordered_gold):
        near_miss = _first_in(candidates, universe.near_misses(code))
        relation = universe.near_miss_relation(code, near_miss)
        region = region_of(code)
        line = TRACE_LINE.format(
            mention=mention_wording(universe.description[code]),
            region=region,
            near_miss=near_miss,
            reason=REJECTION_REASONS[relation].format(region),
            code=code,
        )
        events += _mention_events(
            universe, candidates, code, near_miss, relation, index, len(prompt) + len(output), line
        )
        mentions.append(
            Mention(mention_wording(universe.description[code]), code, near_miss, relation)
        )
        output += line
    output += CODES_HEADER + ", ".join(ordered_gold) + "\n"
    return Example(
        id=example_id,
        split=split,
        prompt=prompt,
        output=output,
        gold_codes=tuple(ordered_gold),
        candidates=tuple(candidates),
        mentions=tuple(mentions),
        events=tuple(events),
        negated_codes=tuple(negated),
    )


@functools.lru_cache(maxsize=16)
def gold_pool(universe_size: int, split: str) -> tuple[str, ...]:
    """The codes that can be gold in `split` (held-out codes are never gold in training)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    want_heldout = split == "heldout"
    return tuple(
        c for c in load_universe(universe_size).codes if is_heldout_code(c) == want_heldout
    )


def _draw_gold(universe: Universe, pool: list[str], n: int, rng: random.Random) -> list[str]:
    chosen: list[str] = []
    while len(chosen) < n:
        code = rng.choice(pool)
        if region_of(code) in {region_of(c) for c in chosen}:
            continue
        if any(code in universe.near_misses(c) or c in universe.near_misses(code) for c in chosen):
            continue
        chosen.append(code)
    return chosen


def min_k(max_mentions: int) -> int:
    """The smallest K that works for every example with up to `max_mentions` mentions: each gold
    code plants at most three candidates (itself and two near-misses), plus one candidate from
    another region (the region decision's contrast)."""
    return 3 * max_mentions + 1


def check_task_config(*, universe_size: int, k: int, max_mentions: int) -> None:
    """Raise a ValueError naming the bad option and the values that work."""
    if not 1 <= max_mentions <= 4:
        raise ValueError(f"max_mentions must be between 1 and 4, got {max_mentions}")
    if k < min_k(max_mentions):
        raise ValueError(
            f"K={k} candidates is smaller than the {min_k(max_mentions)} that up to {max_mentions} "
            f"mention(s) can need (each gold code plants up to 3 candidates, plus one from another "
            f"region); use K >= {min_k(max_mentions)}"
        )
    if universe_size < 1:
        raise ValueError(f"universe_size must be at least 1, got {universe_size}")


def example_at(
    seed: int,
    split: str,
    index: int,
    *,
    universe_size: int = DEFAULT_UNIVERSE_SIZE,
    k: int = DEFAULT_K,
    max_mentions: int = DEFAULT_MAX_MENTIONS,
) -> Example:
    """Example ``index`` of the stream of (seed, split, config): a function of these alone, so
    examples can be made out of order (in parallel workers) and a resumed run sees the same ones."""
    check_task_config(universe_size=universe_size, k=k, max_mentions=max_mentions)
    universe = load_universe(universe_size)
    rng = random.Random(f"mistill:{seed}:{split}:{index}")
    gold = _draw_gold(universe, gold_pool(universe_size, split), rng.randint(1, max_mentions), rng)
    return build_example(
        universe,
        gold,
        k,
        rng,
        example_id=f"{split}-{seed}-{index}",
        split=split,
        n_negated=rng.randint(0, 2),
        n_filler=rng.randint(0, 2),
    )


def iter_examples(
    seed: int,
    split: str,
    *,
    universe_size: int = DEFAULT_UNIVERSE_SIZE,
    k: int = DEFAULT_K,
    max_mentions: int = DEFAULT_MAX_MENTIONS,
    start: int = 0,
) -> Iterator[Example]:
    """An endless, deterministic stream: example ``i`` depends only on (seed, split, i, config)."""
    check_task_config(universe_size=universe_size, k=k, max_mentions=max_mentions)
    config = dict(universe_size=universe_size, k=k, max_mentions=max_mentions)
    index = start
    while True:
        yield example_at(seed, split, index, **config)
        index += 1


def generate_examples(n: int, seed: int, split: str, **config) -> list[Example]:
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    stream = iter_examples(seed, split, **config)
    return [next(stream) for _ in range(n)]


def write_jsonl(examples: Iterable[Example], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example.to_json(), ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples from a JSONL file written by :func:`write_jsonl`; a bad line is an error naming
    the file, its line number and what is wrong (invalid JSON, the missing field)."""
    return read_jsonl_rows(path, lambda row, _where: Example.from_json(row))


@dataclass(frozen=True)
class TraceLine:
    mention: str
    region: str
    near_miss: str
    reason: str
    code: str


def parse_output(output: str) -> tuple[list[TraceLine], list[str]]:
    """The trace lines and the final code list of a (possibly malformed) generated output."""
    lines: list[TraceLine] = []
    codes: list[str] = []
    for raw in output.split("\n"):
        if raw.startswith(CODES_HEADER):
            codes = [c.strip() for c in raw[len(CODES_HEADER) :].split(",") if c.strip()]
            break
        match = _TRACE_LINE_RE.match(raw)
        if match:
            lines.append(TraceLine(**match.groupdict()))
    return lines, codes
