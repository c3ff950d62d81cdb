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
