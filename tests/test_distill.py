"""MISTILL: alignment properties, targets and loss, gradients, the lambda = 0 baseline, precision
modes, bad input, and the evaluation / report path. Tiny random-init teachers and students only."""

import json
import shutil
from dataclasses import replace

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import ByT5Tokenizer, Gemma3ForCausalLM, Gemma3TextConfig

import mistill_lens.distill.training as training_module
from mistill_lens import task
from mistill_lens.distill.align import overlap_matrix, transfer_mass
from mistill_lens.distill.attention import (
    attention_kl,
    collate_items,
    event_attention,
    pattern_recorder,
    pooled_attention,
    residual_recorder,
    student_item,
    teacher_event_attention,
    teacher_head_sets,
)
from mistill_lens.distill.data import reproduces_verbatim
from mistill_lens.distill.evaluation import (
    EVALUATION_FILE,
    causal_recovery,
    check_scores_match,
    evaluate_run,
    median_recovery,
)
from mistill_lens.distill.mention_pairs import mention_comparison
from mistill_lens.distill.report import (
    load_evaluations,
    paired_comparison,
    passes_gate,
    summarise,
    training_curve,
    write_report,
)
from mistill_lens.distill.significance import sign_flip_p_value
from mistill_lens.distill.training import (
    DistillConfig,
    distill,
    distillation_items,
    examples_digest,
    initial_student,
    student_losses,
)
from mistill_lens.lens.adapters import adapter_for
from mistill_lens.lens.calibration import Calibration
from mistill_lens.lens.characterize import Characterization, CharacterizeConfig
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.checkpoints import (
    CheckpointError,
    load_hf_model,
    read_metadata,
    save_checkpoint,
    to_bridge,
)
from mistill_lens.models.precision import compute_mode
from mistill_lens.models.students import build_student, exportable, family_tokenizer, student_config
from mistill_lens.models.tokenizers import student_tokenizer, teacher_tokenizer
from mistill_lens.runs import file_digest

TASK = {"universe_size": 300, "k": 8, "max_mentions": 2}
TEACHER_HEADS = {
    "region": [(1, 0)],
    "within": [(1, 1)],
    "near_miss": [(0, 1), (1, 0)],
    "all": [(0, 1), (1, 0), (1, 1)],
}
TINY = dict(
    n_layer=2, n_head=2, n_embd=32, batch_size=2, lr=3e-3, warmup_steps=1, checkpoint_every=100
)


@pytest.fixture(scope="module")
def examples():
    # gold outputs stand in for traces a perfect teacher reproduces verbatim
    return task.generate_examples(6, 0, "train", **TASK)


@pytest.fixture(scope="module")
def teacher(random_teacher):
    return random_teacher


@pytest.fixture(scope="module")
def texts():
    return [e.text for e in task.generate_examples(4, 1, "train", **TASK)]


def run(config_overrides, teacher, examples, out, **kwargs):
    bridge, tokenizer = teacher
    config = DistillConfig(
        **{**TINY, "family": "llama", "objective": "mistill", "steps": 3, **config_overrides}
    )
    return distill(
        config,
        bridge,
        tokenizer,
        examples,
        teacher_head_sets(TEACHER_HEADS),
        out,
        progress=False,
        **kwargs,
    )


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


# --- alignment -------------------------------------------------------------------------------


def offsets(tokenizer, text):
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def char_level_transfer(mass, source, target):
    """Brute force: spread each source token's mass evenly over its characters, then sum per target token."""
    density = {}
    for m, (s, e) in zip(mass.tolist(), source):
        for c in range(s, e):
            density[c] = density.get(c, 0.0) + m / (e - s)
    return torch.tensor(
        [sum(density.get(c, 0.0) for c in range(s, e)) for s, e in target], dtype=torch.float64
    )


text_slices = st.tuples(
    st.integers(0, 3), st.integers(0, 2000), st.integers(1, 400), st.integers(0, 2**31 - 1)
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text_slices)
def test_alignment_conserves_mass_and_respects_spans(texts, draw):
    which, start, length, seed = draw
    text = texts[which][start : start + length] or texts[which][:length]
    source, target = offsets(teacher_tokenizer(), text), offsets(student_tokenizer(), text)
    mass = torch.rand(
        len(source), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    moved = transfer_mass(mass, source, target, renormalise=False)
    # the student tokens tile the same text: no mass is created or lost
    torch.testing.assert_close(moved.sum(), mass.sum())
    # spans respected: each student token gets exactly the mass of the characters it covers
    torch.testing.assert_close(moved, char_level_transfer(mass, source, target))
    # and only from teacher tokens it overlaps
    matrix = overlap_matrix(source, target)
    for j, (s, e) in enumerate(target):
        overlapping = [i for i, (a, b) in enumerate(source) if a < e and b > s]
        assert set(matrix[:, j].nonzero().flatten().tolist()) <= set(overlapping)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text_slices, st.integers(1, 50))
def test_alignment_into_a_truncated_context_renormalises_what_it_covers(texts, draw, keep):
    which, start, length, seed = draw
    text = texts[which][start : start + length] or texts[which][:length]
    source, target = offsets(teacher_tokenizer(), text), offsets(student_tokenizer(), text)
    target = target[:keep]
    mass = torch.rand(
        len(source), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    expected = char_level_transfer(mass, source, target)
    torch.testing.assert_close(transfer_mass(mass, source, target), expected / expected.sum())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text_slices, st.sampled_from(["teacher", "student"]))
def test_alignment_is_the_identity_for_equal_tokenizers(texts, draw, which_tokenizer):
    which, start, length, seed = draw
    text = texts[which][start : start + length] or texts[which][:length]
    tokenizer = teacher_tokenizer() if which_tokenizer == "teacher" else student_tokenizer()
    spans = offsets(tokenizer, text)
    mass = torch.rand(
        len(spans), generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    assert torch.equal(overlap_matrix(spans, spans), torch.eye(len(spans), dtype=torch.float64))
    assert torch.equal(transfer_mass(mass, spans, spans, renormalise=False), mass)


def test_events_land_inside_their_character_spans_in_both_tokenizers(examples):
    for tokenizer in (teacher_tokenizer(), student_tokenizer()):
        for i, example in enumerate(examples):
            encoded = events_from_spans(example, tokenizer, i)
            for event in encoded.events:
                s, e = encoded.offsets[event.position]
                assert s < event.char_end and e > event.char_start


def test_a_trace_is_verbatim_exactly_when_greedy_decoding_writes_it():
    from dataclasses import replace

    from mistill_lens.models.checkpoints import load_hf_model
    from mistill_lens.models.generate import greedy_text
    from mistill_lens.task.metrics import MAX_NEW_TOKENS

    model, tokenizer = load_hf_model("tiny")
    examples = task.generate_examples(12, 5, "train", k=4, max_mentions=1, universe_size=300)
    verdicts = []
    for example in examples:
        greedy = greedy_text(model, tokenizer, example.prompt, MAX_NEW_TOKENS)
        verbatim = reproduces_verbatim(model, tokenizer, example)
        assert verbatim == (greedy == example.output)
        verdicts.append(verbatim)
        # the teacher's own greedy output is verbatim by definition, a changed one is not
        assert reproduces_verbatim(model, tokenizer, replace(example, output=greedy))
        assert not reproduces_verbatim(model, tokenizer, replace(example, output=greedy + "x"))
    assert any(verdicts) and not all(verdicts), verdicts  # both outcomes were tested


# --- targets and loss ------------------------------------------------------------------------


def tiny_student(family="llama", seed=0, attention="eager"):
    tokenizer = family_tokenizer(family)
    model = build_student(
        student_config(
            family, len(tokenizer), tokenizer.eos_token_id, n_layer=2, n_head=2, n_embd=32
        ),
        seed,
        attention,
    )
    return model, tokenizer


def tiny_gemma(attention="eager"):
    """A 3-layer random Gemma 3: sliding-window layers (window 8) around one global layer, grouped
    keys (4 query heads, 2 key/value heads), QK-norm, norms given some scale."""
    config = Gemma3TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        pad_token_id=0,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.config.architectures = ["Gemma3ForCausalLM"]
    return model


def bridged_pooled(model, tokenizer, ids, heads, query_positions):
    """The pooled event attention as the bridge's hook_pattern holds it (the reference)."""
    bridge = to_bridge(model, tokenizer)
    store = {}
    with bridge.hooks(fwd_hooks=pattern_recorder([layer for layer, _ in heads], store)):
        bridge(ids)
    return pooled_attention(store, heads, query_positions)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_event_rows_equal_the_bridge_pattern_rows_with_their_gradients(family):
    """The training path (memory-efficient attention, event rows recomputed from the recorded
    residuals) gives the rows of hook_pattern, and the same gradients into the student."""
    if family == "gemma3":
        tokenizer = student_tokenizer()
        reference, student = tiny_gemma("eager"), tiny_gemma("sdpa")
        heads = [(0, 1), (1, 0), (1, 3), (2, 2)]  # both window kinds, both key/value groups
    else:
        (reference, tokenizer), (student, _) = (
            tiny_student(family, attention=a) for a in ("eager", "sdpa")
        )
        heads = [(0, 1), (1, 0), (1, 1)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 40), generator=generator)
    query_positions = torch.tensor([[3, 20, 39], [0, 9, 30]])  # early, past the window, last
    expected = bridged_pooled(reference, tokenizer, ids, heads, query_positions)
    store = {}
    adapter = adapter_for(student)
    with residual_recorder(adapter, [layer for layer, _ in heads], store):
        student(ids)
    pooled = event_attention(adapter, store, heads, query_positions)
    torch.testing.assert_close(pooled, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(pooled.sum(-1), torch.ones(2, 3))
    weights = torch.rand(pooled.shape, generator=generator)
    (pooled * weights).sum().backward()
    (expected * weights).sum().backward()
    compared = 0
    # bridged in place, the reference's modules sit under `_original_component`
    bridged = {
        name.replace("._original_component", ""): p for name, p in reference.named_parameters()
    }
    for name, a in student.named_parameters():
        # the GPT-2 bridge moves its attention weights into split q/k/v copies: compared are
        # the parameters both hold
        b = bridged.get(name)
        if b is not None and b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)
            compared += int(b.grad.abs().sum() > 0)
    assert compared > 3


def test_targets_are_distributions_over_the_student_context(teacher, examples):
    bridge, tokenizer = teacher
    item = student_item(
        examples[0],
        0,
        bridge,
        tokenizer,
        student_tokenizer(),
        teacher_head_sets(TEACHER_HEADS),
        1024,
    )
    assert len(item.query_positions) == len(examples[0].events) > 0
    for q, target in zip(item.query_positions, item.attention_targets):
        assert target.shape == (q + 1,) and not target.requires_grad
        torch.testing.assert_close(target.sum(), torch.tensor(1.0))
        assert (target >= 0).all()


def test_targets_on_the_engine_equal_the_full_forward_patterns(teacher, examples):
    bridge, tokenizer = teacher
    heads = teacher_head_sets(TEACHER_HEADS)
    engine = InterventionEngine(bridge)
    for index in range(3):
        encoded = events_from_spans(examples[index], tokenizer, index)
        full = teacher_event_attention(bridge, encoded, heads)
        rows = teacher_event_attention(engine, encoded, heads)
        assert len(rows) == len(full) == len(encoded.events) > 0
        for a, b in zip(rows, full):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_attention_loss_is_zero_iff_pooled_attention_equals_target(teacher, examples):
    model, tokenizer = tiny_student()
    items, _ = distillation_items(
        examples[:2], *teacher, tokenizer, teacher_head_sets(TEACHER_HEADS), 1024
    )
    batch = collate_items(items, tokenizer.pad_token_id)
    with torch.no_grad():
        pooled = bridged_pooled(
            model, tokenizer, batch.ids, [(1, 0), (1, 1)], batch.query_positions
        )
    assert attention_kl(pooled, pooled.clone(), batch.event_mask) == 0
    assert attention_kl(pooled, batch.attention_targets, batch.event_mask) > 0
    nudged = pooled.clone()
    nudged[0, 0, 0] += 1e-3
    nudged[0, 0] /= nudged[0, 0].sum()
    assert attention_kl(pooled, nudged, batch.event_mask) > 0
    # padded event slots do not count
    assert attention_kl(pooled, batch.attention_targets, torch.zeros_like(batch.event_mask)) == 0


def test_gradient_flows_through_the_student_pattern_and_never_into_the_teacher(
    teacher, examples, tmp_path
):
    model, tokenizer = tiny_student(attention="sdpa")
    items, _ = distillation_items(
        examples[:2], *teacher, tokenizer, teacher_head_sets(TEACHER_HEADS), 1024
    )
    batch = collate_items(items, tokenizer.pad_token_id)
    adapter = adapter_for(model)
    _, attention = student_losses(model, adapter, batch, [(1, 0), (1, 1)], "fp32-master")
    attention.backward()
    q_grad = model.model.layers[1].self_attn.q_proj.weight.grad
    assert q_grad is not None and q_grad.abs().sum() > 0  # through the event rows into the student
    before = {name: p.detach().clone() for name, p in teacher[0].named_parameters()}
    run({}, teacher, examples, tmp_path / "run")
    for name, parameter in teacher[0].named_parameters():
        assert parameter.grad is None and not parameter.requires_grad
        assert torch.equal(parameter, before[name])


# --- training --------------------------------------------------------------------------------


def test_lambda_zero_reproduces_the_cot_run(teacher, examples, tmp_path):
    cot = run({"objective": "cot", "steps": 4}, teacher, examples, tmp_path / "cot")
    zero = run(
        {"objective": "mistill", "attention_weight": 0.0, "steps": 4},
        teacher,
        examples,
        tmp_path / "zero",
    )
    assert cot["final_cot_loss"] == zero["final_cot_loss"]
    a, b = weights(tmp_path / "cot"), weights(tmp_path / "zero")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mistill = run(
        {"objective": "mistill", "attention_weight": 1.0, "steps": 4},
        teacher,
        examples,
        tmp_path / "m",
    )
    assert (
        mistill["final_cot_loss"] != cot["final_cot_loss"]
    )  # the attention term does change training
    # the pair saw identical data in the same order from identical initial weights, recorded
    assert cot["paired"] == mistill["paired"] == zero["paired"]
    other_seed = run(
        {"objective": "cot", "steps": 4, "seed": 1}, teacher, examples, tmp_path / "s1"
    )
    assert other_seed["paired"]["initial weights"] != cot["paired"]["initial weights"]
    assert other_seed["paired"]["data"] != cot["paired"]["data"]  # another order


def test_named_rivals_do_not_change_what_a_run_depends_on(examples):
    """Rivals choose a characterisation's contrasts, never a distillation target: examples with and
    without them are the same training data (item caches and runs from before stay valid), while
    a changed event is not."""
    import dataclasses

    def with_events(example, change):
        return dataclasses.replace(example, events=tuple(change(e) for e in example.events))

    assert any(e.rivals for x in examples for e in x.events)
    bare = [with_events(x, lambda e: dataclasses.replace(e, rivals=None)) for x in examples]
    assert examples_digest(bare) == examples_digest(examples)
    moved = [
        with_events(x, lambda e: dataclasses.replace(e, contrast=e.contrast + "0"))
        for x in examples
    ]
    assert examples_digest(moved) != examples_digest(examples)


def test_interrupted_run_resumes_to_identical_weights(teacher, examples, tmp_path, monkeypatch):
    config = {"objective": "mistill", "steps": 4, "checkpoint_every": 2}
    run(config, teacher, examples, tmp_path / "straight")
    # snapshot the folder as the periodic checkpoint at step 2 left it: what a crash leaves
    real_save = training_module.save_checkpoint

    def save_and_snapshot(model, tokenizer, out_dir, metadata, training_state=None):
        path = real_save(model, tokenizer, out_dir, metadata, training_state)
        if metadata["step"] == 2:
            shutil.copytree(path, tmp_path / "interrupted")
        return path

    monkeypatch.setattr(training_module, "save_checkpoint", save_and_snapshot)
    run(config, teacher, examples, tmp_path / "scratch")
    monkeypatch.undo()
    assert read_metadata(tmp_path / "interrupted")["step"] == 2
    with pytest.raises(CheckpointError, match="different configuration"):
        run({**config, "lr": 1e-2}, teacher, examples, tmp_path / "interrupted")
    # nor on a machine that would compute otherwise (bf16 autocast vs float32)
    here = read_metadata(tmp_path / "interrupted")["compute"]
    assert here == compute_mode("cpu", "fp32-master")
    other = "float32" if here == "bf16-autocast" else "bf16-autocast"
    monkeypatch.setattr(training_module, "compute_mode", lambda *args: other)
    with pytest.raises(
        CheckpointError, match=f"computing in {here}, and this machine would go on in {other}"
    ):
        run(config, teacher, examples, tmp_path / "interrupted")
    monkeypatch.undo()
    run(config, teacher, examples, tmp_path / "interrupted")
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "interrupted")
    assert all(torch.equal(a[k], b[k]) for k in a)


def mean_attention_kl(run_dir, teacher, examples):
    model, tokenizer = load_hf_model(run_dir)
    items, _ = distillation_items(
        examples, *teacher, tokenizer, teacher_head_sets(TEACHER_HEADS), 1024
    )
    with torch.no_grad():
        _, kl = student_losses(
            model,
            adapter_for(model),
            collate_items(items, tokenizer.pad_token_id),
            [(1, 0), (1, 1)],
            "fp32-master",
        )
    return float(kl)


def test_attention_loss_moves_pooled_attention_toward_the_target(teacher, examples, tmp_path):
    start = DistillConfig(**{**TINY, "family": "llama", "objective": "mistill"})
    save_checkpoint(
        exportable(initial_student(start)), family_tokenizer("llama"), tmp_path / "start", {}
    )
    initial = mean_attention_kl(tmp_path / "start", teacher, examples)
    run({"objective": "cot", "steps": 12}, teacher, examples, tmp_path / "cot")
    run(
        {"objective": "mistill", "attention_weight": 5.0, "steps": 12},
        teacher,
        examples,
        tmp_path / "mistill",
    )
    cot = mean_attention_kl(tmp_path / "cot", teacher, examples)
    mistill = mean_attention_kl(tmp_path / "mistill", teacher, examples)
    assert initial - mistill > initial - cot
    assert mistill < 0.8 * initial


@pytest.mark.parametrize("family,precision", [("llama", "bf16"), ("gpt2", "fp32-master")])
def test_precision_modes_and_families_train_and_reload(
    teacher, examples, tmp_path, family, precision
):
    metadata = run(
        {"family": family, "precision": precision, "steps": 2}, teacher, examples, tmp_path / "run"
    )
    assert metadata["step"] == 2 and torch.isfinite(torch.tensor(metadata["final_loss"]))
    stored = weights(tmp_path / "run")
    expected = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {t.dtype for t in stored.values()} == {expected}
    model, tokenizer = load_hf_model(tmp_path / "run")
    assert model.config.model_type == ("llama" if family == "llama" else "gpt2")
    assert metadata["n_params"] == sum(
        p.numel() for p in model.parameters()
    )  # not the bridge's extra copies
    assert len(tokenizer) == len(family_tokenizer(family))
    if family == "gpt2":
        assert metadata["n_events"] == sum(len(e.events) for e in examples)


def test_bf16_and_fp32_master_runs_differ_but_both_learn(teacher, examples, tmp_path):
    bf16 = run({"precision": "bf16", "steps": 6}, teacher, examples, tmp_path / "bf16")
    master = run({"precision": "fp32-master", "steps": 6}, teacher, examples, tmp_path / "master")
    state = torch.load(tmp_path / "master" / "training_state.pt", weights_only=False)
    assert state["log"]["cot"][-1] < state["log"]["cot"][0]
    assert bf16["final_cot_loss"] != master["final_cot_loss"]


# --- bad input -------------------------------------------------------------------------------


def test_an_explicit_student_head_set_is_pooled_and_resumes(teacher, examples, tmp_path):
    config = {"student_head_set": ((1, 0),), "steps": 2, "checkpoint_every": 1}
    metadata = run(config, teacher, examples, tmp_path / "one")
    assert metadata["student_heads"] == [[1, 0]]
    # the single head is what the attention loss reads: a different head gives a different loss
    other = run({**config, "student_head_set": ((1, 1),)}, teacher, examples, tmp_path / "other")
    assert other["final_attention_loss"] != metadata["final_attention_loss"]
    # rerunning the finished run is a resume: its saved head set compares equal to the requested one
    assert (
        run(config, teacher, examples, tmp_path / "one")["final_attention_loss"]
        == metadata["final_attention_loss"]
    )
    with pytest.raises(CheckpointError, match="student_head_set"):
        run({**config, "student_head_set": ((0, 0),)}, teacher, examples, tmp_path / "one")
    with pytest.raises(ValueError, match="either as layers or as a head set"):
        DistillConfig(student_layers=(1,), student_head_set=((1, 0),))
    with pytest.raises(ValueError, match="empty head set"):
        run({"student_head_set": ()}, teacher, examples, tmp_path / "empty")


def test_default_student_heads_are_homologous_only_for_a_same_family_student_of_the_teachers_shape():
    teacher_heads = [(0, 1), (1, 0), (1, 0)]
    config = DistillConfig(**{**TINY, "family": "gpt2"})
    assert config.student_heads((2, 2), (2, 2), teacher_heads) == [(0, 1), (1, 0)]
    assert config.student_heads((4, 2), (2, 2), teacher_heads) == [
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
    ]  # another shape: the upper half
    # a cross-family student (no teacher shape given): the upper half
    assert config.student_heads((2, 2), None, teacher_heads) == [(1, 0), (1, 1)]
    assert DistillConfig(**{**TINY, "family": "gpt2", "student_layers": (0,)}).student_heads(
        (2, 2), (2, 2), teacher_heads
    ) == [(0, 0), (0, 1)]


def test_a_run_trained_with_other_heads_is_not_resumed_with_new_ones(teacher, examples, tmp_path):
    bridge, tokenizer = teacher
    config = DistillConfig(**{**TINY, "family": "gpt2", "objective": "mistill", "steps": 1})
    metadata = distill(
        config,
        bridge,
        tokenizer,
        examples,
        teacher_head_sets(TEACHER_HEADS),
        tmp_path / "run",
        progress=False,
    )
    assert metadata["student_heads"] == [
        [0, 1],
        [1, 0],
        [1, 1],
    ]  # the tiny teacher's circuit, homologous
    # as if the run had been made under another default: resuming must not silently switch heads
    metadata_path = tmp_path / "run" / "mistill.json"
    metadata_path.write_text(
        json.dumps({**json.loads(metadata_path.read_text()), "student_heads": [[1, 0], [1, 1]]})
    )
    manifest_path = (
        tmp_path / "run" / "manifest.json"
    )  # written so by that run: its manifest agrees
    manifest_path.write_text(
        json.dumps(
            {**json.loads(manifest_path.read_text()), "mistill.json": file_digest(metadata_path)}
        )
    )
    with pytest.raises(CheckpointError, match="pooling student heads"):
        distill(
            config,
            bridge,
            tokenizer,
            examples,
            teacher_head_sets(TEACHER_HEADS),
            tmp_path / "run",
            progress=False,
        )


def test_student_heads_option_parses_layer_dot_head():
    from mistill_lens.cli.distill import parse_head_set

    assert parse_head_set("3.3, 2.0") == ((3, 3), (2, 0))
    with pytest.raises(ValueError, match="LAYER.HEAD"):
        parse_head_set("3-3")


def test_bad_input_gives_clear_errors(teacher, examples, tmp_path):
    bridge, tokenizer = teacher
    heads = teacher_head_sets(TEACHER_HEADS)
    with pytest.raises(ValueError, match="no character offsets"):
        student_item(examples[0], 0, bridge, tokenizer, ByT5Tokenizer(), heads, 1024)
    with pytest.raises(ValueError, match="outside the student's context of 200"):
        student_item(examples[0], 0, bridge, tokenizer, student_tokenizer(), heads, 200)
    with pytest.raises(ValueError, match="empty teacher head set"):
        teacher_head_sets({"region": [], "within": [], "near_miss": [], "all": []})
    with pytest.raises(ValueError, match="empty student head set"):
        pooled_attention({}, [], torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="empty head set"):
        run({"student_layers": ()}, teacher, examples, tmp_path / "empty")
    with pytest.raises(ValueError, match="fits the student's 200-token context"):
        run({"n_ctx": 200}, teacher, examples, tmp_path / "short")
    with pytest.raises(ValueError, match="unknown objective"):
        DistillConfig(objective="kl")
    with pytest.raises(IndexError, match="out of range"):
        run({"student_layers": (5,)}, teacher, examples, tmp_path / "range")


# --- evaluation and report -------------------------------------------------------------------


def test_causal_recovery_reads_the_characterisation_summary():
    summary = {
        "near_miss": {"n_events": 10, "necessity": 0.6, "knock_in": 0.2, "circuit": [[1, 0]]}
    }
    assert causal_recovery(summary)["causal_recovery"] == pytest.approx(0.4)
    assert causal_recovery(summary)["recovery_knock_in_pooled"] is None  # an older summary
    summary["near_miss"]["knock_in_pooled"] = 0.3
    assert causal_recovery(summary)["recovery_knock_in_pooled"] == 0.3
    no_heads = {"near_miss": {"n_events": 10, "necessity": None, "knock_in": None, "circuit": []}}
    assert causal_recovery(no_heads)["causal_recovery"] == 0.0
    assert causal_recovery(no_heads)["recovery_knock_in_pooled"] == 0.0
    assert causal_recovery({})["causal_recovery"] is None


def test_median_recovery_resists_one_event_with_a_tiny_margin(tmp_path):
    assert median_recovery(tmp_path / "characterization") is None  # not characterised
    kinds = ("near_miss", "region")
    calibration = Calibration(
        kinds, torch.zeros(2, 2, 2), torch.zeros(2, 2), torch.ones(2, 2), 1e-2, (3, 1), 8
    )
    events = pd.DataFrame(
        {
            "example_id": [0, 1, 2, 3],
            "kind": ["near_miss"] * 3 + ["region"],
            "position": [5, 6, 7, 3],
            "necessity": [0.4, 0.6, -12.0, 0.9],
            "sufficiency": [0.0] * 4,
            "knock_in": [0.2, float("nan"), 0.4, 0.9],
        }
    )
    found = Characterization(
        config=CharacterizeConfig(),
        calibration=calibration,
        circuits={"near_miss": [(1, 0)], "region": [], "all": [(1, 0)]},
        attribution=pd.DataFrame(
            columns=["event_row", "kind", "layer", "head", "attribution", "exact"]
        ),
        sweep=pd.DataFrame(),
        null_sweep=pd.DataFrame(),
        events=events,
        families=pd.DataFrame(),
        ablation_curve=pd.DataFrame(),
        elicitation={},
        elicitation_curve=None,
        n_examples=4,
        n_events=4,
        n_null_events=8,
    )
    # median necessity 0.4 (the -12 outlier does not drag it), median knock-in 0.3 (NaN skipped)
    assert found.median_recovery() == pytest.approx(0.35)
    assert found.median_recovery(kind="region") == pytest.approx(0.9)
    assert found.median_recovery(kind="within") is None
    empty = replace(found, circuits={"near_miss": [], "region": [], "all": []}, events=None)
    assert empty.median_recovery() == 0.0  # no heads selected: carries nothing
    assert causal_recovery(found.measures())["recovery_ablation"] == pytest.approx(
        events.necessity[:3].mean()
    )


def test_sign_flip_p_value_known_answers():
    assert sign_flip_p_value([1.0, 2.0, 3.0]) == pytest.approx(
        2 / 8
    )  # only all-plus and all-minus reach |6|
    assert sign_flip_p_value([1.0, -1.0]) == 1.0
    assert sign_flip_p_value([0.5, 0.1, 0.3, 0.2, 0.4, 0.6]) == pytest.approx(2 / 64)
    assert sign_flip_p_value([1.0] * 20) < 1e-3  # Monte Carlo beyond 16 pairs; exact value 2 / 2^20
    assert sign_flip_p_value([1.0] * 20, seed=3) == sign_flip_p_value([1.0] * 20, seed=3)
    with pytest.raises(ValueError, match="paired differences"):
        sign_flip_p_value([0.1, float("nan")])


def test_paired_comparison_pairs_objectives_by_seed():
    rows = [
        {
            "family": "llama",
            "precision": "bf16",
            "objective": objective,
            "seed": seed,
            "causal_recovery": value,
            "code_f1": 0.1,
            "near_miss_acc": 0.0,
        }
        for objective, values in (("cot", [0.1, 0.2, 0.3, 0.9]), ("mistill", [0.3, 0.5, 0.4]))
        for seed, value in enumerate(values)
    ]  # seed 3 has no MISTILL run: left out of the pairs
    paired = paired_comparison(pd.DataFrame(rows)).set_index("metric")
    recovery = paired.loc["causal_recovery"]
    assert recovery.n_pairs == 3 and recovery.mistill_higher == 3
    assert recovery.difference_mean == pytest.approx(0.2) and recovery.p_value == pytest.approx(
        0.25
    )
    assert paired.loc["code_f1"].mistill_higher == 0 and paired.loc["code_f1"].p_value == 1.0


def _mentions(near_miss_by_example, region=1):
    return [
        {"example": e, "mention": j, "region": region, "near_miss": v}
        for e, values in enumerate(near_miss_by_example)
        for j, v in enumerate(values)
    ]


def test_mention_comparison_tests_the_arms_on_the_same_mentions_clustered_by_example():
    def row(objective, seed, near_miss, eval_seed=0):
        return {
            "family": "smollm2",
            "precision": "fp32-master",
            "objective": objective,
            "seed": seed,
            "run": f"{objective}-{seed}",
            "n_eval": 3,
            "eval_seed": eval_seed,
            "per_mention": _mentions(near_miss),
        }

    cot, mistill = [[1, 0], [1], [0, 0]], [[1, 1], [1], [1, 1]]  # per example: +1, 0, +2
    frame = pd.DataFrame(
        [
            row("cot", 0, cot),
            row("mistill", 0, mistill),
            row("cot", 1, cot),
            row("mistill", 1, mistill),
        ]
    )
    table = mention_comparison(frame).set_index(["seed", "outcome"])
    one = table.loc[(0, "near_miss")]
    assert (one.n_examples, one.n_mentions, one.mistill_only, one.cot_only) == (3, 5, 3, 0)
    assert one.cot_acc == pytest.approx(0.4) and one.difference == pytest.approx(0.6)
    # the units are the examples (+1, 0, +2): half of the 8 sign patterns reach |3|
    assert one.p_value == pytest.approx(0.5)
    # pooled over both seeds (+1, 0, +2 twice): only the 8 of 64 with the four non-zero signs equal
    assert table.loc[("all", "near_miss")].p_value == pytest.approx(8 / 64)
    assert table.loc[(0, "region")].difference == 0 and table.loc[(0, "region")].p_value == 1.0
    # arms decoded on other prompts are not a pair
    frame.loc[3, "eval_seed"] = 5
    with pytest.raises(ValueError, match="different held-out prompts"):
        mention_comparison(frame)
    # runs evaluated before mentions were recorded: nothing to compare
    assert mention_comparison(frame.drop(columns=["per_mention"])).empty


def test_the_gate_marks_cells_whose_cot_runs_cannot_do_the_task_and_pairs_must_match():
    def row(family, objective, seed, code_f1, near_miss, n_eval=50, paired="a"):
        return {
            "family": family,
            "precision": "fp32-master",
            "objective": objective,
            "seed": seed,
            "run": f"{family}-{objective}-{seed}",
            "code_f1": code_f1,
            "near_miss_acc": near_miss,
            "causal_recovery": 0.1,
            "n_eval": n_eval,
            "paired": {"data": paired, "initial weights": paired},
        }

    frame = pd.DataFrame(
        [
            row("smollm2", "cot", 0, 0.9, 0.8),
            row("smollm2", "mistill", 0, 0.2, 0.1),  # the gate reads the CoT run alone
            row("gemma3", "cot", 0, 0.9, 0.4),  # near-miss below 0.5
            row("llama", "cot", 0, 0.9, 0.9, n_eval=20),  # too few examples to pass
        ]
    )
    gates = dict(zip(summarise(frame).family, summarise(frame).gate))
    assert gates == {"smollm2": "passed", "gemma3": "failed", "llama": "failed"}
    assert passes_gate(frame.iloc[0]) and not passes_gate(frame.iloc[1])
    unpaired = pd.concat([frame, pd.DataFrame([row("gemma3", "mistill", 0, 0.5, 0.5, paired="b")])])
    with pytest.raises(ValueError, match="not a pair"):
        paired_comparison(unpaired)


def test_scores_given_to_evaluate_run_must_come_from_the_same_prompts(tmp_path):
    """An `evaluate` record stands in for the held-out generation only when it scored the
    prompts evaluate_run would (split, n, seed, task); otherwise it is refused, naming what
    differs, before any model loads."""
    record = {"code_f1": 0.5, "split": "heldout", "n": 50, "seed": 0, **TASK}
    check_scores_match(record, 50, 0, TASK)  # the same prompts: accepted
    with pytest.raises(ValueError, match=r"n 20 \(wanted 50\), seed 3 \(wanted 0\)"):
        check_scores_match({**record, "n": 20, "seed": 3}, 50, 0, TASK)
    with pytest.raises(ValueError, match=r"split 'validation' \(wanted 'heldout'\)"):
        evaluate_run(tmp_path / "absent", TASK, n_eval=50, scores={**record, "split": "validation"})
    with pytest.raises(ValueError, match=r"k 64 \(wanted 8\)"):
        check_scores_match({**record, "k": 64}, 50, 0, TASK)


def test_evaluate_and_report_over_runs(teacher, examples, tmp_path):
    run({"objective": "cot", "steps": 2}, teacher, examples, tmp_path / "s0")
    quick = CharacterizeConfig(ks=(1, 2), z_min=1.5, progress=False)
    result = evaluate_run(
        tmp_path / "s0", TASK, n_eval=1, n_characterize=4, progress=False, characterize_config=quick
    )
    assert {"code_f1", "near_miss_acc", "causal_recovery", "causal_recovery_median"} <= set(result)
    assert result["causal_recovery_median"] == median_recovery(tmp_path / "s0" / "characterization")
    assert result["z_min"] == 1.5  # the student's circuit threshold is recorded with its recovery
    controls = result["recovery_controls"]  # None where the student has no near-miss circuit
    assert controls is None or {"found", "random_mean", "p_found_vs_random"} <= set(controls)
    log = torch.load(tmp_path / "s0" / training_module.TRAINING_STATE_FILE, weights_only=False)[
        "log"
    ]["attention"]
    assert result["attention_loss_tail"] == pytest.approx(
        log[-1], abs=1e-5
    )  # 2 steps: the tail is the last
    assert result["family"] == "llama" and result["objective"] == "cot" and result["seed"] == 0
    summary = write_report([tmp_path / "s0"], tmp_path / "report")
    assert (
        list(summary) == ["llama/cot/fp32-master"]
        and summary["llama/cot/fp32-master"]["n_seeds"] == 1
    )
    assert summary["llama/cot/fp32-master"]["attention_loss_tail_mean"] == pytest.approx(
        result["attention_loss_tail"], abs=1e-4
    )
    for name in ("table.csv", "table.md", "figure.html", "runs.csv", "paired.csv"):
        assert (tmp_path / "report" / name).is_file()
    # the training curve: from the run's training state, one point per window of steps
    curve = training_curve(tmp_path / "s0", window=1)
    assert list(curve["step"]) == [1, 2] and list(curve["attention"]) == pytest.approx(
        log, abs=1e-5
    )
    assert (tmp_path / "report" / "training_curves.html").is_file()
    # an evaluation written before the median was recorded gets it from its per-event table
    evaluation = json.loads((tmp_path / "s0" / EVALUATION_FILE).read_text())
    (tmp_path / "s0" / EVALUATION_FILE).write_text(
        json.dumps({k: v for k, v in evaluation.items() if k != "causal_recovery_median"})
    )
    assert (
        load_evaluations([tmp_path / "s0"])["causal_recovery_median"][0]
        == result["causal_recovery_median"]
    )
    # aggregation over seeds: mean and sample std per cell
    rows = [
        {**result, "seed": s, "code_f1": f, "causal_recovery": r}
        for s, f, r in ((0, 0.2, 0.1), (1, 0.4, 0.5))
    ]
    table = summarise(pd.DataFrame(rows))
    assert table["code_f1_mean"][0] == pytest.approx(0.3) and table["code_f1_std"][
        0
    ] == pytest.approx(0.1414, abs=1e-4)
    assert table["causal_recovery_mean"][0] == pytest.approx(0.3) and table["n_seeds"][0] == 2


# --- starting from a base student --------------------------------------------------------------


def base_student(family, out):
    tokenizer = family_tokenizer(family)
    config = student_config(
        family, len(tokenizer), tokenizer.eos_token_id, n_layer=2, n_head=2, n_embd=32
    )
    model = build_student(config, seed=11)
    save_checkpoint(model, tokenizer, out, {"role": "student", "step": 7})
    return out


def test_student_init_starts_from_the_base_weights(teacher, examples, tmp_path):
    base = base_student("llama", tmp_path / "base")
    config = DistillConfig(
        **{**TINY, "family": "llama", "objective": "mistill", "student_init": str(base)}
    )
    started = weights(base)
    initial = exportable(initial_student(config)).state_dict()
    assert all(torch.equal(started[k], initial[k]) for k in started)
    fresh = exportable(initial_student(DistillConfig(**{**TINY, "family": "llama"}))).state_dict()
    assert not all(torch.equal(started[k], fresh[k]) for k in started)
    moved = run({"steps": 2, "student_init": str(base)}, teacher, examples, tmp_path / "two")
    assert moved["student_init"]["step"] == 7
    assert run({"steps": 1}, teacher, examples, tmp_path / "fresh").get("student_init") is None
    assert moved["step"] == 2 and not all(
        torch.equal(started[k], weights(tmp_path / "two")[k]) for k in started
    )


def test_student_init_refuses_another_family_or_architecture(teacher, examples, tmp_path):
    base = base_student("gpt2", tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match="not a llama student"):
        run({"student_init": str(base)}, teacher, examples, tmp_path / "wrong_family")
    with pytest.raises(CheckpointError, match="architecture"):
        run(
            {"family": "gpt2", "n_embd": 48, "student_init": str(base)},
            teacher,
            examples,
            tmp_path / "wrong_size",
        )


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_shipped_base_students_load_as_their_family_with_their_training_record(family):
    from pathlib import Path

    from mistill_lens.models.students import load_base_student

    path = Path(__file__).parent.parent / "checkpoints" / "base_students" / family
    model = load_base_student(path, family, torch.float32)
    record = read_metadata(path)
    assert record["role"] == "student" and record["config"]["student"] == family
    assert record["step"] == record["config"]["steps"]
    assert (
        model.config.model_type == family
        and sum(p.numel() for p in model.parameters()) == record["n_params"]
    )
    with pytest.raises(CheckpointError, match="not a"):
        load_base_student(path, "gpt2" if family == "llama" else "llama", torch.float32)


def test_the_teachers_circuits_follow_the_chosen_rule_each_cached_apart(tmp_path):
    """Characterised here (no --teacher-heads), the teacher's head sets are the faithful sets
    under circuit="faithful", and each rule keeps its own cached folder."""
    from mistill_lens.distill.teacher import teacher_characterization, teacher_task_config
    from mistill_lens.lens.results import CharacterizeConfig
    from mistill_lens.models.checkpoints import load_model, resolve

    teacher_dir = resolve("tiny")
    model, tokenizer = load_model("tiny")
    task_config = teacher_task_config(teacher_dir)
    faithful = CharacterizeConfig(
        z_min=1.0, circuit="faithful", faithful_pool=4, faithful_random_draws=0, progress=False
    )
    found, folder = teacher_characterization(
        model, tokenizer, teacher_dir, task_config, tmp_path, 4, faithful
    )
    assert "faithful4" in folder.name
    searched = [kind for kind in found.faithful if "heads" in found.faithful[kind]]
    assert searched, "the search ran on no kind"
    for kind in searched:
        assert found.circuits[kind] == [tuple(h) for h in found.faithful[kind]["heads"]]
    z_found, z_folder = teacher_characterization(
        model, tokenizer, teacher_dir, task_config, tmp_path, 4, CharacterizeConfig(z_min=1.0)
    )
    assert z_folder != folder and "z1" in z_folder.name and not z_found.faithful
    again, _ = teacher_characterization(  # read back, not run again
        model, tokenizer, teacher_dir, task_config, tmp_path, 4, faithful
    )
    assert again.circuits == found.circuits
