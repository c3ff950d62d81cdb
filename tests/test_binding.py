"""The binding plan, checked on any machine: on the CUDA EP no hidden state, KV or full logits reach the host per
generated token (only K candidate ids/scores or one scalar per row), for every policy and signal; the CPU plan makes
the same calls in host memory; the plan names only inputs and outputs the exported graphs have."""

from __future__ import annotations

import pytest

from eectl.contracts.manifest import read_manifest
from eectl.exits.signals import SIGNALS
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.quantize import Int4Options
from eectl.runtime.binding import HIDDEN, KV, LOGITS, PER_TOKEN_HOST_ALLOWED, plan_for
from eectl.runtime.policies import POLICIES

EXITS = [2, 4]
DEVICE_HELPERS = {
    "last",
    "concat",
    "logsumexp",
    "cosine",
    "cosine_min",
}  # device-side pieces beyond the exported graphs


@pytest.fixture(scope="module")
def manifest(llama, tmp_path_factory):
    art = tmp_path_factory.mktemp("binding") / "a"
    # with the int4 river copies, so the river policy's plan is checked too
    export_artifact(llama, art, ExportOptions(exits=EXITS, top_k=8, river=True, int4=Int4Options(min_agreement=0.0)))
    return read_manifest(art)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("signal", sorted(SIGNALS))
def test_cuda_plan_keeps_hidden_kv_and_logits_on_the_device(manifest, policy, signal):
    plan = plan_for(manifest, "cuda", EXITS, signal, policy)
    for calls in plan.scenarios():
        copies = plan.host_copies(calls)
        assert copies, "the decision must read something"
        assert {b.kind for _, b in copies} <= set(PER_TOKEN_HOST_ALLOWED), [(c.graph, b.key) for c, b in copies]
        for c in calls:
            for b in c.bindings:
                if b.kind in (HIDDEN, KV, LOGITS):
                    assert b.device == "cuda", (c.graph, c.at, b.key)
        final = [c for c in calls if c.graph == "exit_full" and c.at == manifest.num_layers]
        if final:  # the final token's argmax ran on the device: one id per row comes back, never V logits
            assert {b.key for b in final[-1].bindings if b.host_read} == {"token"}


@pytest.mark.parametrize("policy", POLICIES)
def test_cpu_plan_is_the_same_calls_in_host_memory(manifest, policy):
    cuda = plan_for(manifest, "cuda", EXITS, "topk-prob", policy)
    cpu = plan_for(manifest, "cpu", EXITS, "topk-prob", policy)
    for a, b in zip(cuda.scenarios(), cpu.scenarios(), strict=True):
        assert [(c.graph, c.at, [x.key for x in c.bindings]) for c in a] == [
            (c.graph, c.at, [x.key for x in c.bindings]) for c in b
        ]
        assert all(x.device == "cpu" for c in b for x in c.bindings) and cpu.host_copies(b) == []


@pytest.mark.parametrize("signal", ["topk-prob", "full-prob", "cosine"])
def test_sampling_copies_only_the_deciding_logits(manifest, signal):
    """Sampling from the full vocabulary needs its V logits on the host: the one declared exception, one row per
    token (Top-K exits sample from their K candidates and copy none)."""
    plan = plan_for(manifest, "cuda", EXITS, signal, "defer", temperature=0.8)
    for exit_at in [None, *EXITS]:
        calls = plan.token(exit_at)
        logits = [(c.graph, c.at) for c, b in plan.host_copies(calls) if b.kind == LOGITS]
        full_vocab_pick = exit_at is None or not signal.startswith("topk")
        assert logits == ([("exit_full", exit_at or manifest.num_layers)] if full_vocab_pick else [])
        assert all(b.kind not in (HIDDEN, KV) for _, b in plan.host_copies(calls))


def test_plan_shapes_follow_the_policy(manifest):
    copy = plan_for(manifest, "cuda", EXITS, "topk-prob", "copy").token(exit_at=2)
    assert [c.at for c in copy if c.graph == "kv_segment"] == [1, 2]  # the skipped segments' K/V projections
    defer = plan_for(manifest, "cuda", EXITS, "topk-prob", "defer").token(None, pending=True)
    assert [c.at for c in defer if c.graph == "concat"] == [1, 2]  # deferred states join behind an exit
    graphs = [c.graph for c in plan_for(manifest, "cuda", EXITS, "topk-prob", "defer").token(None)]
    assert graphs.count("exit_full") == 2 and graphs.count("exit_local") == 1  # Top-K once, then K rows only
    cosine = plan_for(manifest, "cuda", EXITS, "cosine", "defer").token(None)
    assert "exit_full" not in [c.graph for c in cosine[:-1]]  # a scalar decides; no head unless the token exits
    river = plan_for(manifest, "cuda", EXITS, "cosine-min", "river").token(exit_at=2)
    assert [c.at for c in river if c.graph == "river_segment"] == [1, 2]  # the int4 copies after the exit
    assert [c.graph for c in river].count("cosine_min") == 1 and "exit_full" not in [c.graph for c in river[:-1]]
    at_exit = plan_for(manifest, "cuda", EXITS, "cosine", "river", river_predict="exit").token(exit_at=2)
    heads = [(c.graph, c.at) for c in at_exit if c.graph in ("exit_full", "river_head")]
    assert heads == [("exit_full", 2)] and at_exit[-1].graph == "river_segment"  # the exit's own head; K/V only


def _exit_graph(manifest, call):
    e = manifest.exit_at(call.at)
    return {"exit_full": e.full, "exit_local": e.local, "river_head": e.river}[call.graph]


def test_plan_names_only_real_graph_io(manifest):
    graphs = {
        "embed": [manifest.embedding],
        "segment": [s.graph for s in manifest.segments],
        "kv_segment": [s.kv_graph for s in manifest.segments],
        "exit_full": [e.full for e in manifest.exits],
        "exit_local": [e.local for e in manifest.exits],
        "river_segment": [s.river for s in manifest.segments[1:]],
        "river_head": [e.river for e in manifest.exits if e.river is not None],
    }
    plans = [
        plan_for(manifest, "cuda", EXITS, "topk-prob", "copy"),
        plan_for(manifest, "cuda", EXITS, "cosine-min", "river"),
    ]
    seen = set()
    for calls in (calls for plan in plans for calls in plan.scenarios()):
        for c in calls:
            seen.add(c.graph)
            for io in graphs.get(c.graph, []):
                if c.graph.startswith("exit") and io.file != _exit_graph(manifest, c).file:
                    continue  # exits differ: the final head has no exit decision
                assert {b.key for b in c.bindings} == set(io.inputs) | set(io.outputs), c.graph
    assert seen - set(graphs) <= DEVICE_HELPERS
