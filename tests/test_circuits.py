import pandas as pd
import pytest
import torch
from conftest import head_ablation_effects
from planted import DECIDER, GENERIC, GENERIC_GAIN, REGION_GAIN, WITHIN
from test_hooks import reference_frequencies

from mistill_lens.lens.circuits import (
    ablation_curve,
    attention_mass,
    circuit_measures,
    circuit_report,
    coverage,
    family_targets,
    head_families,
    knock_in_donors,
    knock_in_transfer,
    necessity,
    phase_structure,
    select_circuit,
    sufficiency,
    transfer_fraction,
)
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor


def share(batch, reference, kind):
    """Per event of `kind`: 1 - f(chosen) + f(contrast), the part of a head's contribution that
    mean-ablation removes (f: reference frequency of each token)."""
    freq = reference_frequencies(reference, kind)
    rows = [i for i, k in enumerate(batch.kinds) if k == kind]
    return rows, torch.tensor(
        [
            1 - freq.get(int(batch.chosen[i]), 0) + freq.get(int(batch.contrast[i, 0]), 0)
            for i in rows
        ]
    )


def test_circuit_selection_finds_the_planted_deciders_only(calibration):
    circuits = select_circuit(calibration)
    assert circuits == {"region": [DECIDER], "within": [WITHIN], "all": [DECIDER, WITHIN]}
    phases = phase_structure(calibration, circuits)
    assert phases["heads"] == {"region": [list(DECIDER)], "within": [list(WITHIN)]}
    assert phases["overlap"] == {"region/within": 0.0}


def test_necessity_sufficiency_and_knock_in_are_exact(planted, planted_data):
    bridge, _ = planted
    batch, means, reference = (
        planted_data["batch"],
        planted_data["means"],
        planted_data["reference_batch"],
    )
    region_rows, region_share = share(batch, reference, "region")
    within_rows, within_share = share(batch, reference, "within")
    clean_region = REGION_GAIN + GENERIC_GAIN

    lost = necessity(bridge, batch, means, [DECIDER, WITHIN])
    torch.testing.assert_close(
        lost[region_rows], REGION_GAIN * region_share / clean_region, atol=1e-4, rtol=0
    )
    torch.testing.assert_close(lost[within_rows], within_share, atol=1e-4, rtol=0)

    kept = sufficiency(bridge, batch, means, [DECIDER, WITHIN])
    torch.testing.assert_close(
        kept[region_rows], 1 - GENERIC_GAIN * region_share / clean_region, atol=1e-4, rtol=0
    )
    torch.testing.assert_close(kept[within_rows], torch.ones(len(within_rows)), atol=1e-4, rtol=0)

    donors = knock_in_donors(batch, seed=0)
    assert all(
        batch.kinds[d] == batch.kinds[i]
        and batch.chosen[d] != batch.chosen[i]
        and batch.events[d].example_id != batch.events[i].example_id
        for i, d in enumerate(donors.tolist())
    )
    # one stream per kind: the region events' donors are the same events without the within ones
    alone = batch.select(region_rows)
    assert [alone.events[d] for d in knock_in_donors(alone, seed=0).tolist()] == [
        batch.events[d] for d in donors[region_rows].tolist()
    ]
    transfer = knock_in_transfer(bridge, batch, [DECIDER, WITHIN], donors)
    torch.testing.assert_close(
        transfer[region_rows],
        torch.full((len(region_rows),), REGION_GAIN / clean_region),
        atol=1e-4,
        rtol=0,
    )
    torch.testing.assert_close(
        transfer[within_rows], torch.ones(len(within_rows)), atol=1e-4, rtol=0
    )
    # knocked in, the generic head carries the donor's mention: its share of the donor's margin
    generic = knock_in_transfer(bridge, batch, [GENERIC], donors)
    torch.testing.assert_close(
        generic[region_rows],
        torch.full((len(region_rows),), GENERIC_GAIN / clean_region),
        atol=1e-4,
        rtol=0,
    )


def test_report_summary_and_coverage(planted, planted_data):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    report = circuit_report(bridge, batch, means, [DECIDER, WITHIN], seed=0)
    summary = report.summary({"necessity": 0.5, "sufficiency": 0.9, "knock_in": 0.9})
    assert set(summary) == {"region", "within"}
    assert summary["within"]["coverage"] == {
        "necessity": pytest.approx(summary["within"]["coverage"]["necessity"]),
        "sufficiency": 1.0,
        "knock_in": 1.0,
    }
    assert summary["region"]["coverage"]["knock_in"] == 0.0  # a third transfers, below 0.9
    assert summary["region"]["knock_in"] == pytest.approx(
        REGION_GAIN / (REGION_GAIN + GENERIC_GAIN), abs=1e-4
    )
    # every event transfers the same share here, so pooling gains and gaps gives it too
    assert summary["region"]["knock_in_pooled"] == pytest.approx(
        REGION_GAIN / (REGION_GAIN + GENERIC_GAIN), abs=1e-4
    )
    torch.testing.assert_close(
        report.knock_in, torch.tensor(report.to_frame().knock_in.to_numpy(), dtype=torch.float32)
    )
    assert (
        coverage(torch.tensor([1.0, 0.0, 1.0, torch.nan]), [0, 0, 1, 2], 0.5) == 1.0
    )  # example 0 averages 0.5
    assert coverage(torch.tensor([0.2, 0.9]), [0, 1], 0.5) == 0.5


def test_head_families_separate_candidate_readers_from_mention_readers(planted, planted_data):
    bridge, _ = planted
    examples, batch = planted_data["examples"], planted_data["batch"].of_kind("region")
    by_id = {x.example_id: x for x in examples}
    targets = [
        family_targets(by_id[e.example_id], e, near_miss_text=e.chosen) for e in batch.events
    ]
    for event, target in zip(batch.events, targets):
        tokens = by_id[event.example_id].tokens
        assert [tokens[p] for p in target["region_candidates"]] == [
            event.chosen_token + 6
        ]  # the flagged "R{b}*"
        assert target["near_miss_mention"] == [event.predict_position - 1]
    masses = {
        family: attention_mass(bridge, batch, [t[family] for t in targets]) for family in targets[0]
    }
    assert masses["region_candidates"][:, DECIDER[0], DECIDER[1]].min() > 0.999
    assert masses["near_miss_mention"][:, GENERIC[0], GENERIC[1]].min() > 0.999
    baselines = {
        f: torch.tensor(
            [len(t[f]) / (e.predict_position + 1) for t, e in zip(targets, batch.events)]
        )
        for f in masses
    }
    families = head_families(masses, batch.kinds, [DECIDER, GENERIC, WITHIN], baselines)
    assert families.set_index("head")["family"].to_dict() == {
        0: "region_candidates",
        1: "near_miss_mention",
        2: "none",
    }
    with pytest.raises(IndexError, match="outside its context"):
        attention_mass(bridge, batch, [[100]] * len(batch))


def test_ablation_curve_by_score_beats_random(planted, planted_data):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    curve = ablation_curve(bridge, batch, means, [WITHIN, DECIDER], seed=0)
    within = curve[(curve.kind == "within") & (curve.order == "by score")].set_index("n_ablated")[
        "fraction_kept"
    ]
    assert within[0] == pytest.approx(1.0)
    assert within[1] == pytest.approx(
        1 - float(necessity(bridge, batch.of_kind("within"), means, [WITHIN]).mean()), abs=1e-5
    )
    random_within = curve[(curve.kind == "within") & (curve.order == "random")].set_index(
        "n_ablated"
    )["fraction_kept"]
    assert within[1] < random_within[1]
    assert sorted(curve.n_ablated.unique()) == list(range(9))


def test_sweep_is_resumable_and_matches_the_direct_effects(planted, planted_data, tmp_path):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    path = tmp_path / "sweep.csv"
    partial = ablation_sweep(bridge, batch, means, path, heads=[(0, 0), (0, 1)], progress=False)
    assert len(partial) == 2 * len(batch)
    # an interrupted block: head (1, 0) written for the first 5 events, the sixth line cut short
    rows = ablation_sweep(bridge, batch.select(range(6)), means, heads=[(1, 0)], progress=False)
    lines = rows.to_csv(index=False, header=False).splitlines()
    with open(path, "a") as f:
        f.write("\n".join(lines[:5]) + "\n" + lines[5][:12])
    full = ablation_sweep(bridge, batch, means, path, progress=False)
    assert len(full) == 8 * len(batch) and len(
        full.drop_duplicates(["event_row", "layer", "head"])
    ) == len(full)
    effects = effects_tensor(full, len(batch), 2, 4)
    torch.testing.assert_close(
        effects, head_ablation_effects(bridge, batch, means), atol=1e-6, rtol=0
    )
    with pytest.raises(ValueError, match="another run"):
        ablation_sweep(bridge, batch.of_kind("within"), means, path, progress=False)


@pytest.fixture(scope="module")
def region_batch(planted):
    from conftest import encode_all
    from planted import planted_examples

    from mistill_lens.lens.events import make_event_batch

    _, tokenizer = planted
    return make_event_batch(encode_all(tokenizer, planted_examples(60, seed=4))).of_kind("region")


def test_early_elicitation_reads_the_region_only_where_it_is_in_the_stream(planted, region_batch):
    """At r-1 ("=") the region appears after layer 0 (the deciding heads write it); at r-2 it is
    the mention token itself; from r-3 on nothing in the stream names it."""
    from mistill_lens.lens.elicitation import elicitation_curve, elicitation_lead
    from mistill_lens.lens.events import candidate_token_ids

    bridge, tokenizer = planted
    curve = elicitation_curve(
        bridge, region_batch, candidate_token_ids(tokenizer, r"R\d"), ks=range(1, 6), seed=0
    )
    accuracy = curve.set_index(["method", "k", "stage"])["accuracy"]
    # the logit lens is exact here; the probe (42 training rows, 128 dimensions) nearly so
    for method, at_least in (("logit_lens", 1.0), ("probe", 0.8)):
        assert (
            accuracy[method, 1, 0] < 0.5
            and min(accuracy[method, 1, 1], accuracy[method, 1, 2]) >= at_least
        )
        assert min(accuracy[method, 2, s] for s in range(3)) >= at_least
        assert max(accuracy[method, k, s] for k in (3, 4, 5) for s in range(3)) < 0.5
        assert elicitation_lead(curve, method) == 2
    assert set(curve.n_held_out) == {18} and set(curve.n_train) == {42}  # held out by example, 30%


def test_carrying_heads_are_the_ones_that_write_the_region(planted, region_batch):
    from mistill_lens.lens.elicitation import carrying_heads, top_heads

    bridge, _ = planted
    at_decision = carrying_heads(bridge, region_batch, k=1, stage=2)
    assert set(top_heads(at_decision, 2)) == {DECIDER, GENERIC}
    assert at_decision[0, 2:].abs().max() < 1e-3 and at_decision[1].abs().max() < 1e-3
    at_mention = carrying_heads(bridge, region_batch, k=2, stage=2)
    assert (
        at_mention.max() < 0.2 * at_decision.max()
    )  # the mention token is read from its embedding


def test_a_rerun_reads_the_stages_before_the_sweeps_from_its_folder(planted, tmp_path, monkeypatch):
    """The reference means, the clean margins and the attribution are kept in the run's folder: a
    second run there reads them (here computing them is made to fail) and finds the same; a run
    whose inputs differ (another null draw) is refused, not given the first run's means."""
    from dataclasses import replace

    from characterized import characterize_into
    from planted import planted_examples

    import mistill_lens.lens.characterize as pipeline
    from mistill_lens.lens.fingerprint import StaleResultError
    from mistill_lens.lens.results import CharacterizeConfig
    from mistill_lens.lens.run_folder import STAGE_FILES

    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, ks=(1,), progress=False)
    args = (bridge, tokenizer, planted_examples(12, seed=0), planted_examples(24, seed=1))
    first = characterize_into(tmp_path / "run", *args, config)
    assert all((tmp_path / "run" / name).is_file() for name in STAGE_FILES)

    def recomputed(*_, **__):
        raise AssertionError("a kept stage was computed again")

    for stage in ("reference_means", "clean_margins", "chunked_attribution"):
        monkeypatch.setattr(pipeline, stage, recomputed)
    again = characterize_into(tmp_path / "run", *args, config)
    # the engine's self-check runs on the first events it is asked about, which differ here
    assert {k: v for k, v in again.items() if k != "backend"} == {
        k: v for k, v in first.items() if k != "backend"
    }
    monkeypatch.undo()
    with pytest.raises(StaleResultError, match="reference means .*options"):
        characterize_into(tmp_path / "run", *args, replace(config, null_per_event=2))


def test_pooled_knock_in_is_not_carried_by_one_event_with_a_tiny_gap():
    """Gains 1, 1, 0.23 over gaps 2, 2, 0.01: the per-event ratios 0.5, 0.5, 23 average 8; pooled,
    2.23 / 4.01. Rows without a donor (NaN) or without a gap (<= 0) are left out of both."""
    nan = float("nan")
    events = pd.DataFrame(
        {
            "example_id": [0, 1, 2, 3, 4],
            "kind": ["near_miss"] * 5,
            "necessity": [1.0] * 5,
            "sufficiency": [1.0] * 5,
            "knock_in_gain": [1.0, 1.0, 0.23, nan, 5.0],
            "knock_in_gap": [2.0, 2.0, 0.01, nan, -1.0],
        }
    )
    events["knock_in"] = transfer_fraction(
        torch.tensor(events.knock_in_gain.to_numpy()), torch.tensor(events.knock_in_gap.to_numpy())
    ).numpy()
    measures = circuit_measures(events, {"necessity": 0.5, "sufficiency": 0.5, "knock_in": 0.5})
    assert measures["near_miss"]["knock_in"] == pytest.approx(8.0)
    assert measures["near_miss"]["knock_in_pooled"] == pytest.approx(2.23 / 4.01)
    assert (
        "knock_in_pooled"
        not in circuit_measures(  # an older table without the two sides
            events.drop(columns=["knock_in_gain", "knock_in_gap"]),
            {"necessity": 0.5, "sufficiency": 0.5, "knock_in": 0.5},
        )["near_miss"]
    )
