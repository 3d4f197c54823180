"""What the configured linter cannot see: ruff's undefined-name rule (F821) is off in
pyproject.toml because jaxtyping's shape strings ("batch pos", "event") read as forward
annotations. Here it runs on its own and every name it flags must lie inside a string literal
(a shape); a name flagged in code is a real NameError waiting on its branch."""

import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).parent.parent


def string_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start, t.end) for t in tokens if t.type == tokenize.STRING]


def in_a_string(spans, row: int, column: int) -> bool:
    point = (row, column - 1)  # ruff's columns count from 1, tokenize's from 0
    return any(start <= point < end for start, end in spans)


def test_every_undefined_name_is_a_shape_string():
    ruff = Path(sys.executable).parent / "ruff"
    found = subprocess.run(
        [
            str(ruff),
            "check",
            "--select",
            "F821",
            "--output-format",
            "json",
            "mistill_lens",
            "tests",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    diagnostics = json.loads(found.stdout)
    spans = {}
    in_code = []
    for d in diagnostics:
        path = Path(d["filename"])
        spans.setdefault(path, string_spans(path))
        if not in_a_string(spans[path], d["location"]["row"], d["location"]["column"]):
            in_code.append(f"{path.relative_to(ROOT)}:{d['location']['row']}: {d['message']}")
    assert diagnostics, "no shape strings flagged at all: has the check stopped running?"
    assert not in_code, "undefined names in code:\n" + "\n".join(in_code)
