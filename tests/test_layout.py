"""The house: wings that import in one direction, a task-free lens, and the command line alone
parsing arguments, printing and exiting."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "mistill_lens"
WINGS = ("lens", "models", "task", "training", "distill", "cli")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mistill_lens" and parts[1] in WINGS else None


def modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_lens_imports_no_task_cli_or_icd_code():
    for path in (PACKAGE / "lens").rglob("*.py"):
        for module in imported_modules(path):
            assert wing_of(module) in (None, "lens"), f"{path.name} imports {module}"
            assert not module.startswith("simple_icd_10_cm"), f"{path.name} imports the ICD data"


def test_wings_have_no_import_cycle():
    graph = {wing: set() for wing in WINGS}
    for path in modules():
        source = wing_of(
            "mistill_lens." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        )
        for module in imported_modules(path):
            target = wing_of(module)
            if source and target and target != source:
                graph[source].add(target)

    def reaches(start, goal, seen=()):
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt)))
            for nxt in graph[start]
        )

    assert not [wing for wing in WINGS if reaches(wing, wing)], graph
    assert "cli" not in set().union(*graph.values()), "nothing imports the command line"


def test_only_the_command_line_parses_arguments_prints_or_exits():
    for path in modules():
        if path.relative_to(PACKAGE).parts[0] == "cli":
            continue
        tree = ast.parse(path.read_text())
        assert "argparse" not in {m.split(".")[0] for m in imported_modules(path)}, path
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "print", f"print in {path}"
            if isinstance(node, ast.Raise) and node.exc is not None:
                raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                assert getattr(raised, "id", None) != "SystemExit", f"SystemExit in {path}"


def test_loading_a_checkpoint_or_the_lens_does_not_import_the_task():
    probe = (
        "import sys, mistill_lens.lens.characterize, mistill_lens.models.checkpoints, mistill_lens.models.students;"
        "print(sorted(m for m in sys.modules if m.startswith(('mistill_lens.task', 'simple_icd_10_cm'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_public_api_resolves_lazily():
    probe = (
        "import sys, mistill_lens as ml; heavy = 'torch' in sys.modules;"
        "[getattr(ml, name) for name in ml.__all__]; ml.lens.sweep, ml.distill.report;"
        "print(heavy, len(ml.__all__))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    heavy, count = result.stdout.split()
    assert heavy == "False" and 20 <= int(count) <= 30


def test_the_public_surface_is_listed_once_in_the_readme():
    import mistill_lens as ml

    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## The public surface", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ")][1:]
    listed = [name for row in rows for name in re.findall(r"`(\w+)`", row)]
    assert sorted(listed) == sorted(ml.__all__), set(listed) ^ set(ml.__all__)


def test_benchmark_scripts_import():
    """Scripts outside the package still name what the package has (a moved function fails here)."""
    for script in (PACKAGE.parent / "benchmarks").glob("*.py"):
        probe = f"import importlib.util as u; s = u.spec_from_file_location('bench', {str(script)!r}); s.loader.exec_module(u.module_from_spec(s))"
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_itself_back():
    """No import cycle between modules anywhere in the package, counting imports inside functions
    too (a lazy import that closes a circle is still a circle)."""
    names = {module_name(path): path for path in modules()}
    graph = {
        name: {m for m in imported_modules(path) if m in names and m != name}
        for name, path in names.items()
    }

    def path_back(start, node, seen):
        for nxt in graph[node]:
            if nxt == start:
                return [*seen, nxt]
            if nxt not in seen:
                found = path_back(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    cycles = [path_back(name, name, [name]) for name in graph]
    assert not [c for c in cycles if c], [c for c in cycles if c]


def test_every_command_is_one_module_of_one_shape():
    """Each command of the command line is a module of mistill_lens.cli with ``add_parser(sub)``
    registering exactly that command and ``run(args)`` running it; the registry lists every one."""
    from mistill_lens import cli

    helpers = {"__init__", "__main__", "arguments", "reference"}
    files = {p.stem for p in (PACKAGE / "cli").glob("*.py")} - helpers
    assert {c.__name__.rsplit(".", 1)[1] for c in cli.COMMANDS} == files
    sub = cli.build_parser()._subparsers._group_actions[0]
    for command in cli.COMMANDS:
        name = command.__name__.rsplit(".", 1)[1].replace("_", "-")
        assert sub.choices[name].get_default("func") is command.run, name
    assert len(sub.choices) == len(cli.COMMANDS)


def test_no_algorithm_tests_which_backend_it_holds():
    """The backend (engine or full forward) is chosen in one place, lens/backends.py; the engine
    knows itself. Nowhere else an isinstance on a backend type."""
    backends = {"InterventionEngine", "FullForward", "EventModel"}
    seam = {PACKAGE / "lens" / "backends.py", PACKAGE / "lens" / "engine.py"}
    for path in modules():
        if path in seam:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                kinds = node.args[1]
                named = {getattr(n, "id", getattr(n, "attr", None)) for n in ast.walk(kinds)}
                assert not named & backends, f"{path.name}:{node.lineno} tests for a backend"


def test_the_readmes_layout_table_names_every_module():
    """Each module has its row (`lens/sweep.py`); the distill and cli packages' rows name theirs."""
    table = (PACKAGE.parent / "README.md").read_text().split("## Layout", 1)[1]
    missing = []
    for path in modules():
        relative = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        packaged = relative.parts[0] in ("distill", "cli")
        if (f"`{path.stem}`" if packaged else f"`{relative}`") not in table:
            missing.append(str(relative))
    assert not missing, f"README's layout table lacks {missing}"
