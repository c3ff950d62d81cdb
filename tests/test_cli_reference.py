"""docs/cli/ is generated from the CLI itself (eectl/cli/reference.py): every command has its page, and every page
equals what the CLI gives now, so the reference cannot drift from --help."""

from __future__ import annotations

from pathlib import Path

from eectl.cli.reference import pages

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli"


def test_the_command_reference_is_the_clis_own():
    want = pages()
    assert {"run.md", "bench.md", "calibrate.md", "export.md", "README.md"} <= set(want)
    stale = [name for name, text in want.items() if not (DOCS / name).is_file() or (DOCS / name).read_text() != text]
    extra = sorted(p.name for p in DOCS.glob("*.md") if p.name not in want)
    assert not stale and not extra, (
        f"docs/cli is stale ({stale}) or has pages of no command ({extra}): "
        "run .venv/bin/python -m eectl.cli.reference docs/cli"
    )


def test_every_option_of_every_command_is_in_its_page():
    import typer

    from eectl.cli import app

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        page = pages()[f"{name}.md"]
        for p in cmd.params:
            if p.param_type_name == "option" and not p.hidden:
                assert all(f"`{o}`" in page for o in p.opts), (name, p.opts)


def test_calibrate_says_what_each_policy_can_use(llama):
    """A calibration where no exit reaches the target says copy/defer run at full depth while verify (lossless) may
    still draft from its menu; one where an exit passes names it and points at the sequence guarantee."""
    from eectl.cli.cmd_calibrate import policy_lines
    from eectl.contracts.calibration import SplitStats
    from tests.conftest import make_calibration
    from tests.test_plan import _option

    loaded = llama
    never = make_calibration(loaded, {2: {"prob": float("inf")}, 4: {"prob": float("inf")}})
    never = never.model_copy(update={"options": [_option([2], [0.3], [0.9], kind="verify", target=0.9)]})
    lossy, lossless = policy_lines(never)
    assert lossy == "copy/defer: no exit reaches 0.9; they run at full depth"
    assert lossless.startswith("verify (lossless") and "1 menu options at precisions 0.9" in lossless
    passing = make_calibration(loaded, {2: {"prob": 0.5}, 4: {"prob": float("inf")}})
    passing.exits[0].calibration = SplitStats(reached=10, exited=4, coverage=0.4, precision=1.0)
    lossy, lossless = policy_lines(passing)
    assert lossy.startswith("copy/defer: exits [2] reach 0.9 per token") and "--guarantee sequence" in lossy
    assert lossless.startswith("verify: no menu options")


def test_console_tables_fit_80_columns_without_cutting_a_word(monkeypatch):
    import io

    from rich.console import Console

    from eectl.output import Output

    # calibrate's table, with a column of no values (as profile's 1-JS was) and a long header
    columns = ["exit", "threshold", "reached", "coverage", "precision", "CP bound 95%", "held-out cov.", "1-JS"]
    columns += ["held-out agreement"]
    rows = [[str(e), "0.9731", "12345", "12.3%", "0.9912", "0.9871", "11.9%", "-", "0.9903"] for e in (8, 16)]
    buf = io.StringIO()
    out = Output()
    out.out = Console(file=buf, width=80, soft_wrap=True)
    out.table("calibration of a model with a long name: topk-prob (K=64), target 0.99", columns, rows)
    text = buf.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in text
    for word in " ".join(c for c in columns if c != "1-JS").split():
        assert word in text, word  # every header word whole, on some line
    assert "1-JS" not in text  # a column with no value in any row is dropped
    assert "0.9731" in text and "12345" in text
    # headers whose words cannot fit at all: printed wider, nothing cut
    buf.truncate(0)
    wide = [f"column-number-{i:02d}" for i in range(8)]
    out.table("wide", wide, [[str(i) for i in range(8)]])
    assert all(w in buf.getvalue() for w in wide[1:]) and "…" not in buf.getvalue()
