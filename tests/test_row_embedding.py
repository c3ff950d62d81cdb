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
