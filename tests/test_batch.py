"""Batched segment calls equal single-row calls: rows of different lengths share one call (per-row seqlens_k),
rows that sit out a call keep their K/V and length, single-row chunks run on a row's view of the batch buffers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.batch import new_batch_kv, prefill_runs, run_prefill
from eectl.runtime.ort import cuda_usable
from eectl.runtime.sessions import ArtifactRuntime
from tests.simulation import assert_cache

ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_dirs):
    """family -> the torch model (loaded on first use): the simulation's (tests/simulation.py)."""
    loaded: dict = {}

    class Models:
        def __getitem__(self, fam):
            if fam not in loaded:
                loaded[fam] = load_model(str(tiny_dirs[fam]))
            return loaded[fam]

    return Models()


@pytest.fixture(scope="module")
def runtimes(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-artifacts")
    out = {}
    for fam, folder in tiny_dirs.items():
        export_artifact(load_model(str(folder)), root / fam, ExportOptions(exits=[2, 4], top_k=8, validate=False))
        out[fam] = ArtifactRuntime(root / fam, provider="cpu")
    return out


def _prompts_on_rows(rt, kv, rows: dict[int, np.ndarray]) -> None:
    """Each row's prompt (token ids) through every segment on the row's view of the buffers (single-row calls)."""
    for r, ids in rows.items():
        h = rt.embed(ids[None])
        for s in range(len(rt.manifest.segments)):
            h = rt.run_segment(s, h, kv, row=r)[0]


def _same_rows(kv, alone) -> None:
    """Row r of the batch buffers holds what the one-row buffers alone[r] hold, at every layer."""
    for r, one in enumerate(alone):
        assert (kv.filled[r] == one.filled[0]).all(), (r, kv.filled[r], one.filled[0])
        for layer in range(len(kv.batch_keys)):
            n = int(kv.filled[r, layer])
            for mine, theirs in ((kv.batch_keys, one.batch_keys), (kv.batch_values, one.batch_values)):
                np.testing.assert_allclose(mine[layer][r, :, :n], theirs[layer][0, :, :n], atol=ATOL)


def test_batched_rows_equal_rows_alone(runtimes, family):
    """Prompts of different lengths on the rows of a batch (single-row calls on the batch buffers), then decode steps
    with some rows sitting out on the batch's bound chain (one call per graph, per-row lengths, idle rows writing only
    their scratch slot): every row's tokens and K/V equal its own one-row chain's; sliding windows (mistral, gemma3)
    are crossed."""
    from eectl.runtime.chain import DecodeChain

    rt = runtimes[family]
    V = rt.manifest.dims["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = {r: rng.integers(3, V, n) for r, n in enumerate([5, 19, 2, 11])}
    B, steps = len(prompts), 9
    kv = new_batch_kv(rt, B, 32)
    alone = [new_batch_kv(rt, 1, 32) for _ in range(B)]
    _prompts_on_rows(rt, kv, prompts)
    for r, ids in prompts.items():
        _prompts_on_rows(rt, alone[r], {0: ids})
    chain, ones = DecodeChain(rt, kv, 0, rows=B), [DecodeChain(rt, one, 0) for one in alone]
    for step in range(steps):
        active = rng.random(B) < 0.7
        active[step % B] = True
        tokens = {int(r): int(rng.integers(3, V)) for r in np.flatnonzero(active)}
        got = chain.step(tokens)
        assert got == {r: ones[r].step({0: t})[0] for r, t in tokens.items()}, step
    assert (kv.filled[:, 0] > np.array([len(p) for p in prompts.values()])).all()
    _same_rows(kv, alone)


def test_padded_prompts_in_one_call_equal_rows_alone(runtimes, family):
    """Prompts of different lengths, right-padded into one first-prompt call per segment (GQA's no-past case),
    give every row the outputs and K/V of its own single-row prefill (the mistral/gemma3 windows are crossed)."""
    rt = runtimes[family]
    m = rt.manifest
    H = m.dims["hidden_size"]
    rng = np.random.default_rng(3)
    prompts = [5, 19, 1, 11]
    B = len(prompts)
    kv, alone = new_batch_kv(rt, B, 32), rt.new_kv(B, 32)
    for s in range(len(m.segments)):
        xs = {r: rng.standard_normal((1, n, H)).astype(np.float32) for r, n in enumerate(prompts)}
        got = run_prefill(rt, s, xs, kv)
        for r in range(B):
            ref = rt.run_segment(s, xs[r], alone, row=r)
            assert got[r][0].shape == (1, prompts[r], H)
            np.testing.assert_allclose(got[r][0], ref[0], atol=ATOL)
            np.testing.assert_allclose(got[r][1], ref[1], atol=ATOL)
    assert (kv.filled == alone.filled).all()
    for r in range(B):
        for layer in range(m.num_layers):
            n = int(kv.filled[r, layer])
            np.testing.assert_allclose(kv.batch_keys[layer][r, :, :n], alone.keys[r][layer][0, :, :n], atol=ATOL)


def test_padded_prompt_calls_take_only_empty_consecutive_rows(runtimes):
    rt = runtimes["llama"]
    kv = new_batch_kv(rt, 5, 8)
    kv.filled[2, :] = 3  # row 2 holds K/V: a padded call over it would overwrite them from position 0
    assert prefill_runs(kv, [0, 1, 2, 3, 4], 0, 2) == [[0, 1], [3, 4]]
    assert prefill_runs(kv, [0, 4], 0, 2) == [[0], [4]]
    x = np.zeros((1, 2, rt.manifest.dims["hidden_size"]), np.float32)
    with pytest.raises(ValueError, match="consecutive rows holding no K/V"):
        run_prefill(rt, 0, {1: x, 2: x}, kv)


def test_a_batch_step_rejects_a_full_buffer_and_idle_rows_keep_theirs(runtimes):
    """A row at the buffer's end sits out a batch step on its scratch slot (its K/V and length untouched); a step
    that would take it past the end is refused."""
    from eectl.runtime.chain import DecodeChain

    rt = runtimes["llama"]
    kv = new_batch_kv(rt, 2, 3)
    chain = DecodeChain(rt, kv, 0, rows=2)
    for t in (5, 6, 7):
        chain.step({0: t})
    before = kv.batch_keys[0][0].copy()
    chain.step({1: 8})  # the full row only rides along, on its scratch slot
    assert list(kv.filled[:, 0]) == [3, 1]
    np.testing.assert_array_equal(kv.batch_keys[0][0, :, :3], before[:, :3])  # its real positions are untouched
    with pytest.raises(UsageError, match="beyond the KV buffer"):
        chain.step({0: 9, 1: 9})


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_batched_rows_on_cuda_equal_rows_alone(tiny_dirs, tmp_path):
    """The batch chain with its KV buffers as CUDA OrtValues (row views by device pointer), rows of different lengths
    and some sitting out: each row's tokens and K/V are its one-row chain's there."""
    from eectl.runtime.chain import DecodeChain

    export_artifact(load_model(str(tiny_dirs["llama"])), tmp_path / "a", ExportOptions(exits=[3], dtype="fp16"))
    rt = ArtifactRuntime(tmp_path / "a", provider="cuda")
    V = rt.manifest.dims["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = {r: rng.integers(3, V, n) for r, n in enumerate([4, 9, 2])}
    kv, alone = new_batch_kv(rt, 3, 16), [new_batch_kv(rt, 1, 16) for _ in range(3)]
    _prompts_on_rows(rt, kv, prompts)
    for r, ids in prompts.items():
        _prompts_on_rows(rt, alone[r], {0: ids})
    chain, ones = DecodeChain(rt, kv, 0, rows=3), [DecodeChain(rt, one, 0) for one in alone]
    for active in ([0, 2], [0, 1, 2], [1]):
        tokens = {r: int(rng.integers(3, V)) for r in active}
        assert chain.step(tokens) == {r: ones[r].step({0: t})[0] for r, t in tokens.items()}
    assert list(kv.filled[:, 0]) == [6, 11, 4]


def test_generate_runs_one_call_per_segment_for_the_batch(runtimes):
    """Full depth, 3 rows: after the prompts every step runs the batch chain once for all rows (its calls bound once
    for the batch), not once per row, and each row gets its tokens alone."""
    from eectl.runtime.chain import DecodeChain
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    rt = runtimes["qwen2"]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    alone = [Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=6)).generate([p])[0] for p in prompts]
    steps: list[tuple[int, list[int]]] = []
    real_step = DecodeChain.step

    def stepping(self, tokens, **kwargs):
        steps.append((self.rows, sorted(tokens)))
        return real_step(self, tokens, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DecodeChain, "step", stepping)
        gens = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=6)).generate(prompts)
    assert steps == [(3, [0, 1, 2])] * 5  # 5 decode steps after the prompts, all rows in each, on the batch's chain
    assert [g.token_ids for g in gens] == [g.token_ids for g in alone]


@pytest.mark.parametrize("fam", ["llama", "gemma3_text"])
def test_the_bound_batch_chain_equals_the_torch_model(runtimes, models, fam):
    """Full-depth greedy decode of a batch on the bound chain (runtime/chain.py `step`: calls bound once over
    the batch buffers, each row at its own length; each prompt on a one-row chain of its slot) gives the torch
    model's tokens and cache, rows of different lengths finishing at different steps (the finished ones ride along);
    the only value read on the host is the token, one per prompt in the prompts' step, then one for all rows."""
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig
    from tests.simulation import Simulation

    rt = runtimes[fam]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [13], [20, 21]]
    probe = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=9)).generate(prompts)
    stop = (probe[2].token_ids[3],)  # row 2 stops after 4 tokens: later steps run without it
    # the full head every step: its token is the one read (the certified head's reads: test_certified_head.py)
    cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=9, stop_ids=stop, certified_head=False)
    runner = Runner(rt, cfg)
    got = runner.generate(prompts)
    ref = Simulation(models[fam].adapter, [], {}).generate(prompts, 9, stop_ids=stop)
    assert [g.token_ids for g in got] == [r.tokens for r in ref]
    assert [g.exit_layers for g in got] == [r.layers for r in ref]
    assert len(ref[2].tokens) == 4 and max(len(r.tokens) for r in ref) == 9
    kv_got = runner.last_kv
    assert kv_got is not None
    for r, g in enumerate(got):
        assert kv_got.filled[r, : rt.manifest.num_layers].tolist() == [len(prompts[r]) + len(g.token_ids) - 1] * 6
        assert_cache(kv_got, r, ref[r], rt.manifest)
    kv = new_batch_kv(rt, 2, 8)
    chain = runner._chain(kv, 2)
    assert chain.rows == 2
    L, final = rt.manifest.num_layers, rt.full_graphs[rt.manifest.num_layers]
    packed = rt.packed_heads.get(L, final, rt.weight_feeds(final), rt.device)
    assert packed is not None and chain.calls[-1][0] is packed  # several rows: the head's table packed once
    one = runner._chain(new_batch_kv(rt, 1, 8), 1)
    assert one.calls[-1][0] is final.session  # one row: the shared table, as fast there
    kv.filled[:] = 1
    kv.filled[1] = 3
    assert sorted(chain.step({0: 5, 1: 6})) == [0, 1]
    assert kv.filled[:, 0].tolist() == [2, 4]  # each row one position further, at its own length
    # the only value a step reads on the host, recorded in the run's placement: the token, once for all rows
    head = ("exit_full", rt.manifest.num_layers, "token")
    assert runner.step_reads == [[head] * len(prompts)] + [[head]] * (max(len(g.token_ids) for g in got) - 1)
    chain.step({1: 7})  # row 0 rides along: written at its next position, never counted
    assert kv.filled[:, 0].tolist() == [2, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_plan_executed_on_cuda_equals_the_host_path(tiny_dirs, tmp_path):
    """On the CUDA EP (fp16), the bound chain's full-depth steps (states in device buffers): one row (its prompt on
    the chain: embedded on the host, joined into device buffers), a batch (its prompts padded into one call per
    segment, then the chain's head) and prompts joining freed slots give each row its greedy tokens alone, and those
    are the greedy choices teacher-forced scoring (host buffers) makes after each prefix; sampling is deterministic
    for a seed and differs from greedy."""
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    export_artifact(load_model(str(tiny_dirs["llama"])), tmp_path / "a", ExportOptions(exits=[3], dtype="fp16"))
    rt = ArtifactRuntime(tmp_path / "a", provider="cuda")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]
    cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=8)
    alone = [Runner(rt, cfg).generate([p])[0].token_ids for p in prompts]
    for p, want in zip(prompts, alone, strict=True):  # the token after each prefix, on host buffers
        assert Runner(rt, cfg).greedy_choices(p + want, len(p)) == want
    for batch, slots in ((prompts[:3], None), (prompts, 2)):
        got = Runner(rt, cfg).generate(batch, slots=slots)
        assert [g.token_ids for g in got] == alone[: len(batch)], (len(batch), slots)
    sampled = replace(cfg, temperature=0.8, seed=5)
    for batch, slots in ((prompts[:1], None), (prompts[:3], None), (prompts, 2)):
        a, b = (Runner(rt, sampled).generate(batch, slots=slots) for _ in range(2))
        assert [g.token_ids for g in a] == [g.token_ids for g in b], (len(batch), slots)
    assert Runner(rt, sampled).generate(prompts[:1])[0].token_ids != alone[0]


@pytest.mark.parametrize("policy", ["full", "defer", "verify"])
def test_generate_with_padded_prompt_calls_equals_rows_alone(runtimes, models, policy, monkeypatch):
    """The padded prompt calls (on by default only off the CPU EP where a run's states are on the host: chain_steps.py
    `padded_prompts`, one call per segment for the runs of empty rows, a prompt of one token on its slot's chain)
    give each row its own tokens alone, those of the torch simulation (tests/simulation.py: defer; full depth for
    full and verify), with its cache; prompts joining freed slots are padded with the others that join in their
    step."""
    from eectl.runtime import chain_steps
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig
    from tests.simulation import Simulation

    rt = runtimes["qwen3"]
    calls: list[int] = []
    real = chain_steps.run_prefill
    monkeypatch.setattr(chain_steps, "run_prefill", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [16, 17], [18], [19, 20, 21, 22]]
    exits = [] if policy == "full" else [2, 4]
    thr = {e: {"prob": 0.1} for e in exits}  # some tokens exit

    def cfg(**kw):
        pol = "defer" if policy == "full" else policy
        return RunConfig(exits=exits, thresholds=thr, policy=pol, top_k=8, max_new_tokens=6, **kw)

    alone = [Runner(rt, cfg()).generate([p])[0] for p in prompts]
    sim = Simulation(models["qwen3"].adapter, exits if policy == "defer" else [], thr, top_k=8)
    ref = sim.generate(prompts, 6)
    assert [g.token_ids for g in alone] == [r.tokens for r in ref]
    if policy == "defer":
        assert [g.exit_layers for g in alone] == [r.layers for r in ref]
        assert any(e < 6 for r in ref for e in r.layers), [r.layers for r in ref]  # some tokens exit
    runner = Runner(rt, cfg(batch_prompts=True))
    gens = runner.generate(prompts[:3])
    assert calls == [3] * len(rt.manifest.segments)  # one call per segment for all three prompts
    assert [g.token_ids for g in gens] == [g.token_ids for g in alone[:3]]
    assert [g.exit_layers for g in gens] == [g.exit_layers for g in alone[:3]]
    assert runner.last_kv is not None
    for row in range(3):
        assert_cache(runner.last_kv, row, ref[row], rt.manifest)
    slotted = Runner(rt, cfg(batch_prompts=True))
    got = slotted.generate(prompts, slots=3)  # 5 prompts in 3 slots: the one-token prompt alone on its chain
    assert [g.token_ids for g in got] == [g.token_ids for g in alone]
    assert [g.exit_layers for g in got] == [g.exit_layers for g in alone]


def test_kv_lengths_change_through_span_advance_and_rollback_only():
    import numpy as np

    from eectl.errors import UsageError
    from eectl.runtime.kv import KVBuffers

    kv = KVBuffers(keys=[], values=[], filled=np.zeros((2, 4), np.int64), max_len=6)
    assert kv.span(0, 0, 4, 3) == (0, 3)
    kv.advance(0, 0, 4, 3)
    kv.advance(np.array([False, True]), 0, 2)  # a mask of rows, as batched calls pass it
    assert kv.filled.tolist() == [[3, 3, 3, 3], [1, 1, 0, 0]]
    with pytest.raises(RuntimeError, match="different lengths"):
        kv.span(1, 0, 4, 1)  # row 1's layers 0..3 are out of step
    with pytest.raises(UsageError, match="beyond the KV buffer of 6"):
        kv.span(0, 0, 4, 4)
    kv.rollback(0, 2)  # verify's rejected drafts: every slot cut at position 2
    kv.rollback(1, 2)  # cutting beyond what a row holds changes nothing
    assert kv.filled.tolist() == [[2, 2, 2, 2], [1, 1, 0, 0]]
    kv.seek(1, 5, 2, 4)
    assert kv.filled[1].tolist() == [1, 1, 5, 5]


def test_rows_still_decoding_narrow_onto_the_first_rows_and_keep_their_tokens(runtimes, family):
    """Once no prompt waits for a slot, the rows still decoding move to the cache's first rows (their K/V and
    lengths) and step on a chain over the fewest rows (slots.py `narrowed`): every prompt gets the tokens it gets
    alone, and the narrower chains ran."""
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    rt = runtimes[family]
    v = rt.manifest.dims["vocab_size"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, v, n).tolist() for n in (7, 12, 3, 5, 9, 4)]

    def runner(stop: tuple[int, ...] = ()) -> Runner:
        return Runner(rt, RunConfig(exits=[], thresholds={}, top_k=8, max_new_tokens=14, stop_ids=stop))

    free = [runner().generate([p])[0].token_ids for p in prompts]

    def ends(stop: set[int]) -> list[int]:  # each answer's length with these stop tokens
        return [next((i + 1 for i, t in enumerate(f) if t in stop), len(f)) for f in free]

    # stop tokens, one at a time, while they make the answers more ragged: lengths ending at different steps
    stop: set[int] = set()
    for t in dict.fromkeys(t for f in free for t in f):
        if len(set(ends(stop | {t}))) > len(set(ends(stop))):
            stop.add(t)
    alone = [runner(tuple(stop)).generate([p])[0].token_ids for p in prompts]
    assert [len(a) for a in alone] == ends(stop) and len(set(ends(stop))) > 2, ends(stop)
    batch = runner(tuple(stop))
    assert [g.token_ids for g in batch.generate(prompts, slots=4)] == alone
    kept = batch._kept
    assert kept is not None and kept.chain is not None and kept.chain.rows == 4
    assert set(kept.narrow) and set(kept.narrow) <= {1, 2}  # the last rows stepped on one or two rows
    assert [g.token_ids for g in batch.generate(prompts, slots=4)] == alone  # again, on the kept chains


def test_a_moved_row_keeps_its_keys_values_and_length(runtimes):
    """`KVBuffers.move`: row src's K/V (every slot, its filled positions) and lengths become row dst's; src empties."""
    rt = runtimes["llama"]
    kv = new_batch_kv(rt, 3, 16)
    rng = np.random.default_rng(1)
    for b in (*kv.batch_keys, *kv.batch_values):
        b[...] = rng.standard_normal(b.shape)
    kv.filled[2] = np.arange(kv.filled.shape[1]) % 7 + 3  # lengths that differ by slot
    want = [(k[2].copy(), v_[2].copy()) for k, v_ in zip(kv.batch_keys, kv.batch_values, strict=True)]
    lengths = kv.filled[2].copy()
    kv.move(2, 0)
    assert (kv.filled[0] == lengths).all() and (kv.filled[2] == 0).all()
    for slot, (k, v_) in enumerate(want):
        n = int(lengths[slot])
        np.testing.assert_array_equal(kv.batch_keys[slot][0, :, :n], k[:, :n])
        np.testing.assert_array_equal(kv.batch_values[slot][0, :, :n], v_[:, :n])


def test_narrowing_keeps_a_sampled_batchs_tokens(runtimes, monkeypatch):
    """Sampling picks row by row in row order from one generator: narrowing keeps the rows' order, so a seeded
    sampled batch in slots draws the same tokens with it as without it."""
    from eectl.runtime import runner as runner_module
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    rt = runtimes["llama"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, rt.manifest.dims["vocab_size"], n).tolist() for n in (6, 9, 4, 7, 5)]
    cfg = RunConfig(exits=[], thresholds={}, top_k=8, max_new_tokens=12, temperature=0.9, seed=3)
    free = Runner(rt, cfg).generate(prompts[:1])[0].token_ids
    cfg.stop_ids = (free[3],)  # an end for some answers: rows finish at different steps

    def sampled() -> tuple[list[list[int]], set[int]]:
        runner = Runner(rt, cfg)
        got = [g.token_ids for g in runner.generate(prompts, slots=4)]
        return got, set(runner._kept.narrow) if runner._kept is not None else set()

    narrowed, widths = sampled()
    monkeypatch.setattr(runner_module, "narrowed", lambda rt, kept, chain, seated: chain)
    plain, none = sampled()
    assert narrowed == plain and widths and not none
