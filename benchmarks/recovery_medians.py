"""Causal recovery per run as the median over near-miss events instead of the mean.

    python benchmarks/recovery_medians.py RUN_DIR...

`causal_recovery` (in evaluation.json and the report) averages per-event margin fractions; an
event whose clean margin is barely positive can dominate that mean (a fraction of -10 from one
such event). This reads each run's per-event table (characterization/events.csv) and prints
(median necessity + median knock-in) / 2 over the near-miss events, per run and per cell. A run
whose characterisation selected no heads has no table and recovers 0, as in the report.
"""

import sys
from pathlib import Path

import pandas as pd

from mistill_lens.distill.report import CELL, load_evaluations


def median_recovery(run: Path) -> float | None:
    table = run / "characterization" / "events.csv"
    if not table.is_file():
        return 0.0
    near_miss = pd.read_csv(table).query("kind == 'near_miss'")
    if near_miss.empty:
        return None
    return (near_miss.necessity.median() + near_miss.knock_in.median()) / 2


def main(run_dirs: list[str]) -> None:
    frame = load_evaluations(run_dirs)
    frame["median_recovery"] = [median_recovery(Path(run)) for run in run_dirs]
    print(frame.pivot_table(index=CELL, columns="seed", values="median_recovery").round(3).to_string())
    print()
    print(frame.groupby(CELL).median_recovery.agg(["mean", "std"]).round(3).to_string())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
