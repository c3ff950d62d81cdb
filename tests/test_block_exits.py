"""Block exit heads exported and run (export/block.py, runtime/blocks.py), on tiny models of several families:
export validates the block's graphs and KV against torch; under defer and copy the runner equals the PyTorch
simulation (tests/simulation.py: tokens, exit layers, decisions, every layer's K/V and the blocks' own; copy fills a
block's KV from the skipped token's exit state), and defer's block KV equals the torch block's on the exact states;
verify equals full depth and leaves the block's KV equal to the torch block's on the exact states after its
rollbacks; batch rows equal rows alone and the simulation's batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.exits.designs import BlockHead
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.models.parts import KVCache
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.simulation import Simulation, assert_cache

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


def _simulation(adapter, heads, policy: str, thresholds: dict[int, float], exits=EXITS) -> Simulation:
    """The runner's reference (tests/simulation.py) for an artifact with block heads at EXITS, `exits` active,
    topk-prob at `thresholds` (exit -> prob)."""
    thr = {e: {"prob": t} for e, t in thresholds.items()}
    return Simulation(adapter, exits, thr, policy=policy, top_k=K, cuts=EXITS, heads=heads)


def _thresholds(adapter, heads, prompt, new=20) -> dict[int, float]:
    """Per exit, the 0.75 quantile of topk-prob over the decode tokens of `prompt` (the simulation never exiting)."""
    row = _simulation(adapter, heads, "defer", {e: 2.0 for e in EXITS}).generate([prompt], new)[0]
    return {e: float(torch.tensor(p).quantile(0.75)) for e, p in row.values.items()}


def _mixed(layers: list[int]) -> bool:
    return any(x < L for x in layers[1:]) and any(x == L for x in layers[1:])


def _same_as_simulation(rt, gen, kv, row: int, ref) -> None:
    """A runner's generation and its cache row `row` == the simulation's row `ref`: tokens, exit layers, decisions,
    and every layer's and every active block's K/V up to the runner's length there (within 1e-4; defer's last
    deferred positions wait for a later flush, so deeper slots may hold fewer; copy's hold all)."""
    assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers
    assert gen.decided == ref.decided
    assert int(kv.filled[row, 0]) == ref.cache.length(0) == len(ref.sequence) - 1  # every fed position
    assert set(ref.own) == set(EXITS)  # both blocks' own caches compared
    assert_cache(kv, row, ref, rt.manifest, whole=gen.exit_layers[-1] == L)  # a last exited token's flush waits


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
            np.testing.assert_allclose(np.asarray(got)[0, :, :n], want[0, :, :n].numpy(), rtol=1e-4, atol=1e-4)


def test_manifest_names_the_block_graphs_slots_and_cost(block_artifacts):
    loaded, _, rt = block_artifacts["llama"]
    m = rt.manifest
    blocks = [e.block for e in m.exits]
    assert [b.kv_slot if b else None for b in blocks] == [L, L + 1, None] and m.kv_slots == L + 2
    assert [b.init_layer for b in blocks if b] == [5, 3] and all(b.cost_layers == 1.0 for b in blocks if b)
    assert m.validation["passed"] and m.validation["block_kv_max_abs_diff"] < 1e-4
    assert all(e.candidates is None for e in m.exits)  # the exit graphs score the block's output: no head in them
    assert {"past_key", "past_value"} <= set(blocks[0].graph.inputs) and blocks[0].graph.outputs["hidden_out"]


def test_defer_with_blocks_equals_the_simulation(block_artifacts, block_family):
    loaded, heads, rt = block_artifacts[block_family]
    a = loaded.adapter
    prompt = _prompt(2, 9, a.dims.vocab_size)
    thresholds = _thresholds(a, heads, prompt)
    runner = _runner(rt, "defer", thresholds)
    gen = runner.generate([prompt])[0]
    ref = _simulation(a, heads, "defer", thresholds).generate([prompt], 20)[0]
    assert _mixed(ref.layers), ref.layers  # some tokens exit early, some do not: deferred positions reach the blocks
    assert set(ref.own) == set(EXITS)
    _same_as_simulation(rt, gen, runner.last_kv, 0, ref)
    _block_kv_matches(rt, runner.last_kv, a, heads, prompt + gen.token_ids)  # and the whole sequence's, at once


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


def test_copy_with_blocks_equals_the_simulation(block_artifacts, block_family):
    """Copy: an exited token's exit state projected through the K/V path of every later layer and of every later
    exit's block (CALM-style state copying): the runner's tokens, decisions and K/V, the blocks' own included, equal
    the simulation's."""
    loaded, heads, rt = block_artifacts[block_family]
    a = loaded.adapter
    prompt = _prompt(4, 8, a.dims.vocab_size)
    thresholds = _thresholds(a, heads, prompt)
    runner = _runner(rt, "copy", thresholds)
    gen = runner.generate([prompt])[0]
    ref = _simulation(a, heads, "copy", thresholds).generate([prompt], 20)[0]
    assert 2 in ref.layers[1:] and _mixed(ref.layers), ref.layers  # exit 2 taken: block 4's KV gets a copied state
    assert set(ref.own) == set(EXITS)
    _same_as_simulation(rt, gen, runner.last_kv, 0, ref)


def test_batch_rows_with_blocks_equal_rows_alone_and_the_simulation(block_artifacts, monkeypatch):
    """Batched rows (their blocks run in the chain's call over the one-position rows, as their segments; rows with
    several positions on their own chains) == rows alone, the blocks' K/V included, under every policy; under defer
    and copy the batch equals the simulation's batch (tokens, exits, decisions, every layer's and block's K/V), under
    verify full depth."""
    from eectl.runtime import chain_steps

    loaded, heads, rt = block_artifacts["gemma3_text"]
    a = loaded.adapter
    v = a.dims.vocab_size
    prompts = [_prompt(5, 7, v), _prompt(6, 12, v), _prompt(7, 3, v), _prompt(9, 5, v)]
    thresholds = _thresholds(a, heads, prompts[0], 15)
    steps: list[int] = []  # the rows of each step on the chain
    real = chain_steps.rows_step

    def counting(runner, chain, one, live, *args, **kw):
        steps.append(len(live))
        return real(runner, chain, one, live, *args, **kw)

    monkeypatch.setattr(chain_steps, "rows_step", counting)
    full = [_runner(rt, exits=[], new=15).generate([p])[0].token_ids for p in prompts]
    for policy in ("defer", "verify", "copy"):
        alone = []
        for p in prompts:
            one = _runner(rt, policy, thresholds, new=15)
            alone.append((one.generate([p])[0], one.last_kv))
        steps.clear()
        runner = _runner(rt, policy, thresholds, new=15)
        batch = runner.generate(prompts)
        assert max(steps) == len(prompts), (policy, steps)  # the rows stepped together, their blocks batched
        kv = runner.last_kv
        for r, (g, (one, kv_one)) in enumerate(zip(batch, alone, strict=True)):
            assert g.token_ids == one.token_ids and g.exit_layers == one.exit_layers, (policy, r)
            assert kv.filled[r, 0] == kv_one.filled[0, 0], (policy, r)  # deeper, a batch's riders may flush more
            for slot in range(rt.manifest.kv_slots):  # the blocks' own K/V slots included
                n = int(min(kv.filled[r, slot], kv_one.filled[0, slot]))
                for got, want in ((kv.keys[r], kv_one.keys[0]), (kv.values[r], kv_one.values[0])):
                    np.testing.assert_allclose(
                        np.asarray(got[slot])[0, :, :n], np.asarray(want[slot])[0, :, :n], rtol=1e-4, atol=1e-4
                    )
        if policy == "verify":
            assert [g.token_ids for g in batch] == full
            assert sum(g.drafted for g in batch) > 0 and sum(g.rejected_drafts for g in batch) > 0
            continue
        refs = _simulation(a, heads, policy, thresholds).generate(prompts, 15)
        decode = [x for ref in refs for x in ref.layers[1:]]
        assert any(x < L for x in decode) and any(x == L for x in decode), policy  # some exit early, some do not
        for r, (g, ref) in enumerate(zip(batch, refs, strict=True)):
            assert set(ref.own) == set(EXITS)
            _same_as_simulation(rt, g, kv, r, ref)


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
