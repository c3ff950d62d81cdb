"""Exits whose graphs do not decide the run's signal (the full-vocabulary softmax and margin, the cosines) run on the
bound chain with the host deciding them (runtime/chain.py `step_exits`'s `host`, the runner's exit test): the same
tokens, exit layers, drafts and KV cache as the general path, greedy and sampled, gated, every policy the chain
takes, block exit heads included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eectl.exits.signals import get_signal
from eectl.runtime.chain import chain_exits_supported
from eectl.runtime.runner import Runner
from tests.test_block_exits import block_artifacts  # noqa: F401 (the fixture)
from tests.test_resident import _config, _prompts, _thresholds, runtimes  # noqa: F401 (the fixture)

SIGNALS = ["full-prob", "full-margin", "cosine", "cosine-min"]


def _generate(rt, cfg, prompts, monkeypatch):
    """Generate; returns the generations, the last cache, and how many steps the general path and the chain's host
    decisions took."""
    from eectl.runtime import chain_steps

    general, host = [], []
    real_steps, real_exits = Runner._steps, chain_steps.rows_step

    def steps(self, kv, work, *a):
        general.append(len(work))
        return real_steps(self, kv, work, *a)

    def exits(runner, chain, *a, **kw):
        host.append(not chain.in_graph)
        return real_exits(runner, chain, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(Runner, "_steps", steps)
        m.setattr(chain_steps, "rows_step", exits)
        runner = Runner(rt, cfg)
        got = runner.generate(prompts)
    return got, runner.last_kv, general, host


@pytest.mark.parametrize("signal", SIGNALS)
@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_host_decided_exits_on_the_chain_equal_the_general_path(runtimes, signal, policy, monkeypatch):  # noqa: F811
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 2)[1:]  # one row: 7 tokens
    thresholds = _thresholds(rt, signal, prompts, monkeypatch)
    cfg = _config(signal, policy, thresholds, False, new=20)
    assert chain_exits_supported(rt, cfg.exits, get_signal(signal))
    plain, kv_plain, _, _ = _generate(rt, dataclasses.replace(cfg, bound=False), prompts, monkeypatch)
    got, kv, general, host = _generate(rt, cfg, prompts, monkeypatch)
    assert general == [] and host and all(host)  # every step on the chain, its exits decided on the host
    L = rt.manifest.num_layers
    exited = any(e < L for e in plain[0].exit_layers[1:])
    assert exited or plain[0].drafted, plain[0].exit_layers  # some tokens exit: a real comparison
    assert got[0].token_ids == plain[0].token_ids and got[0].exit_layers == plain[0].exit_layers
    assert (got[0].drafted, got[0].rejected_drafts) == (plain[0].drafted, plain[0].rejected_drafts)
    assert got[0].decided == plain[0].decided
    assert (kv.filled == kv_plain.filled).all()
    n = int(kv.filled[0].min())
    for mine, other in zip(kv.batch_keys + kv.batch_values, kv_plain.batch_keys + kv_plain.batch_values, strict=True):
        assert (mine[:, :, :n] == other[:, :, :n]).all()


def test_sampled_and_gated_host_decisions_on_the_chain_equal_the_general_path(runtimes, monkeypatch):  # noqa: F811
    loaded, rt = runtimes["qwen3"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 2)[1:]
    thresholds = _thresholds(rt, "full-prob", prompts, monkeypatch)
    H = rt.manifest.dims["hidden_size"]
    w = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    for sampled, gated in ((True, False), (False, True)):
        cfg = dataclasses.replace(_config("full-prob", "defer", thresholds, False, new=20), temperature=0.8 * sampled)
        runs = []
        for bound in (True, False):
            runner = Runner(rt, dataclasses.replace(cfg, bound=bound))
            if gated:  # exit 2's gate opens for some tokens only: exit 4 picks the candidates of the others
                runner.gates = {2: (w, 0.0, 0.0)}
            runs.append(runner.generate(prompts)[0])
        got, plain = runs
        assert got.token_ids == plain.token_ids and got.exit_layers == plain.exit_layers, (sampled, gated)
        assert got.decided == plain.decided, (sampled, gated)
        assert any(e < rt.manifest.num_layers for e in plain.exit_layers[1:]), (sampled, gated)


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_block_exit_heads_on_the_chain_equal_the_general_path(block_artifacts, policy, monkeypatch):  # noqa: F811
    """Block exit heads (runtime/blocks.py) run on the chain after their segment, wide where it runs wide, their own
    K/V advancing with it: every step on the chain, the same tokens, exit layers, KV cache (the blocks' slots
    included) and teacher-forced scores as the general path."""
    from tests.test_block_exits import EXITS, _prompt, _runner, _thresholds

    loaded, heads, rt = block_artifacts["llama"]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    thresholds = _thresholds(loaded.adapter, heads, prompt)
    assert chain_exits_supported(rt, EXITS, get_signal("topk-prob")) and set(EXITS) <= set(rt.block_graphs)
    runs = []
    for bound in (True, False):
        cfg = dataclasses.replace(_runner(rt, policy, thresholds).cfg, bound=bound)
        got, kv, general, host = _generate(rt, cfg, [prompt], monkeypatch)
        texts = [(prompt + got[0].token_ids, len(prompt))]
        scored = Runner(rt, cfg).score_many(texts)[0] if policy != "verify" else None  # verify: full depth's
        runs.append((got[0], kv, general, scored))
    (gen, kv, general, scored), (plain, kv_plain, plain_steps, plain_scored) = runs
    assert general == [] and plain_steps  # the chain took every step of the first run, the general path the second's
    assert gen.token_ids == plain.token_ids and gen.exit_layers == plain.exit_layers
    assert len(set(plain.exit_layers[1:])) >= 2 or plain.drafted, plain.exit_layers
    assert (kv.filled == kv_plain.filled).all()
    for mine, other in zip(kv.batch_keys + kv.batch_values, kv_plain.batch_keys + kv_plain.batch_values, strict=True):
        n = int(kv.filled[0].min())
        assert (mine[:, :, :n] == other[:, :, :n]).all()
    if scored is not None and plain_scored is not None:
        assert scored.layers == plain_scored.layers and scored.greedy == plain_scored.greedy
        np.testing.assert_allclose(scored.nll, plain_scored.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_block_exit_heads_under_a_cached_prompt_prefix(block_artifacts, policy):  # noqa: F811
    """A prompt fed after the prefix its slot's cache holds (runtime/slots.py `reused`) with block exit heads active
    on the chain: the blocks' own K/V for the prefix are the cache's too, so the tokens, exit layers and every slot's
    K/V (the blocks' included) equal the prompt's fed whole by a fresh runner."""
    from tests.test_block_exits import _prompt, _runner, _thresholds

    loaded, heads, rt = block_artifacts["llama"]
    V = loaded.adapter.dims.vocab_size
    header = _prompt(5, 12, V)
    prompts = [header + _prompt(6, 4, V), header + _prompt(7, 6, V)]
    thresholds = _thresholds(loaded.adapter, heads, prompts[1], new=12)  # some of its tokens exit
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


def _counting_general_steps(monkeypatch) -> list[int]:
    """The rows of each step the general path (`Runner._steps`) takes from now on, in the returned list."""
    general: list[int] = []
    real = Runner._steps

    def steps(self, kv, work, *a):
        general.append(len(work))
        return real(self, kv, work, *a)

    monkeypatch.setattr(Runner, "_steps", steps)
    return general


def _same_batches(got, kv, plain, kv_plain):
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    assert [g.exit_layers for g in got] == [p.exit_layers for p in plain]
    assert [g.decided for g in got] == [p.decided for p in plain]
    assert [(g.drafted, g.rejected_drafts) for g in got] == [(p.drafted, p.rejected_drafts) for p in plain]
    assert (kv.filled == kv_plain.filled).all()
    n = int(kv.filled.min())
    for mine, other in zip(kv.batch_keys + kv.batch_values, kv_plain.batch_keys + kv_plain.batch_values, strict=True):
        assert (mine[:, :, :n] == other[:, :, :n]).all()


@pytest.mark.parametrize("signal", ["topk-prob", "full-prob", "cosine-min"])
@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_a_batch_with_exits_steps_on_the_chain_as_on_the_general_path(runtimes, signal, policy, monkeypatch):  # noqa: F811
    """A batch's steps with exits (runtime/chain_rows.py: per segment, the one-position rows in the batch chain's
    bound call, the wide rows on their slots' chains; one decision per exit, in the graphs or on the host): 5
    prompts in 3 slots (rows join freed slots), greedy, then sampled and gated. Every step on the chain, and the
    same tokens, exit layers, decisions, drafts and KV cache as the general path."""
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 5)
    thresholds = _thresholds(rt, signal, prompts[1:2], monkeypatch)
    H = rt.manifest.dims["hidden_size"]
    w = np.random.default_rng(3).standard_normal(H).astype(np.float32)
    general = _counting_general_steps(monkeypatch)
    for sampled, gated in ((False, False), (True, False), (False, True)):
        if sampled and policy == "verify":
            continue  # greedy only
        cfg = dataclasses.replace(_config(signal, policy, thresholds, False, new=16), temperature=0.8 * sampled)
        runs = []
        for bound in (True, False):
            general.clear()
            runner = Runner(rt, dataclasses.replace(cfg, bound=bound))
            if gated:  # exit 2's gate opens for some tokens only: exit 4 picks the candidates of the others
                runner.gates = {2: (w, 0.0, 0.0)}
            runs.append((runner.generate(prompts, slots=3), runner.last_kv, list(general)))
            if bound and signal == "topk-prob" and not sampled:  # each decision's flags and tokens read, recorded
                assert any(key == "passed" for step in runner.step_reads for _, _, key in step)
        (got, kv, chain_steps), (plain, kv_plain, plain_steps) = runs
        assert chain_steps == [] and max(plain_steps) > 1, (sampled, gated)  # the chain took every step, batched
        assert any(e < rt.manifest.num_layers for p in plain for e in p.exit_layers[1:]), (sampled, gated)
        _same_batches(got, kv, plain, kv_plain)
