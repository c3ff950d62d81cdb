"""Block exit heads exported and run (export/block.py, runtime/blocks.py), on tiny models of several families:
export validates the block's graphs and KV against torch; under defer the runner equals a PyTorch simulation with
exact KV (the block's own KV included), verify equals full depth and leaves the block's KV equal to the torch
block's on the exact states after its rollbacks, copy equals an incremental PyTorch copy simulation (the block's KV
filled from the skipped token's exit state), batch rows equal rows alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.exits.base import ExitHead, signals, topk_candidates
from eectl.exits.designs import BlockHead
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.models.parts import KVCache
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig

EXITS = [2, 4]
L = 6
K = 8
FAMILIES = ["llama", "qwen3", "gemma3_text"]  # plain, q/k-norm, sandwich norms + sliding window + softcap
INITS = {2: 5, 4: 3}  # exit -> the layer its block is a copy of (and runs as: rotary kind, window)


def _block_heads(adapter, seed: int = 0) -> dict[int, BlockHead]:
    """Blocks copied from layers 5 and 3, perturbed (seeded): trained-like heads that differ from any layer."""
    g = torch.Generator().manual_seed(seed)
    heads = {}
    for e, init in INITS.items():
        head = BlockHead(adapter, init, identity=False)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g) * p.abs().mean())
        heads[e] = head.to(adapter.dtype).eval().requires_grad_(False)
    return heads


@pytest.fixture(scope="module")
def block_artifacts(tiny_dirs, tmp_path_factory):
    """family -> (loaded, heads, runtime): each family exported with block heads at exits 2 and 4 (validated)."""
    root = tmp_path_factory.mktemp("block-artifacts")
    out = {}
    for fam in FAMILIES:
        loaded = load_model(str(tiny_dirs[fam]))
        heads = _block_heads(loaded.adapter)
        export_artifact(loaded, root / fam, ExportOptions(exits=EXITS, top_k=K, profile_costs=False), heads=heads)
        out[fam] = (loaded, heads, ArtifactRuntime(root / fam, provider="cpu"))
    return out


@pytest.fixture(params=FAMILIES)
def block_family(request) -> str:
    return request.param


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _runner(rt, policy="defer", thresholds=None, exits=EXITS, new=20, **kw) -> Runner:
    thr = {e: {"prob": t} for e, t in (thresholds or {}).items()}
    return Runner(rt, RunConfig(exits=exits, thresholds=thr, policy=policy, top_k=K, max_new_tokens=new, **kw))


def _decide(adapter, exit_states: dict[int, torch.Tensor], thresholds: dict[int, float], probs=None):
    """topk-prob at exits 2 then 4 on the exits' inputs ([1, H]: block outputs): (token, layer) or None."""
    lens = ExitHead(adapter)
    full = lens.full(exit_states[EXITS[0]])
    cand = topk_candidates(full, K)
    for e in EXITS:
        local = full.gather(-1, cand) if e == EXITS[0] else lens.local(exit_states[e], cand)
        s = signals(local, cand)
        if probs is not None:
            probs.setdefault(e, []).append(float(s.prob[0]))
        if float(s.prob[0]) >= thresholds[e]:
            return int(s.token[0]), e
    return None


@torch.no_grad()
def _exact_states(adapter, heads, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Every position's state at each exit after its block (whole sequence, exact KV), and the final state: [S, H]."""
    states: dict[int, torch.Tensor] = {}
    adapter.forward_layers(
        adapter.embed(torch.tensor([tokens])),
        torch.arange(len(tokens))[None],
        0,
        L,
        on_layer=lambda i, a, b: states.__setitem__(i + 1, b[0]),
    )
    out = {e: heads[e](states[e]) for e in EXITS}
    out[L] = states[L]
    return out


@torch.no_grad()
def _defer_simulation(adapter, heads, prompt, new, thresholds, probs=None):
    """Decisions on states computed with every position's exact KV, the blocks' own KV included (defer's promise)."""
    tokens, layers = list(prompt), []
    for step in range(new):
        st = _exact_states(adapter, heads, tokens)
        picked = _decide(adapter, {e: st[e][-1:] for e in EXITS}, thresholds, probs) if step else None
        token, layer = picked if picked is not None else (int(ExitHead(adapter).full(st[L][-1:]).argmax(-1)[0]), L)
        tokens.append(token)
        layers.append(layer)
    return tokens[len(prompt) :], layers


def _thresholds(adapter, heads, prompt, new=20) -> dict[int, float]:
    probs: dict[int, list[float]] = {}
    _defer_simulation(adapter, heads, prompt, new, {e: 2.0 for e in EXITS}, probs)
    return {e: float(torch.tensor(p).quantile(0.75)) for e, p in probs.items()}


def _mixed(layers: list[int]) -> bool:
    return any(x < L for x in layers[1:]) and any(x == L for x in layers[1:])


def _block_kv_matches(rt, kv, adapter, heads, tokens: list[int]) -> None:
    """Each block's buffer holds exactly its segment's positions, and their K/V equal the torch block's on the exact
    states of those positions."""
    m = rt.manifest
    st: dict[int, torch.Tensor] = {}
    adapter.forward_layers(
        adapter.embed(torch.tensor([tokens])),
        torch.arange(len(tokens))[None],
        0,
        L,
        on_layer=lambda i, a, b: st.__setitem__(i + 1, b[0]),
    )
    for e in EXITS:
        slot = m.exit_at(e).block.kv_slot
        n = int(kv.filled[0, slot])
        assert n == int(kv.filled[0, e - 1]) and n > len(tokens) // 2
        cache = KVCache()
        with torch.no_grad():
            heads[e].step(st[e][None, :n], torch.arange(n)[None], cache)
        for got, want in ((kv.keys[0][slot], cache.keys[INITS[e]]), (kv.values[0][slot], cache.values[INITS[e]])):
            np.testing.assert_allclose(np.asarray(got)[0, :, :n], want[0].numpy(), rtol=1e-4, atol=1e-4)


def test_manifest_names_the_block_graphs_slots_and_cost(block_artifacts):
    loaded, _, rt = block_artifacts["llama"]
    m = rt.manifest
    blocks = [e.block for e in m.exits]
    assert [b.kv_slot if b else None for b in blocks] == [L, L + 1, None] and m.kv_slots == L + 2
    assert [b.init_layer for b in blocks if b] == [5, 3] and all(b.cost_layers == 1.0 for b in blocks if b)
    assert m.validation["passed"] and m.validation["block_kv_max_abs_diff"] < 1e-4
    assert all(e.candidates is None for e in m.exits)  # the exit graphs score the block's output: no head in them
    assert {"past_key", "past_value"} <= set(blocks[0].graph.inputs) and blocks[0].graph.outputs["hidden_out"]


def test_defer_with_blocks_equals_exact_kv_simulation(block_artifacts, block_family):
    loaded, heads, rt = block_artifacts[block_family]
    a = loaded.adapter
    prompt = _prompt(2, 9, a.dims.vocab_size)
    thresholds = _thresholds(a, heads, prompt)
    runner = _runner(rt, "defer", thresholds)
    gen = runner.generate([prompt])[0]
    ref_tokens, ref_layers = _defer_simulation(a, heads, prompt, 20, thresholds)
    assert _mixed(ref_layers), ref_layers  # some tokens exit early, some do not: deferred positions reach the blocks
    assert gen.token_ids == ref_tokens and gen.exit_layers == ref_layers
    _block_kv_matches(rt, runner.last_kv, a, heads, prompt + gen.token_ids)


def test_verify_with_blocks_equals_full_depth_and_rolls_their_kv_back(block_artifacts, block_family):
    loaded, heads, rt = block_artifacts[block_family]
    a = loaded.adapter
    prompt = _prompt(3, 10, a.dims.vocab_size)
    full = _runner(rt, exits=[], new=30).generate([prompt])[0]
    for thresholds in ({2: 0.0, 4: 0.0}, _thresholds(a, heads, prompt, 30)):
        runner = _runner(rt, "verify", thresholds, new=30)
        gen = runner.generate([prompt])[0]
        assert gen.token_ids == full.token_ids, thresholds
        assert gen.drafted > 0 and gen.rejected_drafts > 0  # drafts were proposed and some rolled back
        _block_kv_matches(rt, runner.last_kv, a, heads, prompt + gen.token_ids)


@torch.no_grad()
def _copy_simulation(adapter, heads, prompt, new, thresholds):
    """Incremental torch decoding, one KV cache per block beside the model's: an exited token's exit state is projected
    through the K/V path of every later layer and of every later exit's block (CALM-style state copying)."""
    cache, own = KVCache(), {e: KVCache() for e in EXITS}
    cuts = list(zip([0, *EXITS], [*EXITS, L], strict=True))
    lens = ExitHead(adapter)
    tokens, layers = list(prompt), []
    for step in range(new):
        ids = tokens if step == 0 else tokens[-1:]
        pos = torch.arange(len(tokens) - len(ids), len(tokens))[None]
        h = adapter.embed(torch.tensor([ids]))
        cand, picked = None, None
        for lo, hi in cuts:
            h = adapter.forward_layers(h, pos, lo, hi, cache)
            if hi == L:
                break
            x = heads[hi].step(h, pos, own[hi])[0, -1:]  # every position that passes the exit runs its block
            if step == 0:
                continue  # the prompt: full depth
            if cand is None:
                full = lens.full(x)
                cand = topk_candidates(full, K)
                local = full.gather(-1, cand)
            else:
                local = lens.local(x, cand)
            s = signals(local, cand)
            if float(s.prob[0]) >= thresholds[hi]:
                picked = (int(s.token[0]), hi)
                for lo2, hi2 in cuts:
                    if lo2 >= hi:
                        adapter.project_kv(h, pos, lo2, hi2, cache)
                        if hi2 < L:
                            adapter.block_project_kv(heads[hi2].block, h, pos, INITS[hi2], own[hi2])
                break
        token, layer = picked if picked is not None else (int(lens.full(h[0, -1:]).argmax(-1)[0]), L)
        tokens.append(token)
        layers.append(layer)
    return tokens[len(prompt) :], layers, own


def test_copy_with_blocks_equals_incremental_copy_simulation(block_artifacts, block_family):
    loaded, heads, rt = block_artifacts[block_family]
    a = loaded.adapter
    prompt = _prompt(4, 8, a.dims.vocab_size)
    thresholds = _thresholds(a, heads, prompt)
    runner = _runner(rt, "copy", thresholds)
    gen = runner.generate([prompt])[0]
    ref_tokens, ref_layers, own = _copy_simulation(a, heads, prompt, 20, thresholds)
    assert 2 in ref_layers[1:] and _mixed(ref_layers), ref_layers  # exit 2 taken: block 4's KV gets a copied state
    assert gen.token_ids == ref_tokens and gen.exit_layers == ref_layers
    kv = runner.last_kv
    for e in EXITS:  # the blocks' own KV, copied positions included, equal the simulation's
        slot = rt.manifest.exit_at(e).block.kv_slot
        n = int(kv.filled[0, slot])
        assert n == own[e].length(INITS[e]) == int(kv.filled[0, e - 1])
        for got, want in ((kv.keys[0][slot], own[e].keys[INITS[e]]), (kv.values[0][slot], own[e].values[INITS[e]])):
            np.testing.assert_allclose(np.asarray(got)[0, :, :n], want[0].numpy(), rtol=1e-4, atol=1e-4)


def test_batch_rows_with_blocks_equal_rows_alone(block_artifacts, monkeypatch):
    """Batched rows (their blocks batched like their segments, rows with several positions alone) == rows alone, on
    the bound chain and the general path alike, the blocks' K/V included."""
    import eectl.runtime.segment_rows as segment_rows_module

    loaded, heads, rt = block_artifacts["gemma3_text"]
    v = loaded.adapter.dims.vocab_size
    prompts = [_prompt(5, 7, v), _prompt(6, 12, v), _prompt(7, 3, v), _prompt(9, 5, v)]
    thresholds = _thresholds(loaded.adapter, heads, prompts[0], 15)
    batched = []
    original = segment_rows_module.run_block_rows
    monkeypatch.setattr(
        segment_rows_module, "run_block_rows", lambda *a, **kw: batched.append(int(a[4].sum())) or original(*a, **kw)
    )
    for policy in ("defer", "verify", "copy"):
        alone = [_runner(rt, policy, thresholds, new=15).generate([p])[0] for p in prompts]
        caches = []
        for bound in (True, False):  # the bound chain (runtime/chain_rows.py), then the general path
            runner = _runner(rt, policy, thresholds, new=15, bound=bound)
            batch = runner.generate(prompts)
            assert [g.token_ids for g in batch] == [g.token_ids for g in alone], (policy, bound)
            assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone], (policy, bound)
            caches.append(runner.last_kv)
        chain, general = caches
        assert (chain.filled == general.filled).all()  # the blocks' own K/V slots included
        for slot in (rt.manifest.exit_at(e).block.kv_slot for e in EXITS):
            n = int(chain.filled[:, slot].min())
            np.testing.assert_array_equal(chain.batch_keys[slot][:, :, :n], general.batch_keys[slot][:, :, :n])
    assert batched and max(batched) > 1  # the general path's batched block call ran, for several rows at once


def test_inactive_block_exit_costs_nothing_and_a_block_out_of_step_is_refused(block_artifacts):
    from eectl.runtime.blocks import run_block

    loaded, _, rt = block_artifacts["llama"]
    prompt = _prompt(8, 6, loaded.adapter.dims.vocab_size)
    runner = _runner(rt, "defer", {4: 0.0}, exits=[4], new=5)
    gen = runner.generate([prompt])[0]
    kv = runner.last_kv
    assert gen.exit_layers == [L] + [4] * 4
    assert kv.filled[0, rt.manifest.exit_at(2).block.kv_slot] == 0  # exit 2 inactive: its block never ran
    assert kv.filled[0, rt.manifest.exit_at(4).block.kv_slot] == kv.filled[0, 3]
    with pytest.raises(RuntimeError, match="out of step"):
        run_block(rt, 2, np.zeros((1, 1, loaded.adapter.dims.hidden_size), rt.np_dtype), kv, 0)


def test_trained_block_heads_calibrate_export_and_run_through_the_cli(llama, gsm8k, tiny_dirs, tmp_path):
    """train-heads --design block -> calibrate with them -> `eectl export --heads --calibration` -> `eectl run`
    (verify: output == full depth)."""
    import json

    from typer.testing import CliRunner

    from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model
    from eectl.cli import app
    from eectl.contracts.calibration import write_calibration
    from eectl.exits.designs import load_heads
    from eectl.heads.cached import train_cached
    from eectl.heads.config import TrainConfig
    from tests.test_head_data import _tiny_cache

    cache = _tiny_cache(llama, gsm8k, tmp_path / "c")
    cfg = TrainConfig(exits=[2, 4], design="block", steps=4, batch_tokens=32, tail_samples=64)
    train_cached(llama, cache, cfg, tmp_path / "b.safetensors")
    heads = load_heads(tmp_path / "b.safetensors", llama)
    opts = CalibrateOptions(exits=[2, 4], target=0.5, tokens=400, gen_tokens=4, chunk_len=32)
    write_calibration(calibrate_model(llama, gsm8k, opts, heads.heads, tmp_path / "b.safetensors"), tmp_path / "c.json")
    runner = CliRunner()
    art = tmp_path / "art"
    args = ["export", str(tiny_dirs["llama"]), "--heads", str(tmp_path / "b.safetensors")]
    res = runner.invoke(app, [*args, "--calibration", str(tmp_path / "c.json"), "--out", str(art), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["validation"]["passed"] and set(doc["costs"]["block_ms"]) == {"2", "4"}
    assert {k: v["cost_layers"] for k, v in doc["block_heads"].items()} == {"2": 1.0, "4": 1.0}
    run = ["run", str(art), "12 clips", "--raw", "--max-new-tokens", "12", "--json"]
    full = runner.invoke(app, [*run, "--exits", "none"])
    verify = runner.invoke(app, [*run, "--exits", "2,4", "--policy", "verify"])
    assert full.exit_code == 0 and verify.exit_code == 0, verify.output
    want, got = json.loads(full.stdout)["results"][0], json.loads(verify.stdout)["results"][0]
    assert got["token_ids"] == want["token_ids"]


def test_river_runs_later_block_heads_on_the_rivers_state(tiny_dirs, tmp_path):
    """Under the river the exited token flows on through int4 copies; a later active block head runs on the river's
    state there, so its KV keeps its segment's positions (the runner checks it on every call)."""
    loaded = load_model(str(tiny_dirs["llama"]))
    heads = _block_heads(loaded.adapter)
    opts = ExportOptions(exits=EXITS, top_k=K, profile_costs=False, river=True)
    export_artifact(loaded, tmp_path / "r", opts, heads=heads)
    rt = ArtifactRuntime(tmp_path / "r", provider="cpu")
    assert rt.manifest.validation["river"]["block_kv_max_abs_diff"] is not None
    runner = _runner(rt, "river", {2: 0.0, 4: 0.0}, new=8)
    gen = runner.generate([_prompt(10, 6, loaded.adapter.dims.vocab_size)])[0]
    kv = runner.last_kv
    assert gen.exit_layers == [L] + [2] * 7  # every decode token exits at 2 and flows on through the river
    assert kv.filled[0, rt.manifest.exit_at(4).block.kv_slot] == kv.filled[0, 3] == kv.filled[0, L - 1]
