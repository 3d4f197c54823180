"""Benchmarks of the intervention engine against the full-forward path, measured side by side in
one run (the cores are shared: ratios are what carries over, absolute seconds are shown beside).

Each returns a JSON-ready dict; ``mistill-lens bench NAME`` prints it as its last line.
"""

from __future__ import annotations

import platform
import random
import time
from typing import Any

import torch

from mistill_lens import task
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import events_from_spans, make_event_batch
from mistill_lens.lens.hooks import all_heads, means_from_events
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor


def _events(tokenizer, k: int, n_examples: int, max_events: int | None, seed: int, context: int):
    examples = task.generate_examples(n_examples, seed, "heldout", k=k, max_mentions=4)
    encoded = [events_from_spans(e, tokenizer, i) for i, e in enumerate(examples)]
    longest = max(len(x.tokens) for x in encoded)
    if longest > context:
        raise ValueError(
            f"K={k} examples reach {longest} tokens, beyond the model's {context}-token context; "
            "use a smaller --k or a model with longer positions"
        )
    events = [e for x in encoded for e in x.events][:max_events]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_event_batch(encoded, events, pad), encoded


def sweep_benchmark(
    model,
    tokenizer,
    *,
    k: int,
    n_examples: int,
    max_events: int | None = None,
    loop_heads: int | None = None,
    seed: int = 0,
    context: int | None = None,
) -> dict[str, Any]:
    """Exact single-head mean-ablation sweep of every head over the events of `n_examples`
    held-out examples at `k` candidates: the engine against the per-head full-forward loop (the
    reference path). The loop runs on `loop_heads` heads drawn at random (seeded; None: all) and
    its time is scaled to all heads; `max_abs_diff` compares the two on those heads. Means are
    the events' own class means (the benchmark measures cost and agreement, not a finding)."""
    context = context or model.cfg.n_ctx
    batch, encoded = _events(tokenizer, k, n_examples, max_events, seed, context)
    heads = all_heads(model)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads

    started = time.perf_counter()
    engine = InterventionEngine(model)
    means = means_from_events(engine, batch)
    fast_table = ablation_sweep(engine, batch, means, heads=heads, progress=False)
    engine_s = time.perf_counter() - started

    timed = heads if loop_heads is None else sorted(random.Random(seed).sample(heads, loop_heads))
    started = time.perf_counter()
    loop_table = ablation_sweep(model, batch, means, heads=timed, progress=False)
    loop_timed_s = time.perf_counter() - started
    loop_s = loop_timed_s * len(heads) / len(timed)

    fast = effects_tensor(fast_table, len(batch), n_layers, n_heads)
    loop = effects_tensor(loop_table, len(batch), n_layers, n_heads)
    swept = ~torch.isnan(loop)
    return {
        "bench": "sweep",
        "speedup": round(loop_s / engine_s, 1),
        "max_abs_diff": float((fast[swept] - loop[swept]).abs().max()),
        "engine_s": round(engine_s, 2),
        "loop_s": round(loop_s, 2),
        "loop_scaled_from_heads": len(timed),
        "loop_timed_s": round(loop_timed_s, 2),
        "heads": len(heads),
        "events": len(batch),
        "examples": len({e.example_id for e in batch.events}),
        "k": k,
        "context_tokens_mean": round(sum(len(x.tokens) for x in encoded) / len(encoded), 1),
        "context_tokens_max": max(len(x.tokens) for x in encoded),
        "largest_effect": float(fast.abs().max()),
        "seed": seed,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
