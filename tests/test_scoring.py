"""Teacher-forced scoring in one pass (runtime/scoring.py) equals the token-by-token path on every family: full depth
and defer with exits deciding (softmax, cosine and cosine-min signals, gates, block heads), texts alone and batched
(padded, different lengths); copy falls back to token by token. Token by token, defer and copy score as the
simulation does (tests/simulation.py `score`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.runtime import scoring
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.simulation import Simulation

K = 8


def _texts(vocab: int, lengths=((5, 19), (3, 11), (9, 30), (1, 7))) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(3, vocab, (n,), generator=g).tolist(), p) for p, n in lengths]


def _runner(rt, exits, thresholds, signal="topk-prob", policy="defer") -> Runner:
    return Runner(rt, RunConfig(exits=exits, thresholds=thresholds, policy=policy, signal=signal, top_k=K))


def _sequential(runner: Runner, texts) -> list[scoring.Scored]:
    done = [scoring.token_by_token(runner, ids, p) for ids, p in texts]
    return [scoring.Scored(st.nll, st.greedy, st.exit_layers) for st in done]


def _assert_same(got: list[scoring.Scored], want: list[scoring.Scored]) -> None:
    # the same graphs on [S, H] instead of [1, H]: float summation order only (fp32: ~1e-5 nats)
    for a, b in zip(got, want, strict=True):
        assert a.layers == b.layers
        assert a.greedy == b.greedy
        np.testing.assert_allclose(a.nll, b.nll, rtol=1e-4, atol=1e-4)


def test_full_depth_in_one_pass_equals_token_by_token(exported, family):
    loaded, folder = exported[family]
    rt = ArtifactRuntime(folder, provider="cpu")
    texts = _texts(rt.manifest.dims["vocab_size"])
    runner = _runner(rt, [], {})
    assert scoring.one_pass(runner)
    want = _sequential(runner, texts)
    assert [len(w.nll) for w in want] == [n - p for p, n in ((5, 19), (3, 11), (9, 30), (1, 7))]
    assert all(set(w.layers) == {rt.manifest.num_layers} for w in want)
    _assert_same(scoring.score_texts(runner, texts), want)
    _assert_same(scoring.score_texts(runner, texts, rows=3), want)  # padded: rows of different lengths in one pass
    nll, layers = runner.score(*texts[2])
    np.testing.assert_allclose(nll, want[2].nll, atol=1e-4)


@pytest.mark.parametrize(
    ("signal", "criterion", "thresholds"),
    [
        ("topk-prob", "prob", {2: 0.14, 4: 0.14}),  # on the seeded tiny model: 9 positions exit at 2, 34 at 4
        ("cosine", "cosine", {2: 0.6, 4: 0.8}),
        ("cosine-min", "cosine", {2: 0.6, 4: 0.75}),
    ],
)
def test_defer_with_exits_in_one_pass_equals_token_by_token(exported, signal, criterion, thresholds):
    loaded, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu")
    texts = _texts(rt.manifest.dims["vocab_size"])
    thr = {e: {criterion: t} for e, t in thresholds.items()}
    runner = _runner(rt, [2, 4], thr, signal=signal)
    want = _sequential(runner, texts)
    sim = Simulation(loaded.adapter, [2, 4], thr, signal=signal, top_k=K)
    _assert_same(want, [scoring.Scored(r.nll, r.greedy, r.layers) for r in (sim.score(*t) for t in texts)])
    layers = [x for w in want for x in w.layers]
    # the thresholds must make both exits and full depth occur, or the comparison shows nothing
    assert len(set(layers)) >= 2, layers
    assert scoring.one_pass(runner)
    _assert_same(scoring.score_texts(runner, texts), want)
    _assert_same(runner.score_many(texts, rows=4), want)


def test_block_heads_and_gates_score_in_one_pass(tmp_path, tiny_dirs):
    from eectl.export.exporter import ExportOptions, export_artifact
    from eectl.models import load_model
    from tests.test_block_exits import EXITS, _block_heads

    loaded = load_model(str(tiny_dirs["llama"]))
    opts = ExportOptions(exits=EXITS, top_k=K, profile_costs=False)
    export_artifact(loaded, tmp_path / "a", opts, heads=_block_heads(loaded.adapter))
    rt = ArtifactRuntime(tmp_path / "a", provider="cpu")
    texts = _texts(rt.manifest.dims["vocab_size"])
    runner = _runner(rt, EXITS, {2: {"prob": 0.14}, 4: {"prob": 0.14}})
    want = _sequential(runner, texts)
    assert len({x for w in want for x in w.layers}) >= 2
    _assert_same(scoring.score_texts(runner, texts, rows=2), want)
    # a gate (eectl.exits.gates) that opens for some positions only: the ungated positions stay undecided there
    H = rt.manifest.dims["hidden_size"]
    w = np.random.default_rng(0).standard_normal(H).astype(np.float32)
    runner.gates = {2: (w, 0.0, 0.0)}
    _assert_same(scoring.score_texts(runner, texts, rows=2), _sequential(runner, texts))


def test_copy_scores_token_by_token(exported):
    loaded, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu")
    texts = _texts(rt.manifest.dims["vocab_size"])[:2]
    runner = _runner(rt, [2, 4], {2: {"prob": 0.14}, 4: {"prob": 0.14}}, policy="copy")
    assert not scoring.one_pass(runner)
    _assert_same(runner.score_many(texts, rows=2), _sequential(runner, texts))
    with pytest.raises(Exception, match="does not score text in one pass"):
        scoring.score_texts(runner, texts)


@pytest.mark.parametrize("policy", ["copy", "defer"])
def test_token_by_token_on_the_bound_chain_equals_the_simulation(exported, monkeypatch, policy):
    """Fed token by token, a configuration the bound chain runs (one row, CPU, exits decided in the graphs) steps
    there, the fed tokens scored on the final head's logits or the exit's full vocabulary: the same layers, argmaxes
    and -log p as the simulation's teacher-forced scores (tests/simulation.py `score`), a one-token prompt's first
    position included."""
    from eectl.runtime import chain_steps

    loaded, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu")
    texts = _texts(rt.manifest.dims["vocab_size"])
    thresholds = {2: {"prob": 0.14}, 4: {"prob": 0.14}}
    sim = Simulation(loaded.adapter, [2, 4], thresholds, policy=policy, top_k=K)
    want = [sim.score(ids, p) for ids, p in texts]
    steps: list[int] = []
    real = chain_steps.chain_step
    monkeypatch.setattr(chain_steps, "chain_step", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    monkeypatch.setattr(scoring, "chain_step", chain_steps.chain_step)
    got = _sequential(_runner(rt, [2, 4], thresholds, policy=policy), texts)
    assert len(steps) == sum(n - p for p, n in ((5, 19), (3, 11), (9, 30), (1, 7)))  # the prompt's and each next
    layers = [x for w in want for x in w.layers]
    assert {2, 4, rt.manifest.num_layers} <= set(layers), layers  # exits at both and full depth: a real comparison
    _assert_same(got, [scoring.Scored(w.nll, w.greedy, w.layers) for w in want])


def test_bad_texts_are_refused(exported):
    _, folder = exported["llama"]
    runner = _runner(ArtifactRuntime(folder, provider="cpu"), [], {})
    for ids, p in (([5, 6], 2), ([5, 6], 0), ([5] * (runner.m.max_positions + 1), 1)):
        with pytest.raises(Exception, match="text too short or longer"):
            runner.score_many([(ids, p)])
