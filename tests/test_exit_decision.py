"""The exit decision inside the exit graphs (exits.decision_nodes) is the decision calibrate measures
(exits.signals + passes): on the graphs' own logits, for thresholds across the range, every decision and token
agrees except where a value lies within TOL of its threshold (float32 exp/sum order: the graph's values are
compared too)."""

from __future__ import annotations

import numpy as np
import pytest

from eectl.errors import UsageError
from eectl.exits.base import signals
from eectl.exits.signals import GRAPH_CRITERIA, get_signal, graph_thresholds
from eectl.runtime.sessions import ArtifactRuntime

TOL = 1e-6  # |graph value - numpy value| bound, float32 rounding of exp and of the sum's order


def _feeds(rt: ArtifactRuntime, g, hidden: np.ndarray, **extra) -> dict:
    feeds = {g.name("hidden"): hidden.astype(rt.np_dtype), **rt.weight_feeds(g)}
    if "top_k" in g.io.inputs:
        feeds[g.name("top_k")] = np.array([extra.pop("k")], np.int64)
    for key, value in extra.items():
        feeds[g.name(key)] = value
    return feeds


def _check(rt: ArtifactRuntime, g, hidden: np.ndarray, **extra) -> int:
    """Run graph g on each row with thresholds across its values' range; return how many decisions were compared."""
    names = [g.name("candidate_logits"), g.name("passed"), g.name("exit_token")]
    if "candidates" in g.io.outputs:
        names.insert(1, g.name("candidates"))
    compared = 0
    for signal in ("topk-prob", "topk-margin", "topk-prob+margin"):
        sig = get_signal(signal)
        for row in range(hidden.shape[0]):
            feeds = _feeds(rt, g, hidden[row : row + 1], **dict(extra))
            cand = extra.get("candidates")
            if cand is None:
                logits, cand = g.session.run([names[0], names[1]], feeds)
            else:
                (logits,) = g.session.run([names[0]], feeds)
            want = signals(logits, cand)
            values = {"prob": float(want.prob[0]), "margin": float(want.margin[0])}
            grid = {c: [0.0, 1.0, values[c], values[c] - 1e-3, values[c] + 1e-3, 0.5] for c in sig.criteria}
            for i in range(6):
                thr = {c: grid[c][i] for c in sig.criteria}
                feeds["thresholds"] = graph_thresholds(sig, thr, 2)  # a graph without a probe
                passed, token = g.session.run([g.name("passed"), g.name("exit_token")], feeds)
                assert token[0] == want.token[0]
                if all(abs(values[c] - thr[c]) > TOL for c in sig.criteria):
                    assert bool(passed[0]) == all(values[c] >= thr[c] for c in sig.criteria), (signal, thr, values)
                    compared += 1
    return compared


def _hidden(rt: ArtifactRuntime, n: int = 12) -> np.ndarray:
    """Rows from sharp to flat softmaxes: random directions at scales 0.1 .. 30."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((n, rt.manifest.dims["hidden_size"]))
    return (h * np.geomspace(0.1, 30, n)[:, None]).astype(np.float32)


def test_graph_decisions_equal_the_signals(exported, family):
    _, folder = exported[family]
    rt = ArtifactRuntime(folder, provider="cpu")
    hidden = _hidden(rt)
    k = rt.manifest.top_k
    compared = 0
    for layer in rt.manifest.exit_layers:
        full = rt.full_graphs[layer]
        assert full.io.inputs["thresholds"] == "thresholds" and full.io.outputs["passed"] == "passed"
        compared += _check(rt, full, hidden, k=k)
        cand = rt.exit_full(layer, hidden[:1], k)[1]
        compared += _check(rt, rt.local_graphs[layer], hidden, candidates=cand)
    assert compared > 300  # most grid points lie clear of the boundary


def test_the_graph_thresholds_cover_every_softmax_criterion():
    assert GRAPH_CRITERIA == ("prob", "margin", "score")
    t = graph_thresholds(get_signal("topk-margin"), {"margin": 0.25}, 2)  # a graph without a probe (and before)
    assert t.dtype == np.float32 and t.tolist() == [-np.inf, 0.25]
    t = graph_thresholds(get_signal("learned"), {"score": 1.5}, 3)  # a graph with a probe
    assert t.tolist() == [-np.inf, -np.inf, 1.5]
    assert graph_thresholds(get_signal("topk-prob"), {"prob": 0.5}, 3).tolist() == [0.5, -np.inf, -np.inf]
    with pytest.raises(KeyError):
        graph_thresholds(get_signal("topk-prob"), {}, 2)
    with pytest.raises(UsageError, match="score"):  # the learned signal on an artifact without probes
        graph_thresholds(get_signal("learned"), {"score": 0.0}, 2)


def test_one_candidate_decides_with_the_margin_equal_to_the_probability(exported):
    """K = 1 (a caller asking the full graph for its top-1 only): no second candidate, as numpy: margin = prob = 1."""
    _, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu")
    g = rt.full_graphs[rt.manifest.exit_layers[0]]
    feeds = _feeds(rt, g, _hidden(rt)[:1], k=1)
    feeds["thresholds"] = np.array([1.0, 1.0], np.float32)
    passed, token, logits = g.session.run(["passed", "exit_token", "logits"], feeds)
    assert bool(passed[0]) and token[0] == logits[0].argmax()


def test_every_path_decides_in_the_exit_graphs_as_the_signal_scored_on_the_host(exported, monkeypatch):
    """Greedy steps of a batch, teacher-forced scoring and a device-resident run decide at their exits in the exit
    graphs, several rows per call (runtime/graph_decide.py), nothing scored in host numpy; the decisions are the ones
    the same signal scored on the host makes on the graphs' K logits (an artifact whose graphs do not decide: here
    the runtime told so), tokens and exit layers alike. A signal the graphs do not compute (the cosine) is scored on
    the host."""
    from dataclasses import replace

    from eectl.exits.signals import Signal
    from eectl.runtime import decide
    from eectl.runtime.graph_decide import GraphDecisions
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig
    from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K

    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    calls: list[tuple[int, int, bool]] = []
    host: list[int] = []
    real_call, real_device, real_passes = GraphDecisions.__call__, GraphDecisions.on_device, Signal.passes

    def spy(self, layer, hidden, candidates):
        calls.append((layer, hidden.shape[0], candidates is None))
        return real_call(self, layer, hidden, candidates)

    def spy_device(self, layer, hidden, candidates, place):
        calls.append((layer, hidden.shape[0], candidates is None))
        return real_device(self, layer, hidden, candidates, place)

    def passes(self, values, thresholds):
        host.append(len(next(iter(values.values()))))
        return real_passes(self, values, thresholds)

    monkeypatch.setattr(GraphDecisions, "__call__", spy)
    monkeypatch.setattr(GraphDecisions, "on_device", spy_device)
    monkeypatch.setattr(Signal, "passes", passes)
    prompts = [[5, 9, 14], [7, 3, 21, 8, 2], [11, 4], [30, 12, 6, 9]]
    cfg = RunConfig(
        exits=list(EXPORT_EXITS),
        thresholds={e: {"prob": 0.135} for e in EXPORT_EXITS},
        top_k=EXPORT_TOP_K,
        max_new_tokens=10,
        device_resident=False,
    )
    batch = Runner(rt, cfg).generate(prompts)
    assert calls and not host  # decided in the graphs, nothing scored on the host
    assert any(n > 1 for _, n, _ in calls) and {picking for *_, picking in calls} == {True, False}
    calls.clear()
    scored = Runner(rt, cfg).score_many([(p + g.token_ids, len(p)) for p, g in zip(prompts, batch, strict=True)])
    assert calls and not host and any(n > 1 for _, n, _ in calls)
    calls.clear()
    resident = Runner(rt, replace(cfg, device_resident=True)).generate(prompts)
    assert calls and not host and {picking for *_, picking in calls} == {True, False}
    with monkeypatch.context() as m:
        m.setattr(decide, "decides_in_graph", lambda *a: False)
        scored_on_host = Runner(rt, cfg).generate(prompts)
    assert host
    for got in (resident, scored_on_host):
        assert [g.token_ids for g in got] == [g.token_ids for g in batch]
        assert [g.exit_layers for g in got] == [g.exit_layers for g in batch]
    L = rt.manifest.num_layers
    assert any(e < L for g in batch for e in g.exit_layers[1:])  # some tokens exited
    # teacher-forced on the batch's own tokens, each position is decided where generation decided it
    assert [s.layers for s in scored] == [g.exit_layers for g in batch]
    calls.clear()
    host.clear()
    Runner(rt, replace(cfg, signal="cosine", thresholds={e: {"cosine": 0.5} for e in EXPORT_EXITS})).generate(prompts)
    assert host and not calls


def test_thresholds_of_exits_not_active_are_not_the_graphs_business(exported):
    """A run's thresholds may name exits it does not activate (a calibration's every exit), with criteria of another
    signal or none: the graphs' decisions take the active exits' only."""
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig
    from tests.conftest import EXPORT_TOP_K

    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    cfg = RunConfig(exits=[2], thresholds={2: {"prob": 0.0}, 4: {}}, top_k=EXPORT_TOP_K, max_new_tokens=4)
    runner = Runner(rt, cfg)
    assert runner.exit_test.graph is not None
    gen = runner.generate([[5, 9, 14], [7, 3]])
    assert all(e == 2 for g in gen for e in g.exit_layers[1:])  # threshold 0: every token exits at 2
