"""The embedding on the CPU EP: token ids gathered from the row-major LM head table where the embedding is that
table (runtime/tables.py `row_embedding`), with the same states as the exported embedding graph's."""

from __future__ import annotations

import numpy as np

from eectl.contracts.manifest import LM_HEAD_ROWS
from eectl.runtime.ort import _ort, session_options
from eectl.runtime.sessions import ArtifactRuntime


def test_the_embedding_gathers_lm_head_rows_where_it_is_that_table(exported):
    tied = 0
    for fam, (_, folder) in exported.items():
        rt = ArtifactRuntime(folder, provider="cpu")
        m, shared = rt.manifest, rt.manifest.shared_weights
        ids = np.array([[1, 5, 7, 2], [3, 3, 2, 9]], np.int64) % m.dims["vocab_size"]
        cpu = ["CPUExecutionProvider"]
        graph = _ort().InferenceSession(str(folder / m.embedding.file), session_options(), providers=cpu)
        names = m.embedding.inputs
        want = graph.run(None, {names["input_ids"]: ids, names["weight"]: rt.weights["embed"]})[0]
        assert np.array_equal(rt.embed(ids), want), fam
        assert np.array_equal(rt.embed(ids[:1, 2:3]), want[:1, 2:3]), fam
        if shared["embed"].file == shared["lm_head"].file and LM_HEAD_ROWS in shared:
            tied += 1
            assert "rows" in rt.embedding.io.inputs, fam
        else:
            assert rt.embedding.io.file == m.embedding.file, fam
    assert tied  # the tiny families include tied embeddings (the default model's)


def test_a_scaled_tied_embedding_keeps_its_scale(tiny_dirs, tmp_path):
    """Gemma multiplies the embedding by sqrt(H) and ties it to the LM head (the tiny Gemma is untied): the row
    gather keeps the exported graph's scale."""
    import torch

    from eectl.export.exporter import ExportOptions, export_artifact
    from eectl.models import load_model

    loaded = load_model(str(tiny_dirs["gemma3_text"]))
    a = loaded.adapter
    assert a.embed_scale() != 1.0
    a.lm_head.weight = a.embed_tokens.weight  # tied, as Gemma 3's checkpoints are
    with torch.no_grad():
        assert a.lm_head.weight.data_ptr() == a.embed_tokens.weight.data_ptr()
    export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[2], top_k=8))
    rt = ArtifactRuntime(tmp_path / "a", provider="cpu")
    m = rt.manifest
    assert "rows" in rt.embedding.io.inputs
    graph = _ort().InferenceSession(
        str(tmp_path / "a" / m.embedding.file), session_options(), providers=["CPUExecutionProvider"]
    )
    ids = np.array([[1, 5, 7, 2]], np.int64) % m.dims["vocab_size"]
    names = m.embedding.inputs
    want = graph.run(None, {names["input_ids"]: ids, names["weight"]: rt.weights["embed"]})[0]
    assert np.array_equal(rt.embed(ids), want)
