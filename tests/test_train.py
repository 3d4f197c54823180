"""Training: a tiny teacher learns, and an interrupted run resumes to the same weights."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

import mistill_lens.training.loop as train_module
from mistill_lens import task
from mistill_lens.models.checkpoints import CheckpointError, load_hf_model
from mistill_lens.models.precision import compute_mode
from mistill_lens.models.tokenizers import teacher_tokenizer
from mistill_lens.runs import MANIFEST_FILE, file_digest
from mistill_lens.task.examples import CANDIDATES_HEADER, REASONING_HEADER
from mistill_lens.task.icd import region_of
from mistill_lens.training.checkpoint_state import TRAINING_STATE_FILE
from mistill_lens.training.config import TrainConfig
from mistill_lens.training.data import collate, encode, event_token_mask
from mistill_lens.training.loop import train
from mistill_lens.training.models import build_model

TINY = TrainConfig(
    seed=3,
    steps=8,
    batch_size=2,
    lr=3e-3,
    warmup_steps=2,
    universe_size=300,
    k=8,
    max_mentions=1,
    n_layer=1,
    n_head=2,
    n_embd=32,
    checkpoint_every=4,
)


def test_loss_mask_covers_exactly_the_output_and_end_of_text():
    tokenizer = teacher_tokenizer()
    ids, targets = encode(tokenizer, "Summary: x\nReasoning:\n", "- x => y\n")
    assert (
        tokenizer.decode([i for i, t in zip(ids, targets) if t])
        == "- x => y\n" + tokenizer.eos_token
    )
    batch, attention, target_mask = collate(
        [(ids, targets), (ids[:3], targets[:3])], tokenizer.pad_token_id
    )
    assert batch.shape == (2, len(ids)) and attention[1].sum() == 3 and not target_mask[1].any()


def test_a_tiny_teacher_learns(tmp_path):
    config = replace(TINY, steps=80, batch_size=4, n_layer=2, n_embd=64, checkpoint_every=80)
    metadata = train(config, tmp_path / "run", progress=False)
    losses = torch.load(tmp_path / "run" / TRAINING_STATE_FILE, weights_only=False)["losses"]
    assert metadata["step"] == 80 and len(losses) == 80
    # chance is ln(vocab) ~ 8.2; the trace's fixed wording alone is learnable within 80 steps
    assert losses[0] > 7.5
    assert sum(losses[-10:]) / 10 < 0.5 * losses[0]


def test_interrupted_run_resumes_to_identical_weights(tmp_path, monkeypatch):
    train(TINY, tmp_path / "straight", progress=False)

    # Snapshot the folder as the periodic checkpoint at step 4 left it: what a crash leaves.
    real_save = train_module.save_checkpoint

    def save_and_snapshot(model, tokenizer, out_dir, metadata, training_state=None):
        path = real_save(model, tokenizer, out_dir, metadata, training_state)
        if metadata["step"] == 4:
            shutil.copytree(path, tmp_path / "interrupted")
        return path

    monkeypatch.setattr(train_module, "save_checkpoint", save_and_snapshot)
    train(TINY, tmp_path / "scratch", progress=False)
    monkeypatch.undo()

    assert load_hf_model(tmp_path / "interrupted")[0].config.n_layer == 1
    train(TINY, tmp_path / "interrupted", progress=False)
    resumed, _ = load_hf_model(tmp_path / "interrupted")
    straight, _ = load_hf_model(tmp_path / "straight")
    for (name, a), (_, b) in zip(resumed.state_dict().items(), straight.state_dict().items()):
        assert torch.equal(a, b), name


def test_resuming_with_other_options_is_refused(tmp_path):
    train(replace(TINY, steps=4), tmp_path / "run", progress=False)
    with pytest.raises(CheckpointError, match="different configuration"):
        train(replace(TINY, steps=4, lr=1e-2), tmp_path / "run", progress=False)


def test_init_from_starts_at_the_given_weights(tmp_path):
    train(replace(TINY, steps=4), tmp_path / "base", progress=False)
    more_config = replace(TINY, steps=1, seed=4, init_from=str(tmp_path / "base"))
    base, _ = load_hf_model(tmp_path / "base")
    more = build_model(
        more_config, teacher_tokenizer()
    )  # the weights step 0 of that run starts from
    for (name, a), (_, b) in zip(base.state_dict().items(), more.state_dict().items()):
        assert torch.equal(a, b), name
    metadata = train(more_config, tmp_path / "more", progress=False)
    assert metadata["init_from"]["step"] == 4


def test_event_mask_marks_exactly_the_gold_decision_tokens():
    tokenizer = teacher_tokenizer()
    for example in task.generate_examples(10, 0, "train"):
        ids, _ = encode(tokenizer, example.prompt, example.output)
        mask = event_token_mask(tokenizer, example)
        marked = [tokenizer.decode([i]) for i, m in zip(ids, mask) if m]
        # a within event and a sibling near-miss event share their token
        assert sorted(marked) == sorted(
            chosen for _, chosen in {(e.start, e.chosen) for e in example.events}
        )


def test_event_weight_changes_training_and_weight_one_is_the_plain_loss(tmp_path):
    plain = train(replace(TINY, steps=3), tmp_path / "plain", progress=False)
    weighted = train(
        replace(TINY, steps=3, event_weight=5.0), tmp_path / "weighted", progress=False
    )
    assert plain["final_loss"] != weighted["final_loss"]


def test_fp32_master_trains_under_bf16_autocast_and_old_runs_still_resume(tmp_path, monkeypatch):
    """fp32-master computes the same loss in bf16 where the CPU has bf16 units (close to fp32's at
    the same first-step weights, not equal to it) and in float32 where it has not (equal), keeps
    float32 weights, and records both; a run saved before the option existed resumes as fp32."""
    fp32 = train(replace(TINY, steps=4), tmp_path / "fp32", progress=False)
    for units, run in ((True, "m"), (False, "m-no-units")):
        monkeypatch.setattr(
            train_module, "compute_mode", lambda d, p, u=units: compute_mode(d, p, bf16_units=u)
        )
        master = train(
            replace(TINY, steps=4, precision="fp32-master"), tmp_path / run, progress=False
        )
        assert master["compute_by_step"] == [[0, "bf16-autocast" if units else "float32"]]
    monkeypatch.undo()
    assert (fp32["precision"], master["precision"]) == ("fp32", "fp32-master")
    first = [
        torch.load(tmp_path / run / TRAINING_STATE_FILE, weights_only=False)["losses"][0]
        for run in ("fp32", "m", "m-no-units")
    ]
    assert first[0] != first[1] and first[1] == pytest.approx(first[0], rel=0.02)
    assert first[2] == first[0]
    model, _ = load_hf_model(tmp_path / "m")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="unknown precision 'bf16'"):
        replace(TINY, precision="bf16")

    state_path = tmp_path / "fp32" / TRAINING_STATE_FILE
    state = torch.load(state_path, weights_only=False)
    del state["config"]["precision"]  # as runs before the option saved it
    torch.save(state, state_path)
    manifest_path = tmp_path / "fp32" / MANIFEST_FILE  # its digest as that run wrote it
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps(manifest | {TRAINING_STATE_FILE: file_digest(state_path)}))
    assert train(replace(TINY, steps=4), tmp_path / "fp32", progress=False)["step"] == 4


def test_device_option_resolves_and_refuses_a_missing_accelerator(tmp_path, monkeypatch):
    assert train_module.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_module.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        train(TINY, tmp_path / "run", progress=False, device="cuda")
    # the device is not part of the configuration: a CPU run records it and resumes under "auto"
    metadata = train(replace(TINY, steps=4), tmp_path / "run", progress=False, device="auto")
    assert metadata["device"] == "cpu"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_base_student_trains_with_its_family_architecture_and_tokenizer(tmp_path, family):
    from mistill_lens.models.students import family_tokenizer

    config = replace(
        TINY, steps=30, batch_size=4, n_layer=2, n_embd=32, checkpoint_every=30, student=family
    )
    metadata = train(config, tmp_path / "base", progress=False)
    model, tokenizer = load_hf_model(tmp_path / "base")
    losses = torch.load(tmp_path / "base" / TRAINING_STATE_FILE, weights_only=False)["losses"]
    assert metadata["role"] == "student" and model.config.model_type == family
    assert tokenizer.get_vocab() == family_tokenizer(family).get_vocab()
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]  # ln(vocab) at the start


def test_a_lora_teacher_on_smollm2_saves_only_its_adapter_and_loads_merged(tmp_path):
    """A LoRA run on the real pretrained base: the checkpoint holds the adapter, loading merges it
    into the base with the same logits as the adapter model, a rerun resumes, and a truncated
    adapter is a clear error."""
    from mistill_lens.models.checkpoints import CheckpointError, load_hf_model
    from mistill_lens.training.models import lora_model

    config = replace(
        TINY, base="smollm2", steps=1, batch_size=1, warmup_steps=1, k=4, n_layer=4, lr=1e-3
    )
    metadata = train(config, tmp_path / "lora", progress=False)
    files = {p.name for p in (tmp_path / "lora").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    assert metadata["n_params"] < 0.05 * metadata["n_params_total"]  # only the adapter trains
    merged, tokenizer = load_hf_model(tmp_path / "lora")
    adapter = lora_model(config, resume_from=tmp_path / "lora").eval()
    example = task.generate_examples(1, 0, "heldout", universe_size=300, k=4, max_mentions=1)[0]
    ids = torch.tensor([encode(tokenizer, example.prompt, example.output)[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(ids).logits, adapter(input_ids=ids).logits, atol=2e-4, rtol=0
        )
    assert (
        train(config, tmp_path / "lora", progress=False)["step"] == 1
    )  # finished: resumed, nothing to do
    weights = tmp_path / "lora" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="adapter could not be loaded"):
        load_hf_model(tmp_path / "lora")


def without_candidates(example: task.Example) -> task.Example:
    """The example with its candidate lines removed (event offsets shifted to match): a model
    reading it is blind to the context it is meant to look codes up in."""
    head, _, _ = example.prompt.partition(CANDIDATES_HEADER)
    prompt = head + "\n" + REASONING_HEADER
    shift = len(prompt) - len(example.prompt)
    events = tuple(replace(e, start=e.start + shift, end=e.end + shift) for e in example.events)
    return replace(example, prompt=prompt, candidates=(), events=events)


def uniform_guess(examples: list[task.Example]) -> dict[str, float]:
    """Accuracy per kind of a guess uniform over the options the candidate list offers: its
    regions for a region event, the region's candidates for a within or near-miss event."""
    chances = {}
    for example in examples:
        regions = [region_of(c) for c in example.candidates]
        for event in example.events:
            options = len(set(regions)) if event.kind == "region" else regions.count(event.region)
            chances.setdefault(event.kind, []).append(1 / options)
    return {kind: sum(c) / len(c) for kind, c in chances.items()}


def test_the_default_teacher_reproduces_its_record_and_beats_context_blind_baselines():
    """The shipped default teacher (SmolLM2 + LoRA at K = 64; docs/teacher-lora.md): teacher-forced
    on held-out examples at its default K it reproduces the scores recorded when it was saved
    (reference_scores.json), and each decision kind's accuracy beats, by far, two context-blind
    baselines computed here: the same model with the candidate list removed, and a uniform guess
    among the options the list offers."""
    import json

    from mistill_lens.models.checkpoints import load_hf_model, read_metadata
    from mistill_lens.models.registry import DEFAULT_TEACHER
    from mistill_lens.task.metrics import teacher_forced_events

    record = json.loads((DEFAULT_TEACHER / "reference_scores.json").read_text())
    spec = record["examples"]
    assert (spec["k"], spec["max_mentions"]) == (task.DEFAULT_K, task.DEFAULT_MAX_MENTIONS)
    assert read_metadata("default")["config"]["k"] == task.DEFAULT_K
    model, tokenizer = load_hf_model("default")
    examples = task.generate_examples(
        spec["n"], spec["seed"], spec["split"], k=spec["k"], max_mentions=spec["max_mentions"]
    )
    scores = teacher_forced_events(model, tokenizer, examples)
    blind = teacher_forced_events(model, tokenizer, [without_candidates(e) for e in examples])
    chance = uniform_guess(examples)
    assert set(scores) == set(record["teacher_forced"]) == {"region", "within", "near_miss"}
    for kind, recorded in record["teacher_forced"].items():
        assert scores[kind]["n"] == recorded["n"] >= 10
        assert scores[kind]["margin"] == pytest.approx(recorded["margin"], abs=1e-3)
        assert scores[kind]["loss"] == pytest.approx(recorded["loss"], abs=1e-3)
    for kind, score in scores.items():
        assert blind[kind]["n"] == score["n"]
        assert score["acc"] >= 0.8 and score["margin"] > blind[kind]["margin"] + 5, (kind, score)
        assert score["acc"] >= max(blind[kind]["acc"], chance[kind]) + 0.5, (kind, blind, chance)
