"""Bad input that used to give a traceback or the wrong message (#34): one line, the right exit code, naming
what was wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from eectl.cli import app

runner = CliRunner()


def test_manifest_counts_out_of_range_name_the_manifest(exported, tmp_path):
    for key, value in (("max_positions", -1), ("top_k", 0)):
        art = tmp_path / key
        shutil.copytree(exported["llama"][1], art)
        doc = json.loads((art / "manifest.json").read_text())
        doc[key] = value
        (art / "manifest.json").write_text(json.dumps(doc))
        res = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"])
        assert res.exit_code == 5 and "manifest" in res.stderr and key in res.stderr, res.output
        assert "--top-k" not in res.stderr


def test_a_huge_thread_count_is_one_line(exported):
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", "--threads", "99999999999"])
    assert res.exit_code == 2 and res.stderr == "error: --threads must be in 1..1024, got 99999999999\n"


def test_recipe_values_are_not_coerced(tmp_path):
    for bad, word in (("exits: [true, 4]", "exits"), ("top_k: '64'", "top_k"), ("target: yes", "target")):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"name: r\n{bad}\n")
        res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"])
        assert res.exit_code == 2 and word in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize(
    "option,value,text",
    [
        ("--signal", "bogus", "--signal must be one of"),
        ("--policy", "bogus", "--policy must be one of"),
        ("--thresholds", "abc", "--thresholds: cannot parse"),
        ("--thresholds", "12:x", "--thresholds: cannot parse"),
        ("--exits", "abc", "--exits must be comma-separated"),
        ("--top-k", "1", "--top-k must be >= 2"),
        ("--river-predict", "middle", "--river-predict must be end or exit"),
    ],
)
def test_run_options_are_checked_before_the_artifact_loads(exported, monkeypatch, option, value, text):
    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before the options were checked")

    monkeypatch.setattr("eectl.run.generate.ArtifactRuntime", no_load)
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", option, value])
    assert res.exit_code == 2 and text in res.stderr, res.output


def test_an_exit_the_artifact_lacks_is_named_as_such(exported):
    """--exits 99 without --thresholds said "no calibrated thresholds for signal ... at exits [99]" (export with
    --calibration): the exit does not exist, and no calibration would make it."""
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", "--raw", "-n", "2", "--exits", "2,99"])
    assert (
        res.exit_code == 2
        and res.stderr.splitlines()[-1] == "error: --exits [99] not in the artifact (its exits: [2, 4])"
    )
