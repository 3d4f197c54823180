"""Peak memory of `characterize` on a model with a 262,144-token vocabulary (issue: no forward may
materialise logits that nothing reads). A 3-layer random-weight Gemma 3 of Gemma 3 270M's widths,
with the real Gemma tokenizer (from the GGUF package), saved as a Hugging Face folder, then
characterised from the command line on the counting task of docs/your-own-task.md:

    python benchmarks/large_vocab_memory.py N SEED WORK_DIR

Prints the command, its wall time and the child process's peak resident memory."""

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from mistill_lens.models.gguf import find_gemma3_gguf


def counting(starts) -> list[dict]:
    """Continue a count: the decision is the next number, its contrast the one after it."""
    rows = []
    for start in starts:
        prompt = "Count: " + ", ".join(str(n) for n in range(start, start + 5)) + ","
        chosen, contrast = f" {start + 5}", f" {start + 6}"
        event = dict(
            kind="next",
            start=len(prompt),
            end=len(prompt) + len(chosen),
            chosen=chosen,
            contrast=contrast,
        )
        rows.append({"id": f"count-{start}", "prompt": prompt, "output": chosen, "events": [event]})
    return rows


def gemma_folder(folder: Path, seed: int) -> int:
    gguf = find_gemma3_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=32768,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    Gemma3ForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def main(n: int, seed: int, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    vocab = gemma_folder(work / "gemma3-3layer", seed)
    for name, starts in (
        ("mine.jsonl", range(3, 3 + 6 * n, 6)),
        ("ref.jsonl", range(500, 500 + 6 * n, 6)),
    ):
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in counting(starts)))
    command = [
        sys.executable, "-m", "mistill_lens.cli", "characterize",
        "--model", str(work / "gemma3-3layer"),
        "--examples", str(work / "mine.jsonl"), "--reference", str(work / "ref.jsonl"),
        "--seed", str(seed), "--out", str(work / "run"), "--no-progress",
    ]  # fmt: skip
    print("$", " ".join(command[2:]), flush=True)
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.time() - start
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(done.stdout.strip()[-600:], done.stderr.strip()[-600:], sep="\n")
    print(
        f"vocabulary {vocab:,}; {n} examples; exit {done.returncode}; {seconds:.0f} s; "
        f"peak resident memory of the command {peak_gib:.2f} GiB"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
