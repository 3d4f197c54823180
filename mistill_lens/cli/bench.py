"""The ``bench`` command: the intervention engine against the full-forward path, and the other
recorded benchmarks."""

from __future__ import annotations

import argparse
import json

from mistill_lens.cli.arguments import POSITIVE_INT, SEED, SEED_HELP


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmark the intervention engine against the full-forward path (prints one JSON "
        "object as its last line)",
    )
    parser.add_argument(
        "name",
        choices=["sweep", "attribution", "scaling", "long_context", "distill_step"],
        help="sweep: every head x every event on --model; attribution: its cost in clean-pass "
        "equivalents and rank correlation with the sweep; scaling: engine and loop time and "
        "memory against K on a random Llama of the teacher's shape; long_context: the whole "
        "characterisation of one example at --k on that model; distill_step: a MISTILL step "
        "against a CoT step (time and memory ratios)",
    )
    parser.add_argument(
        "--ks",
        default="16,64,256,1024,5651",
        help="scaling: the K values (default 16,64,256,1024,5651)",
    )
    parser.add_argument(
        "--family", choices=["llama", "gpt2"], default="llama", help="distill_step: the student"
    )
    parser.add_argument(
        "--loop-max-k", type=POSITIVE_INT, default=256, help="scaling: largest K for the loop"
    )
    parser.add_argument(
        "--model",
        default="default",
        help="checkpoint folder, 'default', 'tiny' (the shipped teachers), 'smollm2' or 'gemma3' "
        "(the pretrained bases) or a GGUF file",
    )
    parser.add_argument("--k", type=POSITIVE_INT, default=16, help="candidates per example")
    parser.add_argument(
        "--n-examples", type=POSITIVE_INT, default=8, help="held-out examples (default 8)"
    )
    parser.add_argument(
        "--events", type=POSITIVE_INT, default=None, help="at most this many events (default all)"
    )
    parser.add_argument(
        "--loop-heads",
        type=POSITIVE_INT,
        default=None,
        help="time the full-forward loop on this many random heads and scale (default all heads)",
    )
    parser.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("examples and heads"))
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from mistill_lens import benchmarks

    if args.name == "distill_step":
        result = benchmarks.distill_step_benchmark(args.family, seed=args.seed)
    elif args.name == "long_context":
        result = benchmarks.long_context_benchmark(args.k, seed=args.seed)
    elif args.name == "scaling":
        try:
            ks = tuple(int(k) for k in args.ks.split(","))
        except ValueError:
            raise ValueError(f"--ks takes comma-separated integers, got {args.ks!r}") from None
        result = benchmarks.scaling_benchmark(
            ks, loop_max_k=args.loop_max_k, loop_heads=args.loop_heads or 1, seed=args.seed
        )
    else:  # sweep, attribution: on --model
        from mistill_lens.models.checkpoints import load_model

        model, tokenizer = load_model(args.model)
        options = dict(k=args.k, n_examples=args.n_examples, max_events=args.events, seed=args.seed)
        if args.name == "attribution":
            result = benchmarks.attribution_benchmark(model, tokenizer, **options)
        else:
            result = benchmarks.sweep_benchmark(
                model, tokenizer, loop_heads=args.loop_heads, **options
            )
        result = {"model": args.model, **result}
    print(json.dumps(result))
