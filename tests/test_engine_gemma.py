"""Gemma 3 on the intervention engine: one shared key/value head, QK-norm, post-norms, scaled
embeddings, rotary buffers per layer type and sliding-window layers, equal to the full forward on
random-weight configs, with contexts over 1,024 tokens and events both inside and beyond the
first window (a sliding layer's own cache would keep only the last window of the prefix)."""

import pytest
import torch
from transformer_lens import TransformerBridge
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from mistill_lens.lens.backends import means_from_events
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import DecisionEvent, EncodedExample, make_event_batch
from mistill_lens.lens.hooks import (
    ablate_all_but_hooks,
    event_position_classes,
    mean_ablation_hooks,
)
from mistill_lens.lens.margins import attribution_scores, run_event_logits, run_margins
from mistill_lens.models.tokenizers import student_tokenizer

CONFIGS = {
    # the real model's window (512) and layer pattern in miniature, 1,100-token contexts
    "window 512": dict(sliding_window=512, n_layers=4, full_at=(2,), length=1100),
    # a short window crossed many times, soft-capped logits
    "window 8, soft-capped logits": dict(
        sliding_window=8, n_layers=3, full_at=(1,), length=60, softcap=True
    ),
}


def random_gemma(sliding_window, n_layers, full_at, softcap=False, **_):
    tokenizer = student_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=sliding_window,
        layer_types=[
            "full_attention" if layer in full_at else "sliding_attention"
            for layer in range(n_layers)
        ],
        max_position_embeddings=4096,
        final_logit_softcapping=3.0 if softcap else None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # post-norm weights start at zero scale: give them some
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    # the GGUF loader and a fresh config leave `architectures` empty; the bridge needs it
    hf.config.architectures = ["Gemma3ForCausalLM"]
    return TransformerBridge.boot_transformers(
        "random-gemma3", hf_model=hf, tokenizer=tokenizer, device="cpu", dtype=torch.float32
    )


def event_batch(model, length, sliding_window):
    """Two examples of random tokens; events early (before T - window) and late (past the first
    window); chosen = the model's top token, contrast = its second, so margins are positive."""
    generator = torch.Generator().manual_seed(1)
    vocab = model.cfg.d_vocab
    positions = sorted({3, sliding_window // 2, length - sliding_window // 2, length - 1})
    examples = []
    for example_id in range(2):
        tokens = torch.randint(3, vocab, (length,), generator=generator)
        with torch.no_grad():
            logits = model(tokens[None])[0]
        events = [
            DecisionEvent(
                example_id,
                "late" if p >= sliding_window else "early",
                p,
                int(logits[p - 1].topk(2).indices[0]),
                (int(logits[p - 1].topk(2).indices[1]),),
            )
            for p in positions
        ]
        examples.append(
            EncodedExample(example_id, "", 0, tokens.tolist(), [(0, 0)] * length, events)
        )
    return make_event_batch(examples)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gemma3_on_the_engine_equals_the_full_forward(name):
    settings = CONFIGS[name]
    model = random_gemma(**settings)
    batch = event_batch(model, settings["length"], settings["sliding_window"])
    assert max(batch.predict_positions) > 2 * settings["sliding_window"] or name != "window 512"
    engine = InterventionEngine(model)
    means = means_from_events(model, batch)
    torch.testing.assert_close(
        means_from_events(engine, batch).means, means.means, atol=1e-5, rtol=0
    )
    heads = [(0, 1), (settings["n_layers"] - 1, 3), (1, 2)]

    def classes(b):
        return event_position_classes(b, means.class_names)

    interventions = {
        "clean": lambda b: [],
        "mean ablation": lambda b: mean_ablation_hooks(model, heads, means, classes(b)),
        "ablate all but": lambda b: ablate_all_but_hooks(model, heads, means, classes(b)),
    }
    clean = run_margins(model, batch)
    assert clean.min() > 0
    for what, hooks_for in interventions.items():
        full = run_margins(model, batch, hooks_for(batch))
        fast = engine.margins(batch, hooks_for)
        torch.testing.assert_close(fast, full, atol=1e-4, rtol=0, msg=f"{name}: {what}")
        if what != "clean":
            assert (full - clean).abs().max() > 1e-3, f"{what} changed nothing: a vacuous check"
    torch.testing.assert_close(
        engine.attribution(batch, means), attribution_scores(model, batch, means), atol=1e-4, rtol=0
    )
    assert engine.check_record["passed"]
    for layer in range(settings["n_layers"]):  # sliding and full layers
        _, cache = model.run_with_cache(
            batch.tokens, names_filter=[f"blocks.{layer}.attn.hook_pattern"]
        )
        rows = torch.arange(len(batch))
        full_rows = cache[f"blocks.{layer}.attn.hook_pattern"][rows, :, batch.predict_positions]
        got = engine.event_patterns(batch, layer)
        torch.testing.assert_close(got, full_rows[..., : got.shape[-1]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_event_row_logits_equal_the_full_forwards_rows(name):
    """run_event_logits stops at the unembedding's input and unembeds the events' rows alone (the
    soft cap applied as the model's forward does): equal to the full logits' rows, with and without
    intervention hooks; a hook on the final norm gets the full forward."""
    settings = CONFIGS[name]
    model = random_gemma(**settings)
    batch = event_batch(model, settings["length"], settings["sliding_window"])
    rows = torch.arange(len(batch))
    hooks = mean_ablation_hooks(
        model,
        [(0, 1), (1, 2)],
        means_from_events(model, batch),
        event_position_classes(batch, means_from_events(model, batch).class_names),
    )
    for extra in ([], hooks):
        with torch.no_grad():
            full = model.run_with_hooks(batch.tokens, fwd_hooks=list(extra))[
                rows, batch.predict_positions
            ]
        torch.testing.assert_close(run_event_logits(model, batch, extra), full, atol=1e-5, rtol=0)
    if settings.get("softcap"):
        assert full.abs().max() <= 3.0  # the cap is in the reference, so it was checked

    def double(act, hook):
        return act * 2

    doubled = run_event_logits(model, batch, [("ln_final.hook_normalized", double)])
    with torch.no_grad():
        reference = model.run_with_hooks(
            batch.tokens, fwd_hooks=[("ln_final.hook_normalized", double)]
        )[rows, batch.predict_positions]
    torch.testing.assert_close(doubled, reference, atol=1e-5, rtol=0)
