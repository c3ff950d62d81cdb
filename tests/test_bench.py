"""eectl bench on a tiny model: every configuration measured, fidelity numbers consistent, report written."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from eectl.bench import _agreement, final_number
from eectl.cli import app
from eectl.export import ExportOptions, export_artifact
from eectl.models import load_model
from tests.tiny import GSM8K


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "art"
    export_artifact(load_model(str(tiny_dirs["llama"])), out, ExportOptions(exits=[2, 4], top_k=8))
    return out


def test_bench_cli_report(artifact, tmp_path):
    report = tmp_path / "bench.md"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            str(artifact),
            "--data",
            str(GSM8K),
            "--prompts",
            "3",
            "--max-new-tokens",
            "12",
            "--reps",
            "2",
            "--thresholds",
            "0.0",
            "--sweep",
            "0.5,1.0",
            "--ppl-tokens",
            "64",
            "--raw",
            "--report",
            str(report),
            "--json",
            "--threads",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    by = {c["name"]: c for c in doc["configs"]}
    assert list(by) == ["full", "hf", "copy", "defer", "verify"]
    assert doc["hf_matches_full"] is True  # transformers generate and eectl full depth: the same tokens
    assert by["full"]["token_agreement"] == 1.0 and by["full"]["speedup_vs_full"] == 1.0
    assert by["verify"]["token_agreement"] == 1.0 and by["verify"]["exact_match"] == 1.0
    for c in by.values():
        assert c["ms_per_token"] > 0 and c["ms_per_token_spread"][0] <= c["ms_per_token"] <= c["ms_per_token_spread"][1]
    for name in ("copy", "defer"):
        c = by[name]
        assert c["mean_layers"] == 2.0 and c["layer_bound"] == 3.0 and 0 < c["decide_share"] < 1  # threshold 0
        assert c["exit_histogram"] == {"2": sum(c["exit_histogram"].values())}
        assert c["perplexity"] > 0
    assert by["full"]["perplexity"] > 0 and by["verify"]["perplexity"] == by["full"]["perplexity"]
    assert [s["scale"] for s in doc["sweep"]] == [0.5, 1.0]
    assert by["full"]["gsm8k_accuracy"] is not None
    assert report.is_file() and "| full |" in report.read_text()
    assert (tmp_path / "bench-latency.png").is_file() and (tmp_path / "bench.json").is_file()


def test_bench_rejects_unknown_config(artifact):
    res = CliRunner().invoke(app, ["bench", str(artifact), "--policies", "full,turbo", "--data", str(GSM8K)])
    assert res.exit_code == 2 and "unknown configuration" in res.stderr


def test_agreement_and_answers():
    assert _agreement([[1, 2, 3], [4, 5]], [[1, 2, 4], [4, 5]]) == (pytest.approx(4 / 5), 0.5, 2.0)
    assert final_number("so 3 + 4 = 7.\n#### 1,200") == "1200" and final_number("none") is None
