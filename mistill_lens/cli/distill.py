"""The ``distill`` command: teacher generations (cached), the teacher's
characterised head set (cached), training, then evaluation of the student.

Heavy modules are imported inside the commands so that building the parser stays fast."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mistill_lens.cli.arguments import (
    NON_NEGATIVE_FLOAT,
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    SEED,
)
from mistill_lens.distill import FAMILIES, OBJECTIVES, PRECISIONS
from mistill_lens.models import BASE_MODELS


def student_architecture_options(args: argparse.Namespace) -> dict:
    """Architecture fields of the run: the base student's with --student-init (explicit sizes must
    agree with it; a Llama's rotary context may grow), else --n-layer/--n-head/--n-embd/--n-ctx
    or their defaults."""
    sizes = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd}
    if args.student in BASE_MODELS:  # the base's own architecture; --student-init: an adapter
        given = [f"--{k.replace('_', '-')}" for k, v in sizes.items() if v is not None]
        if given:
            raise ValueError(
                f"--student {args.student} is a pretrained base with its own architecture: "
                f"drop {', '.join(given)}"
            )
        return {"n_ctx": args.n_ctx, "student_init": args.student_init, "lora_r": args.lora_r}
    if args.student_init is None:
        defaults = {"n_layer": 4, "n_head": 4, "n_embd": 96}
        fresh = {k: v if v is not None else defaults[k] for k, v in sizes.items()}
        return {**fresh, "n_ctx": args.n_ctx}
    import torch

    from mistill_lens.models.students import (
        DEFAULT_CONTEXT,
        load_base_student,
        student_architecture,
    )

    architecture = student_architecture(
        load_base_student(args.student_init, args.student, torch.float32)
    )
    if args.student == "llama":  # rotary positions: the context grows to a fresh student's
        wanted = args.n_ctx or DEFAULT_CONTEXT["llama"]
        architecture["n_ctx"] = max(architecture["n_ctx"], wanted)
    else:
        sizes["n_ctx"] = args.n_ctx
    conflicting = {k: v for k, v in sizes.items() if v is not None and v != architecture[k]}
    if conflicting:
        raise ValueError(
            f"--student-init {args.student_init} has {architecture}; it conflicts with {conflicting}"
        )
    return {**architecture, "student_init": str(args.student_init)}


def parse_head_set(text: str) -> tuple[tuple[int, int], ...]:
    """``"3.3,2.0"`` -> ((3, 3), (2, 0)): comma-separated LAYER.HEAD pairs."""
    heads = []
    for part in text.split(","):
        layer, dot, head = part.strip().partition(".")
        if not (dot and layer.isdigit() and head.isdigit()):
            raise ValueError(
                f"--student-heads takes comma-separated LAYER.HEAD pairs such as 3.3,2.0; got {part!r}"
            )
        heads.append((int(layer), int(head)))
    return tuple(heads)


def _circuit_config(args: argparse.Namespace, z_min: float, progress: bool):
    """How a characterisation here (the teacher's, a student's after training) picks its
    circuits: `--circuit` z (heads significant alone at `z_min`) or faithful (the search by joint
    effect among `--faithful-pool` candidates)."""
    from mistill_lens.lens.results import CharacterizeConfig

    faithful = args.circuit == "faithful"
    return CharacterizeConfig(
        z_min=z_min,
        progress=progress,
        circuit=args.circuit,
        faithful_pool=args.faithful_pool if faithful else None,
    )


def run(args: argparse.Namespace) -> dict:
    from mistill_lens.distill.attention import read_heads_json, teacher_head_sets
    from mistill_lens.distill.data import teacher_traces
    from mistill_lens.distill.evaluation import EVALUATION_FILE, evaluate_run
    from mistill_lens.distill.teacher import teacher_characterization, teacher_task_config
    from mistill_lens.distill.training import DistillConfig, distill
    from mistill_lens.models.checkpoints import load_model, resolve, weights_digest
    from mistill_lens.runs import claim_run_dir
    from mistill_lens.training.checkpoint_state import check_checkpoint_dir

    teacher_dir = resolve(args.teacher)
    out = Path(args.out)
    cache = Path(args.cache) if args.cache else out.parent / "distill_cache"
    task_config = teacher_task_config(teacher_dir)
    # refused up front, before any work: folders that are not this command's
    check_checkpoint_dir(out, "distill")  # claimed once, by the run itself
    claim_run_dir(cache, "distill-cache")
    progress = not args.no_progress
    teacher, teacher_tokenizer = load_model(teacher_dir)
    if args.teacher_heads:
        heads_source = Path(args.teacher_heads)
        circuits = read_heads_json(heads_source)
    else:
        characterization, heads_source = teacher_characterization(
            teacher,
            teacher_tokenizer,
            teacher_dir,
            task_config,
            cache,
            args.characterize_n,
            _circuit_config(args, args.teacher_z_min, progress),
        )
        circuits = characterization.circuits
    heads_by_kind = teacher_head_sets(circuits)
    examples, n_tried = teacher_traces(
        teacher_dir, args.n_train, args.data_seed, "train", task_config, cache, progress
    )
    layers = tuple(int(x) for x in args.student_layers.split(",")) if args.student_layers else None
    head_set = parse_head_set(args.student_heads) if args.student_heads else None
    config = DistillConfig(
        family=args.student,
        objective=args.objective,
        precision=args.precision,
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        attention_weight=args.attention_weight,
        student_layers=layers,
        student_head_set=head_set,
        checkpoint_every=args.checkpoint_every,
        teacher=weights_digest(teacher_dir),
        n_train=args.n_train,
        data_seed=args.data_seed,
        **student_architecture_options(args),
    )
    command = "mistill-lens " + shlex.join(sys.argv[1:])
    n_events = sum(len(e.events) for e in examples)
    metadata = distill(
        config,
        teacher,
        teacher_tokenizer,
        examples,
        heads_by_kind,
        out,
        cache_dir=cache,
        command=command,
        extra_metadata={
            "teacher_dir": str(teacher_dir),
            "teacher_heads_source": str(heads_source),
            "teacher_events": n_events,
            "teacher_traces": {"tried": n_tried, "reproduced_verbatim": len(examples)},
            "task": task_config,
        },
        progress=progress,
    )
    result = {
        k: metadata[k]
        for k in ("step", "n_params", "train_time_s", "final_cot_loss", "final_attention_loss")
    }
    if args.n_eval > 0:
        z_min = args.teacher_z_min if args.student_z_min is None else args.student_z_min
        student_config = _circuit_config(args, z_min, progress)
        previous = out / EVALUATION_FILE
        done = json.loads(previous.read_text()) if previous.is_file() else {}
        if (
            done.get("steps"),
            done.get("n_eval"),
            done.get("z_min"),
            done.get("n_characterize"),
            done.get("circuit", "z"),  # evaluations recorded before the rule was a choice: z
        ) != (metadata["step"], args.n_eval, z_min, args.characterize_n, args.circuit):
            done = evaluate_run(
                out,
                task_config,
                n_eval=args.n_eval,
                n_characterize=args.characterize_n,
                progress=progress,
                characterize_config=student_config,
            )
        result.update(
            {
                k: done.get(k)
                for k in ("causal_recovery", "causal_recovery_median", "code_f1", "near_miss_acc")
            }
        )
    result["warnings"] = metadata.get("warnings", []) + (
        done.get("warnings", []) if args.n_eval > 0 else []
    )
    print(json.dumps(result))
    return result


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "distill",
        help="distil the teacher into a student (CoT or MISTILL; resumable), then evaluate it",
    )
    parser.add_argument(
        "--teacher", default="default", help="teacher checkpoint folder, 'default' or 'tiny'"
    )
    parser.add_argument(
        "--student",
        choices=FAMILIES + BASE_MODELS,
        required=True,
        help="llama: a small Llama on the student tokenizer; gpt2: a small GPT-2 on the tiny teacher's "
        "tokenizer (the same family and tokenizer as --teacher tiny); smollm2, gemma3: that "
        "pretrained base fine-tuned with a LoRA adapter, on its own tokenizer",
    )
    parser.add_argument("--objective", choices=OBJECTIVES, required=True)
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32-master",
        help="student weights and compute: bf16, or fp32 master weights with bf16 compute",
    )
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument(
        "--out", required=True, help="student checkpoint folder; rerun the same command to resume"
    )
    parser.add_argument("--steps", type=POSITIVE_INT, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=POSITIVE_INT, default=4, help="examples per step")
    parser.add_argument("--lr", type=POSITIVE_FLOAT, default=1e-3, help="peak learning rate")
    parser.add_argument(
        "--attention-weight",
        type=NON_NEGATIVE_FLOAT,
        default=1.0,
        help="lambda of the attention loss (mistill)",
    )
    parser.add_argument(
        "--n-layer",
        type=POSITIVE_INT,
        default=None,
        help="student layers (default 4, or --student-init's)",
    )
    parser.add_argument(
        "--n-head",
        type=POSITIVE_INT,
        default=None,
        help="student heads per layer (default 4, or --student-init's)",
    )
    parser.add_argument(
        "--n-embd",
        type=POSITIVE_INT,
        default=None,
        help="student width (default 96, or --student-init's)",
    )
    parser.add_argument(
        "--n-ctx",
        type=POSITIVE_INT,
        default=None,
        help="student positions (default: llama 2048, gpt2 1024, a pretrained base 4096; a Llama "
        "--student-init's rotary context grows to it, a GPT-2's learned one cannot)",
    )
    parser.add_argument(
        "--student-init",
        default=None,
        help="start from this base student (`train --role student`) instead of a fresh "
        "initialisation; for a pretrained --student, a LoRA checkpoint of that base (`train --base`, "
        "e.g. a shared warm-up)",
    )
    parser.add_argument(
        "--lora-r",
        type=POSITIVE_INT,
        default=16,
        help="LoRA rank of a pretrained --student's fresh adapter (default 16)",
    )
    parser.add_argument(
        "--student-layers",
        default=None,
        help="comma-separated student layers whose heads are pooled (default: a same-family student "
        "of the teacher's shape pools the teacher's head positions, others the upper half)",
    )
    parser.add_argument(
        "--student-heads",
        default=None,
        help="comma-separated LAYER.HEAD student heads whose attention is pooled (instead of --student-layers)",
    )
    parser.add_argument(
        "--checkpoint-every", type=POSITIVE_INT, default=100, help="steps between checkpoints"
    )
    parser.add_argument(
        "--n-train",
        type=POSITIVE_INT,
        default=256,
        help="training prompts tried; those whose gold trace the teacher reproduces verbatim are "
        "the distillation data",
    )
    parser.add_argument(
        "--data-seed",
        type=SEED,
        default=0,
        help="seed of the training prompts (shared by all runs)",
    )
    parser.add_argument(
        "--teacher-heads",
        default=None,
        help="heads.json of a teacher characterisation (default: characterise it once, cached)",
    )
    parser.add_argument(
        "--teacher-z-min",
        type=float,
        default=3.0,
        help="calibrated z a teacher head needs to join its circuit, when characterising it here",
    )
    parser.add_argument(
        "--circuit",
        choices=("z", "faithful"),
        default="z",
        help="how the teacher's circuits (when characterised here: MISTILL's head sets) and the "
        "student's found circuit (its recovery) are chosen: heads significant alone at the z "
        "thresholds (default), or the smallest sets by joint effect (the faithfulness search)",
    )
    parser.add_argument(
        "--faithful-pool",
        type=POSITIVE_INT,
        default=40,
        metavar="N",
        help="with --circuit faithful: candidate heads per kind, those with the largest "
        "single-head effects (default 40)",
    )
    parser.add_argument(
        "--student-z-min",
        type=float,
        default=None,
        help="calibrated z a student head needs to join its found circuit (default: --teacher-z-min)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        help="folder for teacher generations and characterisation (default: OUT/../distill_cache)",
    )
    parser.add_argument(
        "--n-eval",
        type=NON_NEGATIVE_INT,
        default=50,
        help="held-out examples for code_f1 / near_miss_acc (0: skip evaluation)",
    )
    parser.add_argument(
        "--characterize-n", type=POSITIVE_INT, default=24, help="examples for each characterisation"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars (model loading included)"
    )
    parser.set_defaults(func=run, resume_hint="the student's checkpoints so far are kept in --out")
