"""One commented recipe per supported family: each parses, names its family, and dry-runs on a tiny model of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.recipe import load_recipe
from eectl.models.adapters import supported_model_types

RECIPES = {p.stem: p for p in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))}
BY_FAMILY = {load_recipe(p).family: p for p in RECIPES.values()}
runner = CliRunner()


def test_every_supported_family_has_a_recipe():
    assert set(BY_FAMILY) == set(supported_model_types())
    for family, path in BY_FAMILY.items():
        text = path.read_text()
        r = load_recipe(path)
        # the header names the exact command; the model is a hub id a user can get, or the built-in default
        assert text.startswith("# ") and f"eectl pipeline --recipe recipes/{path.name}" in text
        assert r.model is None if family == "llama" else (r.model or "").count("/") == 1


@pytest.mark.parametrize("family", sorted(supported_model_types()))
def test_recipe_dry_runs_on_a_tiny_model_of_its_family(family, tiny_dirs):
    path = BY_FAMILY[family]
    args = ["pipeline", "--recipe", str(path), "--model", str(tiny_dirs[family]), "--dry-run", "--threads", "1"]
    res = runner.invoke(app, args)
    # the default recipe's exits (8..24, for the built-in default model's 30 layers) give way to the 6-layer model's
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())  # the plan's table folds its cells to the terminal's width
    assert f"({family}, 6 layers), exits [2, 3, 4, 5]" in text and "the recipe fits the model" in text
    for stage in ("profile", "train-heads", "calibrate", "export", "run", "bench"):
        assert stage in text


def test_dry_run_refuses_a_model_of_another_family(tiny_dirs):
    res = runner.invoke(
        app, ["pipeline", "--recipe", str(BY_FAMILY["qwen3"]), "--model", str(tiny_dirs["llama"]), "--dry-run"]
    )
    assert res.exit_code == 2 and "for the qwen3 family, but the model is llama" in res.stderr


def test_a_dry_run_with_another_model_leaves_no_temporary_recipe(tiny_dirs, tmp_path, monkeypatch):
    """--model writes a copy of the recipe for the stages to read: it is removed when the pipeline ends, the failing
    end included."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ok = ["pipeline", "--recipe", str(BY_FAMILY["qwen2"]), "--model", str(tiny_dirs["qwen2"]), "--dry-run"]
    assert runner.invoke(app, [*ok, "--threads", "1"]).exit_code == 0
    bad = ["pipeline", "--recipe", str(BY_FAMILY["qwen3"]), "--model", str(tiny_dirs["llama"]), "--dry-run"]
    assert runner.invoke(app, bad).exit_code != 0
    assert list(tmp_path.iterdir()) == []
