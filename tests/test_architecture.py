"""The layout keeps its shape: no import cycle, no package importing one above it, contracts that stay light.

Every import counts: top-level, lazy (inside a function) and under TYPE_CHECKING, read with ast from the sources, so
a cycle cannot hide behind an import moved into a function. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eectl"

# Bottom to top. A module may import its own unit (package or module) and any unit on a LOWER line; units on the
# same line are siblings and may not import each other.
LAYERS: list[list[str]] = [
    ["eectl.errors"],
    ["eectl", "eectl.files", "eectl.output"],
    ["eectl.output_checks", "eectl.stdin"],
    ["eectl.contracts"],
    ["eectl.data", "eectl.cache"],
    ["eectl.models"],
    ["eectl.exits"],
    ["eectl.runtime"],
    ["eectl.plan"],
    ["eectl.profile", "eectl.calibrate", "eectl.heads", "eectl.run"],
    ["eectl.export"],
    ["eectl.evaluate"],
    ["eectl.pipeline"],
    ["eectl.api"],
    ["eectl.serve"],
    ["eectl.cli"],
]
# The contracts (the files between stages) are read by every stage; importing them must stay cheap.
HEAVY = ("torch", "onnx", "onnxruntime", "transformers", "safetensors", "scipy", "matplotlib", "lm_eval", "typer")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The eectl modules an import statement loads (a name that is a submodule counts as that submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    base = node.module or ""
    if node.level:
        here = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
    out = []
    for a in node.names:
        if f"{base}.{a.name}" in MODULES:
            out.append(f"{base}.{a.name}")
        elif base in MODULES:
            out.append(base)
    return out


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[m].update(t for t in _imported(m, node) if t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> tuple[int, str]:
    """(layer, unit) of a module: the longest listed prefix."""
    best: tuple[int, str] | None = None
    for rank, units in enumerate(LAYERS):
        for u in units:
            if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best[1])):
                best = (rank, u)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add its package to LAYERS")
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in sorted(graph.items()):
        ra, ua = unit(a)
        for b in sorted(targets):
            rb, ub = unit(b)
            if ua != ub and rb >= ra:
                bad.append(f"{a} -> {b} ({ub} is {'a sibling of' if rb == ra else 'above'} {ua})")
    return bad


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_package_imports_one_above_it():
    assert upward(import_graph()) == []


MAX_MODULE_LINES = 500  # a module past this holds two ideas: split it where they part
MAX_FUNCTION_LINES = 80  # a function past this (docstring included) does several steps a reader must hold at once


def oversized(root: Path = PACKAGE) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions (methods, nested ones) over MAX_FUNCTION_LINES, by path."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(root.parent).as_posix()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            bad.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    bad.append(f"{name}: {node.name} {span} lines")
    return bad


def test_no_module_or_function_outgrows_its_limit():
    assert oversized() == []


def test_the_size_check_catches_a_long_module_and_function(tmp_path):
    pkg = tmp_path / "eectl"
    pkg.mkdir()
    (pkg / "short.py").write_text("def f():\n    return 1\n")
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "long.py").write_text("def g():\n" + body + "\n" * MAX_MODULE_LINES)
    assert oversized(pkg) == [
        f"eectl/long.py: {MAX_MODULE_LINES + MAX_FUNCTION_LINES + 1} lines",
        f"eectl/long.py: g {MAX_FUNCTION_LINES + 1} lines",
    ]


def test_the_pipeline_calls_stage_functions_not_commands():
    """eectl.pipeline runs the stages through their packages' library functions: nothing in it imports the CLI (the
    upward-import test forbids it too; this names the rule), and it reaches every stage package it runs."""
    graph = import_graph()
    pipeline = {m: t for m, t in graph.items() if m == "eectl.pipeline" or m.startswith("eectl.pipeline.")}
    assert pipeline and not any(t == "eectl.cli" or t.startswith("eectl.cli.") for ts in pipeline.values() for t in ts)
    reached = {unit(t)[1] for ts in pipeline.values() for t in ts}
    stages = ("eectl.profile", "eectl.heads", "eectl.calibrate", "eectl.export", "eectl.run", "eectl.evaluate")
    assert set(stages) <= reached


def test_every_package_is_in_a_layer():
    for m in MODULES:
        unit(m)  # raises for a module outside every layer


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {
        "eectl.contracts.manifest": {"eectl.runtime.sessions"},
        "eectl.runtime.sessions": {"eectl.contracts.manifest"},
    }
    assert cycles(graph) == [["eectl.contracts.manifest", "eectl.runtime.sessions"]]
    assert upward(graph) == [
        "eectl.contracts.manifest -> eectl.runtime.sessions (eectl.runtime is above eectl.contracts)"
    ]
    assert upward({"eectl.profile.lens": {"eectl.heads.train"}}) == [
        "eectl.profile.lens -> eectl.heads.train (eectl.heads is a sibling of eectl.profile)"
    ]


def test_lazy_and_type_checking_imports_count(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eectl.runtime import sessions\n")
    node = tree.body[1].body[0]  # type: ignore[attr-defined]
    assert _imported("eectl.contracts.manifest", node) == ["eectl.runtime.sessions"]


@pytest.mark.parametrize("package", ["eectl.contracts"])
def test_contracts_import_nothing_heavy(package):
    modules = [m for m in MODULES if m == package or m.startswith(package + ".")]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(','.join(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {package} loads {out.stdout.strip()}"


def test_loading_a_recipe_beside_the_manifest_reader_loads_neither_torch_nor_onnxruntime():
    code = (
        "import sys\n"
        "from eectl.contracts.manifest import read_manifest\n"
        "from eectl.contracts.recipe import load_recipe\n"
        "load_recipe(sys.argv[1])\n"
        "print(','.join(m for m in ('torch', 'onnxruntime', 'onnx') if m in sys.modules))\n"
    )
    recipe = next((ROOT / "recipes").glob("*.yaml"))
    out = subprocess.run(
        [sys.executable, "-c", code, str(recipe)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""


def test_registries_implement_exactly_the_contract_names():
    from eectl.contracts.names import POLICY_SPECS, SIGNAL_SPECS
    from eectl.exits.signals import SIGNALS
    from eectl.runtime.policies import POLICIES

    assert set(SIGNALS) == set(SIGNAL_SPECS)
    assert set(POLICIES) == set(POLICY_SPECS)
    for name, signal in SIGNALS.items():
        assert SIGNAL_SPECS[name].criteria == signal.criteria
        assert SIGNAL_SPECS[name].needs_candidates == signal.needs_candidates


def test_a_registry_refuses_a_name_the_contracts_do_not_know():
    from eectl.exits.signals import LocalSoftmax, register_signal
    from eectl.runtime.policies import Copy, register_policy

    with pytest.raises(TypeError, match="SIGNAL_SPECS"):
        register_signal(LocalSoftmax("topk-unknown", ("prob",)))
    with pytest.raises(TypeError, match="SIGNAL_SPECS"):
        register_signal(LocalSoftmax("topk-prob", ("margin",)))  # a known name with other criteria

    class Unknown(Copy):
        name = "unknown"

    with pytest.raises(TypeError, match="POLICY_SPECS"):
        register_policy(Unknown)


def test_help_names_every_signal_and_head_design():
    """The CLI's help lists what the registries hold (the names come from contracts: no torch at --help)."""
    from typer.testing import CliRunner

    from eectl.cli import app
    from eectl.contracts.names import SIGNAL_SPECS
    from eectl.exits.designs import HEAD_DESIGNS

    runner = CliRunner()
    for command in ("calibrate", "run", "bench", "eval"):
        text = " ".join(runner.invoke(app, [command, "-h"], env={"COLUMNS": "400"}).stdout.split())
        assert all(name in text for name in SIGNAL_SPECS), command
    text = " ".join(runner.invoke(app, ["train-heads", "-h"], env={"COLUMNS": "400"}).stdout.split())
    assert all(name in text for name in HEAD_DESIGNS)


def test_readme_is_for_users():
    """The README stays a user's page: short, with the sections a newcomer looks for and the two lines CI runs."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 20_000
    for section in ("## Quick start", "## Your own checkpoint", "## What to expect", "## Errors and outputs"):
        assert section in text
    assert "# set up, then the main job" in text and "# the tests" in text  # what .ci/run reads


def test_help_shows_no_bool_metavars_on_flags():
    """Flags read as flags, the help flag too: `-h` of the app and of every command shows no `<bool>` beside any
    option (issue 63: `--help  -h  <bool>`), while an option taking a value still shows its type."""
    import re

    import typer
    from typer.testing import CliRunner

    from eectl.cli import app

    runner = CliRunner()
    commands = list(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert {"run", "export", "pipeline"} <= set(commands)
    for command in ([], *([name] for name in commands)):
        result = runner.invoke(app, [*command, "-h"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, command
        assert "<bool>" not in result.stdout, command
        help_row = next(line for line in result.stdout.splitlines() if "--help" in line)
        assert re.search(r"--help\s+-h\s+Show this message and exit\.", help_row), (command, help_row)
        if command:
            assert re.search(r"<(int|str|float|path)>", result.stdout), command  # values keep their type


def test_help_fits_80_columns_without_cut_option_names():
    from typer.testing import CliRunner

    from eectl.cli import app

    runner = CliRunner()
    for command in ("profile", "calibrate", "train-heads", "export", "run", "bench", "pipeline", "eval"):
        lines = runner.invoke(app, [command, "-h"], env={"COLUMNS": "80"}).stdout.splitlines()
        options = [line for line in lines if line.lstrip("│ ").startswith("-")]
        assert options, command
        assert [line for line in options if "…" in line.split("  ")[0]] == [], command
