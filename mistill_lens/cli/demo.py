"""The ``demo`` command: the main job on the shipped defaults, as the commands a user would type.

Held-out accuracy of the teacher (``evaluate``), its characterisation (``characterize``: events,
attribution, exact sweeps, calibration, the circuit with necessity / sufficiency / knock-in and
coverage, head families, early elicitation), a short CoT and a short MISTILL run into the shipped
base student (``distill``, clearly a short run), and one HTML report over all of it (``report``);
then a one-screen summary. Each stage's files stay in its folder under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

from mistill_lens.cli.arguments import POSITIVE_INT, SEED, parse_command

BASE_STUDENT = Path(__file__).resolve().parents[2] / "checkpoints" / "base_students" / "llama"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "demo",
        help="the main job on the shipped defaults: accuracy, characterisation, a short MISTILL "
        "vs CoT run, the HTML report, a one-screen summary",
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument(
        "--model", default="default", help="teacher: checkpoint folder, 'default' or 'tiny'"
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of every stage (default 0)")
    parser.add_argument(
        "--n-eval",
        type=POSITIVE_INT,
        default=20,
        help="held-out examples for accuracy (20; the teacher's recorded figure is on 100)",
    )
    parser.add_argument(
        "--n-characterize",
        type=POSITIVE_INT,
        default=4,
        help="held-out examples characterised (4: ~30 decided events at K = 64; 12 in docs)",
    )
    parser.add_argument(
        "--distill-steps",
        type=POSITIVE_INT,
        default=60,
        help="steps of each short distillation run (60; the paper-scale runs: docs/distill.md)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run, resume_hint="each finished stage is kept in --out")


def run(args: argparse.Namespace) -> dict:
    import mistill_lens.cli.characterize as characterize
    import mistill_lens.cli.distill as distill
    import mistill_lens.cli.evaluate as evaluate
    from mistill_lens.report import write_report
    from mistill_lens.runs import claim_run_dir

    out = claim_run_dir(args.out, "demo")
    quiet = ["--no-progress"] if args.no_progress else []
    common = ["--seed", str(args.seed), *quiet]

    def stage(title: str, command: ModuleType, argv: list[str]):
        print(f"\n== {title}\n$ mistill-lens {' '.join(argv)}", flush=True)
        return command.run(parse_command(command, argv))

    scores = stage(
        "1/4 the teacher's accuracy on held-out examples (gold codes never seen in training)",
        evaluate,
        ["evaluate", "--model", args.model, "--split", "heldout", "--n", str(args.n_eval), *common],
    )
    characterization = out / "characterization"
    summary = stage(
        "2/4 which heads decide: the characterisation",
        characterize,
        [
            "characterize",
            "--model",
            args.model,
            "--split",
            "heldout",
            "--n",
            str(args.n_characterize),
            "--out",
            str(characterization),
            *common,
        ],
    )
    runs = {}
    # the students learn from the heads just found, on the teacher's answers to training prompts
    heads = characterization / "heads.json"
    for objective in ("cot", "mistill"):
        runs[objective] = out / "distill" / objective
        stage(
            f"3/4 a SHORT distillation run ({args.distill_steps} steps, {objective}) into the "
            "shipped base student",
            distill,
            [
                "distill",
                "--teacher",
                args.model,
                "--student",
                "llama",
                "--student-init",
                str(BASE_STUDENT),
                "--objective",
                objective,
                "--steps",
                str(args.distill_steps),
                "--teacher-heads",
                str(heads),
                "--n-train",
                "16",
                "--n-eval",
                "10",
                "--characterize-n",
                "4",
                "--out",
                str(runs[objective]),
                "--cache",
                str(out / "distill" / "cache"),
                *common,
            ],
        )
    print("\n== 4/4 the report", flush=True)
    report = write_report([characterization, *runs.values()], out / "report")
    screen = summary_screen(scores, summary, runs, report)
    print("\n" + screen)
    (out / "summary.txt").write_text(screen + "\n")
    return {"report": str(report)}


def summary_screen(scores: dict, summary: dict, runs: dict[str, Path], report: Path) -> str:
    """What the demo found, on one screen."""
    circuit = ", ".join(f"L{l}H{h}" for l, h in summary["circuit"]) or "none (see top_heads)"
    lines = [
        "=" * 78,
        f"teacher on {scores['n']} held-out examples (K = {scores['k']}, up to "
        f"{scores['max_mentions']} mentions): code_f1 {scores['code_f1']:.3f}, region "
        f"{scores['region_acc']:.3f}, near-miss {scores['near_miss_acc']:.3f}",
        f"circuit: {circuit}  ({summary['circuit_size']} of {summary['n_heads_total']} heads, "
        f"z >= {summary['config']['z_min']:g}; {summary['n_decided_events']} decided events in "
        f"{summary['n_examples']} examples)",
    ]
    kinds = [k for k, v in summary.items() if isinstance(v, dict) and "n_events" in v]
    for kind in kinds:
        m = summary[kind]
        cov = (m.get("coverage") or {}).get("necessity")
        lines.append(
            f"  {kind:10s} n={m['n_events']:3d}  necessity {_fmt(m['necessity'])}  sufficiency "
            f"{_fmt(m['sufficiency'])}  knock-in {_fmt(m['knock_in'])}  coverage {_fmt(cov)}"
        )
    lead = (summary.get("elicitation") or {}).get("lead")
    if lead:
        lines.append(
            f"early elicitation: the region is readable {lead['probe']} tokens ahead (probe), "
            f"{lead['logit_lens']} (logit lens)"
        )
    for objective, run in runs.items():
        evaluation = json.loads((run / "evaluation.json").read_text())
        lines.append(
            f"short {objective:8s} student: code_f1 {_fmt(evaluation.get('code_f1'))}, causal "
            f"recovery {_fmt(evaluation.get('causal_recovery'))} (a short run, not a result)"
        )
    for warning in summary.get("warnings", []):
        lines.append(f"warning: {warning}")
    lines += [f"report: {report}", "=" * 78]
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.2f}"
