"""The learned exit signal (exits.Probe, eectl.exits.probe): its fit is deterministic for a seed, the heads file keeps
it, its score is one number whether torch (calibrate), numpy (Probe.score) or the exit graphs (the runner) compute
it, and the runner with it keeps verify exact and decides as the PyTorch simulation (tests/simulation.py) does under
defer and copy. Heads without probes fail with one clear line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from eectl.cli import app
from eectl.errors import UsageError
from eectl.exits.base import PROBE_SCALARS, ExitHead, Probe, TorchExitLogits, attach_probe, probe_of, signals
from eectl.exits.candidates import CANDIDATE_SOURCES
from eectl.exits.designs import HeadStack, build_heads, load_heads, save_heads
from eectl.exits.probe import ProbeConfig, fit_probe, fit_probes, probe_features
from eectl.exits.signals import ExitScoring, choose_signal, get_signal, graph_thresholds
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.runtime.exit_logits import OrtExitLogits
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import make_heads_meta
from tests.simulation import Simulation

EXITS = [2, 4]
K = 8
L = 6
SCORE_TOL = 1e-5  # |graph or numpy score - torch score|: float32 rounding of a dot product over H and of exp/sum
LEARNED = get_signal("learned")
FIRST = CANDIDATE_SOURCES["first-exit-topk"]


def _states(loaded, seed: int, n_seq: int = 6, length: int = 24):
    """(exit states [T, H] by layer, the final top-1 [T]) per random sequence: the probes' training samples."""
    adapter = loaded.adapter
    lens = ExitHead(adapter)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_seq):
        ids = torch.randint(3, adapter.dims.vocab_size, (1, length), generator=g)
        states: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            adapter.forward_layers(
                adapter.embed(ids),
                torch.arange(length)[None],
                0,
                L,
                on_layer=lambda i, a, b, states=states: states.__setitem__(i + 1, b[0].float()),
            )
            teacher = lens.full(states[L]).argmax(-1)
        yield {e: states[e] for e in EXITS}, teacher


def _same(a, b) -> bool:
    """Two probes with identical tensors."""
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k]) for k in ta)


def _mlp_probe(H: int, seed: int, hidden: int = 8) -> Probe:
    """A random MLP probe over every scalar feature (scores spread over a few units on the tiny model's states)."""
    rng = np.random.default_rng(seed)
    f = len(PROBE_SCALARS)
    return Probe(
        (rng.standard_normal((H, hidden)) / np.sqrt(H)).astype(np.float32),
        rng.standard_normal((f, hidden)).astype(np.float32),
        rng.standard_normal(hidden).astype(np.float32),
        rng.standard_normal(hidden).astype(np.float32),
        0.25,
    )


def _heads_with_probes(loaded, seed: int = 0):
    """Residual-linear heads (perturbed from identity so each exit differs) with probes fitted on random text (few
    tokens: logistic regressions), the first exit's then replaced by a random MLP probe, so the graphs,
    the runner and the heads file carry both kinds."""
    H = loaded.adapter.dims.hidden_size
    stack = build_heads("residual-linear", H, EXITS, None, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    heads = {e: stack.head(e) for e in EXITS}
    exit_heads = {e: ExitHead(loaded.adapter, heads[e]).eval() for e in EXITS}
    config = ProbeConfig(tokens=100, hidden=0, steps=60, batch=64, top_k=K)
    fit = fit_probes(heads, exit_heads, _states(loaded, 7), FIRST, config)
    attach_probe(heads[EXITS[0]], _mlp_probe(H, seed))
    return stack, heads, fit


@pytest.fixture(scope="module")
def probed(llama, tmp_path_factory):
    """(heads dict with probes, heads file, artifact folder exported with them)."""
    root = tmp_path_factory.mktemp("probe")
    stack, heads, fit = _heads_with_probes(llama)
    path = root / "heads.safetensors"
    save_heads(stack, make_heads_meta(llama, EXITS, probe=fit.to_dict()), path)
    folder = root / "art"
    manifest = export_artifact(llama, folder, ExportOptions(exits=EXITS, top_k=K), heads)
    assert 0 < manifest.validation["probe_score_max_abs_diff"] < SCORE_TOL  # export checked the graphs' score
    return heads, path, folder


def test_probe_fit_is_deterministic_for_a_seed(llama):
    _, a, fa = _heads_with_probes(llama)
    _, b, fb = _heads_with_probes(llama)
    assert fa.tokens == fb.tokens == 100 and fa.features == ["normed", *PROBE_SCALARS]
    assert fa.chosen == fb.chosen and fa.validation == fb.validation and set(fa.chosen) == {"2", "4"}
    for e in EXITS:
        pa, pb = probe_of(a[e]), probe_of(b[e])
        assert pa is not None and pb is not None and _same(pa, pb)
    _, c, _ = _heads_with_probes(llama, seed=3)
    assert not _same(probe_of(c[4]), probe_of(a[4]))


def test_features_score_each_token_on_the_candidates_of_an_exit_at_or_before_it(llama):
    """probe_features with a generator: at the first exit every token's own candidates; at a later exit, per token,
    the candidates of a drawn exit at or before it (both occur), the softmax scalars and label over those rows."""
    H = llama.adapter.dims.hidden_size
    stack = build_heads("residual-linear", H, EXITS, None, 0)
    exit_heads = {e: ExitHead(llama.adapter, stack.head(e)).eval() for e in EXITS}
    states, teacher = next(_states(llama, 5, n_seq=1, length=64))
    own = probe_features(exit_heads, states, teacher, FIRST, K)
    mixed = probe_features(exit_heads, states, teacher, FIRST, K, torch.Generator().manual_seed(0))
    assert torch.equal(mixed[EXITS[0]][0], own[EXITS[0]][0])
    backend = TorchExitLogits(exit_heads)
    later = EXITS[1]
    cands = {e: backend.full_topk(e, states[e], K)[0] for e in EXITS}  # each exit's own pick (first-exit-topk)
    seen = set()
    for t in range(len(teacher)):
        row = mixed[later][0][t]
        matches = []
        for e in EXITS:
            s = signals(backend.local(later, states[later][t : t + 1], cands[e][t : t + 1]), cands[e][t : t + 1])
            if abs(float(s.prob[0]) - float(row[0])) < 1e-6 and abs(float(s.margin[0]) - float(row[1])) < 1e-6:
                matches.append(e)
                assert bool(mixed[later][1][t]) == bool(s.token[0] == teacher[t])
        assert matches, t
        seen.update(matches)
    assert seen == set(EXITS)  # both exits' candidates were drawn


def test_fit_keeps_the_mlp_where_it_generalises_and_the_logistic_where_not():
    """fit_probe's choice on the held-out share: labels a nonlinear function of the scalars (confident AND sharp: an
    MLP fits it, a linear score cannot) with many tokens -> the MLP, more held-out tokens covered at the tail's
    precisions; 40 tokens (too few to judge the tail) -> the logistic regression."""
    g = torch.Generator().manual_seed(0)
    n, H = 12000, 16
    prob = torch.rand(n, generator=g)
    margin = prob * torch.rand(n, generator=g)
    z = torch.randn(n, H, generator=g)
    x = torch.cat([prob[:, None], margin[:, None], z], 1)
    y = ((prob > 0.5) ^ (margin > 0.25)) | (z[:, 0] > 1.5)
    config = ProbeConfig(hidden=16, mlp_steps=600, mlp_batch=512, steps=200, batch=1024)
    probe, kind, cover = fit_probe(x, y, config)
    assert kind == "mlp" and probe.hidden == 16 and cover["mlp"] > cover["logistic"] + 0.05, cover

    def accuracy(p: Probe) -> float:
        return float(((torch.from_numpy(p.score(z.numpy(), prob.numpy(), margin.numpy())) > 0) == y).float().mean())

    mlp = probe
    noise = torch.rand(40, generator=g) > 0.5
    probe, kind, cover = fit_probe(x[:40], noise, config)
    assert kind == "logistic" and probe.hidden == 0 and probe.w_scalar.shape == (2, 1), cover
    logistic, kind, cover = fit_probe(x, y, ProbeConfig(hidden=0, steps=200, batch=1024))
    assert kind == "logistic" and cover == {}
    assert accuracy(mlp) > accuracy(logistic) + 0.04, (accuracy(mlp), accuracy(logistic))  # (0.85 vs 0.79 when written)


def test_heads_file_keeps_the_probes_and_old_files_load_without(llama, probed, tmp_path):
    heads, path, _ = probed
    again = load_heads(path, llama)
    assert again.meta.probe is not None and again.meta.probe.top_k == K
    for e in EXITS:
        assert _same(probe_of(heads[e]), probe_of(again.heads[e]))
    assert probe_of(again.heads[EXITS[0]]).hidden == 8 and probe_of(again.heads[EXITS[1]]).hidden == 0
    old = tmp_path / "old.safetensors"  # a heads file written before probes: no probe keys, no meta entry
    save_heads(
        build_heads("residual-linear", llama.adapter.dims.hidden_size, EXITS, None, 0),
        make_heads_meta(llama, EXITS),
        old,
    )
    loaded = load_heads(old, llama)
    assert all(probe_of(h) is None for h in loaded.heads.values()) and loaded.meta.probe is None


def test_the_signal_is_the_named_one_else_learned_where_every_exit_has_a_probe(llama, probed):
    heads, _, _ = probed
    assert choose_signal(None, heads, EXITS) == "learned"
    assert choose_signal("topk-prob", heads, EXITS) == "topk-prob"  # --signal, or a recipe that names one, wins
    assert choose_signal(None, None, EXITS) == "topk-prob"  # no heads (the logit lens)
    plain = build_heads("residual-linear", llama.adapter.dims.hidden_size, EXITS, None, 0)
    mixed = {e: (heads[e] if e != EXITS[-1] else plain.head(e)) for e in EXITS}  # one exit without a probe
    assert choose_signal(None, mixed, EXITS) == "topk-prob"


def test_score_is_the_same_in_torch_numpy_and_the_exit_graphs(llama, probed):
    """The learned score of rows from sharp to flat softmaxes: torch (calibrate's path) == numpy Probe.score ==
    the exit graphs' `score` output (the runner's), within SCORE_TOL; decisions in the graph equal numpy's."""
    heads, _, folder = probed
    rt = ArtifactRuntime(folder, provider="cpu")
    H = llama.adapter.dims.hidden_size
    rng = np.random.default_rng(3)
    hidden = (rng.standard_normal((10, H)) * np.geomspace(0.1, 30, 10)[:, None]).astype(np.float32)
    exit_heads = {e: ExitHead(llama.adapter, heads[e]).eval() for e in EXITS}
    t = ExitScoring(LEARNED, TorchExitLogits(exit_heads), K, FIRST)
    o = ExitScoring(LEARNED, OrtExitLogits(rt), K, FIRST)
    compared = 0
    for e in EXITS:
        st, so = t.score(e, torch.from_numpy(hidden)), o.score(e, hidden)
        want = st.values["score"].numpy()
        ids, logits = t.candidates, st.prediction().logits
        s = signals(logits, ids)
        z = exit_heads[e].normed(torch.from_numpy(hidden)).detach().numpy()
        np.testing.assert_allclose(probe_of(heads[e]).score(z, s.prob.numpy(), s.margin.numpy()), want, atol=1e-6)
        np.testing.assert_allclose(so.values["score"], want, atol=SCORE_TOL, rtol=0)
        assert (so.prediction().token == st.prediction().token.numpy()).all()
        # the bound path's decision: the graph's `passed` at thresholds around each row's score
        g = rt.full_graphs[e] if e == EXITS[0] else rt.local_graphs[e]
        for row in range(len(hidden)):
            feeds = {g.name("hidden"): hidden[row : row + 1], **rt.weight_feeds(g)}
            if e == EXITS[0]:
                feeds[g.name("top_k")] = np.array([K], np.int64)
            else:
                feeds[g.name("candidates")] = np.asarray(t.candidates[row : row + 1])
            v = float(want[row])
            for thr in (v - 1e-3, v + 1e-3, v - 1.0, v + 1.0):
                feeds[g.name("thresholds")] = graph_thresholds(LEARNED, {"score": thr}, 3)
                (passed,) = g.session.run([g.name("passed")], feeds)
                assert bool(passed[0]) == (v >= thr)
                compared += 1
    assert compared == 2 * 10 * 4


def _simulation(loaded, heads, thresholds: dict[int, float], policy: str = "defer") -> Simulation:
    """The runner's reference (tests/simulation.py) with the learned signal over `heads` (their probes)."""
    thr = {e: {"score": t} for e, t in thresholds.items()}
    return Simulation(loaded.adapter, EXITS, thr, signal="learned", policy=policy, top_k=K, heads=heads)


def _run(rt, policy, thresholds, exits=EXITS, new=20, **kw):
    thr = {e: {"score": t} for e, t in thresholds.items()}
    cfg = RunConfig(exits=exits, thresholds=thr, signal="learned", policy=policy, top_k=K, max_new_tokens=new, **kw)
    return Runner(rt, cfg)


def _as_simulated(gen, kv, row: int, ref) -> None:
    """A generation and its cache row `row` == the simulation's row: tokens, exit layers, decisions, and each
    layer's K/V up to the runner's length there (defer's last deferred positions may wait for a later flush)."""
    assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers
    assert gen.decided == ref.decided
    assert int(kv.filled[row, 0]) == ref.cache.length(0) == len(ref.sequence) - 1
    for layer in range(L):
        n = int(kv.filled[row, layer])
        assert n <= ref.cache.length(layer) and (n == ref.cache.length(layer) or gen.exit_layers[-1] < L), layer
        for got, want in (
            (kv.keys[row][layer], ref.cache.keys[layer]),
            (kv.values[row][layer], ref.cache.values[layer]),
        ):
            np.testing.assert_allclose(np.asarray(got)[0, :, :n], want[0, :, :n].numpy(), rtol=1e-4, atol=1e-4)


def test_runner_with_the_learned_signal_decides_as_torch_and_verify_is_exact(llama, probed):
    """The learned score decided in the exit graphs (the chain's bound decision, one row, device-resident, a batch)
    and under copy: the simulation's tokens, exits, decisions and K/V (the score computed by calibrate's torch code);
    verify equals full depth."""
    heads, _, folder = probed
    rt = ArtifactRuntime(folder, provider="cpu")
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, llama.adapter.dims.vocab_size, (9,), generator=g).tolist()
    scores = _simulation(llama, heads, {e: float("inf") for e in EXITS}).generate([prompt], 20)[0].values
    thresholds = {e: float(np.quantile(v, 0.6)) for e, v in scores.items()}
    ref = _simulation(llama, heads, thresholds).generate([prompt], 20)[0]
    assert any(x < L for x in ref.layers[1:]) and any(x == L for x in ref.layers[1:]), ref.layers
    runner = _run(rt, "defer", thresholds)
    _as_simulated(runner.generate([prompt])[0], runner.last_kv, 0, ref)  # the bound chain (in-graph score) decides
    resident = _run(rt, "defer", thresholds, device_resident=True).generate([prompt])[0]  # runtime/resident.py
    assert resident.token_ids == ref.tokens and resident.exit_layers == ref.layers
    other = torch.randint(3, llama.adapter.dims.vocab_size, (5,), generator=g).tolist()
    batch = _run(rt, "defer", thresholds)
    rows = batch.generate([prompt, other])  # a batch: rows decided in one graph call
    for r, want in enumerate(_simulation(llama, heads, thresholds).generate([prompt, other], 20)):
        _as_simulated(rows[r], batch.last_kv, r, want)
    full = _run(rt, "defer", {}, exits=[], new=20).generate([prompt])[0]
    verify = _run(rt, "verify", thresholds).generate([prompt])[0]
    assert verify.token_ids == full.token_ids and verify.drafted > 0
    copy = _run(rt, "copy", thresholds)
    copy_ref = _simulation(llama, heads, thresholds, "copy").generate([prompt], 20)[0]
    assert any(x < L for x in copy_ref.layers[1:]) and any(x == L for x in copy_ref.layers[1:]), copy_ref.layers
    _as_simulated(copy.generate([prompt])[0], copy.last_kv, 0, copy_ref)


def test_learned_without_probes_is_one_clear_error(llama, exported, tiny_dirs, tmp_path):
    from eectl.exits.measure import ExitScorer

    with pytest.raises(UsageError, match="needs exit probes"):
        ExitScorer(llama.adapter, EXITS, "learned", K)
    _, folder = exported["llama"]  # exported without heads: graphs without a score
    with pytest.raises(UsageError, match="needs exit probes"):
        _run(ArtifactRuntime(folder, provider="cpu"), "defer", {e: 0.0 for e in EXITS})
    old = tmp_path / "old.safetensors"
    save_heads(
        build_heads("residual-linear", llama.adapter.dims.hidden_size, EXITS, None, 0),
        make_heads_meta(llama, EXITS),
        old,
    )
    args = ["calibrate", str(tiny_dirs["llama"]), "--heads", str(old), "--signal", "learned", "--exits", "2,4"]
    result = CliRunner().invoke(app, [*args, "--tokens", "64", "--confidence", "0", "--out", str(tmp_path / "c.json")])
    assert result.exit_code != 0 and "needs exit probes" in result.output
    assert "Traceback" not in result.output


SMALL = ProbeConfig(tokens=128, steps=20, batch=32, mlp_steps=20, mlp_batch=32, top_k=K)


def test_probe_only_fits_onto_a_heads_file_from_a_cache(llama, tmp_path):
    """`train-heads --probe-only`'s library call: the probes fitted from a state cache, written beside the heads."""
    from eectl.data import load_text_data
    from eectl.heads.cached import add_probes
    from eectl.heads.state_cache import CacheSpec
    from eectl.heads.state_cache_build import build_cache
    from tests.tiny import GSM8K

    spec = CacheSpec.for_budget(EXITS, 256, 0.0, 64)
    cache = build_cache(llama, load_text_data(str(GSM8K)), spec, tmp_path / "cache", lambda n: None, lambda m: None)
    heads = tmp_path / "h.safetensors"
    save_heads(HeadStack({e: h for e, h in _heads_with_probes(llama)[1].items()}), make_heads_meta(llama, EXITS), heads)
    out = tmp_path / "h2.safetensors"
    fit = add_probes(llama, heads, cache, out, SMALL)
    again = load_heads(out, llama)
    assert fit.tokens == 128 and again.meta.probe is not None and again.meta.probe.tokens == 128
    assert all(probe_of(h) is not None for h in again.heads.values())
    fit2 = add_probes(
        llama,
        heads,
        cache,
        tmp_path / "h3.safetensors",
        SMALL,
    )
    third = load_heads(tmp_path / "h3.safetensors", llama)
    assert fit2.agreement == fit.agreement
    assert _same(probe_of(third.heads[2]), probe_of(again.heads[2]))


def test_heads_files_with_logistic_probes_of_before_load_and_score_as_then(llama, tmp_path):
    """A heads file written before MLP probes stores `weight` [H] and `coef` [3] (w_prob, w_margin, bias): it loads
    as a logistic probe scoring z . weight + w_prob * prob + w_margin * margin + bias."""
    from safetensors.torch import load_file, save_file

    H = llama.adapter.dims.hidden_size
    path = tmp_path / "old.safetensors"
    save_heads(build_heads("residual-linear", H, EXITS, None, 0), make_heads_meta(llama, EXITS), path)
    tensors = load_file(str(path))
    rng = np.random.default_rng(0)
    weight, coef = rng.standard_normal(H).astype(np.float32), np.array([2.0, -1.0, 0.5], np.float32)
    for e in EXITS:
        tensors[f"probe.exit_{e}.weight"] = torch.from_numpy(weight.copy())
        tensors[f"probe.exit_{e}.coef"] = torch.from_numpy(coef.copy())
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
        meta = f.metadata()
    save_file(tensors, str(path), metadata=meta)
    probe = probe_of(load_heads(path, llama).heads[EXITS[0]])
    z, prob, margin = rng.standard_normal((5, H)).astype(np.float32), rng.random(5), rng.random(5) * 0.3
    want = z @ weight + 2.0 * prob - 1.0 * margin + 0.5
    assert probe.hidden == 0
    np.testing.assert_allclose(probe.score(z, prob, margin), want, atol=1e-5)


def test_costs_time_the_learned_decision_as_the_runner_makes_it(probed):
    """export's cost model times each exit's decision with the learned signal (the bound chain's in-graph score)."""
    from eectl.plan.costs import measure_costs

    _, _, folder = probed
    rt = ArtifactRuntime(folder, provider="cpu")
    c = measure_costs(rt, past=8, repeats=2, warmup=0, signal="learned")
    assert c.bound_exits  # the decisions timed on the bound chain, as `eectl run` makes them
    for e in EXITS:
        assert c.candidates_ms[str(e)] > 0 and (e == EXITS[0] or c.local_ms[str(e)] > 0)
