"""The intervention engine against the full forward: every intervention and combination, on GPT-2,
Llama with grouped key/value heads and the planted model, in float32 and bfloat16."""

import warnings

import pandas as pd
import pytest
import torch
from characterized import characterize_into
from conftest import head_ablation_effects
from planted import DECIDER, WITHIN, planted_examples
from transformer_lens import TransformerBridge

from mistill_lens import task
from mistill_lens.lens.backends import EngineFallbackWarning, chunked_margins, means_from_events
from mistill_lens.lens.characterize import CharacterizeConfig
from mistill_lens.lens.circuits import attention_mass, knock_in_donors, knock_in_transfer, necessity
from mistill_lens.lens.elicitation import carrying_heads, residuals_before
from mistill_lens.lens.engine import EngineUnsupported, InterventionEngine, event_view
from mistill_lens.lens.events import events_from_spans, make_event_batch
from mistill_lens.lens.hooks import (
    ablate_all_but_hooks,
    collect_z,
    event_position_classes,
    knock_in_hooks,
    mean_ablation_hooks,
)
from mistill_lens.lens.margins import attribution_scores, run_margins
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor
from mistill_lens.models.checkpoints import load_model
from mistill_lens.models.students import build_student, student_config
from mistill_lens.models.tokenizers import student_tokenizer


def gqa_llama(dtype=torch.float32):
    """A random Llama with 4 query heads sharing 2 key/value heads, rotary positions."""
    tokenizer = student_tokenizer()
    config = student_config(
        "llama",
        len(tokenizer),
        tokenizer.eos_token_id,
        n_layer=3,
        n_head=4,
        n_embd=64,
        n_kv_head=2,
        n_ctx=2048,
    )
    hf = build_student(config, seed=0).eval()
    bridge = TransformerBridge.boot_transformers(
        "gqa-llama", hf_model=hf, tokenizer=tokenizer, device="cpu", dtype=dtype
    )
    return bridge.to(dtype), tokenizer


MODELS = {
    "gpt2 teacher": lambda: load_model("tiny"),
    "llama student": lambda: load_model("checkpoints/base_students/llama"),
    "llama grouped kv": gqa_llama,
}


def task_batch(tokenizer, n=3, k=8):
    examples = task.generate_examples(n, 0, "heldout", k=k, max_mentions=2)
    encoded = [events_from_spans(e, tokenizer, i) for i, e in enumerate(examples)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_event_batch(encoded, pad_token_id=pad)


def knock_in_values(model, batch, sources):
    return collect_z(model, batch.tokens)[:, sources, batch.predict_positions[sources]]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_intervention_matches_the_full_forward(name):
    model, tokenizer = MODELS[name]()
    batch = task_batch(tokenizer)
    means = means_from_events(model, batch)
    engine = InterventionEngine(model)
    with torch.no_grad():  # the engine stands in for the model, full forwards included
        torch.testing.assert_close(engine(batch.tokens[:1]), model(batch.tokens[:1]))
    engine_means = means_from_events(engine, batch)
    torch.testing.assert_close(engine_means.means, means.means, atol=1e-5, rtol=0)
    assert engine_means.class_names == means.class_names
    assert torch.equal(engine_means.counts, means.counts)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    heads = [(0, 1), (n_layers - 1, n_heads - 1), (1, 0)]
    sources = torch.arange(len(batch)).flip(0)
    full_values = knock_in_values(model, batch, sources)
    engine_values = engine.event_z(batch)[:, sources]
    torch.testing.assert_close(engine_values, full_values, atol=1e-4, rtol=0)

    def classes(b):
        return event_position_classes(b, means.class_names)

    def scale_head(b):
        def fn(act, hook):
            act = act.clone()
            act[torch.arange(act.shape[0]), b.predict_positions, 1] *= 3.0
            return act

        return [(f"blocks.{n_layers // 2}.attn.hook_z", fn)]

    interventions = {
        "clean": lambda b: [],
        "mean ablation": lambda b: mean_ablation_hooks(model, heads, means, classes(b)),
        "ablate all but": lambda b: ablate_all_but_hooks(model, heads, means, classes(b)),
        "knock-in": lambda b: knock_in_hooks(
            model, heads, full_values if b is batch else engine_values, b.predict_positions
        ),
        "a user's hook": scale_head,
        "ablation + knock-in + user hook": lambda b: [
            *mean_ablation_hooks(model, heads[:1], means, classes(b)),
            *knock_in_hooks(
                model, heads[1:], full_values if b is batch else engine_values, b.predict_positions
            ),
            *scale_head(b),
        ],
    }
    clean = run_margins(model, batch)
    for what, hooks_for in interventions.items():
        full = run_margins(model, batch, hooks_for(batch))
        fast = engine.margins(batch, hooks_for, chunk=len(batch))
        torch.testing.assert_close(fast, full, atol=1e-4, rtol=0, msg=f"{name}: {what}")
        if what != "clean":
            assert (full - clean).abs().max() > 1e-3, f"{what} changed nothing: a vacuous check"

    scores = attribution_scores(model, batch, means)
    torch.testing.assert_close(engine.attribution(batch, means), scores, atol=1e-4, rtol=0)
    # in backward passes of two rows each (the engine's grad_rows bounds its memory)
    two_rows = InterventionEngine(model, grad_rows=2)
    torch.testing.assert_close(two_rows.attribution(batch, means), scores, atol=1e-4, rtol=0)
    for layer in (0, n_layers - 1):
        _, cache = model.run_with_cache(
            batch.tokens, names_filter=[f"blocks.{layer}.attn.hook_pattern"]
        )
        rows = torch.arange(len(batch))
        full_rows = cache[f"blocks.{layer}.attn.hook_pattern"][rows, :, batch.predict_positions]
        got = engine.event_patterns(batch, layer)
        torch.testing.assert_close(got, full_rows[..., : got.shape[-1]], atol=1e-5, rtol=0)
        # one event alone, from clean passes that reach further (the example's later events)
        first = engine.event_patterns(batch.select([0]), layer)
        torch.testing.assert_close(first[0], got[0, :, : first.shape[-1]], atol=1e-6, rtol=0)


def test_bfloat16_engine_matches_the_bfloat16_full_forward():
    model, tokenizer = gqa_llama(torch.bfloat16)
    batch = task_batch(tokenizer)
    means = means_from_events(model, batch)
    engine = InterventionEngine(model)
    heads = [(0, 1), (2, 3)]

    def ablate(b):
        return mean_ablation_hooks(
            model, heads, means, event_position_classes(b, means.class_names)
        )

    full = run_margins(model, batch, ablate(batch)).float()
    fast = engine.margins(batch, ablate).float()
    # bfloat16 keeps 8 bits of mantissa: the two kernel orders differ by a few of its steps
    scale = full.abs().max().clamp(min=1.0)
    assert (fast - full).abs().max() <= 0.05 * scale, (fast - full).abs().max()


def test_planted_necessity_knock_in_and_families_are_exact_on_the_engine(planted, planted_data):
    bridge, _ = planted
    engine = InterventionEngine(bridge)
    batch, means = planted_data["batch"], planted_data["means"]
    torch.testing.assert_close(
        necessity(engine, batch, means, [DECIDER, WITHIN]),
        necessity(bridge, batch, means, [DECIDER, WITHIN]),
        atol=1e-5,
        rtol=0,
    )
    donors = knock_in_donors(batch, seed=0)
    torch.testing.assert_close(
        knock_in_transfer(engine, batch, [DECIDER, WITHIN], donors),
        knock_in_transfer(bridge, batch, [DECIDER, WITHIN], donors),
        atol=1e-5,
        rtol=0,
        equal_nan=True,
    )
    targets = [[0, int(p)] for p in batch.predict_positions]
    torch.testing.assert_close(
        attention_mass(engine, batch, targets),
        attention_mass(bridge, batch, targets),
        atol=1e-5,
        rtol=0,
    )


def test_a_sweep_on_the_engine_equals_the_full_forward_sweep(planted, planted_data):
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    full = head_ablation_effects(bridge, batch, means)
    table = ablation_sweep(InterventionEngine(bridge), batch, means, progress=False)
    fast = effects_tensor(table, len(batch), bridge.cfg.n_layers, bridge.cfg.n_heads)
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
    assert full.abs().max() > 0.1  # the planted deciders move the margin
    # a cache with room for about three examples: the sweep goes block by block, same table
    engine = InterventionEngine(bridge)
    engine.prepare(batch)
    per_example = max(c.n_bytes for c in engine._caches.values())
    tight = InterventionEngine(bridge, cache_bytes=3 * per_example)
    assert len(tight.sweep_blocks(batch)) >= 8
    blocked = ablation_sweep(tight, batch, means, progress=False)
    pd.testing.assert_frame_equal(
        blocked.drop(columns=["ablated_margin", "effect", "fraction_lost"]),
        table.drop(columns=["ablated_margin", "effect", "fraction_lost"]),
    )
    torch.testing.assert_close(
        effects_tensor(blocked, len(batch), bridge.cfg.n_layers, bridge.cfg.n_heads),
        full,
        atol=1e-5,
        rtol=0,
    )


def test_a_cache_too_small_for_the_examples_runs_each_clean_pass_once_per_call(
    planted, planted_data, monkeypatch
):
    """With room for one example's clean pass, a call that repeats the events once per head set
    (events of 24 examples, 3 sets) still runs each example's pass once, not once per set, and
    gives the margins of an engine that keeps every pass."""
    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    masks = torch.zeros(3, bridge.cfg.n_layers, bridge.cfg.n_heads, dtype=torch.bool)
    masks[1, 0, 0] = masks[2, 1, :2] = True
    roomy = InterventionEngine(bridge)
    expected = roomy.set_margins(batch, means, masks)
    tight = InterventionEngine(bridge, cache_bytes=1, chunk=16)  # several chunks per call
    tight.check(batch)
    tight.clear()
    passes = []
    original = InterventionEngine._clean_pass
    monkeypatch.setattr(
        InterventionEngine,
        "_clean_pass",
        lambda self, tokens, positions: passes.append(1) or original(self, tokens, positions),
    )
    torch.testing.assert_close(tight.set_margins(batch, means, masks), expected, atol=1e-5, rtol=0)
    n_examples = len({e.example_id for e in batch.events})
    assert len(passes) == n_examples
    # the sweep's per-layer calls and the attribution alike: once per example per call
    passes.clear()
    tight.clear()
    tight.layer_sweep(batch, means, 1, [0, 1, 2])
    assert len(passes) == n_examples


def test_reading_every_example_keeps_no_more_passes_alive_than_the_cache(
    planted, planted_data, monkeypatch
):
    """The means, knock-in sources and attention rows read every example's clean pass: with room
    for one pass, no earlier pass may still be alive when the next is made (a list of every
    example's pass, held to the end of the call, made the n = 150 means hold ~8 GB), and the
    results equal those of an engine that keeps every pass."""
    import weakref

    bridge, _ = planted
    batch, means = planted_data["batch"], planted_data["means"]
    roomy = InterventionEngine(bridge)
    expected_z, expected_rows = roomy.event_z(batch), roomy.event_patterns(batch, 1)
    tight = InterventionEngine(bridge, cache_bytes=1)
    tight.check(batch)
    tight.clear()
    made, alive_at_make = [], []
    original = InterventionEngine._clean_pass

    def counted(self, tokens, positions):
        alive_at_make.append(sum(ref() is not None for ref in made))
        cache = original(self, tokens, positions)
        made.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(InterventionEngine, "_clean_pass", counted)
    torch.testing.assert_close(tight.event_z(batch), expected_z, atol=1e-6, rtol=0)
    torch.testing.assert_close(tight.event_patterns(batch, 1), expected_rows, atol=1e-6, rtol=0)
    tight.head_means(batch, means.class_names)
    tight.prepare(batch)
    assert len(made) > 24 and max(alive_at_make) <= 1


def test_a_hook_the_engine_cannot_apply_runs_on_the_full_forward_with_a_warning(
    planted, planted_data
):
    bridge, _ = planted
    batch = planted_data["batch"]

    def resid_hooks(b):  # a hook point inside the layer norm: no single-position meaning here
        return [("blocks.0.ln1.hook_normalized", lambda act, hook: act * 0.5)]

    with pytest.raises(EngineUnsupported, match="only, not 'blocks.0.ln1.hook_normalized'"):
        InterventionEngine(bridge).margins(batch, resid_hooks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = chunked_margins(InterventionEngine(bridge), batch, resid_hooks)
    assert any(issubclass(w.category, EngineFallbackWarning) for w in caught)
    torch.testing.assert_close(fallback, run_margins(bridge, batch, resid_hooks(batch)))


def test_the_event_view_puts_each_event_at_position_zero(planted_data):
    batch = planted_data["batch"]
    view = event_view(batch)
    assert view.tokens.shape == (len(batch), 1)
    assert view.predict_positions.eq(0).all()
    rows = torch.arange(len(batch))
    assert torch.equal(view.tokens[:, 0], batch.tokens[rows, batch.predict_positions])


@pytest.mark.parametrize("name", ["gpt2 teacher", "llama grouped kv"])
def test_early_elicitation_reads_the_same_residuals_on_the_engine(name):
    model, tokenizer = MODELS[name]()
    batch = task_batch(tokenizer).of_kind("region")
    engine = InterventionEngine(model)
    ks = [1, 2, 5]
    torch.testing.assert_close(
        residuals_before(engine, batch, ks), residuals_before(model, batch, ks), atol=1e-4, rtol=0
    )
    means = means_from_events(model, batch)

    def ablate_early(b):  # the head mean-ablated where the rows are read (r - k)
        classes = torch.full(b.tokens.shape, -1, dtype=torch.long)
        classes[torch.arange(len(b)), b.predict_positions] = means.class_names.index("region")
        return mean_ablation_hooks(model, [(0, 1)], means, classes)

    ablated = residuals_before(model, batch, [2], ablate_early)
    torch.testing.assert_close(
        residuals_before(engine, batch, [2], ablate_early), ablated, atol=1e-4, rtol=0
    )
    clean = residuals_before(model, batch, [2])
    assert (ablated[0, -1] - clean[0, -1]).abs().max() > 1e-3  # the ablation moves the residual
    assert (ablated[0, 0] - clean[0, 0]).abs().max() == 0  # but not before its layer
    # the carrying-heads measure runs on the engine (equal to the full forward, NaN included)
    torch.testing.assert_close(
        carrying_heads(engine, batch, k=2, stage=model.cfg.n_layers),
        carrying_heads(model, batch, k=2, stage=model.cfg.n_layers),
        atol=1e-3,
        rtol=1e-3,
        equal_nan=True,
    )


def assert_same_numbers(a, b, path="summary"):
    """Every number of two nested JSON values agrees to 1e-4; everything else is equal."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            assert_same_numbers(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_numbers(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-4, nan_ok=True), path
    else:
        assert a == b, path


def test_the_whole_characterisation_is_the_same_on_the_engine(planted, tmp_path):
    bridge, tokenizer = planted
    summaries = {}
    for engine in (True, False):
        config = CharacterizeConfig(
            seed=0, ks=(1, 2, 3), progress=False, elicitation_kind="region", engine=engine
        )
        summaries[engine] = characterize_into(
            tmp_path / str(engine),
            bridge,
            tokenizer,
            planted_examples(20, seed=0),
            planted_examples(40, seed=1),
            config,
            near_miss_text=lambda example, event: event.chosen if event.kind == "region" else None,
        )
        summaries[engine].pop("config")
    # the backend and the engine's self-check against the full forward are recorded
    engine_backend, full_backend = summaries[True].pop("backend"), summaries[False].pop("backend")
    assert full_backend == {"name": "full forward"}
    assert engine_backend["name"] == "engine" and engine_backend["check"]["passed"]
    assert engine_backend["check"]["max_abs_diff"] <= engine_backend["check"]["tolerance"]
    assert summaries[True]["circuit"] == [list(DECIDER), list(WITHIN)]
    # heads tied at (near) zero effect are ranked by float noise: compare the leaders only
    engine_top, full_top = summaries[True].pop("top_heads"), summaries[False].pop("top_heads")
    for kind in full_top:
        assert engine_top[kind][0] == pytest.approx(full_top[kind][0], abs=1e-4)
    assert_same_numbers(summaries[True], summaries[False])


@pytest.mark.parametrize("name", list(MODELS))
def test_residual_attention_and_mlp_outputs_are_intervened_on_the_engine(name):
    """hook_resid_pre / _post, hook_attn_out and hook_mlp_out at the predicting positions:
    single-position recomputations equal to the full forward (hook_resid_mid falls back to it)."""
    model, tokenizer = MODELS[name]()
    batch = task_batch(tokenizer)
    engine = InterventionEngine(model)
    n_layers = model.cfg.n_layers

    # a shift, not only a scale: RMSNorm would undo a scale of the last residual
    shift = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))

    def at_events(scale):
        def fn(act, hook):
            act = act.clone()
            rows = torch.arange(act.shape[0]), batch_of[0].predict_positions
            act[rows] = act[rows] * scale + shift
            return act

        return fn

    batch_of = [batch]
    clean = run_margins(model, batch)
    for site in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"):
        for layer in (0, n_layers - 1):
            name_ = f"blocks.{layer}.{site}"

            def hooks_for(b, name_=name_):
                batch_of[0] = b
                return [(name_, at_events(0.0 if "out" in name_ else 0.5))]

            full = run_margins(model, batch, hooks_for(batch))
            assert (full - clean).abs().max() > 1e-3, f"{name_} changed nothing"
            fast = engine.margins(batch, hooks_for)
            torch.testing.assert_close(fast, full, atol=1e-4, rtol=0, msg=f"{name}: {name_}")
    with pytest.raises(EngineUnsupported, match="hook_resid_mid"):
        engine.margins(batch, lambda b: [("blocks.0.hook_resid_mid", lambda act, hook: act)])
