"""Circuits found by what they do, on a planted model whose region decision four heads carry
jointly (each a quarter of the margin, closed form), while a per-head z rule finds none of them."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import encode_all, head_ablation_effects
from planted import TOKEN_ID, planted_examples
from planted_joint import JOINT_GAIN, JOINT_HEADS, joint_bridge

from mistill_lens.lens.backends import FullForward, means_from_events
from mistill_lens.lens.calibration import calibrate, null_events
from mistill_lens.lens.circuits import select_circuit
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import make_event_batch
from mistill_lens.lens.faithful_search import (
    Search,
    faithful_circuit,
    resample_rows,
    selection_frequencies,
)
from mistill_lens.lens.faithfulness import (
    BAND_SIZES,
    band_summary,
    beyond_chance,
    effect_pool,
    necessity_curve,
    random_band,
    ranked_heads,
    ranking_curve,
    sufficiency_curve,
)
from mistill_lens.lens.fingerprint import StaleResultError, StaleResultWarning
from mistill_lens.lens.hooks import (
    all_heads,
    event_position_classes,
    gated_ablation_hooks,
    head_mask,
    row_set_ablation_hooks,
)
from mistill_lens.lens.learned_mask import backpropagate_mean_margin, learn_mask
from mistill_lens.lens.margins import run_margins
from mistill_lens.lens.search_log import SearchLog


@pytest.fixture(scope="module")
def joint(tmp_path_factory):
    bridge, tokenizer = joint_bridge(tmp_path_factory.mktemp("joint_tokenizer"))
    examples = encode_all(tokenizer, planted_examples(24, seed=0))
    reference = encode_all(tokenizer, planted_examples(60, seed=1), first_id=1000)
    reference_events = [e for x in reference for e in x.events]
    nulls = null_events(reference, reference_events, per_event=1, seed=1)
    means = means_from_events(bridge, make_event_batch(reference, reference_events + nulls))
    batch = make_event_batch(examples).of_kind("region")
    null_batch = make_event_batch(
        examples, null_events(examples, make_event_batch(examples).events, per_event=2, seed=0)
    )
    # how often each region is the reference's chosen one: the mean-ablated heads' share
    chosen = [e.chosen_token for e in reference_events if e.kind == "region"]
    frequency = {t: chosen.count(t) / len(chosen) for t in set(chosen)}
    drift = sum(
        frequency.get(int(c), 0.0) - frequency.get(int(d[0]), 0.0)
        for c, d in zip(batch.chosen, batch.contrast)
    ) / len(batch)
    return bridge, batch, null_batch, means, drift


def test_the_region_margin_is_the_closed_form(joint):
    bridge, batch, *_ = joint
    torch.testing.assert_close(
        run_margins(bridge, batch), torch.full((len(batch),), 4 * JOINT_GAIN), atol=1e-3, rtol=0
    )
    assert int(batch.chosen[0]) in {TOKEN_ID[f"R{i}"] for i in range(6)}


def test_the_z_rule_misses_the_joint_heads_and_the_search_finds_exactly_them(joint):
    bridge, batch, null_batch, means, drift = joint
    calibration = calibrate(
        head_ablation_effects(bridge, batch, means),
        batch.kinds,
        head_ablation_effects(bridge, null_batch, means),
    )
    assert select_circuit(calibration)["region"] == []  # no head passes z >= 3 alone

    engine = InterventionEngine(bridge)
    necessity = necessity_curve(engine, batch, means, all_heads(bridge))
    assert set(necessity.smallest(0.8)) == set(JOINT_HEADS)
    # closed form: k joint heads ablated remove k/4 of the margin, less the means' own share
    for k in range(len(JOINT_HEADS) + 1):
        assert necessity.values[k] == pytest.approx(k / 4 * (1 - drift), abs=1e-4)
    assert all(b >= a - 1e-6 for a, b in zip(necessity.values, necessity.values[1:]))  # monotone
    assert necessity.values[-1] == pytest.approx(necessity.values[len(JOINT_HEADS)], abs=1e-5)

    sufficiency = sufficiency_curve(engine, batch, means, all_heads(bridge))
    assert set(sufficiency.smallest(0.8)) == set(JOINT_HEADS)
    for heads, value in zip(sufficiency.sets, sufficiency.values):  # normalised: k/4 exactly
        kept = len(set(heads) & set(JOINT_HEADS))
        assert value == pytest.approx(kept / 4, abs=1e-4)


def test_random_sets_score_their_planted_share_in_closed_form(joint):
    """A random set holding j of the four joint heads keeps j/4 of the margin alone (normalised
    sufficiency) and removes j/4 of it, less the means' own share (necessity): every draw, exactly."""
    bridge, batch, _, means, drift = joint
    rows = random_band(InterventionEngine(bridge), batch, means, [1, 4, 8, 500], draws=25, seed=3)
    planted = {f"L{l}H{h}" for l, h in JOINT_HEADS}
    assert {r["size"] for r in rows} == {1, 4, 8}  # sizes past the model's heads are dropped
    assert len(rows) == 2 * 3 * 25
    hits = []
    for row in rows:
        heads = row["heads"].split()
        assert len(heads) == len(set(heads)) == row["size"]
        share = len(planted & set(heads)) / 4
        expected = share if row["measure"] == "sufficiency" else share * (1 - drift)
        assert row["value"] == pytest.approx(expected, abs=1e-4)
        hits.append(share)
    assert 0 < sum(hits)  # some draws hit a planted head, so the check above is not all zeros
    band = band_summary(rows)
    assert [(b["measure"], b["size"]) for b in band] == [
        (m, k) for m in ("necessity", "sufficiency") for k in (1, 4, 8)
    ]
    for b in band:
        assert b["low"] - 1e-9 <= b["mean"] <= b["high"] + 1e-9 and b["draws"] == 25
    # the planted set beats random sets of its size; a random-looking value does not
    size_four = [r["value"] for r in rows if r["size"] == 4 and r["measure"] == "sufficiency"]
    assert beyond_chance(1.0, size_four) == pytest.approx(1 / 26)
    assert beyond_chance(0.0, size_four) == 1.0
    with pytest.raises(ValueError, match="draws must be at least 1"):
        random_band(bridge, batch, means, [1], draws=0)
    # the caller's clean and all-ablated means give the same band; a non-positive clean is refused
    engine = InterventionEngine(bridge)
    masks = torch.stack([head_mask(bridge, []), ~head_mask(bridge, [])])
    clean, none = engine.set_margins(batch, means, masks).mean(dim=1).tolist()
    given = random_band(engine, batch, means, [1, 4, 8], 25, 3, clean_and_none=(clean, none))
    assert [r["value"] for r in given] == pytest.approx([r["value"] for r in rows], abs=1e-5)
    with pytest.raises(ValueError, match="mean clean margin"):
        random_band(engine, batch, means, [1], 2, 3, clean_and_none=(-1.0, none))


def test_the_search_agrees_on_the_full_forward_and_refuses_meaningless_input(joint):
    bridge, batch, _, means, _ = joint
    pool = effect_pool(head_ablation_effects(bridge, batch, means), 5)
    assert set(JOINT_HEADS) <= set(pool) and len(pool) == 5
    engine = necessity_curve(InterventionEngine(bridge), batch, means, pool, max_size=4)
    full = necessity_curve(bridge, batch, means, pool, max_size=4)
    assert full.values == pytest.approx(engine.values, abs=1e-4)
    with pytest.raises(ValueError, match="no events"):
        necessity_curve(bridge, batch.select([]), means, pool)
    flipped = batch.select(range(len(batch)))
    flipped.chosen, flipped.contrast = flipped.contrast[:, 0].clone(), flipped.chosen[:, None]
    with pytest.raises(ValueError, match="mean clean margin"):
        necessity_curve(bridge, flipped, means, pool)


def test_a_bootstrap_resample_draws_whole_examples(joint):
    """Every example drawn brings all of its events (as many times as it is drawn), the resample
    holds as many examples as the batch, and one seed gives one resample."""
    import numpy as np

    _, batch, *_ = joint
    per_example = {}
    for event in batch.events:
        per_example[event.example_id] = per_example.get(event.example_id, 0) + 1
    sample = batch.select(resample_rows(batch, np.random.default_rng(5)))
    counts = {}
    for event in sample.events:
        counts[event.example_id] = counts.get(event.example_id, 0) + 1
    draws = {e: counts[e] // per_example[e] for e in counts}
    assert all(counts[e] == draws[e] * per_example[e] for e in counts)
    assert sum(draws.values()) == len(per_example)
    assert len(draws) < len(per_example)  # with replacement: some examples are left out
    again = batch.select(resample_rows(batch, np.random.default_rng(5)))
    assert [e.example_id for e in again.events] == [e.example_id for e in sample.events]
    assert torch.equal(again.chosen, sample.chosen) and torch.equal(again.tokens, sample.tokens)


def test_the_planted_joint_heads_are_chosen_on_every_resample(joint):
    """Each of the four joint heads carries a quarter of every event's margin, so every resample's
    search finds exactly the four of them: frequency 1 for each, 0 for every other head."""
    bridge, batch, _, means, _ = joint
    engine = InterventionEngine(bridge)
    effects = head_ablation_effects(bridge, batch, means)
    heads = all_heads(bridge)
    stability = selection_frequencies(engine, batch, means, effects, heads, resamples=10, seed=1)
    planted = {f"L{l}H{h}" for l, h in JOINT_HEADS}
    assert set(stability["frequency"]) == {f"L{l}H{h}" for l, h in all_heads(bridge)}
    for head, share in stability["frequency"].items():
        assert share == (1.0 if head in planted else 0.0), head
    assert list(stability["frequency"])[: len(planted)] == sorted(planted)  # most chosen first
    assert stability["sizes"] == [4] * 10 and stability["failed"] == 0
    with pytest.raises(ValueError, match="resamples must be at least 1"):
        selection_frequencies(engine, batch, means, effects, heads, resamples=0)


def test_a_resample_without_a_positive_margin_is_counted_as_failed(joint):
    """Events whose margin the model does not decide its way leave the search undefined: such
    resamples are counted, not scored as 'no head chosen'."""
    bridge, batch, _, means, _ = joint
    flipped = batch.select(range(len(batch)))
    flipped.chosen, flipped.contrast = flipped.contrast[:, 0].clone(), flipped.chosen[:, None]
    effects = head_ablation_effects(bridge, flipped, means)
    stability = selection_frequencies(
        bridge, flipped, means, effects, JOINT_HEADS, resamples=3, seed=0
    )
    assert stability["failed"] == 3 and stability["sizes"] == []
    assert set(stability["frequency"].values()) == {0.0}


def test_gates_interpolate_between_the_clean_run_and_mean_ablation_on_both_backends(joint):
    """Gate 0 is the clean run, gate 1 the mean-ablation of a set; the engine's differentiable
    margins equal the full forward's, values and gradients with respect to the gates."""

    bridge, batch, _, means, _ = joint
    full, engine = FullForward(bridge), InterventionEngine(bridge)
    chosen = head_mask(bridge, JOINT_HEADS[:2] + [(1, 3)])

    def gated(gates):
        return lambda sub: gated_ablation_hooks(
            bridge, gates, means, event_position_classes(sub, means.class_names)
        )

    def ablated(sub):
        rows = chosen.expand(len(sub), *chosen.shape)
        return row_set_ablation_hooks(
            bridge, rows, means, event_position_classes(sub, means.class_names)
        )

    with torch.no_grad():
        torch.testing.assert_close(
            full.differentiable_margins(batch, gated(chosen.float())),
            full.margins(batch, ablated),
            atol=1e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            engine.differentiable_margins(batch, gated(torch.zeros(chosen.shape))),
            run_margins(bridge, batch),
            atol=1e-4,
            rtol=0,
        )
    gates = torch.rand(chosen.shape, generator=torch.Generator().manual_seed(0))
    values, grads = [], []
    for backend in (full, engine):
        leaf = gates.clone().requires_grad_()
        margin = backend.differentiable_margins(batch, gated(leaf)).mean()
        (grad,) = torch.autograd.grad(margin, leaf)
        values.append(margin.item())
        grads.append(grad)
    assert values[0] == pytest.approx(values[1], abs=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=0)
    # each joint head's gate lowers the margin; layer 1 is zero, so its gates do nothing
    assert (grads[0][0] < -0.1).all() and grads[0][1].abs().max() < 1e-5
    with pytest.raises(ValueError, match="gates of shape"):
        gated_ablation_hooks(bridge, torch.zeros(3, 3), means, event_position_classes(batch))


@pytest.mark.parametrize("measure", ["necessity", "sufficiency"])
def test_a_learned_mask_opens_exactly_the_joint_heads(joint, measure):
    """On the engine, gradient descent on the gates opens the four joint heads (each a quarter of
    the margin, none decisive alone) and closes the rest; the ranking's exact curve reaches the
    target at exactly those four."""
    bridge, batch, _, means, _ = joint
    engine = InterventionEngine(bridge)
    gates = learn_mask(engine, batch, means, measure, steps=60)
    ranking = ranked_heads(gates)
    assert set(ranking[:4]) == set(JOINT_HEADS)
    assert gates[0].min() > 0.9 and gates[1].max() < 0.1
    curve = ranking_curve(engine, batch, means, ranking, measure, max_size=6)
    assert set(curve.smallest(0.8)) == set(JOINT_HEADS)
    assert [len(s) for s in curve.sets] == list(range(0 if measure == "necessity" else 1, 7))
    if measure == "sufficiency":  # normalised: k of the joint heads kept keep k/4
        assert curve.values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-4)


def test_a_learned_mask_backpropagates_chunk_by_chunk_to_the_full_batch_gradient(joint):
    """The mask's loss is affine in the mean margin, so backpropagating a few rows at a time (one
    chunk's graph held at once) gives the gradient of one full-batch backward, on both backends;
    and the gates learned either way agree."""
    bridge, batch, _, means, _ = joint
    assert len(batch) % 5 != 0  # a last chunk shorter than the others
    gates = torch.rand(2, bridge.cfg.n_heads, generator=torch.Generator().manual_seed(1))
    for make in (InterventionEngine, FullForward):
        grads = []
        for rows in (len(batch), 5):
            backend = make(bridge)
            backend.grad_rows = rows
            leaf = gates.clone().requires_grad_()

            def hooks_for(sub):
                classes = event_position_classes(sub, means.class_names)
                return gated_ablation_hooks(bridge, leaf, means, classes)

            backpropagate_mean_margin(backend, batch, hooks_for, scale=-0.5)
            grads.append(leaf.grad)
        assert grads[0].abs().max() > 1e-2  # a gradient that can differ
        torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            learn_mask(backend, batch, means, "necessity", steps=5),
            learn_mask(make(bridge), batch, means, "necessity", steps=5),
            atol=1e-5,
            rtol=0,
        )


def test_a_ranking_curve_follows_the_ranking_order(joint):
    """The top-n sets follow the ranking as given (not head order): with the joint heads ranked
    last, no set short of all of them reaches the target."""
    bridge, batch, _, means, _ = joint
    layer_one = [(1, h) for h in range(4)]
    ranking = [*layer_one, *reversed(JOINT_HEADS)]
    curve = ranking_curve(InterventionEngine(bridge), batch, means, ranking, "sufficiency", 8)
    assert [s[-1] for s in curve.sets] == ranking
    assert curve.values[:4] == pytest.approx([0.0] * 4, abs=1e-4)
    assert curve.values[4:] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-4)
    assert len(curve.smallest(0.8)) == 8
    with pytest.raises(ValueError, match="names each head once"):
        ranking_curve(bridge, batch, means, [(0, 1), (0, 1)], "necessity")


def test_the_three_methods_compared_on_held_out_examples(joint):
    """faithful_circuit with the mask as its method and the others compared: each finds the four
    joint heads on the discovery half, and on the validation half the set keeps and removes the
    closed-form shares (sufficiency 1, necessity 1 less the means' own share)."""
    bridge, batch, _, means, drift = joint
    ids = sorted({e.example_id for e in batch.events})
    half = torch.tensor([e.example_id in ids[::2] for e in batch.events])
    effects = head_ablation_effects(bridge, batch, means)
    found = faithful_circuit(
        InterventionEngine(bridge),
        batch.select(half),
        batch.select(~half),
        means,
        effects[half],
        pool_size=8,
        search=Search("mask", max_size=6, mask_steps=60),
        random_draws=0,
        compare=("greedy", "single"),
    )
    assert found["method"] == "mask" and set(found["methods"]) == {"mask", "greedy", "single"}
    for method, result in found["methods"].items():
        assert sorted(map(tuple, result["heads"])) == sorted(JOINT_HEADS), method
        assert result["sufficiency"] == pytest.approx(1.0, abs=1e-4)
        assert result["necessity"] == pytest.approx(1 - drift, abs=0.05)
    assert found["necessity"] == pytest.approx(found["methods"]["mask"]["necessity"], abs=1e-5)
    for name in ("necessity_ci", "sufficiency_ci", "coverage", "coverage_ci"):
        assert found["methods"]["mask"][name] == pytest.approx(found[name], abs=1e-5), name
    assert {(r["method"], r["measure"]) for r in found["curves"]} == {
        (m, measure)
        for m in ("mask", "greedy", "single")
        for measure in ("necessity", "sufficiency")
    }
    with pytest.raises(ValueError, match="unknown search method 'beam'"):
        Search("beam")
    with pytest.raises(ValueError, match="target must be a share"):
        Search(target=1.5)


def test_validation_measures_are_ratios_of_sums_with_coverage_by_example():
    """Four examples of two events each, margins set by hand: necessity and sufficiency are
    ratios of summed margins (not means of per-event ratios), coverage counts the examples whose
    summed margin the set removes at least 0.8 of, and each interval holds its value."""
    from mistill_lens.lens.faithful_search import validation_measures

    clean = np.array([4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 3.0, 1.0])
    ablated = np.array([0.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.5])  # removes 8, 2, 0, 3.5
    kept = np.array([3.0, 3.0, 1.0, 1.0, 0.5, 0.5, 2.0, 1.0])
    none = np.zeros(8)
    ids = [0, 0, 1, 1, 2, 2, 3, 3]
    measured = validation_measures(clean, ablated, kept, none, ids, seed=0)
    assert measured["necessity"] == pytest.approx(13.5 / 18)
    assert measured["sufficiency"] == pytest.approx(12 / 18)
    assert measured["coverage"] == pytest.approx(2 / 4)  # examples 0 (8/8) and 3 (3.5/4)
    for name in ("necessity", "sufficiency", "coverage"):
        low, high = measured[f"{name}_ci"]
        assert low <= measured[name] <= high and low < high, name


def test_a_learned_mask_refuses_what_it_cannot_learn(joint):
    bridge, batch, _, means, _ = joint
    with pytest.raises(ValueError, match="unknown measure 'coverage'"):
        learn_mask(bridge, batch, means, "coverage")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        learn_mask(bridge, batch, means, "necessity", steps=0)
    flipped = batch.select(range(len(batch)))
    flipped.chosen, flipped.contrast = flipped.contrast[:, 0].clone(), flipped.chosen[:, None]
    with pytest.raises(ValueError, match="mean clean margin"):
        learn_mask(bridge, flipped, means, "necessity")
    assert ranked_heads(torch.tensor([[0.1, 0.9], [0.5, 0.9]]), pool=[(1, 1), (1, 0)]) == [
        (1, 1),
        (1, 0),
    ]


def test_batched_set_ablations_equal_one_forward_per_set(joint, planted, planted_data):
    """Many head sets jointly ablated in one engine call equal the full forward, set by set."""

    for model, batch, means in [
        (joint[0], joint[1], joint[3]),
        (planted[0], planted_data["batch"], planted_data["means"]),
    ]:
        generator = torch.Generator().manual_seed(0)
        shape = (5, model.cfg.n_layers, model.cfg.n_heads)
        masks = torch.rand(shape, generator=generator) < 0.4
        masks[0] = False  # the clean run
        fast = InterventionEngine(model).set_margins(batch, means, masks)
        full = FullForward(model).set_margins(batch, means, masks)
        torch.testing.assert_close(fast, full, atol=1e-4, rtol=0)
        assert (full[1:] - full[0]).abs().max() > 1e-3  # the ablations move the margins


def test_characterize_reports_the_faithful_circuit_on_held_out_examples(planted, tmp_path):
    """On the planted model (the region margin is DECIDER's 2 + the previous-token head's 4 logits,
    the within margin WITHIN's 3): each kind's set is found on half of the examples and reported on
    the other half, with CIs around it. The z rule discounts the previous-token head as generic;
    by joint effect it is part of the region's mechanism (it carries two thirds of the margin)."""
    from characterized import characterize_into
    from planted import DECIDER, GENERIC, WITHIN

    from mistill_lens.lens.results import CharacterizeConfig

    bridge, tokenizer = planted
    config = CharacterizeConfig(
        seed=0, ks=(1, 2), progress=False, faithful_pool=6, faithful_stability=4
    )
    summary = characterize_into(
        tmp_path / "run",
        bridge,
        tokenizer,
        planted_examples(20, seed=0),
        planted_examples(40, seed=1),
        config,
    )
    faithful = summary["faithful"]
    assert faithful["region"]["heads"] == [list(DECIDER), list(GENERIC)]
    assert faithful["within"]["heads"] == [list(WITHIN)]
    for kind in ("region", "within", "all"):
        found = faithful[kind]
        assert found["necessity"] >= 0.8 and found["sufficiency"] >= 0.8
        low, high = found["necessity_ci"]
        assert low <= found["necessity"] <= high
        assert found["n_examples_discovery"] + found["n_examples_validation"] == 20
        assert found["pool_size"] == 6 and found["size"] == len(found["heads"])
        assert found["random_same_size"]["draws"] == 20
        total = bridge.cfg.n_layers * bridge.cfg.n_heads  # random sets: of every size that fits
        assert {b["size"] for b in found["random_band"]} == {k for k in BAND_SIZES if k <= total}
    # the found sets beat random sets of their size on the validation examples
    assert faithful["region"]["random_same_size"]["necessity"]["p"] < 0.1
    assert (tmp_path / "run" / "figures" / "faithfulness.html").is_file()
    # every resample of the discovery examples finds the region's two heads again; 4 resamples
    # are fewer than a reading needs, which the run records
    stability = faithful["region"]["stability"]
    assert stability["resamples"] == 4 and stability["failed"] == 0
    assert stability["frequency"][f"L{DECIDER[0]}H{DECIDER[1]}"] == 1.0
    assert stability["frequency"][f"L{GENERIC[0]}H{GENERIC[1]}"] == 1.0
    assert len(stability["frequency"]) == 6  # the pool's heads, each with its share
    assert any("4 bootstrap resamples" in w for w in summary["warnings"])
    assert (tmp_path / "run" / "figures" / "stability.html").is_file()
    assert sorted(map(tuple, faithful["all"]["heads"])) == sorted([DECIDER, GENERIC, WITHIN])
    assert summary["circuit"] == [list(DECIDER), list(WITHIN)]  # the z rule's


def test_the_discovery_share_splits_whole_examples(planted, tmp_path):
    """--faithful-discovery 0.25 of 20 examples: the search discovers on 5 and reports on 15, and
    still finds the planted region heads; a share that leaves a side empty is refused."""
    from characterized import characterize_into
    from planted import DECIDER, GENERIC

    from mistill_lens.lens.results import CharacterizeConfig
    from mistill_lens.report import write_report

    with pytest.raises(ValueError, match="faithful_discovery must be a share strictly between"):
        CharacterizeConfig(faithful_pool=6, faithful_discovery=1.0)
    bridge, tokenizer = planted
    config = CharacterizeConfig(
        seed=0,
        ks=(1, 2),
        progress=False,
        faithful_pool=6,
        faithful_random_draws=0,
        faithful_discovery=0.25,
    )
    args = (bridge, tokenizer, planted_examples(20, seed=0), planted_examples(40, seed=1))
    region = characterize_into(tmp_path / "run", *args, config)["faithful"]["region"]
    assert (region["n_examples_discovery"], region["n_examples_validation"]) == (5, 15)
    assert region["heads"] == [list(DECIDER), list(GENERIC)]
    # the report's table shows the set, its measures with their intervals and the split
    page = write_report([tmp_path / "run"], tmp_path / "report").read_text()
    table = page[page.index("<h3>Faithful circuits") :]
    region_row = table[table.index("<td>region</td>") :].split("</tr>")[0]
    assert f"L{DECIDER[0]}H{DECIDER[1]}, L{GENERIC[0]}H{GENERIC[1]}" in region_row
    low, high = region["necessity_ci"]
    assert f"[{low:.3g}, {high:.3g}]" in region_row and "<td>5 / 15</td>" in region_row


class _Interrupted(Exception):
    pass


class _StopsAfter(SearchLog):
    """A search log whose run is killed after it has recorded `limit` steps."""

    def __init__(self, path, fingerprint, limit):
        super().__init__(path, fingerprint)
        self.limit, self.recorded = limit, 0

    def record(self, key, step):
        if self.recorded == self.limit:
            raise _Interrupted
        super().record(key, step)
        self.recorded += 1


def test_an_interrupted_search_resumes_to_the_uninterrupted_curves(joint, tmp_path):
    """Killed after a few steps, a greedy search given the same log replays the steps taken and
    computes only the rest: both curves equal an uninterrupted run's, and the resumed run records
    exactly the steps the first did not."""
    bridge, batch, _, means, _ = joint
    engine = InterventionEngine(bridge)
    pool, path, fingerprint = all_heads(bridge), tmp_path / "search.json", {"run": "a"}
    whole = (
        necessity_curve(engine, batch, means, pool, max_size=6),
        sufficiency_curve(engine, batch, means, pool),
    )

    def both(log):
        return (
            necessity_curve(engine, batch, means, pool, max_size=6, log=log, key="n"),
            sufficiency_curve(engine, batch, means, pool, log=log, key="s"),
        )

    with pytest.raises(_Interrupted):
        both(_StopsAfter(path, fingerprint, limit=8))  # 6 necessity steps, 2 sufficiency steps
    resumed = _StopsAfter(path, fingerprint, limit=10**6)
    assert both(resumed) == whole
    assert resumed.recorded == len(pool) - 1 - 2  # the sufficiency steps not yet taken
    assert both(_StopsAfter(path, fingerprint, limit=0)) == whole  # all replayed, none computed

    with pytest.raises(StaleResultError, match="run differ"):
        SearchLog(path, {"run": "b"})
    with pytest.warns(StaleResultWarning):
        fresh = SearchLog(path, {"run": "b"}, stale="recompute")
    assert fresh.steps("n") == [] and fresh.result("n") is None


def test_a_characterisation_resumes_its_faithful_search_from_its_folder(
    planted, tmp_path, monkeypatch
):
    """The search log stays in the run's folder: a second run there takes each kind's finished
    search from it (here the search itself is made to fail, so nothing can be recomputed), and a
    run with other search options is refused rather than given the first run's sets."""
    from characterized import characterize_into

    import mistill_lens.lens.characterize as pipeline
    from mistill_lens.lens.results import CharacterizeConfig
    from mistill_lens.lens.run_folder import SEARCH_LOG

    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, ks=(1,), progress=False, faithful_pool=4)
    args = (bridge, tokenizer, planted_examples(12, seed=0), planted_examples(24, seed=1))
    first = characterize_into(tmp_path / "run", *args, config)
    assert (tmp_path / "run" / SEARCH_LOG).is_file()

    def no_search(*_, **__):
        raise AssertionError("the search ran again")

    monkeypatch.setattr(pipeline, "faithful_circuit", no_search)
    again = characterize_into(tmp_path / "run", *args, config)
    assert again["faithful"] == first["faithful"] and set(first["faithful"]) >= {"region", "all"}
    with pytest.raises(StaleResultError, match="search options"):
        characterize_into(tmp_path / "run", *args, replace(config, faithful_pool=5))


def test_the_faithful_rule_makes_the_search_s_sets_the_run_s_circuits(planted, tmp_path):
    """With circuit='faithful' the sets found by joint effect are the run's circuits (its measures,
    its figures, what consumers read): the region's is the decider and the previous-token head the
    z rule discounts; the z rule's circuit stays the default."""
    from characterized import characterize_into
    from planted import DECIDER, GENERIC

    from mistill_lens.lens.results import CharacterizeConfig

    bridge, tokenizer = planted
    config = CharacterizeConfig(seed=0, ks=(1,), progress=False, faithful_pool=6)
    args = (bridge, tokenizer, planted_examples(20, seed=0), planted_examples(40, seed=1))
    by_z = characterize_into(tmp_path / "run", *args, config)
    faithful = characterize_into(tmp_path / "run", *args, replace(config, circuit="faithful"))
    assert by_z["region"]["circuit"] != faithful["region"]["circuit"]
    assert faithful["region"]["circuit"] == [list(DECIDER), list(GENERIC)]
    assert faithful["circuit"] == faithful["faithful"]["all"]["heads"]
    assert faithful["faithful"] == by_z["faithful"]  # one search, two ways of reading it
    with pytest.raises(ValueError, match="needs the faithfulness search"):
        CharacterizeConfig(circuit="faithful")
    with pytest.raises(ValueError, match="circuit must be one of"):
        CharacterizeConfig(circuit="greedy")
