"""Distillation (from conftest's `random_teacher`) into a pretrained student (SmolLM2-135M-Instruct
from its registry package) with a LoRA adapter, on its own tokenizer: the attention loss moves
the supervised heads and the CoT run does not, the adapter written is the adapter trained, and
bad starting points are refused."""

import pytest
import torch

from mistill_lens import task
from mistill_lens.distill.attention import teacher_head_sets
from mistill_lens.distill.training import DistillConfig, distill, pretrained_student
from mistill_lens.models.checkpoints import (
    ADAPTER_WEIGHTS_FILE,
    CheckpointError,
    load_base_model,
    load_hf_model,
    read_metadata,
)

TASK = {"universe_size": 300, "k": 8, "max_mentions": 2}
TEACHER_HEADS = {"region": [(1, 0)], "within": [(1, 1)], "near_miss": [(0, 1), (1, 0)]}
STUDENT_HEADS = ((29, 0), (29, 1))
PRETRAINED = dict(
    family="smollm2",
    batch_size=4,
    lr=3e-2,
    warmup_steps=1,
    checkpoint_every=100,
    student_head_set=STUDENT_HEADS,
    lora_r=4,
)


@pytest.fixture(scope="module")
def examples():
    return task.generate_examples(4, 0, "train", **TASK)


def run(objective, teacher, examples, out, **overrides):
    bridge, tokenizer = teacher
    config = DistillConfig(**{**PRETRAINED, "objective": objective, "steps": 4, **overrides})
    metadata = distill(
        config, bridge, tokenizer, examples, teacher_head_sets(TEACHER_HEADS), out, progress=False
    )
    return config, metadata


def attention_log(out):
    """The attention loss of every step: each step's batch is all the items, so the values are
    the KL on the same data before each update."""
    state = torch.load(out / "training_state.pt", weights_only=False)
    return state["log"]["attention"]


def test_the_attention_loss_lowers_the_kl_and_the_cot_run_does_not(
    random_teacher, examples, tmp_path
):
    _, cot = run("cot", random_teacher, examples, tmp_path / "cot")
    _, mistill = run(
        "mistill", random_teacher, examples, tmp_path / "mistill", attention_weight=5.0
    )
    assert cot["paired"] == mistill["paired"]  # same data, order and initial adapter
    cot_log, mistill_log = attention_log(tmp_path / "cot"), attention_log(tmp_path / "mistill")
    assert cot_log[0] == pytest.approx(mistill_log[0])  # the same student before the first step
    assert mistill_log[-1] < 0.9 * mistill_log[0]
    assert mistill_log[0] - mistill_log[-1] > 3 * abs(cot_log[0] - cot_log[-1])
    assert mistill["base"] == "smollm2" and mistill["n_params"] < mistill["n_params_total"] / 20


def test_the_written_adapter_is_the_trained_one(random_teacher, examples, tmp_path):
    config, _ = run("mistill", random_teacher, examples, tmp_path / "run", steps=2)
    assert (tmp_path / "run" / ADAPTER_WEIGHTS_FILE).is_file()
    assert read_metadata(tmp_path / "run")["base"] == "smollm2"
    merged, tokenizer = load_hf_model(tmp_path / "run")  # the base from its package + the adapter
    unmerged = pretrained_student(config, resume_from=tmp_path / "run").eval()
    base, _ = load_base_model("smollm2")
    ids = torch.tensor([tokenizer(examples[0].prompt + examples[0].output)["input_ids"]])
    with torch.no_grad():
        logits = merged(ids).logits
        torch.testing.assert_close(unmerged(ids).logits, logits, atol=2e-4, rtol=0)
        assert (logits - base(ids).logits).abs().max() > 1e-2  # training moved the model


def test_a_pretrained_student_refuses_a_start_that_is_not_its_base(
    random_teacher, examples, tmp_path
):
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint of base 'smollm2'"):
        run("cot", random_teacher, examples, tmp_path / "run", student_init="tiny")
    with pytest.raises(ValueError, match="unknown student 'llama3'.*smollm2"):
        DistillConfig(family="llama3")
    config = DistillConfig(family="gemma3", n_layer=7)
    assert config.n_layer is None and config.n_ctx == 4096  # the base's own architecture
