"""`mistill-lens evaluate` at several K in one process (the model is loaded once): one JSON line
per K, appended to OUT as soon as it is done, so a run cut short keeps what it finished.
Each line equals `mistill-lens evaluate --model MODEL --k K --n N --seed SEED --device DEVICE
--batch-size B` (same examples, same decoding).
Usage: python benchmarks/gpu/evaluate_ks.py MODEL OUT.jsonl --ks 64,16,256,448 [--n 100]
"""

from __future__ import annotations

import argparse
import json
import time

from mistill_lens import task
from mistill_lens.models.checkpoints import load_hf_model, read_metadata
from mistill_lens.task.metrics import evaluate
from mistill_lens.training.loop import resolve_device


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--ks", default="64,16,256,448")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--save-outputs", default=None, help="folder for each K's generations")
    args = parser.parse_args()
    trained = read_metadata(args.model).get("config", {})
    model, tokenizer = load_hf_model(args.model)
    model.to(resolve_device(args.device))
    for k in (int(k) for k in args.ks.split(",")):
        config = dict(
            universe_size=trained.get("universe_size", task.DEFAULT_UNIVERSE_SIZE),
            k=k,
            max_mentions=trained.get("max_mentions", task.DEFAULT_MAX_MENTIONS),
        )
        examples = task.generate_examples(args.n, args.seed, args.split, **config)
        started = time.perf_counter()
        scores, outputs = evaluate(
            model,
            tokenizer,
            examples,
            config["universe_size"],
            batch_size=args.batch_size,
            progress=False,
        )
        scores.update(
            split=args.split,
            seed=args.seed,
            seconds=round(time.perf_counter() - started, 1),
            **config,
        )
        with open(args.out, "a") as f:
            f.write(json.dumps(scores) + "\n")
        print(json.dumps(scores), flush=True)
        if args.save_outputs:
            with open(f"{args.save_outputs}/outputs_k{k}.jsonl", "w") as f:
                for example, output in zip(examples, outputs):
                    f.write(json.dumps({"id": example.id, "generated": output}) + "\n")


if __name__ == "__main__":
    main()
