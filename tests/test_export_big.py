"""A model whose one segment is past protobuf's 2 GB limit exports (weights as ONNX external data), validates
against PyTorch, and runs: the path a 7-8B model in fp16 takes, on a synthetic model that is cheap to build (one
wide decoder layer of random weights, a 384-token vocabulary; about 2.3 GB in fp32)."""

from __future__ import annotations

import pytest
import torch

from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models.adapters import adapter_for
from eectl.models.loading import LoadedModel, ModelSource
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.tiny import tiny_tokenizer

PROTOBUF_LIMIT = 2**31


def wide_model() -> LoadedModel:
    """One wide Llama layer of seeded random weights, a 384-token vocabulary: its one segment is 2.33 GB in fp32
    (benchmarks/export_big.py measures this model's export)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=384,
        hidden_size=4096,
        intermediate_size=44032,  # 3 x 4096 x 44032 MLP + attention: 583M parameters, 2.33 GB in fp32
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    source = ModelSource("wide", "hf-folder", "in-process", None, [])  # never written to disk: too big to be quick
    return LoadedModel(model, tiny_tokenizer(384), adapter_for(model), source)


@pytest.mark.slow
def test_segment_past_2gb_exports_validates_and_runs(tmp_path):
    loaded = wide_model()
    model = loaded.model
    art = tmp_path / "wide"
    m = export_artifact(loaded, art, ExportOptions(exits=[]))  # the one segment is the whole model
    seg = m.segments[0].graph
    assert seg.data is not None and (art / seg.data).stat().st_size > PROTOBUF_LIMIT
    assert (art / seg.file).stat().st_size < 1 << 20 and seg.data in m.files
    assert m.validation["passed"] and m.validation["greedy_token_mismatches"] == {"1": 0}

    prompt = [5, 6, 7, 8]
    rt = ArtifactRuntime(art, provider="cpu")  # checks every hash, the 2.3 GB weights file included
    got = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=4)).generate([prompt])[0].token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :].tolist()
    assert got == ref
