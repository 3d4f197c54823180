"""Cost of one distillation step by how the student's attention at the events is read, side by
side: ``python benchmarks/distill_attention_path.py FAMILY STEPS SEED``.

``pattern``: the student bridged with eager attention, every layer's [pos, pos] pattern
materialised and the supervised heads' rows read from ``hook_pattern`` (how students trained
before 2026-12-06). ``rows``: memory-efficient attention everywhere and the event rows alone
recomputed from the residuals entering the supervised layers (``distill.attention.event_attention``,
how they train now). One step = forward, CoT + attention loss, backward, optimizer update, on the
longest item of the committed distillation cache (``checkpoints/distill_cache``, SmolLM2's
tokens) or, for another family, one K = 64 example with uniform targets. Each path runs in its
own process (peak resident memory is per process), one after the other; the first step is
warm-up.
Prints the median seconds per step, the peak resident memory and the losses of the first step
(the two paths compute the same function: they differ by bf16 rounding only)."""

import multiprocessing
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parents[1] / "checkpoints" / "distill_cache"
HEADS = [(19, 1), (23, 3)]  # the default teacher's circuit, the same-family student's head set


def longest_item(family: str):
    from mistill_lens import task
    from mistill_lens.distill.attention import DistillItem
    from mistill_lens.lens.events import events_from_spans
    from mistill_lens.models.checkpoints import base_tokenizer
    from mistill_lens.training.data import encode

    if family == "smollm2":
        files = sorted(CACHE.glob("items-*.pt"))
        if files:
            items = torch.load(files[0], weights_only=False)["items"]
            return DistillItem(**max(items, key=lambda item: len(item["ids"])))
    tokenizer = base_tokenizer(family)
    example = task.generate_examples(1, 0, "train", k=64, max_mentions=4)[0]
    ids, targets = encode(tokenizer, example.prompt, example.output)
    queries = [e.predict_position for e in events_from_spans(example, tokenizer, 0).events]
    uniform = [torch.full((q + 1,), 1.0 / (q + 1)) for q in queries]
    return DistillItem(ids, targets, queries, ["region"] * len(queries), uniform)


def pattern_losses(model, bridge, batch, heads):
    from mistill_lens.distill.attention import attention_kl, pattern_recorder, pooled_attention
    from mistill_lens.models.precision import compute_context, compute_mode
    from mistill_lens.training.loop import output_loss

    store = {}
    recorder = pattern_recorder([layer for layer, _ in heads], store)
    with (
        bridge.hooks(fwd_hooks=recorder),
        compute_context("cpu", compute_mode("cpu", "fp32-master")),
    ):
        cot = output_loss(model, batch.ids, batch.attention, batch.targets)
        pooled = pooled_attention(store, heads, batch.query_positions)
    return cot, attention_kl(pooled, batch.attention_targets, batch.event_mask)


def run_path(path: str, family: str, steps: int, seed: int, queue) -> None:
    from mistill_lens.distill.attention import collate_items
    from mistill_lens.distill.training import DistillConfig, pretrained_student, student_losses
    from mistill_lens.lens.adapters import adapter_for
    from mistill_lens.models.bridge import to_bridge
    from mistill_lens.models.checkpoints import base_tokenizer
    from mistill_lens.training.loop import make_optimizer

    torch.set_num_threads(1)
    config = DistillConfig(family=family, precision="fp32-master", seed=seed)
    model = pretrained_student(config)
    if path == "pattern":
        model.get_base_model().config._attn_implementation = "eager"
        reader = to_bridge(model.get_base_model(), base_tokenizer(family), dtype=model.dtype)
    else:
        reader = adapter_for(model.get_base_model())
    model.train()
    batch = collate_items([longest_item(family)], 0)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, parameters)
    times, first = [], None
    for step in range(steps + 1):
        start = time.perf_counter()
        if path == "pattern":
            cot, attention = pattern_losses(model, reader, batch, HEADS)
        else:
            cot, attention = student_losses(model, reader, batch, HEADS, "fp32-master")
        (cot + attention).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:
            first = (cot.item(), attention.item())
        else:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    queue.put((path, batch.ids.shape[1], times, peak, first))


def main(family: str, steps: int, seed: int) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    results = {}
    for path in ("pattern", "rows"):
        process = context.Process(target=run_path, args=(path, family, steps, seed, queue))
        process.start()
        name, tokens, times, peak, first = queue.get()
        process.join()
        results[name] = (times, peak, first)
    base = statistics.median(results["pattern"][0])
    print(
        f"{family}, one item of {tokens} tokens, {steps} steps after warm-up, 1 thread, "
        f"fp32-master, heads {HEADS}"
    )
    for name, (times, peak, (cot, attention)) in results.items():
        median = statistics.median(times)
        print(
            f"  {name:8s} {median:6.2f} s/step (x{base / median:.2f}), peak {peak:5.2f} GiB, "
            f"first step cot {cot:.5f} attention {attention:.5f}"
        )


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
