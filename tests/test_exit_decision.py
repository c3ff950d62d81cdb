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
