"""The engine cannot be silently wrong: it shares every buffer of the model, honours
TransformerLens's hook contract, and checks itself against the model's own forward. Each failure is
planted and caught."""

import pytest
import torch
from test_engine import gqa_llama, task_batch

from mistill_lens.lens.engine import EngineMismatch, InterventionEngine, unbridged
from mistill_lens.lens.margins import run_margins
from mistill_lens.models.checkpoints import load_model


def rotary_buffers(model):
    return [b for name, b in model.original_model.named_buffers() if name.endswith("inv_freq")]


def in_place(batch):
    def fn(act, hook):  # edits in place and returns None: TransformerLens keeps the edited tensor
        act[torch.arange(act.shape[0]), batch.predict_positions, 1] *= 3.0

    return fn


def keyword_only(batch):
    def fn(act, *, hook):  # TransformerLens calls fn(activation, hook=point)
        act = act.clone()
        act[torch.arange(act.shape[0]), batch.predict_positions, 1] *= 0.5
        return act

    return fn


def test_the_engine_takes_the_models_buffers_not_the_configs():
    """A rotary buffer set by hand (not what the config implies, and non-persistent: not in the
    state dict) is the engine's too; a twin rebuilt from the config would differ by ~1 logit."""
    model, tokenizer = load_model("checkpoints/base_students/llama")  # trained: margins of ~logits
    batch = task_batch(tokenizer)
    before = run_margins(model, batch)
    for buffer in rotary_buffers(model):
        buffer.mul_(1.7)
    changed = run_margins(model, batch)
    assert (changed - before).abs().max() > 0.1  # the buffer matters: not a vacuous check
    engine = InterventionEngine(model)
    torch.testing.assert_close(engine.margins(batch, lambda view: []), changed, atol=1e-4, rtol=0)
    assert engine.check_record["passed"]
    # shared, not copied: every parameter and buffer of the twin is the model's own tensor
    theirs = {t.data_ptr() for t in model.original_model.state_dict(keep_vars=True).values()}
    theirs |= {b.data_ptr() for b in model.original_model.buffers()}
    twin = engine.hf
    assert all(t.data_ptr() in theirs for t in [*twin.parameters(), *twin.buffers()])


def test_the_twin_is_built_without_a_second_copy_of_the_weights():
    model, _ = gqa_llama()
    twin = unbridged(model)
    assert not any(t.is_meta for t in [*twin.parameters(), *twin.buffers()])
    # every parameter object is the model's own (requires_grad flags untouched)
    own = {id(p) for p in model.original_model.parameters()}
    assert all(id(p) in own for p in twin.parameters())


def test_a_buffer_that_differs_from_the_models_is_caught_by_the_check():
    model, tokenizer = gqa_llama()
    batch = task_batch(tokenizer)
    engine = InterventionEngine(model)
    rotary = engine.hf.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq * 1.7  # the twin's own, no longer the model's
    with pytest.raises(EngineMismatch, match=r"disagrees with the model's own forward by up to"):
        engine.margins(batch, lambda view: [])
    assert not engine.check_record["passed"]
    assert engine.check_record["max_abs_diff"] > engine.check_record["tolerance"]


def test_a_broken_layer_below_the_last_is_caught_by_the_check():
    """The clean margins are recomputed from layer 0, so a wrong layer 0 cannot hide behind a
    cached residual of the last layer."""
    model, tokenizer = gqa_llama()
    batch = task_batch(tokenizer)
    engine = InterventionEngine(model)
    right = engine.adapter.mlp_out

    def wrong(layer, x):
        out = right(layer, x)
        return out * 1.5 if layer == 0 else out

    engine.adapter.mlp_out = wrong
    with pytest.raises(EngineMismatch, match="clean, from layer 0"):
        engine.prepare(batch)


def test_the_check_passes_and_is_recorded_when_the_engine_is_right():
    model, tokenizer = gqa_llama()
    engine = InterventionEngine(model)
    record = engine.check(task_batch(tokenizer))
    assert record["passed"] and record["max_abs_diff"] <= record["tolerance"]
    assert record["ablation_effect"] > 1e-3  # the zeroed heads moved the margin: a real check
    assert len(record["ablated_heads"]) >= 1


@pytest.mark.parametrize(
    "hook",
    [
        pytest.param(in_place, id="in place, returns None"),
        pytest.param(keyword_only, id="keyword-only hook"),
    ],
)
def test_the_engine_honours_the_transformer_lens_hook_contract(hook):
    model, tokenizer = gqa_llama()
    batch = task_batch(tokenizer)
    engine = InterventionEngine(model)

    def hooks_for(b):
        return [("blocks.1.attn.hook_z", hook(b))]

    full = run_margins(model, batch, hooks_for(batch))
    assert (full - run_margins(model, batch)).abs().max() > 1e-3
    torch.testing.assert_close(engine.margins(batch, hooks_for), full, atol=1e-4, rtol=0)
