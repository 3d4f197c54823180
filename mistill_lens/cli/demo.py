"""The ``demo`` command: the main job on the shipped defaults, as the commands a user would type.

Held-out accuracy of the teacher (``evaluate``), its characterisation (``characterize``: events,
attribution, exact sweeps, calibration, the circuit with necessity / sufficiency / knock-in and
coverage, head families, early elicitation), the same two commands on each shipped distilled
student (the CoT / MISTILL pair distilled from the default teacher into SmolLM2, beside the
figures recorded when they were trained), and one HTML report over all of it (``report``); then
a one-screen summary. Each stage's files stay in its folder under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType

from mistill_lens.cli.arguments import POSITIVE_INT, SEED, parse_command
from mistill_lens.models.registry import shipped_students

NO_STUDENTS = "none"
# prompts decoded together in the accuracy stages: a decode step reads every weight once for all
# rows, and this machine's memory bandwidth, not its arithmetic, bounds decoding
DECODE_BATCH = 8


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "demo",
        help="the main job on the shipped defaults: the teacher's accuracy and characterisation, "
        "the same for the shipped CoT / MISTILL students, the HTML report, a one-screen summary",
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument(
        "--model", default="default", help="teacher: checkpoint folder, 'default' or 'tiny'"
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of every stage (default 0)")
    parser.add_argument(
        "--n-eval",
        type=POSITIVE_INT,
        default=16,
        help="held-out examples for accuracy (16: two decode batches; the teacher's recorded "
        "figure is on 100)",
    )
    parser.add_argument(
        "--n-characterize",
        type=POSITIVE_INT,
        default=4,
        help="held-out examples characterised, the teacher's and each student's (4: ~30 decided "
        "events at K = 64; 12 in docs)",
    )
    parser.add_argument(
        "--students",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"shipped students to evaluate and characterise ({', '.join(shipped_students())}; "
        f"'{NO_STUDENTS}' for none; default: all of them with --model default, none otherwise: "
        "they were distilled from the default teacher)",
    )
    parser.add_argument(
        "--n-eval-students",
        type=POSITIVE_INT,
        default=DECODE_BATCH,
        help=f"held-out examples for each student's accuracy ({DECODE_BATCH}: one decode batch; "
        "their recorded figures are on 50)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run, resume_hint="each finished stage is kept in --out")


def chosen_students(names: list[str] | None, model: str) -> dict[str, Path]:
    """The shipped students the demo runs: `names` (none for ['none']), by default all of them
    with the default teacher and none with another (they were distilled from the default)."""
    shipped = shipped_students()
    if names is None:
        return shipped if model == "default" else {}
    if names == [NO_STUDENTS]:
        return {}
    unknown = [name for name in names if name not in shipped]
    if unknown:
        raise ValueError(
            f"no shipped student {unknown[0]!r}; the shipped students are "
            f"{', '.join(shipped) or 'none'} (or '{NO_STUDENTS}')"
        )
    return {name: shipped[name] for name in names}


def run(args: argparse.Namespace) -> dict:
    import mistill_lens.cli.characterize as characterize
    import mistill_lens.cli.evaluate as evaluate
    from mistill_lens.report import write_report
    from mistill_lens.runs import claim_run_dir

    students = chosen_students(args.students, args.model)  # refused before anything is claimed
    out = claim_run_dir(args.out, "demo")
    quiet = ["--no-progress"] if args.no_progress else []
    common = ["--seed", str(args.seed), *quiet]

    def stage(title: str, command: ModuleType, argv: list[str]):
        print(f"\n== {title}\n$ mistill-lens {' '.join(argv)}", flush=True)
        return command.run(parse_command(command, argv))

    def accuracy(title: str, model: str, n: int) -> dict:
        argv = ["evaluate", "--model", model, "--split", "heldout", "--n", str(n)]
        argv += ["--batch-size", str(DECODE_BATCH), *common]
        return stage(title, evaluate, argv)

    def heads(title: str, model: str, folder: Path) -> dict:
        argv = ["characterize", "--model", model, "--split", "heldout"]
        argv += ["--n", str(args.n_characterize), "--out", str(folder), *common]
        return stage(title, characterize, argv)

    held_out = "held-out examples (gold codes never seen in training)"
    scores = accuracy(f"1/4 the teacher's accuracy on {held_out}", args.model, args.n_eval)
    characterization = out / "characterization"
    summary = heads("2/4 which heads decide: the characterisation", args.model, characterization)
    found = {}
    for name, folder in students.items():
        student_scores = accuracy(
            f"3/4 the shipped student {name}: accuracy on {held_out}",
            str(folder),
            args.n_eval_students,
        )
        student_summary = heads(
            f"3/4 the shipped student {name}: which of its heads decide",
            str(folder),
            out / "students" / name,
        )
        found[name] = (folder, student_scores, student_summary)
    if not students:
        print("\n== 3/4 no shipped student runs (--students, or --model default)", flush=True)
    print("\n== 4/4 the report", flush=True)
    runs = [characterization]
    for name, (folder, _, _) in found.items():
        runs += [out / "students" / name, folder]  # its heads now, and its recorded evaluation
    report = write_report(runs, out / "report")
    screen = summary_screen(scores, summary, found, report)
    print("\n" + screen)
    (out / "summary.txt").write_text(screen + "\n")
    return {"report": str(report)}


def summary_screen(
    scores: dict, summary: dict, students: dict[str, tuple[Path, dict, dict]], report: Path
) -> str:
    """What the demo found, on one screen."""
    lines = [
        "=" * 78,
        f"teacher on {scores['n']} held-out examples (K = {scores['k']}, up to "
        f"{scores['max_mentions']} mentions): code_f1 {scores['code_f1']:.3f}, region "
        f"{scores['region_acc']:.3f}, near-miss {scores['near_miss_acc']:.3f}",
        f"circuit: {_circuit(summary)}",
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
    for name, (folder, student_scores, student_summary) in students.items():
        lines += student_lines(name, folder, student_scores, student_summary)
    for warning in summary.get("warnings", []):
        lines.append(f"warning: {warning}")
    lines += [f"report: {report}", "=" * 78]
    return "\n".join(lines)


def student_lines(name: str, folder: Path, scores: dict, summary: dict) -> list[str]:
    """A shipped student's scores and heads in this run, beside the figures recorded (on more
    examples) when it was trained."""
    from mistill_lens.distill.evaluation import EVALUATION_FILE

    lines = [
        f"student {name}: code_f1 {scores['code_f1']:.3f}, near-miss "
        f"{scores['near_miss_acc']:.3f} on {scores['n']} held-out examples; circuit "
        f"{_circuit(summary)}"
    ]
    recorded = folder / EVALUATION_FILE
    if recorded.is_file():
        done = json.loads(recorded.read_text())
        lines.append(
            f"  recorded: code_f1 {_fmt(done.get('code_f1'))}, near-miss "
            f"{_fmt(done.get('near_miss_acc'))} on {done.get('n_eval')} examples; causal recovery "
            f"{_fmt(done.get('causal_recovery'))} (median {_fmt(done.get('causal_recovery_median'))}) "
            f"on {done.get('n_characterize')}"
        )
    return lines


def _circuit(summary: dict) -> str:
    heads = ", ".join(f"L{l}H{h}" for l, h in summary["circuit"]) or "none (see top_heads)"
    config = summary["config"]
    rule = (
        f"faithful at {config['faithful_target']:g}"
        if config.get("circuit") == "faithful"
        else f"z >= {config['z_min']:g}"
    )
    return (
        f"{heads}  ({summary['circuit_size']} of {summary['n_heads_total']} heads, {rule}; "
        f"{summary['n_decided_events']} decided events in "
        f"{summary['n_examples']} examples)"
    )


def _fmt(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.2f}"
