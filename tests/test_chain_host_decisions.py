"""Exits whose graphs do not decide the run's signal (the full-vocabulary softmax and margin, the cosines) run on the
bound chain with the host deciding them (runtime/chain.py `step_exits`'s `host`, the runner's exit test). Under defer
and copy the runner gives the tokens, exit layers, decisions and KV cache of the simulation (tests/simulation.py),
greedy and sampled, gated, one row and a batch in slots, block exit heads included (their own K/V, and teacher-forced
scores); verify gives full depth's tokens (it is lossless), with drafts proposed, and leaves the full model's cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eectl.exits.signals import get_signal
from eectl.runtime import chain_steps
from eectl.runtime.chain import chain_exits_supported
from eectl.runtime.runner import Runner
from eectl.runtime.state import RunConfig
from tests.simulation import Row, Simulation, assert_cache
from tests.test_block_exits import block_artifacts  # noqa: F401 (the fixture)
from tests.test_resident import _config, _prompts, _simulation, _thresholds, runtimes  # noqa: F401 (the fixture)

SIGNALS = ["full-prob", "full-margin", "cosine", "cosine-min"]


def _generate(rt, cfg, prompts, monkeypatch, slots=None, gates=None):
    """Generate on a fresh runner (its gates `gates`); returns the generations, the runner, and per step of the chain
    with exits (chain_rows.py `rows_step`) its rows and whether the host decided its exits."""
    steps: list[tuple[int, bool]] = []
    real = chain_steps.rows_step

    def counted(runner, chain, one, live, *a, **kw):
        steps.append((len(live), not chain.in_graph))
        return real(runner, chain, one, live, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(chain_steps, "rows_step", counted)
        runner = Runner(rt, cfg)
        if gates is not None:
            runner.gates = gates
        got = runner.generate(prompts, slots=slots)
    return got, runner, steps


def _same_kv(rt, kv, refs: list[Row], spare: int = 0) -> None:
    """Each row of the runner's cache that holds positions holds one simulation row's K/V, layer 0 every position
    the simulation fed (with fewer slots than prompts a row holds the last prompt seated there: it is found by its
    positions' layer-0 keys). `spare`: the simulation ran that many positions further (verify's last check may have
    fed the last token)."""
    matched: list[int] = []
    for row in range(kv.filled.shape[0]):
        n = int(kv.filled[row, 0])
        if n == 0:
            continue
        keys = np.asarray(kv.keys[row][0])[0, :, :n]
        same = [
            i
            for i, ref in enumerate(refs)
            if i not in matched
            and ref.cache.length(0) - spare <= n <= ref.cache.length(0)
            and np.allclose(keys, ref.cache.keys[0][0, :, :n].numpy(), rtol=1e-4, atol=1e-4)
        ]
        assert len(same) == 1, (row, kv.filled[row], [r.cache.length(0) for r in refs], same)
        assert_cache(kv, row, refs[same[0]], rt.manifest, fed=spare == 0)
        matched.append(same[0])
    assert matched


def _same_as_simulation(rt, got, kv, want: list[Row]) -> None:
    assert [g.token_ids for g in got] == [w.tokens for w in want]
    assert [g.exit_layers for g in got] == [w.layers for w in want]
    assert [g.decided for g in got] == [w.decided for w in want]
    _same_kv(rt, kv, want)


def _same_as_full_depth(rt, got, kv, exact: Simulation, prompts, new: int, slots=None) -> None:
    """verify: full depth's tokens (a runner without exits), drafts proposed, and the full model's cache (`exact`:
    a simulation where nothing exits)."""
    full = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=new)).generate(prompts, slots=slots)
    want = exact.generate(prompts, new + 1, slots=slots)  # one token further: the cache holds the last one's position
    assert [w.tokens[:new] for w in want] == [f.token_ids for f in full]
    assert [g.token_ids for g in got] == [f.token_ids for f in full]
    assert sum(g.drafted for g in got) > 0  # the exits proposed drafts: a real comparison
    _same_kv(rt, kv, want, spare=1)


def _never(signal: str, exits) -> dict:
    return {e: {get_signal(signal).criteria[0]: float("inf")} for e in exits}


@pytest.mark.parametrize("signal", SIGNALS)
@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_host_decided_exits_on_the_chain_equal_the_simulation(runtimes, signal, policy, monkeypatch):  # noqa: F811
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 2)[1:]  # one row: 7 tokens
    thresholds = _thresholds(loaded, signal, prompts)
    cfg = _config(signal, policy, thresholds, False, new=20)
    assert chain_exits_supported(rt, cfg.exits, get_signal(signal))
    got, runner, steps = _generate(rt, cfg, prompts, monkeypatch)
    kv = runner.last_kv
    assert steps and all(host for _, host in steps)  # every step on the chain, its exits decided on the host
    if policy == "verify":
        exact = _simulation(loaded, signal, "defer", _never(signal, cfg.exits))
        _same_as_full_depth(rt, got, kv, exact, prompts, 20)
        return
    want = _simulation(loaded, signal, policy, thresholds).generate(prompts, 20)
    L = rt.manifest.num_layers
    assert any(e < L for e in want[0].layers[1:]), want[0].layers  # some tokens exit: a real comparison
    _same_as_simulation(rt, got, kv, want)


def test_sampled_and_gated_host_decisions_on_the_chain_equal_the_simulation(runtimes, monkeypatch):  # noqa: F811
    loaded, rt = runtimes["qwen3"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 2)[1:]
    thresholds = _thresholds(loaded, "full-prob", prompts)
    H = rt.manifest.dims["hidden_size"]
    w = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    L = rt.manifest.num_layers
    for sampled, gated in ((True, False), (False, True)):
        cfg = dataclasses.replace(_config("full-prob", "defer", thresholds, False, new=20), temperature=0.8 * sampled)
        gates = {2: (w, 0.0, 0.0)} if gated else None  # exit 2's gate opens for some tokens only
        got, runner, steps = _generate(rt, cfg, prompts, monkeypatch, gates=gates)
        kv = runner.last_kv
        assert steps and all(host for _, host in steps)
        sim = _simulation(
            loaded, "full-prob", "defer", thresholds, gates=gates, temperature=cfg.temperature, seed=cfg.seed
        )
        want = sim.generate(prompts, 20)
        assert any(e < L for e in want[0].layers[1:]), (sampled, gated)
        if gated:  # exit 2 decided the tokens its gate opened for, not every decode step's
            assert 0 < want[0].decided.get(2, 0) < len(want[0].tokens) - 1, want[0].decided
        _same_as_simulation(rt, got, kv, want)


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_block_exit_heads_on_the_chain_equal_the_simulation(block_artifacts, policy, monkeypatch):  # noqa: F811
    """Block exit heads (runtime/blocks.py) run on the chain after their segment, wide where it runs wide, their own
    K/V advancing with it: the simulation's tokens, exit layers, decisions, KV cache (the blocks' slots included) and
    teacher-forced scores; verify's tokens are full depth's and its cache (the blocks' too) the exact one."""
    from tests.test_block_exits import EXITS, K, _prompt, _runner
    from tests.test_block_exits import _thresholds as block_thresholds

    loaded, heads, rt = block_artifacts["llama"]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    floats = block_thresholds(loaded.adapter, heads, prompt)
    thresholds = {e: {"prob": t} for e, t in floats.items()}
    assert chain_exits_supported(rt, EXITS, get_signal("topk-prob")) and set(EXITS) <= set(rt.block_graphs)
    cfg = _runner(rt, policy, floats).cfg
    got, runner, steps = _generate(rt, cfg, [prompt], monkeypatch)
    kv = runner.last_kv
    assert steps  # the chain stepped with the exits
    sim = lambda pol, thr: Simulation(loaded.adapter, EXITS, thr, policy=pol, top_k=K, cuts=EXITS, heads=heads)  # noqa: E731
    if policy == "verify":
        _same_as_full_depth(rt, got, kv, sim("defer", _never("topk-prob", EXITS)), [prompt], cfg.max_new_tokens)
        return
    reference = sim(policy, thresholds)
    want = reference.generate([prompt], cfg.max_new_tokens)
    assert len(set(want[0].layers[1:])) >= 2, want[0].layers  # some tokens exit, some do not
    _same_as_simulation(rt, got, kv, want)
    ids = prompt + got[0].token_ids
    scored = Runner(rt, cfg).score_many([(ids, len(prompt))])[0]
    forced = reference.score(ids, len(prompt))
    assert scored.layers == forced.layers and scored.greedy == forced.greedy
    assert len(set(forced.layers)) >= 2, forced.layers
    np.testing.assert_allclose(scored.nll, forced.nll, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_block_exit_heads_under_a_cached_prompt_prefix(block_artifacts, policy):  # noqa: F811
    """A prompt fed after the prefix its slot's cache holds (runtime/slots.py `reused`) with block exit heads active
    on the chain: the blocks' own K/V for the prefix are the cache's too, so the tokens, exit layers and every slot's
    K/V (the blocks' included) equal the prompt's fed whole by a fresh runner."""
    from tests.test_block_exits import _prompt, _runner
    from tests.test_block_exits import _thresholds as block_thresholds

    loaded, heads, rt = block_artifacts["llama"]
    V = loaded.adapter.dims.vocab_size
    header = _prompt(5, 12, V)
    prompts = [header + _prompt(6, 4, V), header + _prompt(7, 6, V)]
    thresholds = block_thresholds(loaded.adapter, heads, prompts[1], new=12)  # some of its tokens exit
    one = _runner(rt, policy, thresholds, new=12)
    got = [one.generate([p])[0] for p in prompts]
    assert got[1].reused >= len(header) - 1, got[1].reused  # the second prompt was fed after the cached header
    fresh = _runner(rt, policy, thresholds, new=12)
    want = fresh.generate([prompts[1]])[0]
    assert got[1].token_ids == want.token_ids and got[1].exit_layers == want.exit_layers
    assert len(set(want.exit_layers[1:])) >= 2 or want.drafted, want.exit_layers
    kv, kv_fresh = one.last_kv, fresh.last_kv
    assert kv is not None and kv_fresh is not None and (kv.filled[0] == kv_fresh.filled[0]).all()
    n = int(kv.filled[0].min())
    for mine, other in zip(kv.batch_keys + kv.batch_values, kv_fresh.batch_keys + kv_fresh.batch_values, strict=True):
        np.testing.assert_array_equal(mine[0, :, :n], other[0, :, :n])


@pytest.mark.parametrize("signal", ["topk-prob", "full-prob", "cosine-min"])
@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_a_batch_with_exits_steps_on_the_chain_as_in_the_simulation(runtimes, signal, policy, monkeypatch):  # noqa: F811
    """A batch's steps with exits (runtime/chain_rows.py: per segment, the one-position rows in the batch chain's
    bound call, the wide rows on their slots' chains; one decision per exit, in the graphs or on the host): 5
    prompts in 3 slots (rows join freed slots), greedy, then sampled and gated. The chain steps the rows together, and
    gives the simulation's tokens, exit layers, decisions and KV cache in the same slots (verify: full depth's tokens
    and the full model's cache)."""
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 5)
    thresholds = _thresholds(loaded, signal, prompts[1:2])
    H = rt.manifest.dims["hidden_size"]
    w = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    L = rt.manifest.num_layers
    for sampled, gated in ((False, False), (True, False), (False, True)):
        if sampled and policy == "verify":
            continue  # greedy only
        cfg = dataclasses.replace(_config(signal, policy, thresholds, False, new=16), temperature=0.8 * sampled)
        gates = {2: (w, 0.0, 0.0)} if gated else None  # exit 2's gate opens for some tokens only
        got, runner, steps = _generate(rt, cfg, prompts, monkeypatch, slots=3, gates=gates)
        kv = runner.last_kv
        assert max(rows for rows, _ in steps) > 1, (sampled, gated)  # the chain stepped rows together
        if signal == "topk-prob" and not sampled:  # each decision's flags and tokens read, recorded
            assert any(key == "passed" for step in runner.step_reads for _, _, key in step)
        if policy == "verify":
            exact = _simulation(loaded, signal, "defer", _never(signal, cfg.exits))
            _same_as_full_depth(rt, got, kv, exact, prompts, 16, slots=3)
            continue
        sim = _simulation(loaded, signal, policy, thresholds, gates=gates, temperature=cfg.temperature, seed=cfg.seed)
        want = sim.generate(prompts, 16, slots=3)
        assert any(e < L for row in want for e in row.layers[1:]), (sampled, gated)
        _same_as_simulation(rt, got, kv, want)
