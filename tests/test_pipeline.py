"""The worked example end to end on a tiny model: every stage runs from one recipe and leaves its outputs."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from eectl.cli import app
from tests.tiny import GSM8K


def test_pipeline_runs_every_stage_from_one_recipe(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        f"""# tiny pipeline
# eectl pipeline --recipe tiny.yaml
name: tiny
model: {tiny_dirs["qwen2"]}
exits: [2, 4]
target: 0.9
top_k: 8
threads: 1
data: {{source: {GSM8K}, tokens: 600}}
heads: {{steps: 4}}
bench: {{prompts: 2, max_new_tokens: 4, reps: 1, configs: [full, defer, verify]}}
"""
    )
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--prompt", "12 clips"])
    assert res.exit_code == 0, res.output
    name = tiny_dirs["qwen2"].name
    art = tmp_path / "artifacts"
    for f in (f"{name}-profile.png", f"{name}-heads.safetensors", f"{name}-calibration.json", f"{name}-bench.md"):
        assert (art / f).is_file(), f
    manifest = json.loads((art / name / "manifest.json").read_text())
    assert manifest["heads"] is not None and manifest["calibration"]["signal"] == "topk-prob"
    assert [e["layer"] for e in manifest["exits"]] == [2, 4, 6] and manifest["validation"]["passed"]
    bench = json.loads((art / f"{name}-bench.json").read_text())
    assert [c["name"] for c in bench["configs"]] == ["full", "defer", "verify"]
    assert "bench report:" in res.stdout
