"""Seconds per training step of a LoRA run on a pretrained base, fp32 vs bf16 autocast, side by
side: ``python benchmarks/train_step_precision.py BASE STEPS SEED`` (BASE smollm2 or gemma3).

One step = the event-weighted output loss of one K = 64 training example (batch 1, as the
warm-up stages train), its backward and the optimizer update, as `train --precision fp32` and
`--precision fp32-master` run it. The two precisions run interleaved on the same examples (fp32,
fp32-master, fp32, ...) so drift on shared cores hits both alike; the first round is warm-up and
not counted. Prints each step, the medians and their ratio. Run it with OMP_NUM_THREADS=1 to
measure one core."""

import statistics
import sys
import time

import torch

from mistill_lens.models import TRAIN_PRECISIONS
from mistill_lens.training.config import TrainConfig
from mistill_lens.training.data import collate, training_batches
from mistill_lens.training.loop import make_optimizer, output_loss
from mistill_lens.training.models import build_model, role_tokenizer


def main(base: str, steps: int, seed: int) -> None:
    config = TrainConfig(
        base=base, seed=seed, k=64, max_mentions=4, event_weight=3, batch_size=1, lr=3e-4
    )
    tokenizer = role_tokenizer(config)
    model = build_model(config, tokenizer)
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, parameters)
    batches = training_batches(config, tokenizer, 0)
    seconds = {precision: [] for precision in TRAIN_PRECISIONS}
    for step in range(steps + 1):
        ids, attention, targets = collate([e[:2] for e in next(batches)], tokenizer.pad_token_id)
        for precision in TRAIN_PRECISIONS:
            start = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "fp32-master"):
                loss = output_loss(model, ids, attention, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            took = time.perf_counter() - start
            if step:  # the first round warms up
                seconds[precision].append(took)
            print(f"step {step} {precision}: {ids.shape[1]} tokens, {took:.2f} s, loss {loss:.4f}")
    medians = {p: statistics.median(s) for p, s in seconds.items()}
    print(
        f"{base}, median of {steps} steps: "
        + ", ".join(f"{p} {m:.2f} s" for p, m in medians.items())
    )
    print(f"fp32 / fp32-master: {medians['fp32'] / medians['fp32-master']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
