"""Seconds per LoRA training step of SmolLM2-135M's architecture (random weights) on this device.

Run on a GPU lease before the real run, so the real run's --steps fits its time: prints one JSON
line per batch size and writes the measurements to the file given (default gpu_timing.json).
Usage: python benchmarks/gpu/step_timing.py [OUT.json] [--tokens 1200] [--targets 110]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from mistill_lens.models.lora import LORA_TARGETS
from mistill_lens.training.loop import output_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default="gpu_timing.json")
    parser.add_argument("--tokens", type=int, default=1200, help="tokens per example")
    parser.add_argument("--targets", type=int, default=110, help="output tokens per example")
    parser.add_argument("--batch-sizes", default="8,16,32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=12, help="steps timed (the first 2 warm up)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a CPU rehearsal)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = LlamaConfig(**json.loads((Path(__file__).parent / "smollm2_config.json").read_text()))
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    device = torch.device(args.device)
    model = LlamaForCausalLM(config).to(device)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS))
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    results = {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for batch in (int(b) for b in args.batch_sizes.split(",")):
        ids = torch.randint(0, config.vocab_size, (batch, args.tokens), device=device)
        attention = torch.ones_like(ids, dtype=torch.bool)
        targets = torch.zeros_like(attention)
        targets[:, -args.targets :] = True
        times = []
        for step in range(args.repeats):
            sync()
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = output_loss(model, ids, attention, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            sync()
            if step >= 2 or args.repeats <= 2:
                times.append(time.perf_counter() - started)
        results[batch] = sum(times) / len(times)
        print(
            json.dumps(
                {
                    "batch_size": batch,
                    "s_per_step": round(results[batch], 4),
                    "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
                    if device.type == "cuda"
                    else None,
                }
            )
        )
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
