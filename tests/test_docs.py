"""The README's quickstart runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_readme_quickstart_runs(tmp_path, monkeypatch, capsys):
    quickstart = section(README.read_text(), "Quickstart")
    code = re.findall(r"```python\n(.*?)```", quickstart, re.S)
    assert len(code) == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code[0], "README quickstart", "exec"), namespace)
    found = namespace["found"]
    assert found.circuit and (tmp_path / "runs" / "quickstart" / "summary.json").is_file()
    assert str(found.circuit) in capsys.readouterr().out


def test_every_command_help_shows_its_defaults():
    from mistill_lens.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"characterize", "demo", "report", "distill", "evaluate", "train"} <= set(commands)
    for name, command in commands.items():
        shown = " ".join(command.format_help().split())
        for action in command._actions:
            if not action.option_strings or action.default in (None, False, "==SUPPRESS=="):
                continue
            helped = " ".join((action.help or "").split())
            assert "default" in helped or f"(default: {action.default})" in shown, (
                f"{name} {action.option_strings[0]}: its default {action.default!r} is not shown"
            )


def test_the_cli_reference_page_matches_the_parser():
    from mistill_lens.cli.reference import reference_markdown

    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    assert page == reference_markdown(), (
        "docs/cli.md is out of date: python -m mistill_lens.cli.reference > docs/cli.md"
    )


DOCS = sorted((Path(__file__).parent.parent / "docs").glob("*.md"))
# ```python blocks run as written; ```python notest marks one that needs the user's own files
SNIPPETS = [
    (page, index, code)
    for page in DOCS
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


@pytest.mark.parametrize(
    "page, index, code", SNIPPETS, ids=[f"{p.stem}-{i}" for p, i, _ in SNIPPETS]
)
def test_doc_snippets_run(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page.name} snippet {index}", "exec"), {})
