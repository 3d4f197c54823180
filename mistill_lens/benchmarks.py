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
from mistill_lens.lens.backends import ablated_margins, clean_margins, means_from_events
from mistill_lens.lens.engine import InterventionEngine
from mistill_lens.lens.events import events_from_spans, make_event_batch
from mistill_lens.lens.hooks import all_heads
from mistill_lens.lens.model_types import HookedModel, Tokenizer
from mistill_lens.lens.sweep import ablation_sweep, effects_tensor


def _tl_patching_seconds(model: HookedModel, batch, rows: int, seed: int) -> dict[str, Any]:
    """TransformerLens's own per-head patching (`get_act_patch_attn_head_out_all_pos`: one full
    forward per head, the head's output patched at every position) on `rows` random event rows,
    scaled to all rows: the cost of the peers' path for a sweep, or why it does not run."""
    from transformer_lens import patching

    chosen = sorted(random.Random(seed).sample(range(len(batch)), min(rows, len(batch))))
    started = time.perf_counter()
    try:
        for row in chosen:
            position = int(batch.predict_positions[row])
            tokens = batch.tokens[row : row + 1, : position + 1]
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens)
            chosen_token, contrast = int(batch.chosen[row]), int(batch.contrast[row, 0])
            patching.get_act_patch_attn_head_out_all_pos(
                model,
                tokens,
                cache,
                lambda logits: logits[0, -1, chosen_token] - logits[0, -1, contrast],
            )
    except Exception as err:  # a peer's code on our bridge: report, do not fail the benchmark
        return {"tl_patching": f"did not run: {type(err).__name__}: {err}"[:300]}
    seconds = time.perf_counter() - started
    return {
        "tl_patching_s": round(seconds * len(batch) / len(chosen), 2),
        "tl_patching_rows_timed": len(chosen),
    }


def _events(
    tokenizer: Tokenizer, k: int, n_examples: int, max_events: int | None, seed: int, context: int
):
    examples = task.generate_examples(n_examples, seed, "heldout", k=k, max_mentions=4)
    encoded = [events_from_spans(e, tokenizer, i) for i, e in enumerate(examples)]
    longest = max(len(x.tokens) for x in encoded)
    if longest > context:
        raise ValueError(
            f"K={k} examples reach {longest} tokens, beyond the model's {context}-token context; "
            "use a smaller k or a model with longer positions"
        )
    events = [e for x in encoded for e in x.events][:max_events]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_event_batch(encoded, events, pad), encoded


def sweep_benchmark(
    model: HookedModel,
    tokenizer: Tokenizer,
    *,
    k: int,
    n_examples: int,
    max_events: int | None = None,
    loop_heads: int | None = None,
    seed: int = 0,
    context: int | None = None,
    loop_batch: int = 8,
    tl_rows: int = 2,
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
    # the loop: clean margins once, then one full forward per head over the event rows (rows in
    # chunks of `loop_batch`, which bounds its [rows, head, T, T] attention patterns)
    started = time.perf_counter()
    clean = clean_margins(model, batch, batch_size=loop_batch)
    clean_s = time.perf_counter() - started
    started = time.perf_counter()
    loop = torch.full((len(batch), n_layers, n_heads), torch.nan)
    for layer, head in timed:
        loop[:, layer, head] = clean - ablated_margins(
            model, batch, means, [(layer, head)], batch_size=loop_batch
        )
    per_head_s = (time.perf_counter() - started) / len(timed)
    loop_s = clean_s + per_head_s * len(heads)

    fast = effects_tensor(fast_table, len(batch), n_layers, n_heads)
    swept = ~torch.isnan(loop)
    tl = _tl_patching_seconds(model, batch, tl_rows, seed)
    return {
        "bench": "sweep",
        "speedup": round(loop_s / engine_s, 1),
        "max_abs_diff": float((fast[swept] - loop[swept]).abs().max()),
        "engine_s": round(engine_s, 2),
        "loop_s": round(loop_s, 2),
        "loop_scaled_from_heads": len(timed),
        "loop_clean_s": round(clean_s, 2),
        "loop_per_head_s": round(per_head_s, 2),
        **tl,
        **(
            {"speedup_vs_tl_patching": round(tl["tl_patching_s"] / engine_s, 1)}
            if "tl_patching_s" in tl
            else {}
        ),
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


def _scaling_point(mode: str, k: int, seed: int, loop_heads: int) -> dict[str, Any]:
    """One (mode, K) measurement in this process: seconds and peak resident memory."""
    import resource

    model, tokenizer = scaling_model(seed)
    batch, encoded = _events(tokenizer, k, 1, None, seed, model.cfg.n_ctx)
    heads = all_heads(model)
    started = time.perf_counter()
    if mode == "engine":
        engine = InterventionEngine(model)
        ablation_sweep(engine, batch, means_from_events(engine, batch), heads=heads, progress=False)
        swept = len(heads)
    else:
        means = means_from_events(model, batch)
        timed = sorted(random.Random(seed).sample(heads, min(loop_heads, len(heads))))
        ablation_sweep(model, batch, means, heads=timed, progress=False, batch_size=1)
        swept = len(timed)
    seconds = time.perf_counter() - started
    return {
        "mode": mode,
        "k": k,
        "tokens": len(encoded[0].tokens),
        "events": len(batch),
        "seconds_all_heads": round(seconds * len(heads) / swept, 2),
        "heads_timed": swept,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def scaling_model(seed: int = 0):
    """A random-weight Llama of the shipped teacher's shape (4 layers x 4 heads, d_model 128)
    with rotary positions up to 262,144 tokens, bridged: what the scaling benchmark measures
    (timing and memory do not depend on the weights' values)."""
    from mistill_lens.models.checkpoints import to_bridge
    from mistill_lens.models.students import build_student, student_config
    from mistill_lens.models.tokenizers import student_tokenizer

    tokenizer = student_tokenizer()
    config = student_config(
        "llama",
        len(tokenizer),
        tokenizer.eos_token_id,
        n_layer=4,
        n_head=4,
        n_embd=128,
        n_kv_head=4,
        n_ctx=262144,
    )
    hf = build_student(config, seed).eval()
    return to_bridge(hf, tokenizer, name="scaling-llama"), tokenizer


def scaling_benchmark(
    ks: tuple[int, ...] = (16, 64, 256, 1024, 5651),
    loop_max_k: int = 256,
    loop_heads: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Engine and full-forward sweep time and peak memory of one example per K (each point in a
    fresh process, so peaks do not carry over), and the fitted growth exponents (log-log slope
    of seconds and of memory above the smallest K's, against context tokens). The loop runs up to
    `loop_max_k` (beyond, its [T, T] patterns per event row do not fit), on `loop_heads` random
    heads scaled to all."""
    import multiprocessing

    jobs = [("engine", k) for k in ks] + [("loop", k) for k in ks if k <= loop_max_k]
    context = multiprocessing.get_context("spawn")
    points = []
    for mode, k in jobs:
        with context.Pool(1) as pool:
            points.append(pool.apply(_scaling_point, (mode, k, seed, loop_heads)))

    result: dict[str, Any] = {"bench": "scaling", "model": "random Llama, 4 x 4 heads, d 128"}
    for mode in ("engine", "loop"):
        rows = [p for p in points if p["mode"] == mode]
        tokens = [r["tokens"] for r in rows]
        result[f"{mode}_time_exponent"] = loglog_slope(
            tokens, [r["seconds_all_heads"] for r in rows]
        )
        # memory above the smallest K's peak (the interpreter, torch and the model)
        result[f"{mode}_memory_exponent"] = loglog_slope(
            tokens[1:], [r["peak_rss_mib"] - rows[0]["peak_rss_mib"] for r in rows[1:]]
        )
    result["points"] = points
    result["seed"] = seed
    return result


def long_context_benchmark(k: int = 5651, seed: int = 0) -> dict[str, Any]:
    """The whole characterisation (attribution, exact sweeps of every head on the decided and
    null events, calibration, circuit measures, families, ablation curve) of one held-out example
    at K candidates, on the engine, with the scaling model (rotary positions long enough): time,
    peak resident memory, context tokens and what it found. The means come from the example
    itself (one example only: recorded among the warnings)."""
    import resource

    from mistill_lens.lens.characterize import CharacterizeConfig, characterize

    model, tokenizer = scaling_model(seed)
    example = task.generate_examples(1, seed, "heldout", k=k, max_mentions=4)
    tokens = len(events_from_spans(example[0], tokenizer, 0).tokens)
    if tokens > model.cfg.n_ctx:
        raise ValueError(f"K={k} reaches {tokens} tokens, beyond the model's {model.cfg.n_ctx}")
    config = CharacterizeConfig(seed=seed, progress=False, curve_points=2, min_events_per_kind=1)
    started = time.perf_counter()
    found = characterize(
        model,
        tokenizer,
        example,
        example,
        config,
        provenance={"warnings": ["one example: the means come from the example itself"]},
    )
    seconds = time.perf_counter() - started
    return {
        "bench": "long_context",
        "model": "random Llama, 4 x 4 heads, d 128",
        "k": k,
        "tokens": tokens,
        "events": found.n_events,
        "decided_events": found.n_decided_events,
        "null_events": found.n_null_events,
        "heads_swept": found.n_heads_swept,
        "circuit": [list(h) for h in found.circuit],
        "seconds": round(seconds, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "warnings": found.warnings,
        "seed": seed,
    }


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log(y) on log(x) over the positive pairs: the growth exponent."""
    import math

    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pairs) < 2:
        return None
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    if spread == 0:
        return None
    return round(sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread, 2)


def attribution_benchmark(
    model: HookedModel,
    tokenizer: Tokenizer,
    *,
    k: int,
    n_examples: int,
    max_events: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Attribution on the engine: its cost in forward-equivalents of the clean passes (all heads,
    all events), and its Spearman rank correlation with the exact engine sweep."""
    from mistill_lens.lens.results import rank_correlation

    batch, encoded = _events(tokenizer, k, n_examples, max_events, seed, model.cfg.n_ctx)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    engine = InterventionEngine(model)
    started = time.perf_counter()
    engine.prepare(batch)
    clean_s = time.perf_counter() - started
    means = means_from_events(engine, batch)
    started = time.perf_counter()
    scores = engine.attribution(batch, means)
    attribution_s = time.perf_counter() - started
    exact = effects_tensor(
        ablation_sweep(engine, batch, means, progress=False), len(batch), n_layers, n_heads
    )
    return {
        "bench": "attribution",
        "forward_equivalents": round(attribution_s / clean_s, 3),
        "rank_correlation": round(rank_correlation(scores, exact), 3),
        "attribution_s": round(attribution_s, 3),
        "clean_passes_s": round(clean_s, 3),
        "heads": n_layers * n_heads,
        "events": len(batch),
        "examples": len({e.example_id for e in batch.events}),
        "k": k,
        "context_tokens_mean": round(sum(len(x.tokens) for x in encoded) / len(encoded), 1),
        "seed": seed,
        "threads": torch.get_num_threads(),
    }


def _distill_step_point(mode: str, family: str, steps: int, batch_size: int, seed: int) -> dict:
    """Seconds per optimiser step and peak resident memory of one objective, in this process."""
    import resource

    from mistill_lens.distill.attention import collate_items
    from mistill_lens.distill.training import (
        DistillConfig,
        distillation_items,
        initial_student,
        student_losses,
    )
    from mistill_lens.lens.adapters import adapter_for
    from mistill_lens.models.checkpoints import load_model
    from mistill_lens.models.precision import compute_context, compute_mode
    from mistill_lens.models.students import context_length, family_tokenizer
    from mistill_lens.training.loop import make_optimizer, output_loss

    torch.manual_seed(seed)
    teacher, teacher_tokenizer = load_model("tiny")  # the teacher the recorded figures used
    # the teacher's last layer as the supervised head set: a cost benchmark, not a finding
    last = teacher.cfg.n_layers - 1
    heads_by_kind = {
        kind: [(last, h) for h in range(teacher.cfg.n_heads)]
        for kind in ("region", "within", "near_miss")
    }
    config = DistillConfig(family=family, objective="mistill", seed=seed, batch_size=batch_size)
    student = initial_student(config)
    tokenizer = family_tokenizer(family)
    examples = task.generate_examples(batch_size * steps, seed, "train", k=4, max_mentions=1)
    items, _ = distillation_items(
        examples, teacher, teacher_tokenizer, tokenizer, heads_by_kind, context_length(student)
    )
    adapter = adapter_for(student)
    student.train()
    heads = config.student_heads(
        (adapter.n_layers, adapter.n_heads),
        (teacher.cfg.n_layers, teacher.cfg.n_heads),
        [h for hs in heads_by_kind.values() for h in hs],
    )
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, parameters)
    batches = [
        collate_items(items[i : i + batch_size], tokenizer.pad_token_id)
        for i in range(0, len(items), batch_size)
    ]
    times = []
    for index, batch in enumerate(batches):
        started = time.perf_counter()
        if mode == "cot":  # the plain chain-of-thought step: no hooks, no attention loss
            with compute_context("cpu", compute_mode("cpu", config.precision)):
                loss = output_loss(student, batch.ids, batch.attention, batch.targets)
        else:
            cot, attention = student_losses(student, adapter, batch, heads, config.precision)
            loss = cot + config.effective_weight * attention
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if index > 0:  # the first step pays one-off allocations
            times.append(time.perf_counter() - started)
    return {
        "mode": mode,
        "seconds_per_step": sum(times) / len(times),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "steps_timed": len(times),
        "events_per_batch": sum(int(b.event_mask.sum()) for b in batches) / len(batches),
    }


def distill_step_benchmark(
    family: str = "llama", steps: int = 6, batch_size: int = 4, seed: int = 0
) -> dict[str, Any]:
    """A MISTILL step (chain-of-thought loss + attention supervision at the decision events,
    through the event rows recomputed from the recorded residuals) against a plain CoT step on the
    same batches,
    each objective in a fresh process: `time_ratio` and `memory_ratio` (peak resident memory)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    points = {}
    for mode in ("cot", "mistill"):
        with context.Pool(1) as pool:
            points[mode] = pool.apply(_distill_step_point, (mode, family, steps, batch_size, seed))
    return {
        "bench": "distill_step",
        "time_ratio": round(
            points["mistill"]["seconds_per_step"] / points["cot"]["seconds_per_step"], 3
        ),
        "memory_ratio": round(points["mistill"]["peak_rss_mib"] / points["cot"]["peak_rss_mib"], 3),
        "cot": points["cot"],
        "mistill": points["mistill"],
        "family": family,
        "batch_size": batch_size,
        "seed": seed,
    }
