"""A characterisation's folder: its file names, and claiming it (new, empty, or an earlier
characterisation's) before a run writes there. Torch-free, so that the command line refuses a bad
``--out`` before it loads anything heavy."""

from __future__ import annotations

import shutil
from pathlib import Path

from mistill_lens.runs import check_run_dir, claim_run_dir, legacy_run

RUN_KIND = "characterize"
SUMMARY = "summary.json"
EXAMPLE_FILE = "example.json"  # one example token by token: the token-labelled figures
RESUMABLE_FILES = ("sweep.csv", "sweep_null.csv")
SEARCH_LOG = "faithful_search.json"  # the faithfulness search's steps (lens/search_log.py)
CONTRAST_LOG = (
    "contrasts.json"  # each example's clean margins against its rivals (lens/contrasts.py)
)
# stages before the sweeps, each kept with its inputs' fingerprint (lens/stage_file.py)
MEANS_FILE = "reference_means.pt"
EVERY_MARGIN_FILE = "clean_margins_all.pt"  # every gold event's, before the undecided are dropped
CLEAN_MARGIN_FILE = "clean_margins.pt"  # the decided events'
ATTRIBUTION_FILE = "attribution.pt"
STAGE_FILES = (MEANS_FILE, EVERY_MARGIN_FILE, CLEAN_MARGIN_FILE, ATTRIBUTION_FILE)
DERIVED_FILES = (
    "attribution.csv",
    "calibration.csv",
    "events.csv",
    "families.csv",
    "elicitation.csv",
    "ablation_curve.csv",
    "heads.json",
    EXAMPLE_FILE,
    SUMMARY,
    "figures",
)


def claim_characterize_dir(out_dir: str | Path) -> Path:
    """`out_dir` as a characterisation folder: new, empty, or an earlier characterisation's."""
    return claim_run_dir(out_dir, RUN_KIND, _legacy_characterization)


def check_characterize_dir(out_dir: str | Path) -> None:
    """Refuse `out_dir` where :func:`claim_characterize_dir` would, writing nothing."""
    check_run_dir(out_dir, RUN_KIND, _legacy_characterization)


# A characterisation folder written before run markers existed: recognised by its files.
_legacy_characterization = legacy_run(
    [SUMMARY],
    [
        *RESUMABLE_FILES,
        *DERIVED_FILES,
        *(f + ".fingerprint.json" for f in RESUMABLE_FILES),
        "generations.jsonl",
        "reference_generations.jsonl",
    ],
)


def prepare_output(out_dir: str | Path) -> Path:
    """Claim `out_dir` as a characterisation folder and remove what an earlier run derived there
    (every derived file is rewritten; a figure or table this run does not make must not survive,
    and a folder without `summary.json` is never mistaken for a finished one). The resumable
    sweep tables and the search and contrast logs stay."""
    out_dir = claim_characterize_dir(out_dir)
    for name in DERIVED_FILES:
        target = out_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return out_dir
