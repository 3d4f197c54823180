"""Checkpoints: exact save/load, clear errors for corrupt or mismatched folders, bridging."""

import pytest
import torch
from transformer_lens.utilities import get_act_name
from transformers import GPT2LMHeadModel

from mistill_lens.models.checkpoints import (
    CheckpointError,
    load_hf_model,
    save_checkpoint,
    teacher_config,
    to_bridge,
)
from mistill_lens.models.tokenizers import student_tokenizer, teacher_tokenizer


@pytest.fixture()
def checkpoint(tmp_path):
    tokenizer = teacher_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        teacher_config(len(tokenizer), n_layer=2, n_head=2, n_embd=32, n_positions=64)
    ).eval()
    path = save_checkpoint(model, tokenizer, tmp_path / "ckpt", {"seed": 0})
    return model, tokenizer, path


def _ids(tokenizer):
    return tokenizer(
        "Summary: Admitted with gas gangrene.\nCandidates:\nA48.0: gas gangrene\n",
        return_tensors="pt",
    )["input_ids"]


def test_save_load_reproduces_logits_exactly(checkpoint):
    model, tokenizer, path = checkpoint
    loaded, loaded_tokenizer = load_hf_model(path)
    ids = _ids(tokenizer)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_overwriting_a_checkpoint_is_atomic(checkpoint, tmp_path):
    model, tokenizer, path = checkpoint
    save_checkpoint(model, tokenizer, path, {"seed": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "no staging folders left behind"


def test_bridge_matches_the_hf_model_and_exposes_standard_hooks(checkpoint):
    model, tokenizer, path = checkpoint
    ids = _ids(tokenizer)
    with torch.no_grad():
        reference = model(ids).logits
    bridge = to_bridge(load_hf_model(path, attn_implementation="eager")[0], tokenizer)
    names = [get_act_name("z", 1), get_act_name("pattern", 0), get_act_name("resid_post", 1)]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids, names_filter=lambda name: name in names)
    assert torch.allclose(logits, reference, atol=1e-4)
    assert cache[names[0]].shape == (1, ids.shape[1], 2, 16)
    assert cache[names[1]].shape == (1, 2, ids.shape[1], ids.shape[1])


def test_truncated_weights_give_a_clear_error(checkpoint):
    _, _, path = checkpoint
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or incomplete"):
        load_hf_model(path)


def test_mismatched_tokenizer_gives_a_clear_error(checkpoint):
    _, _, path = checkpoint
    student_tokenizer().save_pretrained(path)
    with pytest.raises(CheckpointError, match="mismatched tokenizer"):
        load_hf_model(path)


def test_missing_pieces_give_clear_errors(checkpoint, tmp_path):
    _, _, path = checkpoint
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_model(tmp_path / "nowhere")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_model(path)
