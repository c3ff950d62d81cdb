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


def test_wide_passes_are_timed_with_the_full_head(artifact, monkeypatch):
    """The wide passes' timing runs the full head at every width (the certified head's pass or miss on random
    contexts is not decode's) and says so; both heads are timed over each width's rows for the plan to swap
    decode's in."""
    from eectl.plan import costs as costs_module
    from eectl.plan import step_calls
    from eectl.runtime.certified_head import CertifiedHead
    from eectl.runtime.graph_calls import GraphCalls

    rt = ArtifactRuntime(artifact, provider="cpu")
    assert rt.certified_head is not None
    calls = step_calls.wide_step_calls(rt, 8)
    assert set(calls) == {"wide.1", *(f"wide.{w}" for w in step_calls.WIDE_WIDTHS)}
    certified: list[int] = []
    run, tokens = CertifiedHead.run, GraphCalls._certified_tokens
    monkeypatch.setattr(CertifiedHead, "run", lambda self, *a, **k: certified.append(1) or run(self, *a, **k))
    monkeypatch.setattr(GraphCalls, "_certified_tokens", lambda self, *a: certified.append(1) or tokens(self, *a))
    for call in calls.values():
        call()
    assert certified == []
    c = costs_module.measure_costs(rt, past=8, repeats=2, warmup=0)
    assert certified  # the certified head's own timing (one row, and each wide pass's rows)
    widths = {str(w) for w in step_calls.WIDE_WIDTHS}
    assert c.wide_full_head and set(c.wide_ms) == {"1", *widths}
    assert set(c.head_rows_ms) == set(c.certified_rows_ms) == widths and c.samples_ms is not None
    assert c.certified_rows_ms["3"] == pytest.approx(sum(c.samples_ms["certified_rows_ms.3"]) / 2)  # median of 2


def test_a_greedy_verify_runner_packs_the_final_head_when_it_is_made(artifact):
    """The packed final head (several rows: verify's check) is made with the runner, not inside the first decode
    step that checks drafts (on Gemma 3's 262K-token table that took 0.7-2 s, paid as the first prompt's decode
    time); runners that never check drafts make none."""
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    L = ArtifactRuntime(artifact, provider="cpu").manifest.num_layers
    for policy, packed in (("verify", True), ("defer", False)):
        rt = ArtifactRuntime(artifact, provider="cpu")
        Runner(rt, RunConfig(exits=[2], thresholds={2: {"prob": 0.5}}, policy=policy))
        assert (rt.packed_heads._sessions.get(L) is not None) is packed, policy
