"""The cost model times verify's draft check the way decode runs it: the final head over several rows through
`greedy_token` (its table packed once for several rows), not the unpacked exit graph that returns full logits."""

from __future__ import annotations

import pytest

from eectl.export.exporter import ExportOptions, export_artifact
from eectl.runtime.sessions import ArtifactRuntime


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("verify-costs") / "art"
    export_artifact(llama, folder, ExportOptions(exits=[2, 4], top_k=8, profile_costs=False))
    return folder


def test_the_final_heads_extra_row_is_timed_as_verify_checks_drafts(artifact, monkeypatch):
    from eectl.plan import costs as costs_module

    rt = ArtifactRuntime(artifact, provider="cpu")
    L = rt.manifest.num_layers
    greedy_rows: list[tuple[int, int]] = []
    full_rows: list[tuple[int, int]] = []
    greedy, full = rt.greedy_token, rt.exit_full

    def spy_greedy(layer, hidden, *a, **k):
        greedy_rows.append((layer, hidden.shape[0]))
        return greedy(layer, hidden, *a, **k)

    def spy_full(layer, hidden, *a, **k):
        full_rows.append((layer, hidden.shape[0]))
        return full(layer, hidden, *a, **k)

    monkeypatch.setattr(rt, "greedy_token", spy_greedy)
    monkeypatch.setattr(rt, "exit_full", spy_full)
    c = costs_module.measure_costs(rt, past=8, repeats=3, warmup=0)
    assert (L, 2) in greedy_rows and (L, 1) in greedy_rows  # the check's path, one row and two
    assert (L, 2) not in full_rows  # not the unpacked head with full logits
    s = c.samples_ms
    assert s is not None and c.final_head_extra_ms == pytest.approx(sorted(s["final_head_extra_ms"])[1])  # median of 3
