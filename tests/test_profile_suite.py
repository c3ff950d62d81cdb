"""The suitability benchmark: several models x several workloads in one command, with bootstrap CIs, a comparison
plot, a markdown table, JSON and a cache keyed by (model, data, settings)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from eectl.data import load_text_data, token_chunks
from eectl.errors import UsageError
from eectl.profile.lens import EAS_ALPHAS, ProfileSums, bootstrap_ci, measure_chunks, profile_model, summarise
from eectl.profile.report import parse_workloads
from tests.tiny import GSM8K

runner = CliRunner()
PROSE = "\n\n".join(
    f"Paragraph {i}: the river ran past the mill, and the miller counted {i * 7} sacks of flour before dusk."
    for i in range(60)
)


def _workloads(tmp_path) -> str:
    prose = tmp_path / "prose.txt"
    prose.write_text(PROSE)
    return f"gsm8k={GSM8K},humaneval,prose={prose}"


def test_two_models_by_three_workloads(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    png, md = tmp_path / "cmp.png", tmp_path / "cmp.md"
    models = [str(tiny_dirs["llama"]), str(tiny_dirs["qwen3"])]
    args = ["profile", *models, "--data", _workloads(tmp_path), "--tokens", "400", "--threads", "1"]
    res = runner.invoke(app_(), [*args, "--json", "--plot", str(png), "--report", str(md)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = doc["comparison"]
    assert [(r["model"], r["workload"]) for r in rows] == [
        (m, w) for m in ("llama", "qwen3") for w in ("gsm8k", "humaneval", "prose")
    ]
    for row, full in zip(rows, doc["results"], strict=True):
        assert row["tokens"] == 400 and not row["cached"]
        assert set(row["eas"]) == {str(a) for a in EAS_ALPHAS}
        for a in EAS_ALPHAS:
            lo, hi = row["eas_ci"][str(a)]
            assert 0.0 <= lo <= hi <= 1.0
        lo, hi = row["oracle_skip_ratio_ci"]
        assert 0.0 <= lo <= hi <= 1.0
        # the layers where agreement passes 0.5 / 0.9 are read off the same per-layer curve
        agree = [s["top1_agreement"] for s in full["layers"]]
        for t in ("0.5", "0.9"):
            first = row["agreement_layers"][t]
            assert agree[first - 1] >= float(t) and all(a < float(t) for a in agree[: first - 1])
        assert row["eas"]["0.5"] == pytest.approx(full["eas"])  # alpha 0.5 is the run's alpha
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    table = md.read_text()
    assert table.count("| llama |") == 3 and table.count("| qwen3 |") == 3
    assert json.loads(md.with_suffix(".json").read_text())["comparison"] == rows

    # Again, with a third model: the six earlier results come from the cache, unchanged; only the new one runs.
    again = runner.invoke(app_(), [*args[:3], str(tiny_dirs["mistral"]), *args[3:], "--json"])
    assert again.exit_code == 0, again.output
    rows2 = json.loads(again.stdout)["comparison"]
    assert [r["cached"] for r in rows2] == [True] * 6 + [False] * 3
    for a, b in zip(rows, rows2[:6], strict=True):
        assert {k: v for k, v in a.items() if k != "cached"} == {k: v for k, v in b.items() if k != "cached"}


def app_():
    from eectl.cli import app

    return app


def test_cached_equals_fresh(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    data = load_text_data(str(GSM8K))
    fresh = profile_model(llama, data, 300, chunk_len=64)
    first = profile_model(llama, data, 300, chunk_len=64, use_cache=True)
    hit = profile_model(llama, data, 300, chunk_len=64, use_cache=True)
    assert not first.cached and hit.cached
    for r in (first, hit):
        assert [s.top1_agreement for s in r.layers] == [s.top1_agreement for s in fresh.layers]
        assert r.eas == fresh.eas and r.ci == fresh.ci and r.oracle_skip_ratio == fresh.oracle_skip_ratio
    other = profile_model(llama, data, 320, chunk_len=64, use_cache=True)  # another budget: another key
    assert not other.cached


def test_bootstrap_intervals(llama):
    data = load_text_data(str(GSM8K))
    chunks = token_chunks(llama.tokenizer, data, 600, 41)
    sums = measure_chunks(llama.adapter, chunks)
    L = llama.adapter.num_layers
    res = summarise(sums, L, 0.5, "top1")
    for key, (lo, hi) in res.ci.items():
        assert lo <= hi, key
    assert res.ci["eas@0.5"][0] <= res.eas <= res.ci["eas@0.5"][1]
    # identical chunks: every resample is the same sample, so each interval collapses to the point estimate
    one = ProfileSums(*(getattr(sums, k)[:1].repeat(20, *([1] * (getattr(sums, k).dim() - 1))) for k in _FIELDS))
    r1 = summarise(one, L, 0.5, "top1")
    for a in EAS_ALPHAS:
        assert r1.ci[f"eas@{a}"] == pytest.approx([r1.eas_by_alpha[str(a)]] * 2)
    ci = bootstrap_ci(one, L, "top1", [0.5])
    assert ci["oracle_skip_ratio"] == pytest.approx([r1.oracle_skip_ratio] * 2)
    # a round trip through the cache's JSON form keeps every number
    back = ProfileSums.from_dict(json.loads(json.dumps(sums.to_dict())))
    for k in _FIELDS:
        assert torch.equal(getattr(back, k), getattr(sums, k)), k


_FIELDS = ("n", "agree", "kl", "js", "cosine", "oracle")


def test_bf16_lens_option(llama):
    data = load_text_data(str(GSM8K))
    chunks = token_chunks(llama.tokenizer, data, 200, 64)
    ref = summarise(measure_chunks(llama.adapter, chunks), llama.adapter.num_layers, 0.5, "top1")
    bf = summarise(measure_chunks(llama.adapter, chunks, lens_dtype="bf16"), llama.adapter.num_layers, 0.5, "top1")
    assert ref.tokens == bf.tokens and bf.layers[-1].top1_agreement == 1.0
    # bf16 rounding may flip a near-tie top-1 on a random model, not the picture
    assert [s.top1_agreement for s in bf.layers] == pytest.approx([s.top1_agreement for s in ref.layers], abs=0.05)
    with pytest.raises(UsageError):
        measure_chunks(llama.adapter, chunks, lens_dtype="fp8")


def test_parse_workloads():
    assert parse_workloads("gsm8k=a/b.jsonl,humaneval,prose=c.txt") == [
        ("gsm8k", "a/b.jsonl"),
        ("humaneval", "humaneval"),
        ("prose", "c.txt"),
    ]
    assert parse_workloads("data/notes.txt") == [("notes", "data/notes.txt")]
    assert parse_workloads(None) == [("humaneval", "humaneval")]
    for bad in ("a=x,a=y", "=x", "name="):
        with pytest.raises(UsageError):
            parse_workloads(bad)


def test_cli_suite_bad_input(tiny_dirs):
    res = runner.invoke(app_(), ["profile", str(tiny_dirs["llama"]), "--data", "a=x.txt,a=y.txt"])
    assert res.exit_code == 2 and res.stderr.strip().splitlines()[-1].startswith("error:")
    res = runner.invoke(app_(), ["profile", str(tiny_dirs["llama"]), "--lens-dtype", "fp8"])
    assert res.exit_code == 2 and "--lens-dtype" in res.stderr
