import pytest
import torch
from conftest import head_ablation_effects
from planted import DEAD, DECIDER, GENERIC, GENERIC_GAIN, REGION_GAIN, WITHIN, WITHIN_GAIN

from mistill_lens.lens.events import position_class_names
from mistill_lens.lens.hooks import (
    ablate_all_but_hooks,
    all_heads,
    collect_z,
    compute_head_means,
    event_position_classes,
    gather_at_positions,
    knock_in_hooks,
    mean_ablation_hooks,
    validate_heads,
)
from mistill_lens.lens.margins import attribution_scores, decision_margins, run_margins


@pytest.fixture(scope="module")
def random_setup(random_bridge, planted_data):
    reference = planted_data["reference_batch"]
    means = compute_head_means(
        random_bridge,
        reference.tokens,
        event_position_classes(reference),
        position_class_names(reference.kinds),
    )
    return random_bridge, planted_data["batch"], means


def logits_with(model, tokens, hooks):
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=list(hooks))


def test_mean_ablation_equals_a_handwritten_hook(random_setup, planted_data):
    model, batch, means = random_setup
    reference = planted_data["reference_batch"]
    heads = [(0, 1), (2, 3), (2, 0)]
    _, cache = model.run_with_cache(
        reference.tokens, names_filter=lambda n: n.endswith("attn.hook_z")
    )
    rows = torch.arange(len(reference))
    handwritten_means = {}
    for layer in (0, 2):
        at_event = cache[f"blocks.{layer}.attn.hook_z"][
            rows, reference.predict_positions
        ]  # [event, head, d_head]
        for kind in ("region", "within"):
            picked = torch.tensor([k == kind for k in reference.kinds])
            handwritten_means[layer, kind] = at_event[picked].mean(dim=0)

    def handwritten(layer):
        def hook(act, hook):
            act = act.clone()
            for row, (position, kind) in enumerate(
                zip(batch.predict_positions.tolist(), batch.kinds)
            ):
                for l, h in heads:
                    if l == layer:
                        act[row, position, h] = handwritten_means[layer, kind][h]
            return act

        return hook

    expected = logits_with(
        model, batch.tokens, [(f"blocks.{l}.attn.hook_z", handwritten(l)) for l in (0, 2)]
    )
    ours = logits_with(
        model, batch.tokens, mean_ablation_hooks(model, heads, means, event_position_classes(batch))
    )
    clean = logits_with(model, batch.tokens, [])
    assert (expected - clean).abs().max() > 1e-3  # the ablation does something
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)


def test_knocking_all_heads_of_a_into_a_changes_nothing(random_setup):
    model, batch, _ = random_setup
    z = collect_z(model, batch.tokens)
    rows = torch.arange(len(batch))
    source = gather_at_positions(z, rows, batch.predict_positions)
    knocked = logits_with(
        model,
        batch.tokens,
        knock_in_hooks(model, all_heads(model), source, batch.predict_positions),
    )
    torch.testing.assert_close(knocked, logits_with(model, batch.tokens, []), atol=1e-6, rtol=0)


def test_ablating_no_heads_or_no_positions_changes_nothing(random_setup):
    model, batch, means = random_setup
    assert ablate_all_but_hooks(model, all_heads(model), means, event_position_classes(batch)) == []
    nowhere = torch.full(batch.tokens.shape, -1)
    untouched = logits_with(
        model, batch.tokens, mean_ablation_hooks(model, all_heads(model), means, nowhere)
    )
    torch.testing.assert_close(untouched, logits_with(model, batch.tokens, []), atol=0, rtol=0)


def test_hooks_compose_in_either_order_where_they_commute(random_setup):
    model, batch, means = random_setup
    classes = event_position_classes(batch)
    ablate_a = mean_ablation_hooks(model, [(0, 1)], means, classes)
    ablate_b = mean_ablation_hooks(model, [(0, 2), (1, 3)], means, classes)
    both = mean_ablation_hooks(model, [(0, 1), (0, 2), (1, 3)], means, classes)
    donors = torch.roll(torch.arange(len(batch)), 1)
    z = collect_z(model, batch.tokens)
    knock = knock_in_hooks(
        model,
        [(2, 0), (2, 2)],
        gather_at_positions(z, donors, batch.predict_positions[donors]),
        batch.predict_positions,
    )
    reference = logits_with(model, batch.tokens, [*both, *knock])
    for order in (
        [*ablate_a, *ablate_b, *knock],
        [*knock, *ablate_b, *ablate_a],
        [*ablate_b, *knock, *ablate_a],
    ):
        torch.testing.assert_close(
            logits_with(model, batch.tokens, order), reference, atol=1e-6, rtol=0
        )
    # a sufficiency run is the complement ablation, whatever order it is built in
    keep = [(1, 0), (2, 1)]
    others = [h for h in all_heads(model) if h not in keep]
    torch.testing.assert_close(
        logits_with(model, batch.tokens, ablate_all_but_hooks(model, keep, means, classes)),
        logits_with(model, batch.tokens, mean_ablation_hooks(model, others[::-1], means, classes)),
        atol=1e-6,
        rtol=0,
    )


def test_bad_input_gives_clear_errors(random_setup, planted_data):
    model, batch, means = random_setup
    classes = event_position_classes(batch)
    with pytest.raises(KeyError, match="unknown hook name"):
        run_margins(model, batch, [("blocks.9.attn.hook_z", lambda act, hook: act)])
    with pytest.raises(IndexError, match="out of range"):
        mean_ablation_hooks(model, [(3, 0)], means, classes)
    with pytest.raises(IndexError, match="out of range"):
        validate_heads(model, [(0, 4)])
    with pytest.raises(ValueError, match="empty head set"):
        mean_ablation_hooks(model, [], means, classes)
    with pytest.raises(ValueError, match="empty head set"):
        knock_in_hooks(model, [], torch.zeros(3, len(batch), 4, 8), batch.predict_positions)
    with pytest.raises(ValueError, match="positions were given"):
        run_margins(model, batch, mean_ablation_hooks(model, [(0, 0)], means, classes[:, :-1]))
    with pytest.raises(IndexError, match="outside"):
        run_margins(
            model,
            batch,
            knock_in_hooks(
                model, [(0, 0)], torch.zeros(3, len(batch), 4, 8), batch.predict_positions + 100
            ),
        )
    reference = planted_data["reference_batch"]
    names = (
        "region",
        "within",
        "near_miss",
        "null",
    )  # near_miss: a class none of the reference positions has
    with_empty = compute_head_means(
        model, reference.tokens, event_position_classes(reference, names), names
    )
    with pytest.raises(ValueError, match="no reference positions"):
        mean_ablation_hooks(model, [(0, 0)], with_empty, torch.full_like(classes, 2))


def test_attribution_matches_a_finite_difference(random_setup):
    model, batch, means = random_setup
    scores = attribution_scores(model, batch, means)
    layer, head, step = 1, 2, 1e-2
    class_index = torch.tensor([means.class_index(k) for k in batch.kinds])
    rows = torch.arange(len(batch))

    def toward_mean(act, hook):
        act = act.clone()
        current = act[rows, batch.predict_positions, head]
        act[rows, batch.predict_positions, head] = current + step * (
            means.means[class_index, layer, head] - current
        )
        return act

    clean = run_margins(model, batch)
    moved = run_margins(model, batch, [(f"blocks.{layer}.attn.hook_z", toward_mean)])
    torch.testing.assert_close(scores[:, layer, head], (clean - moved) / step, atol=2e-3, rtol=2e-2)


def reference_frequencies(reference, kind):
    chosen = reference.chosen[torch.tensor([k == kind for k in reference.kinds])]
    return {int(t): float((chosen == t).float().mean()) for t in chosen.unique()}


def test_planted_heads_have_their_exact_effects(planted, planted_data):
    """Mean-ablating the decider at "=" leaves gain * (f_chosen - f_contrast) of its contribution,
    f being the reference frequency of each region; attribution is exact on this linear model."""
    bridge, _ = planted
    batch, means, reference = (
        planted_data["batch"],
        planted_data["means"],
        planted_data["reference_batch"],
    )
    exact = head_ablation_effects(bridge, batch, means)
    attribution = attribution_scores(bridge, batch, means)
    torch.testing.assert_close(attribution, exact, atol=1e-4, rtol=0)

    for kind, head, gain in (
        ("region", DECIDER, REGION_GAIN),
        ("region", GENERIC, GENERIC_GAIN),
        ("within", WITHIN, WITHIN_GAIN),
    ):
        freq = reference_frequencies(reference, kind)
        rows = [i for i, k in enumerate(batch.kinds) if k == kind]
        expected = torch.tensor(
            [
                gain
                * (
                    1
                    - freq.get(int(batch.chosen[i]), 0.0)
                    + freq.get(int(batch.contrast[i, 0]), 0.0)
                )
                for i in rows
            ]
        )
        torch.testing.assert_close(exact[rows, head[0], head[1]], expected, atol=1e-4, rtol=0)
    within_rows = [i for i, k in enumerate(batch.kinds) if k == "within"]
    region_rows = [i for i, k in enumerate(batch.kinds) if k == "region"]
    assert exact[within_rows][:, 0, [DECIDER[1], GENERIC[1]]].abs().max() < 1e-4
    assert exact[region_rows, 0, WITHIN[1]].abs().max() < 1e-4
    assert exact[:, DEAD[0], DEAD[1]].abs().max() < 1e-4 and exact[:, 1].abs().max() < 1e-4


def test_planted_knock_in_transfers_exactly_the_deciders_share(planted, planted_data):
    bridge, _ = planted
    batch = planted_data["batch"].of_kind("region")
    z = collect_z(bridge, batch.tokens)
    donors = torch.roll(torch.arange(len(batch)), 1)
    distinct = batch.chosen[donors] != batch.chosen
    hooks = knock_in_hooks(
        bridge,
        [DECIDER],
        gather_at_positions(z, donors, batch.predict_positions[donors]),
        batch.predict_positions,
    )
    with torch.no_grad():
        logits = bridge.run_with_hooks(batch.tokens, fwd_hooks=hooks)
        clean_logits = bridge(batch.tokens)
    from mistill_lens.lens.margins import margins_at

    donor_choice = (batch.predict_positions, batch.chosen[donors], batch.contrast[donors])
    before = margins_at(clean_logits, *donor_choice)
    after = margins_at(logits, *donor_choice)
    donor_own = decision_margins(clean_logits, batch)[donors]
    transfer = (after - before) / (donor_own - before)
    torch.testing.assert_close(
        transfer[distinct],
        torch.full((int(distinct.sum()),), REGION_GAIN / (REGION_GAIN + GENERIC_GAIN)),
        atol=1e-4,
        rtol=0,
    )


def test_the_same_hooks_work_on_a_llama_bridge_with_grouped_kv_heads(planted, planted_data):
    """The student family: rotary, RMSNorm, 4 query heads sharing 2 key/value heads."""
    from planted import VOCAB
    from transformer_lens import TransformerBridge
    from transformers import LlamaConfig, LlamaForCausalLM

    from mistill_lens.lens.backends import means_from_events

    _, tokenizer = planted
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = TransformerBridge.boot_transformers(
        "llama",
        hf_model=LlamaForCausalLM(config).eval(),
        tokenizer=tokenizer,
        device="cpu",
        dtype=torch.float32,
    )
    batch = planted_data["batch"].select(range(8))
    means = means_from_events(model, batch)
    z = collect_z(model, batch.tokens)
    assert z.shape[:2] == (2, 8) and z.shape[3] == 4
    rows = torch.arange(len(batch))
    same = knock_in_hooks(
        model,
        all_heads(model),
        gather_at_positions(z, rows, batch.predict_positions),
        batch.predict_positions,
    )
    torch.testing.assert_close(
        run_margins(model, batch, same), run_margins(model, batch), atol=1e-6, rtol=0
    )
    exact = head_ablation_effects(model, batch, means)
    attribution = attribution_scores(model, batch, means)
    assert exact.abs().max() > 1e-3
    assert torch.corrcoef(torch.stack([attribution.flatten(), exact.flatten()]))[0, 1] > 0.95


def test_heads_are_named_as_the_figures_write_them_and_means_print_briefly(planted, planted_data):
    from mistill_lens.lens.hooks import as_head, mean_ablation_hooks, validate_heads

    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    assert as_head("L1H3") == (1, 3) and as_head("l0h2") == (0, 2) and as_head((1, 0)) == (1, 0)
    assert validate_heads(bridge, ["L1H2", (0, 1), "L0H1"]) == [(0, 1), (1, 2)]
    classes = event_position_classes(batch, means.class_names)
    named = run_margins(bridge, batch, mean_ablation_hooks(bridge, ["L0H0"], means, classes))
    pair = run_margins(bridge, batch, mean_ablation_hooks(bridge, [(0, 0)], means, classes))
    assert torch.equal(named, pair)
    with pytest.raises(ValueError, match="not a name like 'L29H1'"):
        as_head("layer 1 head 2")
    with pytest.raises(IndexError, match="out of range"):
        validate_heads(bridge, ["L9H0"])
    text = repr(means)
    assert "reference positions per class" in text and len(text) < 300


def test_means_need_no_logits_and_are_the_same_in_any_row_batches(random_bridge, planted_data):
    """The means' forwards stop after the last layer's hook_z (no unembedding, whose logits nothing
    reads), leave no hook behind, and do not depend on how rows are batched."""
    reference = planted_data["reference_batch"]
    classes = event_position_classes(reference)
    names = position_class_names(reference.kinds)
    unembedded = []
    random_bridge.hook_dict["unembed.hook_out"].add_hook(lambda act, hook: unembedded.append(1))
    try:
        one_at_a_time = compute_head_means(
            random_bridge, reference.tokens, classes, names, batch_size=1
        )
        budgeted = compute_head_means(random_bridge, reference.tokens, classes, names)
    finally:
        random_bridge.hook_dict["unembed.hook_out"].remove_hooks()
    assert unembedded == []
    torch.testing.assert_close(budgeted.means, one_at_a_time.means, atol=1e-6, rtol=0)
    assert torch.equal(budgeted.counts, one_at_a_time.counts)
    z = collect_z(random_bridge, reference.tokens[:2])  # every layer, from the stopped forward
    assert z.shape[0] == random_bridge.cfg.n_layers
    with torch.no_grad():  # the stopped forwards left no hook in place
        assert all(not point.fwd_hooks for point in random_bridge.hook_dict.values())
