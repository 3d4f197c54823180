"""How long the command line takes to refuse bad arguments and models it cannot find (both are
found before any heavy import): ``python benchmarks/cli_latency.py [REPEATS]``. Prints the median wall time of
each command below over REPEATS runs (default 5), in a fresh interpreter each time."""

import statistics
import subprocess
import sys
import time

USAGE_ERRORS = [
    ["characterize", "--n", "0", "--out", "never"],
    ["characterize", "--split", "test", "--out", "never"],
    ["distill", "--student", "llama3", "--objective", "cot", "--out", "never"],
    ["train", "--steps", "-1", "--out", "never"],
    ["evaluate", "--n", "x"],
    ["characterize", "--model", "Tiny", "--out", "never"],
    ["characterize", "--reference", "ref.jsonl", "--out", "never"],
    ["characterize", "--model", "gemma3", "--out", "never"],
    ["characterize", "--elicitation-kind", "answer", "--out", "never"],
    ["evaluate", "--model", "Tiny"],
]


def main(repeats: int) -> None:
    for argv in USAGE_ERRORS:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "mistill_lens.cli", *argv], capture_output=True, text=True
            )
            times.append(time.perf_counter() - start)
        assert done.returncode == 2, (argv, done.stderr)
        print(f"{statistics.median(times):6.3f} s  mistill-lens {' '.join(argv)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
