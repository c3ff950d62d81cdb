"""Profile on tiny models: invariants of the per-layer measures, EAS formula, oracle, CLI behaviour."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from eectl.cli import app
from eectl.data import load_text_data, token_chunks
from eectl.errors import UsageError
from eectl.models import load_model
from eectl.profile.lens import _eas_term, profile_chunks, profile_model
from tests.tiny import GSM8K

runner = CliRunner()


def test_profile_invariants(tiny_dirs, family):
    loaded = load_model(str(tiny_dirs[family]))
    data = load_text_data(str(GSM8K))
    res = profile_model(loaded, data, 300, alpha=0.5, similarity="js", chunk_len=64)
    L = loaded.adapter.num_layers
    assert res.tokens == 300 and res.num_layers == L == len(res.layers)
    last = res.layers[-1]
    assert last.top1_agreement == 1.0 and last.kl == pytest.approx(0.0, abs=1e-6)
    assert last.js_similarity == pytest.approx(1.0, abs=1e-5) and last.eas_term == 0.0
    for s in res.layers:
        assert 0.0 <= s.top1_agreement <= 1.0 and s.kl >= -1e-6 and -1.0 <= s.transition_cosine <= 1.0
        assert 0.0 <= s.js_similarity <= 1.0 + 1e-6
    assert sum(s.oracle_exits for s in res.layers) == res.tokens
    # EAS is the mean of the per-layer terms, each S^a * w^(1-a)
    assert res.eas == pytest.approx(sum(s.eas_term for s in res.layers) / L)
    for s in res.layers:
        assert s.eas_term == pytest.approx(math.sqrt(s.js_similarity * (L - s.layer) / L), rel=1e-6)
    assert 1.0 <= res.oracle_mean_layers <= L


def test_oracle_matches_brute_force(llama):
    """The oracle exit is the earliest layer from which every later layer's top-1 equals the final top-1."""
    adapter = llama.adapter
    data = load_text_data(str(GSM8K))
    chunks = token_chunks(llama.tokenizer, data, 120, 61)
    res = profile_chunks(adapter, chunks, skip_first=1)
    L = adapter.num_layers
    counts = [0] * L
    agree = [0] * L
    cosines = [0.0] * L
    with torch.no_grad():
        for ids in chunks:
            states, inputs = [], []
            adapter.forward_layers(
                adapter.embed(ids),
                torch.arange(ids.shape[1])[None],
                0,
                L,
                on_layer=lambda i, a, b, states=states, inputs=inputs: (states.append(b), inputs.append(a)),
            )
            for i in range(L):
                cosines[i] += float(
                    torch.nn.functional.cosine_similarity(inputs[i][0, 1:], states[i][0, 1:], dim=-1).sum()
                )
            tops = torch.stack([adapter.logits(h)[0, 1:].argmax(-1) for h in states])  # [L, T]
            for t in range(tops.shape[1]):
                first = L - 1
                while first > 0 and tops[first - 1, t] == tops[-1, t]:
                    first -= 1
                counts[first] += 1
                for i in range(L):
                    agree[i] += int(tops[i, t] == tops[-1, t])
    assert [s.oracle_exits for s in res.layers] == counts
    assert [s.top1_agreement for s in res.layers] == pytest.approx([a / res.tokens for a in agree])
    assert [s.transition_cosine for s in res.layers] == pytest.approx([c / res.tokens for c in cosines], abs=1e-5)
    assert res.tokens == 120
    # the model-level oracle numbers, from the brute-force exits: mean exit layer, skipped share, speedup bound
    mean_exit = sum((i + 1) * c for i, c in enumerate(counts)) / res.tokens
    assert res.oracle_mean_layers == pytest.approx(mean_exit)
    assert res.oracle_skip_ratio == pytest.approx((L - mean_exit) / L)
    assert res.oracle_speedup_bound == pytest.approx(L / mean_exit)


def test_eas_term_edges():
    assert _eas_term(0.5, 0.5, 0.0) == 0.5 and _eas_term(0.5, 0.5, 1.0) == 0.5
    assert _eas_term(1.0, 0.0, 0.5) == 0.0 and _eas_term(0.0, 1.0, 0.0) == 1.0
    assert _eas_term(0.25, 1.0, 0.5) == pytest.approx(0.5)


def test_bad_alpha_and_similarity(llama):
    with pytest.raises(UsageError):
        profile_chunks(llama.adapter, [], alpha=1.5)
    with pytest.raises(UsageError):
        profile_chunks(llama.adapter, [], similarity="cos")


def test_cli_profile_json_and_plot(tiny_dirs, tmp_path):
    png = tmp_path / "p.png"
    res = runner.invoke(
        app,
        [
            "profile",
            str(tiny_dirs["qwen2"]),
            "--data",
            str(GSM8K),
            "--tokens",
            "200",
            "--json",
            "--plot",
            str(png),
            "--threads",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # stdout is exactly one JSON document
    assert doc["tokens"] == 200 and doc["similarity"] == "top1" and doc["alpha"] == 0.5
    assert len(doc["layers"]) == 6 and 0.0 <= doc["eas"] <= 1.0 and doc["threads"] == 1
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_profile_human_output(tiny_dirs):
    res = runner.invoke(app, ["profile", str(tiny_dirs["llama"]), "--tokens", "100", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "EAS" in res.stdout and "verdict:" in res.stdout and "oracle" in res.stdout


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--alpha", "1.5"], 2, "--alpha"),
        (["--similarity", "kl"], 2, "--similarity"),
        (["--tokens", "10000000"], 4, "fewer than"),
        (["--tokens", "0"], 2, "--tokens"),
        (["--plot", "x.jpg"], 2, ".png"),
        (["--data", "/nonexistent.jsonl"], 4, "data not found"),
    ],
)
def test_cli_profile_bad_input(tiny_dirs, args, code, text):
    res = runner.invoke(app, ["profile", str(tiny_dirs["llama"]), "--data", str(GSM8K), *args])
    assert res.exit_code == code, res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and text in last and res.stdout == ""


def test_cli_maps_errors_to_one_line(tmp_path):
    """Through the real entry point: one line on stderr, non-zero exit, no traceback."""
    import subprocess
    import sys

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    for argv, code in (
        [["profile", str(tmp_path / "missing")], 3],
        [["profile", str(bad)], 3],
        [["run", str(tmp_path / "no-artifact"), "hi"], 5],
        [["profile", "--alpha", "-1"], 2],
    ):
        p = subprocess.run(
            [sys.executable, "-m", "eectl.cli", *argv],
            capture_output=True,
            text=True,
            env={**__import__("os").environ, "EECTL_CACHE": str(tmp_path / "cache")},
        )
        assert p.returncode == code, (argv, p.stderr)
        lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert p.stdout == ""
