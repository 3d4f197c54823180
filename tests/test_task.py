"""The coding task: exact events, real near-misses, a clean held-out split, determinism."""

import random
import re
import subprocess
import sys

import pytest
import simple_icd_10_cm as cm

from mistill_lens import task
from mistill_lens.task import icd
from mistill_lens.task.icd import load_universe, region_of, suffix_of


@pytest.fixture(scope="module")
def universe():
    return load_universe()


@pytest.fixture(scope="module")
def examples():
    return {split: task.generate_examples(150, 7, split) for split in task.SPLITS}


def test_event_spans_are_exactly_the_chosen_text(examples):
    n_events = 0
    for split_examples in examples.values():
        for ex in split_examples:
            assert len(ex.events) == 3 * len(ex.mentions)
            for event in ex.events:
                assert ex.text[event.start : event.end] == event.chosen
                assert event.start >= len(ex.prompt), "decisions are in the output"
                assert event.chosen != event.contrast
                n_events += 1
    assert n_events > 1000


def test_event_kinds_point_at_region_and_suffix_of_the_gold_code(examples):
    for ex in examples["train"]:
        for mention in ex.mentions:
            region, within, near_miss = [
                e for e in ex.events if e.mention == ex.mentions.index(mention)
            ]
            assert (region.kind, within.kind, near_miss.kind) == task.EVENT_KINDS
            assert region.chosen == region_of(mention.code)
            assert within.chosen == suffix_of(mention.code)
            # the near-miss event sits where the gold code and the named near-miss first differ
            if region_of(mention.near_miss) == region_of(mention.code):
                assert (near_miss.chosen, near_miss.contrast) == (
                    suffix_of(mention.code),
                    suffix_of(mention.near_miss),
                )
            else:
                assert (near_miss.chosen, near_miss.contrast) == (
                    region_of(mention.code),
                    region_of(mention.near_miss),
                )
            assert region.contrast in {region_of(c) for c in ex.candidates}
            assert within.contrast in {
                suffix_of(c) for c in ex.candidates if region_of(c) == region.chosen
            }
            # the rivals a model's clean run picks from: every other region among the
            # candidates; the region's other candidate codes but the code and its near-miss
            assert region.rivals == tuple(
                dict.fromkeys(region_of(c) for c in ex.candidates if region_of(c) != region.chosen)
            )
            assert set(within.rivals) == {
                suffix_of(c)
                for c in ex.candidates
                if region_of(c) == region.chosen and c not in (mention.code, mention.near_miss)
            }
            assert near_miss.rivals is None


def _named_in_excludes_notes(code: str, other: str) -> bool:
    notes = cm.get_excludes1(code) + cm.get_excludes2(code)
    notes += cm.get_excludes1(region_of(code)) + cm.get_excludes2(region_of(code))
    refs = [r.rstrip(".-") for note in notes for r in re.findall(r"\(([A-Z0-9.\-]+)\)", note)]
    return any(other.startswith(r) for r in refs if r)


def test_every_near_miss_is_a_real_sibling_or_excludes_code(examples):
    relations = set()
    for split_examples in examples.values():
        for ex in split_examples:
            for m in ex.mentions:
                assert m.near_miss in ex.candidates and m.near_miss != m.code
                sibling = region_of(m.near_miss) == region_of(m.code) and cm.is_leaf(m.near_miss)
                assert sibling or _named_in_excludes_notes(m.code, m.near_miss), (
                    m.code,
                    m.near_miss,
                )
                assert m.relation == ("sibling" if sibling else "excludes")
                relations.add(m.relation)
                # the trace names the first near-miss in candidate order
                first = next(
                    c for c in ex.candidates if c in set(load_universe().near_misses(m.code))
                )
                assert m.near_miss == first
    assert relations == {"sibling", "excludes"}


def test_heldout_gold_codes_never_occur_as_training_gold(examples):
    train_gold = {
        c for split in ("train", "validation") for ex in examples[split] for c in ex.gold_codes
    }
    heldout_gold = {c for ex in examples["heldout"] for c in ex.gold_codes}
    assert heldout_gold and train_gold
    assert not train_gold & heldout_gold
    assert all(icd.is_heldout_code(c) for c in heldout_gold)
    # held-out codes still appear in training contexts as candidates: selection is in context
    train_candidates = {c for ex in examples["train"] for c in ex.candidates}
    assert train_candidates & heldout_gold


def test_prompt_lists_k_candidates_and_output_parses_back(examples):
    for ex in examples["validation"]:
        lines = (
            ex.prompt.split(task.CANDIDATES_HEADER)[1].split(task.REASONING_HEADER)[0].splitlines()
        )
        assert [line.split(":")[0] for line in lines] == list(ex.candidates)
        assert len(ex.candidates) == task.DEFAULT_K == len(set(ex.candidates))
        trace, codes = task.parse_output(ex.output)
        assert tuple(codes) == ex.gold_codes
        assert [(t.mention, t.code, t.near_miss) for t in trace] == [
            (m.text, m.code, m.near_miss) for m in ex.mentions
        ]
        for m in ex.mentions:
            assert m.text in ex.prompt.split(task.CANDIDATES_HEADER)[0], (
                "every coded condition is stated"
            )
        for code in ex.negated_codes:
            assert code in ex.candidates and code not in ex.gold_codes


def test_same_seed_same_bytes_through_the_cli(tmp_path):
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"]
    for path, seed in zip(paths, (3, 3, 4)):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mistill_lens.cli",
                "data",
                "--n",
                "20",
                "--seed",
                str(seed),
                "--split",
                "heldout",
                "--out",
                str(path),
            ],
            check=True,
            capture_output=True,
        )
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    assert [e.to_json() for e in task.read_jsonl(paths[0])] == [
        e.to_json() for e in task.generate_examples(20, 3, "heldout")
    ]


def test_universe_is_configurable_up_to_the_full_list():
    small, full = load_universe(300), load_universe(12536)
    assert 300 <= len(small) < 400 and len(full) == 12536
    assert len(load_universe(5651)) >= 5651
    assert set(small.codes) <= set(full.codes)
    for code in small.codes:
        assert cm.is_leaf(code) and small.siblings(code)
    with pytest.raises(ValueError, match="universe size"):
        load_universe(20000)


def test_bad_input_gives_clear_errors(universe):
    rng = random.Random(0)
    with pytest.raises(KeyError, match="unknown code 'Z99.999'"):
        task.build_example(universe, ["Z99.999"], 20, rng)
    gold = task.generate_examples(1, 0, "train", max_mentions=1)[0].gold_codes
    with pytest.raises(ValueError, match="K=2 candidates is smaller"):
        task.build_example(universe, list(gold), 2, rng)
    with pytest.raises(ValueError, match="empty summary"):
        task.build_example(universe, [], 20, rng)
    with pytest.raises(ValueError, match="empty summary"):
        task.render_prompt([], list(gold), universe)
    with pytest.raises(ValueError, match="unknown split"):
        task.generate_examples(1, 0, "test")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mistill_lens.cli",
            "data",
            "--n",
            "1",
            "--k",
            "2",
            "--out",
            "/dev/null",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "smaller than" in result.stderr


def test_small_k_always_leaves_a_region_contrast(universe):
    # With few candidates the random distractors could all be siblings of the gold code; the
    # generator must still place a candidate from another region, the region event's contrast.
    for ex in task.generate_examples(300, 11, "train", k=4, max_mentions=1):
        candidate_regions = {region_of(c) for c in ex.candidates}
        for event in ex.events:
            if event.kind == "region":
                assert event.contrast != event.chosen and event.contrast in candidate_regions
    no_excludes = next(
        c
        for c in universe.codes
        if not universe.excludes_codes(c) and len(universe.siblings(c)) >= 2
    )
    example = task.build_example(
        universe, [no_excludes], 4, random.Random(0), n_negated=0, n_filler=0
    )
    assert sum(region_of(c) != region_of(no_excludes) for c in example.candidates) >= 1
    with pytest.raises(ValueError, match="no room for a candidate outside the gold regions"):
        task.build_example(universe, [no_excludes], 3, random.Random(0), n_negated=0, n_filler=0)
