"""Seconds per distillation step of a pretrained student at the task's K, by precision, side by
side: ``python benchmarks/distill_step_timing.py FAMILY K STEPS SEED``.

One step = the student's forward with its pooled attention recorded, the CoT + attention loss,
backward, clipping and the optimizer update, on one training example (batch 1, as the grid
trains). Precisions: ``fp32`` (fp32 weights and compute), ``fp32-master`` (fp32 weights, bf16
autocast: the grid's default) and ``bf16`` (bf16 weights and compute). They run interleaved
(fp32, fp32-master, bf16, fp32, ...) so drift on shared cores hits each alike; the first round is
warm-up and not counted. Prints the median per precision and its ratio to fp32."""

import statistics
import sys
import time

import torch

from mistill_lens import task
from mistill_lens.distill.attention import DistillItem, collate_items
from mistill_lens.distill.training import DistillConfig, pretrained_student, student_losses
from mistill_lens.lens.adapters import adapter_for
from mistill_lens.lens.events import events_from_spans
from mistill_lens.models.checkpoints import base_tokenizer
from mistill_lens.training.data import encode
from mistill_lens.training.loop import make_optimizer

PRECISIONS = ("fp32", "fp32-master", "bf16")


def item(tokenizer, example) -> DistillItem:
    """The example in the student's tokens with a uniform attention target at each event (the
    target's values do not change the cost of a step)."""
    ids, targets = encode(tokenizer, example.prompt, example.output)
    events = events_from_spans(example, tokenizer, 0).events
    queries = [e.predict_position for e in events]
    uniform = [torch.full((q + 1,), 1.0 / (q + 1)) for q in queries]
    return DistillItem(ids, targets, queries, [e.kind for e in events], uniform)


def student(family: str, precision: str, seed: int):
    config = DistillConfig(
        family=family, precision="bf16" if precision == "bf16" else "fp32-master", seed=seed
    )
    model = pretrained_student(config)
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    return (
        model,
        adapter_for(model.get_base_model()),
        parameters,
        make_optimizer(config, parameters),
    )


def main(family: str, k: int, steps: int, seed: int) -> None:
    torch.set_num_threads(1)
    tokenizer = base_tokenizer(family)
    example = task.generate_examples(1, seed, "train", k=k, max_mentions=4)[0]
    batch = collate_items([item(tokenizer, example)], tokenizer.pad_token_id or 0)
    n_layers = None
    runs = {}
    for precision in PRECISIONS:
        runs[precision] = student(family, precision, seed)
        n_layers = runs[precision][1].n_layers
    heads = [(layer, 0) for layer in range(n_layers // 2, n_layers)]
    times = {p: [] for p in PRECISIONS}
    for round_ in range(steps + 1):
        for precision in PRECISIONS:
            model, adapter, parameters, optimizer = runs[precision]
            start = time.perf_counter()
            cot, attention = student_losses(model, adapter, batch, heads, precision)
            (cot + attention).backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if round_ > 0:  # the first round is warm-up
                times[precision].append(time.perf_counter() - start)
    base = statistics.median(times["fp32"])
    print(f"{family} K={k} tokens {batch.ids.shape[1]} steps {steps} (1 thread)")
    for precision in PRECISIONS:
        median = statistics.median(times[precision])
        print(
            f"  {precision:12s} {median:6.2f} s/step (min {min(times[precision]):.2f}, "
            f"max {max(times[precision]):.2f}); x{base / median:.2f} of fp32's speed"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
