import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from planted import VOCAB, planted_bridge, planted_examples
from transformer_lens import TransformerBridge
from transformers import GPT2Config, GPT2LMHeadModel

from mistill_lens.lens.calibration import calibrate, null_events
from mistill_lens.lens.events import events_from_spans, make_event_batch, position_class_names
from mistill_lens.lens.hooks import compute_head_means, event_position_classes
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor

# Why: on a loaded shared machine two intra-op threads contend with every other process and a
# test that takes 8 s single-threaded can take minutes.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def planted(tmp_path_factory):
    return planted_bridge(tmp_path_factory.mktemp("planted_tokenizer"))


@pytest.fixture(scope="session")
def random_bridge(planted):
    """A random-weight GPT-2 (LayerNorm and MLPs live) on the planted vocabulary, for exactness tests."""
    _, tokenizer = planted
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(VOCAB), n_positions=32, n_embd=32, n_layer=3, n_head=4)
    hf_model = GPT2LMHeadModel(config).eval()
    return TransformerBridge.boot_transformers(
        "random-gpt2", hf_model=hf_model, tokenizer=tokenizer, device="cpu", dtype=torch.float32
    )


def head_ablation_effects(model, batch, means):
    """Exact margin drop of every event when each head alone is mean-ablated, as [event, layer, head]."""
    table = ablation_sweep(model, batch, means, progress=False)
    return effects_tensor(table, len(batch), model.cfg.n_layers, model.cfg.n_heads)


def encode_all(tokenizer, examples, first_id=0):
    return [
        events_from_spans(example, tokenizer, first_id + i) for i, example in enumerate(examples)
    ]


@pytest.fixture(scope="session")
def planted_data(planted):
    """Encoded test examples, their event batch, null batch, and means from separate reference runs."""
    bridge, tokenizer = planted
    examples = encode_all(tokenizer, planted_examples(24, seed=0))
    reference = encode_all(tokenizer, planted_examples(60, seed=1), first_id=1000)
    reference_events = [e for x in reference for e in x.events]
    reference_nulls = null_events(reference, reference_events, per_event=1, seed=1)
    reference_batch = make_event_batch(reference, reference_events + reference_nulls)
    means = compute_head_means(
        bridge,
        reference_batch.tokens,
        event_position_classes(reference_batch),
        position_class_names(reference_batch.kinds),
    )
    batch = make_event_batch(examples)
    nulls = make_event_batch(examples, null_events(examples, batch.events, per_event=2, seed=0))
    return {
        "examples": examples,
        "batch": batch,
        "nulls": nulls,
        "means": means,
        "reference_batch": reference_batch,
    }


@pytest.fixture(scope="session")
def calibration(planted, planted_data):
    bridge, _ = planted
    real = head_ablation_effects(bridge, planted_data["batch"], planted_data["means"])
    null = head_ablation_effects(bridge, planted_data["nulls"], planted_data["means"])
    return calibrate(real, planted_data["batch"].kinds, null)


@pytest.fixture(scope="module")
def random_teacher():
    """A 2-layer random GPT-2 on the teacher tokenizer, bridged: attention targets to distil from."""
    from mistill_lens.models.bridge import to_bridge
    from mistill_lens.models.checkpoints import teacher_config
    from mistill_lens.models.tokenizers import teacher_tokenizer

    tokenizer = teacher_tokenizer()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        teacher_config(
            len(tokenizer), n_layer=2, n_head=2, n_embd=32, eos_token_id=tokenizer.eos_token_id
        )
    ).eval()
    model.config._attn_implementation = "eager"
    return to_bridge(model, tokenizer), tokenizer
