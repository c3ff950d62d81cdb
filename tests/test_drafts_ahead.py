"""Drafts that run ahead (runtime/ahead.py): verify's first exit drafting while the product of its top-1
probabilities holds, checked by the deep pass. On every tiny family the output equals full depth token for token, a
rollback leaves the K/V of full depth, the runs' lengths follow the drafter's confidence; the traces the plan
replays are the run's own decisions."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eectl.errors import UsageError
from eectl.runtime import ahead
from eectl.runtime.ahead import top1, traces
from eectl.runtime.kv import KVBuffers
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.tiny import random_ids as _ids

K = 8


@pytest.fixture(scope="module")
def artifacts(exported):
    return {fam: ArtifactRuntime(art, provider="cpu") for fam, (_, art) in exported.items()}


def _config(bound=0.0, exits=(2,), new=32, block=8, policy="verify", stop=()) -> RunConfig:
    return RunConfig(
        exits=list(exits),
        thresholds={e: {"prob": 2.0} for e in exits},  # the exits' own tests never pass: only the drafter drafts
        policy=policy,
        top_k=K,
        max_new_tokens=new,
        draft_ahead=bound,
        verify_block=block,
        stop_ids=tuple(stop),
    )


@pytest.fixture
def runs(monkeypatch):
    """Every decision the drafter made, as (row's product before, probability, drafted)."""
    seen: list[tuple[float, float, bool]] = []
    real = ahead.ahead_token

    def spy(rt, config, st, layer, hidden):
        before = st.ahead
        token = real(rt, config, st, layer, hidden)
        _, logits = rt.exit_candidates(layer, hidden, config.top_k)
        seen.append((before, top1(logits[0])[1], token is not None))
        return token

    monkeypatch.setattr("eectl.runtime.policies.ahead_token", spy)
    return seen


def _lengths(seen: list[tuple[float, float, bool]]) -> list[int]:
    """The runs' draft counts: a run ends at the first decision that does not draft."""
    out, n = [], 0
    for _, _, drafted in seen:
        if drafted:
            n += 1
        else:
            out.append(n)
            n = 0
    return out


def test_top1_is_the_softmax_of_the_largest():
    i, p = top1(np.array([1.0, 3.0, 2.0]))
    assert i == 1
    assert p == pytest.approx(np.exp(3.0) / np.exp([1.0, 3.0, 2.0]).sum())


@pytest.mark.parametrize("bound", [0.9, 0.3, 0.02])
def test_drafts_ahead_equal_full_depth(artifacts, family, runs, bound):
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompts = [_ids(s, 10, V) for s in (1, 2)]
    want = [g.token_ids for g in Runner(rt, _config(exits=())).generate(prompts)]
    for p, w in zip(prompts, want, strict=True):
        got = Runner(rt, _config(bound)).generate([p])[0]
        assert got.token_ids == w
        assert len(got.exit_layers) == len(got.latencies_s) == len(w) == 32
    assert runs
    # the rule: a token drafts exactly where the run's product with its probability stays at or above the bound
    assert all(drafted == (before * p >= bound) for before, p, drafted in runs)


def test_the_draft_length_follows_the_drafters_confidence(artifacts, family, runs):
    """At a bound between the products of two of the exit's probabilities along the answer (their median), runs of
    one draft and of two occur in one generation, each ended by a product below the bound; a bound of 1 drafts
    nothing the exit is not certain of."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _ids(3, 10, V)
    answer = Runner(rt, _config(exits=(), new=48)).generate([prompt])[0].token_ids
    (probs, _), *_ = traces(rt, 2, [(prompt, answer)], K)
    pairs = np.array(probs[:-1]) * np.array(probs[1:])
    bound = float(np.median(pairs))
    got = Runner(rt, _config(bound, new=48)).generate([prompt])[0]
    assert got.token_ids == answer
    lengths = _lengths(runs)
    assert got.drafted == sum(1 for *_, d in runs if d)
    assert {1, 2} <= set(lengths), lengths  # the length varies with confidence
    assert all(before * p < bound for before, p, drafted in runs if not drafted)
    runs.clear()
    none = Runner(rt, _config(1.0, new=24)).generate([prompt])[0]
    assert none.drafted == sum(1 for *_, d in runs if d) and all(p >= 1.0 for _, p, d in runs if d)


def test_a_rollback_restores_the_full_depth_kv(artifacts, family, monkeypatch):
    """Every rollback under a run ahead leaves every layer's K/V (exit block heads' too) those of full depth up to
    the position it rolls back to, and no layer longer; at the end the cache is full depth's."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _ids(4, 10, V)
    full = Runner(rt, _config(exits=(), new=40))
    want = full.generate([prompt])[0].token_ids
    ref = full.last_kv
    checked: list[int] = []
    real = KVBuffers.rollback

    def spy(self, row, pos):
        real(self, row, pos)
        assert int(self.filled[row].max()) <= pos
        for slot in range(self.filled.shape[1]):
            n = int(self.filled[row, slot])
            for mine, other in ((self.keys, ref.keys), (self.values, ref.values)):
                a, b = np.asarray(mine[row][slot])[0, :, :n], np.asarray(other[0][slot])[0, :, :n]
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        checked.append(pos)

    monkeypatch.setattr(KVBuffers, "rollback", spy)
    runner = Runner(rt, _config(0.02, new=40))
    got = runner.generate([prompt])[0]
    assert got.token_ids == want
    assert checked and got.rejected_drafts > 0, "no draft was rolled back"
    kv = runner.last_kv
    for slot in range(kv.filled.shape[1]):
        n = int(min(kv.filled[0, slot], ref.filled[0, slot]))
        np.testing.assert_allclose(
            np.asarray(kv.keys[0][slot])[0, :, :n], np.asarray(ref.keys[0][slot])[0, :, :n], rtol=1e-4, atol=1e-4
        )


def test_stop_tokens_and_batches_stay_full_depths(artifacts, family):
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompts = [_ids(s, 9, V) for s in (5, 6, 7)]
    want = Runner(rt, _config(exits=(), new=24)).generate(prompts)
    stop = (want[0].token_ids[5],)
    want_stop = Runner(rt, _config(exits=(), new=24, stop=stop)).generate(prompts[:1])[0].token_ids
    assert Runner(rt, _config(0.05, new=24, stop=stop)).generate(prompts[:1])[0].token_ids == want_stop
    got = Runner(rt, _config(0.05, new=24)).generate(prompts, slots=2)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]


def test_traces_are_the_runs_own_decisions(artifacts, family, runs):
    """The traces the plan replays (the exit's probability and correctness by position, read from one prompt call)
    give the run's probabilities on the accepted path: a run at bound 0 (every token a draft up to the block) sees
    the probability the trace has at each position it drafts from the answer's own prefix."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _ids(8, 10, V)
    answer = Runner(rt, _config(exits=(), new=20)).generate([prompt])[0].token_ids
    (probs, right), *_ = traces(rt, 2, [(prompt, answer)], K)
    assert len(probs) == len(right) == 19
    # the first decision: the step that feeds answer[0]
    Runner(rt, _config(1e-9, new=20, block=1)).generate([prompt])
    assert runs[0][1] == pytest.approx(probs[0], abs=1e-4)
    cand, logits = rt.exit_candidates(2, np.zeros((1, rt.manifest.dims["hidden_size"]), np.float32), K)
    assert cand.shape == logits.shape == (1, K)


def test_bad_settings_are_refused(artifacts):
    rt = artifacts["llama"]
    with pytest.raises(UsageError, match="draft-ahead"):
        Runner(rt, _config(1.5))
    with pytest.raises(UsageError, match="draft-ahead"):
        Runner(rt, _config(0.5, policy="defer"))
    with pytest.raises(UsageError, match="exits"):
        Runner(rt, _config(0.5, exits=()))


@pytest.mark.parametrize("bound", ["median", 1e-9])
def test_the_plans_replay_is_what_the_run_checks(artifacts, family, monkeypatch, bound):
    """plan/ahead.py's replay on the traces gives the run's own cycles: per check pass the drafts kept, and the drafts
    checked wherever the run kept them all (its states on the answer's path), but for the last cycle (the length
    limit ends it)."""
    from eectl.plan.ahead import replay_ahead
    from eectl.runtime.policies import Verify

    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _ids(10, 10, V)
    answer = Runner(rt, _config(exits=(), new=40)).generate([prompt])[0].token_ids
    (probs, right), *_ = traces(rt, 2, [(prompt, answer)], K)
    b = float(np.median(np.array(probs[:-1]) * np.array(probs[1:]))) if bound == "median" else bound
    seen: list[tuple[int, int]] = []
    real = Verify.on_final

    def spy(self, row, st, kv, out, *, place):
        drafts = list(st.drafts)
        token = real(self, row, st, kv, out, place=place)
        if drafts:
            seen.append((len(drafts), sum(1 for pos, _ in drafts if pos < len(st.tokens))))
        return token

    monkeypatch.setattr(Verify, "on_final", spy)
    got = Runner(rt, _config(b, new=40, block=3)).generate([prompt])[0]
    assert got.token_ids == answer
    want = [c for c in replay_ahead(probs, right, b, block=3) if c[0]]  # cycles without drafts check nothing
    assert seen and [a for _, a in seen[:-1]] == [c.kept for c in want[: len(seen) - 1]]
    assert all(k == c.drafts for (k, a), c in zip(seen[:-1], want, strict=False) if a == k)


def test_the_replay_makes_the_runs_passes_and_tokens(artifacts, family, monkeypatch):
    """At a bound of ~0 the drafter drafts wherever the block lets it (on the answer's path or past a wrong draft),
    so a run's cycles are the replay's: a run of n tokens (n = 2..16) makes exactly the replay's passes on the trace
    cut at n - 1 positions and decodes the replay's tokens, n - 1, among them the runs whose last drafts are right
    up to the n-th token (the closing pass emits nothing: runner.py `_settled`). Exit 4 drafts (of the tiny models'
    two, the one right more often), on the prompt where it is right most."""
    from eectl.plan.ahead import replay_ahead
    from eectl.runtime import runner as runner_module

    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    traced = []
    for seed in (1, 2, 3, 4, 5):
        prompt = _ids(seed, 10, V)
        answer = Runner(rt, _config(exits=(), new=16)).generate([prompt])[0].token_ids
        (probs, right), *_ = traces(rt, 4, [(prompt, answer)], K)
        traced.append((sum(right), prompt, answer, probs, right))
    _, prompt, answer, probs, right = max(traced, key=lambda t: t[0])
    passes = [0]

    def counted(real):
        def call(*args, **kw):
            passes[0] += 1
            return real(*args, **kw)

        return call

    for name in ("chain_tokens", "chain_step"):  # a step's pass; the closing pass at the end
        monkeypatch.setattr(runner_module, name, counted(getattr(runner_module, name)))
    closing = 0
    for n in range(2, 17):
        passes[0] = 0
        got = Runner(rt, _config(1e-9, exits=(4,), new=n, block=3)).generate([prompt])[0]
        assert got.token_ids == answer[:n]
        cycles = replay_ahead(probs[: n - 1], right[: n - 1], 1e-9, block=3)
        assert passes[0] - 1 == sum(c.drafts + 1 for c in cycles)  # the prompt's pass aside
        assert sum(c.tokens for c in cycles) == len(got.token_ids) - 1 == n - 1
        closing += cycles[-1].kept == cycles[-1].drafts > 0  # right up to the end: no check token
    assert closing > 0, "no run ended on right drafts"


def test_bench_runs_the_ahead_configuration_at_its_price(exported):
    """bench's `ahead` row: replayed on prompts it does not time, priced; where its drafts cannot pay (a random
    tiny model's exit is rarely right) it runs full depth and says why; a pinned bound runs the drafter, and its
    tokens are full depth's."""
    from eectl.data import load_text_data
    from eectl.evaluate.bench import run_bench
    from eectl.evaluate.results import BenchOptions
    from tests.tiny import GSM8K

    prompts = load_text_data(str(GSM8K)).prompts
    opts = BenchOptions(
        configs=["full", "ahead"], prompts=2, max_new_tokens=10, reps=1, ppl_tokens=0, sweep=[], provider="cpu",
        raw=True, ahead_prompts=prompts[2:5],
    )  # fmt: skip
    art = exported["llama"][1]
    res = run_bench(art, prompts, opts)
    row = {c.name: c for c in res.configs}["ahead"]
    assert row.exits == [] and "full depth" in row.note and "replayed on 3 prompts" in row.note
    assert row.predicted_speedup == 1.0
    pinned = {c.name: c for c in run_bench(art, prompts, replace(opts, draft_ahead=1e-6)).configs}["ahead"]
    assert pinned.exits in ([2], [4]) and "pinned by --draft-ahead: " in pinned.note and "bound 1e-06" in pinned.note
    assert pinned.token_agreement == 1.0 and pinned.drafted > 0
    assert pinned.predicted_speedup is not None and pinned.predicted_speedup > 0
    with pytest.raises(UsageError, match="replays"):
        run_bench(art, prompts, replace(opts, ahead_prompts=[]))


def test_eectl_run_drafts_ahead_with_full_depths_tokens(exported):
    """`eectl run --draft-ahead`: verify at the first of --exits drafting ahead gives full depth's tokens; a policy
    without verify's check, or a bound outside (0, 1], is a one-line error."""
    import json

    from typer.testing import CliRunner

    from eectl.cli import app

    art = str(exported["llama"][1])
    base = ["run", art, "hello there", "-n", "16", "--json", "--threads", "1"]
    full = CliRunner().invoke(app, [*base, "--exits", "none"])
    ahead = CliRunner().invoke(
        app, [*base, "--exits", "2", "--thresholds", "1.0", "--policy", "verify", "--draft-ahead", "0.01"]
    )
    assert full.exit_code == 0 and ahead.exit_code == 0, ahead.output
    got, want = (json.loads(r.stdout)["results"][0] for r in (ahead, full))
    assert got["token_ids"] == want["token_ids"] and 2 in got["exit_layers"]
    for bad in (["--policy", "defer", "--draft-ahead", "0.5"], ["--policy", "verify", "--draft-ahead", "2"]):
        res = CliRunner().invoke(app, ["run", art, "hello", "-n", "4", "--exits", "2", "--thresholds", "1.0", *bad])
        assert res.exit_code != 0 and "--draft-ahead" in res.stderr and len(res.stderr.strip().splitlines()) <= 2
