"""The ONNX Runtime runner on tiny models: full depth == transformers generate, verify == full depth, defer ==
a PyTorch simulation with exact KV, batch rows == rows alone, sampling deterministic, bad input rejected."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.gates import GATE, Gate
from eectl.errors import ArtifactError, UsageError
from eectl.exits.base import ExitHead, signals, topk_candidates
from eectl.exits.gates import gate_logits, gate_open
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.run.generate import RunOptions, resolve_config
from eectl.runtime.binding import plan_for
from eectl.runtime.chain import DecodeChain
from eectl.runtime.ort import cuda_usable, resolve_provider
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import ROOM
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K, make_calibration

EXITS = [2, 4]
K = 8


@pytest.fixture(scope="module")
def artifacts(exported):
    """family -> (loaded model, its artifact's runtime): the five-family export shared with test_export."""
    assert EXITS == EXPORT_EXITS and K == EXPORT_TOP_K
    return {fam: (loaded, ArtifactRuntime(art, provider="cpu")) for fam, (loaded, art) in exported.items()}


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _runner(rt, policy="defer", thresholds=None, exits=EXITS, new=24, **kw) -> Runner:
    thr = {e: {"prob": t} for e, t in (thresholds or {}).items()}
    return Runner(rt, RunConfig(exits=exits, thresholds=thr, policy=policy, top_k=K, max_new_tokens=new, **kw))


def test_full_depth_equals_transformers_generate(artifacts, family):
    loaded, rt = artifacts[family]
    prompt = _prompt(1, 11, loaded.adapter.dims.vocab_size)
    with torch.no_grad():
        ref = loaded.model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    gen = _runner(rt, exits=[], new=24).generate([prompt])[0]
    assert gen.token_ids == ref
    assert gen.exit_layers == [6] * 24 and gen.mean_layers(6) == 6.0


def test_full_depth_without_the_token_output_uses_the_logits(artifacts, tmp_path):
    """An artifact whose final exit graph lists no greedy token output (exported before it existed): the runner
    takes the argmax of the logits instead, with the same tokens."""
    import shutil

    loaded, rt = artifacts["llama"]
    prompt = _prompt(3, 9, loaded.adapter.dims.vocab_size)
    want = _runner(rt, exits=[], new=12).generate([prompt])[0].token_ids
    old = tmp_path / "old"
    shutil.copytree(rt.folder, old)
    doc = json.loads((old / "manifest.json").read_text())
    for e in doc["exits"]:
        del e["full"]["outputs"]["token"]
    (old / "manifest.json").write_text(json.dumps(doc))
    assert _runner(ArtifactRuntime(old, provider="cpu"), exits=[], new=12).generate([prompt])[0].token_ids == want


def _torch_simulation(loaded, prompt, new, thresholds, probs=None, gates=None, seen=None):
    """Sequential topk-prob exits decided on states computed with the exact (full-model) KV of every position.

    `probs`, when given, collects each exit's top-1 local probability per decode step; `seen` each exit's state.
    `gates` (exit -> (weight, bias, threshold), eectl.exits.gates): an exit decides only where its gate opens, the first
    exit that decides picks the candidates.
    """
    adapter = loaded.adapter
    heads = {e: ExitHead(adapter) for e in [*EXITS, 6]}
    tokens = list(prompt)
    layers = []
    with torch.no_grad():
        for step in range(new):
            states = {}
            ids = torch.tensor([tokens])
            adapter.forward_layers(
                adapter.embed(ids),
                torch.arange(len(tokens))[None],
                0,
                6,
                on_layer=lambda i, a, b, states=states: states.__setitem__(i + 1, b[0, -1:]),
            )
            token, layer = None, 6
            if step > 0:  # the first token comes from the prefill, at full depth
                cand = None
                for e in EXITS:
                    if seen is not None:
                        seen.setdefault(e, []).append(states[e][0])
                    if gates is not None and not gate_open(gates.get(e), states[e].numpy()):
                        continue
                    if cand is None:
                        full = heads[e].full(states[e])
                        cand = topk_candidates(full, K)
                        local = full.gather(-1, cand)
                    else:
                        local = heads[e].local(states[e], cand)
                    s = signals(local, cand)
                    if probs is not None:
                        probs.setdefault(e, []).append(float(s.prob[0]))
                    if float(s.prob[0]) >= thresholds[e]:
                        token, layer = int(s.token[0]), e
                        break
            if token is None:
                token = int(heads[6].full(states[6]).argmax(-1)[0])
            tokens.append(token)
            layers.append(layer)
    return tokens[len(prompt) :], layers


def _median_thresholds(loaded, prompt, new=20):
    """Thresholds that make some tokens exit and others not: 80th percentile of each exit's probability."""
    probs: dict[int, list[float]] = {}
    _torch_simulation(loaded, prompt, new, {e: 2.0 for e in EXITS}, probs)
    return {e: float(torch.tensor(p).quantile(0.8)) for e, p in probs.items()}


def _mixed(layers: list[int]) -> bool:
    return any(x < 6 for x in layers[1:]) and any(x == 6 for x in layers[1:])


@pytest.mark.parametrize("path", ["bound", "general", "resident"])
def test_defer_equals_exact_kv_simulation(artifacts, family, path):
    """Each path that executes a decode step (the bound chain, the general path alone, the device-resident path)
    against the PyTorch simulation with exact KV: the same tokens and exit layers."""
    loaded, rt = artifacts[family]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    thresholds = _median_thresholds(loaded, prompt)
    kw = {"bound": path == "bound", "device_resident": path == "resident"}
    runner = _runner(rt, "defer", thresholds, new=20, **kw)
    gen = runner.generate([prompt])[0]
    ref_tokens, ref_layers = _torch_simulation(loaded, prompt, 20, thresholds)
    assert _mixed(ref_layers), ref_layers  # some tokens exit early and some do not: deferred KV is exercised
    assert gen.token_ids == ref_tokens
    assert gen.exit_layers == ref_layers


def test_some_tokens_exit_early(artifacts):
    loaded, rt = artifacts["llama"]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    gen = _runner(rt, "defer", {2: 0.0, 4: 0.0}, new=10).generate([prompt])[0]
    assert gen.exit_layers == [6] + [2] * 9  # threshold 0: every decode token takes the first exit


@pytest.mark.parametrize("path", ["bound", "general", "resident"])
def test_verify_equals_full_depth(artifacts, family, path):
    """Verify on each executing path against full depth on the general path (which the chain's full depth is
    tested against too), and full depth against transformers' greedy above."""
    loaded, rt = artifacts[family]
    prompt = _prompt(3, 10, loaded.adapter.dims.vocab_size)
    full = _runner(rt, exits=[], new=30, bound=False).generate([prompt])[0]
    kw = {"bound": path == "bound", "device_resident": path == "resident"}
    for thresholds in ({2: 0.0, 4: 0.0}, _median_thresholds(loaded, prompt, 30)):
        gen = _runner(rt, "verify", thresholds, new=30, **kw).generate([prompt])[0]
        assert gen.token_ids == full.token_ids, thresholds
        assert gen.drafted > 0 and gen.rejected_drafts > 0  # drafts were proposed, and some were wrong


def test_copy_fills_every_layer_and_matches_exit_lens_at_one_exit(artifacts, family):
    """With one always-taken exit, earlier layers' KV are exact, so tokens follow the logit lens at that exit. The
    skipped layers hold K/V for every position: the first skipped layer's input is the exit state itself, so its
    copied K/V equal full depth's; a deeper layer's copy (its input taken to be the exit state) does not."""
    loaded, rt = artifacts[family]
    prompt = _prompt(4, 8, loaded.adapter.dims.vocab_size)
    copy = _runner(rt, "copy", {4: 0.0}, exits=[4], new=12)
    gen = copy.generate([prompt])[0]
    defer = _runner(rt, "defer", {4: 0.0}, exits=[4], new=12).generate([prompt])[0]
    assert gen.token_ids == defer.token_ids and gen.exit_layers == [6] + [4] * 11
    kv, L = copy.last_kv, rt.manifest.num_layers
    fed = len(prompt) + len(gen.token_ids) - 1  # the last token is never fed back
    assert kv is not None and kv.filled[0, :L].tolist() == [fed] * L
    full = _runner(rt, exits=[], new=1)  # full depth over the same tokens, as one prompt
    full.generate([prompt + gen.token_ids[:-1]])
    ref = full.last_kv
    assert ref is not None and ref.filled[0, :L].tolist() == [fed] * L
    exited = slice(len(prompt), fed)  # the positions of tokens that exited at 4 (their K/V after 4 were copied)
    for layer in range(L):
        for mine, exact in ((kv.keys[0][layer], ref.keys[0][layer]), (kv.values[0][layer], ref.values[0][layer])):
            got, want = np.asarray(mine)[:, :, :fed], np.asarray(exact)[:, :, :fed]
            if layer <= 4:  # computed by the layers (< 4), or copied from the first skipped layer's true input
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"layer {layer}")
            else:
                assert not np.allclose(got[:, :, exited], want[:, :, exited], atol=1e-3), f"layer {layer}"


def test_batch_rows_equal_rows_alone(artifacts, family, monkeypatch):
    """Batched rows (one segment call for the rows that reach it, exited rows' deferred states riding along in
    deeper calls, or waiting with ride_along off) give each row exactly its tokens and exits alone, every policy,
    on the bound chain (runtime/chain_rows.py) and on the general path alike, with the same cache."""
    from eectl.runtime import chain_rows

    loaded, rt = artifacts[family]
    v = loaded.adapter.dims.vocab_size
    prompts = [_prompt(5, 7, v), _prompt(6, 12, v), _prompt(7, 3, v), _prompt(8, 5, v)]
    thresholds = _median_thresholds(loaded, prompts[0], 15)
    rides: dict[bool, list[int]] = {True: [], False: []}  # bound -> the deeper calls an exited row's state rode in
    ride, rode = Runner._ride, chain_rows._rode

    def counting(self, st, s):  # the general path's rides
        gen = ride(self, st, s)
        try:
            ask = next(gen)
            while True:
                answer = yield ask
                rides[False].extend([1] if answer is not None else [])
                ask = gen.send(answer)
        except StopIteration:
            return

    def chained(*args):  # the chain's
        rides[True].append(1)
        return rode(*args)

    monkeypatch.setattr(Runner, "_ride", counting)
    monkeypatch.setattr(chain_rows, "_rode", chained)
    mixed = []
    for policy in rt.manifest.kv_policies:  # river needs an artifact with river copies: tests/test_river.py
        alone = [_runner(rt, policy, thresholds, new=15).generate([p])[0] for p in prompts]
        for ride_along in (True, False):
            caches = []
            for bound in (True, False):
                runner = _runner(rt, policy, thresholds, new=15, ride_along=ride_along, bound=bound)
                batch = runner.generate(prompts)
                mixed.append(any(_mixed(g.exit_layers) for g in batch))
                assert [g.token_ids for g in batch] == [g.token_ids for g in alone], (policy, ride_along, bound)
                assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone], (policy, ride_along, bound)
                caches.append(runner.last_kv)
            chain, general = caches
            assert (chain.filled == general.filled).all()
            n = int(chain.filled.min())
            for mine, theirs in zip(
                chain.batch_keys + chain.batch_values, general.batch_keys + general.batch_values, strict=True
            ):
                np.testing.assert_array_equal(mine[:, :, :n], theirs[:, :, :n])
    assert any(mixed) and rides[True] and rides[False]  # rows exited at different depths, and both rode along


def test_rows_join_and_leave_between_steps(artifacts, family):
    """More prompts than slots, answers of different lengths: a finished row's slot takes the next prompt (its
    cache rows forgotten, its prefill in the step the others decode), and every prompt gets exactly its tokens and
    exits alone, for every policy."""
    loaded, rt = artifacts[family]
    v = loaded.adapter.dims.vocab_size
    prompts = [_prompt(20 + i, n, v) for i, n in enumerate([7, 12, 3, 5, 9, 4, 6])]
    thresholds = _median_thresholds(loaded, prompts[0], 15)
    for policy in rt.manifest.kv_policies:
        free = [_runner(rt, policy, thresholds, new=15).generate([p])[0].token_ids for p in prompts]
        stop = (free[0][2], free[1][6], free[3][4])  # tokens that end some answers early: ragged lengths
        alone = [_runner(rt, policy, thresholds, new=15, stop_ids=stop).generate([p])[0] for p in prompts]
        lengths = {len(g.token_ids) for g in alone}
        assert len(lengths) > 1, lengths  # the answers are ragged
        for slots in (1, 3):
            got = _runner(rt, policy, thresholds, new=15, stop_ids=stop).generate(prompts, slots=slots)
            assert [g.token_ids for g in got] == [g.token_ids for g in alone], (policy, slots)
            assert [g.exit_layers for g in got] == [g.exit_layers for g in alone], (policy, slots)
    with pytest.raises(UsageError, match="batch-size"):
        _runner(rt, exits=[]).generate(prompts, slots=0)


@pytest.mark.parametrize("policy", ["full", "defer", "verify"])
def test_calls_reuse_the_last_calls_cache_and_chain(artifacts, policy):
    """A generate call steps on the last call's KV cache and bound chain where they fit (lengths reset, nothing bound
    again: verify's check widths stay bound) and generates what a fresh runner does, exits and cache alike; a call
    needing more room, another batch width or a changed configuration gets new buffers."""
    loaded, rt = artifacts["llama"]
    v = loaded.adapter.dims.vocab_size
    a, b = _prompt(41, 12, v), _prompt(42, 5, v)
    # verify: every token drafts at the first exit (its checks run wide); defer: some exit, some do not
    thresholds = (
        {} if policy == "full" else {2: 0.0, 4: 0.0} if policy == "verify" else _median_thresholds(loaded, a, 16)
    )

    def fresh() -> Runner:
        return _runner(rt, "verify" if policy == "full" else policy, thresholds, [] if policy == "full" else EXITS, 16)

    runner = fresh()
    first = runner.generate([a])[0]
    kv, kept = runner.last_kv, runner._kept
    assert kept is not None and kept.chain is not None and kv is kept.kv
    bound = dict(kept.chain.wide)  # the wide calls bound so far (verify's checks, defer's flushes)
    if policy != "full":
        assert _mixed([6, *first.exit_layers]) and bound, first.exit_layers
        assert policy != "verify" or first.rejected_drafts > 0
    for prompt, ref in ((b, None), (a, first)):  # b after a, then a after b: nothing of the last answer is read
        got = runner.generate([prompt])[0]
        alone = fresh()
        want = ref or alone.generate([prompt])[0]
        assert runner.last_kv is kv and runner._kept is kept and kept.chain.wide.items() >= bound.items()
        assert (got.token_ids, got.exit_layers) == (want.token_ids, want.exit_layers)
        if ref is None:
            assert alone.last_kv is not None and (kv.filled == alone.last_kv.filled).all()
            n = len(prompt) + len(got.token_ids) - 1
            for mine, theirs in zip(kv.batch_keys, alone.last_kv.batch_keys, strict=True):
                assert (mine[:, :, :n] == theirs[:, :, :n]).all()
    assert kv.max_len == ROOM  # the call's 29 positions rounded up: room for calls of about that length
    runner.generate([a * 11])  # more room than the cache has: new buffers, grown
    assert runner.last_kv is not kv and runner.last_kv.max_len > kv.max_len
    grown = runner.last_kv
    runner.generate([a, b])  # two rows
    assert runner.last_kv is not grown and runner.last_kv.rows == 2
    two = runner.last_kv
    slots = dict(runner._kept.prompt_chains)  # the one-row chains each slot's prompt (and wide calls) ran on
    assert len(slots) == 2
    alone_b = fresh().generate([b])[0].token_ids
    assert [g.token_ids for g in runner.generate([b, a])] == [alone_b, first.token_ids]
    assert runner.last_kv is two and runner._kept.prompt_chains == slots
    runner.cfg.certified_head = not runner.cfg.certified_head  # another configuration: its chain binds anew
    runner.generate([a, b])
    assert runner.last_kv is not two and runner._kept is not None and runner._kept.cfg == runner.cfg


def test_sampling_is_deterministic_for_a_seed(artifacts):
    loaded, rt = artifacts["mistral"]
    prompt = _prompt(8, 6, loaded.adapter.dims.vocab_size)

    thresholds = _median_thresholds(loaded, prompt)

    def sample(seed):
        return _runner(rt, "defer", thresholds, new=20, temperature=1.5, top_p=0.95, seed=seed).generate([prompt])[0]

    a, b, c = sample(1), sample(1), sample(2)
    assert a.token_ids == b.token_ids and a.exit_layers == b.exit_layers
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("policy", ["full", "defer", "copy"])
def test_sampled_decode_runs_on_the_chain_as_on_the_general_path(artifacts, family, policy, monkeypatch):
    """Sampling (temperature, top-p) steps on the bound chain: one row at full depth or with exits decided in the
    graphs (the exiting token sampled from its K candidates), and a batch of rows, its prompts included (each on its
    slot's chain, every row's final logits picked in row order) and prompts joining freed slots.
    Same seed, same tokens, exit layers and KV cache as the general path, which then runs no step at all."""
    loaded, rt = artifacts[family]
    V = loaded.adapter.dims.vocab_size
    prompts = [_prompt(31, 7, V), _prompt(32, 5, V), _prompt(33, 9, V)]
    exits = [] if policy == "full" else EXITS
    thresholds = {} if policy == "full" else _median_thresholds(loaded, prompts[0], 20)
    # (prompts, slots): one, all at once, and 3 prompts in 2 slots (a batch with exits: runtime/chain_rows.py)
    batches = [(prompts[:1], None), (prompts, None), (prompts, 2)]

    def run(batch, bound=True):
        runner = _runner(rt, "defer" if policy == "full" else policy, thresholds, exits, 20, temperature=1.3,
                         top_p=0.9, seed=7, bound=bound)  # fmt: skip
        return runner.generate(batch[0], slots=batch[1]), runner.last_kv

    general_calls = []
    general = Runner._steps

    def counted(self, kv, work, force_full=False):
        general_calls.append(len(work))
        return general(self, kv, work, force_full)

    monkeypatch.setattr(Runner, "_steps", counted)
    bound = [run(b) for b in batches]
    assert sum(general_calls) == 0  # no step on the general path, prompts included
    plain = [run(b, bound=False) for b in batches]  # the general path alone
    assert sum(general_calls) > 0
    if exits:
        assert _mixed(plain[0][0][0].exit_layers), plain[0][0][0].exit_layers
    for (got, kv_got), (want, kv_want) in zip(bound, plain, strict=True):
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.exit_layers for g in got] == [w.exit_layers for w in want]
        assert (kv_got.filled == kv_want.filled).all()
        for mine, other in zip(
            kv_got.batch_keys + kv_got.batch_values, kv_want.batch_keys + kv_want.batch_values, strict=True
        ):
            n = int(kv_got.filled.min())
            assert (mine[:, :, :n] == other[:, :, :n]).all()
    # sampled, not greedy: the greedy answer differs
    greedy = _runner(rt, "defer" if policy == "full" else policy, thresholds, exits, 20).generate(prompts[:1])[0]
    assert greedy.token_ids != bound[0][0][0].token_ids


def test_bad_run_input(artifacts, tmp_path):
    loaded, rt = artifacts["llama"]
    with pytest.raises(UsageError, match="not in the artifact"):
        _runner(rt, exits=[3], thresholds={3: 0.5})
    with pytest.raises(UsageError, match="maximum context"):
        _runner(rt, exits=[], new=10).generate([[5] * 510])
    with pytest.raises(UsageError, match="no prob threshold"):
        Runner(rt, RunConfig(exits=[2], thresholds={}, top_k=K))
    with pytest.raises(UsageError, match="no calibrated thresholds"):
        resolve_config(rt, RunOptions(exits="2"), ())
    cfg = resolve_config(rt, RunOptions(exits="2,4", thresholds="2:0.9,4:0.8", threshold_scale=0.5), ())
    assert cfg.thresholds == {2: {"prob": 0.45}, 4: {"prob": 0.4}}
    assert resolve_config(rt, RunOptions(exits="none"), ()).exits == []
    with pytest.raises(UsageError, match="verify policy is greedy"):
        _runner(rt, "verify", {2: 0.5, 4: 0.5}, temperature=1.0)


def test_provider_resolution_without_a_gpu():
    if cuda_usable():
        pytest.skip("this machine has CUDA")
    assert resolve_provider("auto", "fp16") == "cpu" and resolve_provider("auto", "fp32") == "cpu"
    with pytest.raises(UsageError, match="CUDA"):
        resolve_provider("cuda", "fp16")
    with pytest.raises(UsageError):
        resolve_provider("tpu", "fp32")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_cuda_fp16_full_depth_matches_cpu(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs["llama"]))
    export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[3], dtype="fp16"))
    prompt = _prompt(9, 8, loaded.adapter.dims.vocab_size)
    cpu = _runner(ArtifactRuntime(tmp_path / "a", provider="cpu"), exits=[], new=8).generate([prompt])[0]
    gpu = _runner(ArtifactRuntime(tmp_path / "a", provider="cuda"), exits=[], new=8).generate([prompt])[0]
    assert gpu.token_ids == cpu.token_ids


def test_cli_run_json_and_errors(artifacts, tmp_path):
    _, rt = artifacts["gemma3_text"]
    runner = CliRunner()
    args = ["run", str(rt.folder), "12 clips", "--raw", "--max-new-tokens", "6", "--json"]
    res = runner.invoke(app, [*args, "--exits", "none"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    r = doc["results"][0]
    assert len(r["token_ids"]) == 6 and r["exit_layers"] == [6] * 6 and r["mean_executed_layers"] == 6.0
    assert doc["provider"] == "cpu" and r["tokens_per_s"] > 0
    res = runner.invoke(app, [*args, "--exits", "2", "--thresholds", "0.0", "--policy", "copy"])
    assert res.exit_code == 0 and json.loads(res.stdout)["results"][0]["exit_layers"][1:] == [2] * 5
    res = runner.invoke(app, [*args, "--exits", "3", "--thresholds", "0.5"])
    assert res.exit_code == 2 and "not in the artifact" in res.stderr
    res = runner.invoke(app, ["run", str(tmp_path / "missing"), "hi"])
    assert res.exit_code == 5 and "artifact not found" in res.stderr
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b"}\n{"question": "c"}\n')
    batch = ["run", str(rt.folder), "--prompt-file", str(prompts), "--raw", "-n", "3", "--exits", "none"]
    batch += ["--batch-size", "2"]
    res = runner.invoke(app, [*batch, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [len(x["token_ids"]) for x in doc["results"]] == [3, 3]
    # a batch's whole run: every prompt's tokens over the generate call's time (a row's own rate shares every call)
    assert doc["batch"]["size"] == 2 and doc["batch"]["tokens"] == 6 and doc["batch"]["seconds"] > 0
    assert doc["batch"]["tokens_per_s"] == pytest.approx(6 / doc["batch"]["seconds"], rel=1e-2)
    assert json.loads(runner.invoke(app, [*args, "--exits", "none"]).stdout)["batch"] is None  # one prompt, one row
    text = runner.invoke(app, batch)
    assert text.exit_code == 0, text.stderr
    assert "batch of 2: 6 tokens in" in text.stderr and "measured full depth" not in text.stderr


def test_cli_run_reads_stdin_and_takes_short_options(artifacts):
    """`eectl run ART -` sends stdin as one prompt, `--prompt-file -` one prompt per line; -n, -t and -h work; a
    loading line goes to stderr before the model loads."""
    _, rt = artifacts["llama"]
    runner = CliRunner()
    base = ["run", str(rt.folder), "--raw", "--json", "--exits", "none", "-t", "1"]
    want = runner.invoke(app, [*base[:2], "12 clips", *base[2:], "-n", "4"])
    got = runner.invoke(app, [*base[:2], "-", *base[2:], "-n", "4"], input="12 clips\n")
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["results"][0]["token_ids"] == json.loads(want.stdout)["results"][0]["token_ids"]
    assert json.loads(got.stdout)["threads"] == 1
    many = runner.invoke(app, [*base, "-f", "-", "-n", "2"], input="a b\n\nc\n")
    assert many.exit_code == 0, many.output
    assert [x["prompt"] for x in json.loads(many.stdout)["results"]] == ["a b", "c"]
    empty = runner.invoke(app, [*base[:2], "-", *base[2:]], input="  \n")
    assert empty.exit_code == 2 and "stdin is empty" in empty.stderr
    plain = runner.invoke(app, ["run", str(rt.folder), "12 clips", "--raw", "-n", "2", "-t", "1", "--exits", "none"])
    assert plain.exit_code == 0, plain.output
    assert f"loading {rt.folder}" in plain.stderr
    assert "(full depth, cpu, 1 threads)" in plain.stderr  # the summary names what ran, not a policy that did not
    helped = runner.invoke(app, ["run", "-h"])
    assert helped.exit_code == 0 and "--prompt-file" in helped.stdout


def test_edited_artifact_is_rejected(artifacts, tmp_path):
    import shutil

    _, rt = artifacts["llama"]
    copy = tmp_path / "a"
    shutil.copytree(rt.folder, copy)
    (copy / "weights" / "lm_head.npy").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="changed since export"):
        ArtifactRuntime(copy, provider="cpu")


def test_calibrated_thresholds_are_used_and_never_exits_dropped(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs["llama"]))
    never = {"prob": float("inf")}
    cal = make_calibration(loaded, {2: never, 3: never, 4: {"prob": 0.4}})
    export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[2, 3, 4], top_k=K), calibration=cal)
    rt = ArtifactRuntime(tmp_path / "a", provider="cpu")
    cfg = resolve_config(rt, RunOptions(threshold_scale=1.25), ())
    # exit 3 can never exit: dropped; exit 2 never exits either but picks the Top-K candidates: kept
    assert cfg.exits == [2, 4] and cfg.signal == "topk-prob"
    assert cfg.thresholds == {2: {"prob": float("inf")}, 4: {"prob": 0.5}}
    with pytest.raises(UsageError, match="another model"):
        export_artifact(
            loaded,
            tmp_path / "b",
            ExportOptions(exits=[2, 4]),
            calibration=cal.model_copy(update={"model": cal.model.model_copy(update={"sha256": "0"})}),
        )


def test_full_depth_decode_chain_equals_the_general_path(artifacts, family, monkeypatch):
    """Full-depth greedy decode of one row runs the bound call chain (runtime/chain.py), its prompt included (wide
    calls): same tokens and the same KV cache as the general per-segment path, which the chain's runner never
    calls."""
    loaded, rt = artifacts[family]
    prompt = _prompt(5, 7, loaded.adapter.dims.vocab_size)
    runner = _runner(rt, exits=[], new=16)
    calls = []
    general = Runner._steps
    monkeypatch.setattr(Runner, "_steps", lambda self, *a, **kw: calls.append(1) or general(self, *a, **kw))
    chained = runner.generate([prompt])[0]
    kv_chained = runner.last_kv
    assert calls == []
    runner.cfg.bound = False  # the general path alone
    plain = runner.generate([prompt])[0]
    assert calls and chained.token_ids == plain.token_ids and chained.exit_layers == plain.exit_layers == [6] * 16
    assert kv_chained is not None and runner.last_kv is not None
    assert (kv_chained.filled == runner.last_kv.filled).all()
    n = len(prompt) + 15  # positions written: the prompt and every generated token but the last
    for mine, theirs in zip(
        kv_chained.batch_keys + kv_chained.batch_values,
        runner.last_kv.batch_keys + runner.last_kv.batch_values,
        strict=True,
    ):
        assert (mine[:, :, :n] == theirs[:, :, :n]).all()


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_bound_exit_steps_equal_the_general_path(artifacts, family, policy, monkeypatch):
    """Steps with active exits run the bound chain (decisions inside the exit graphs), steps that meet pending
    positions included (defer's flush, verify's drafts: wide segment calls): same tokens, exit layers, drafts and
    KV cache as the general path alone, on which the chain's runner takes no step (its prompt and verify's closing
    passes run on the chain too)."""
    loaded, rt = artifacts[family]
    prompt = _prompt(6, 9, loaded.adapter.dims.vocab_size)
    thresholds = _median_thresholds(loaded, prompt, 24)
    runner = _runner(rt, policy, thresholds, new=24)
    general_steps = []  # the general path's steps: the chain takes every one
    general = Runner._steps

    def counted(self, kv, work, force_full=False):
        general_steps.append(len(work))
        return general(self, kv, work, force_full)

    monkeypatch.setattr(Runner, "_steps", counted)
    wide = []
    wide_call = DecodeChain._wide
    monkeypatch.setattr(
        DecodeChain, "_wide", lambda self, s, n, keep=True: keep and wide.append((s, n)) or wide_call(self, s, n, keep)
    )
    bound = runner.generate([prompt])[0]
    kv_bound = runner.last_kv
    assert general_steps == []
    # defer and verify met pending positions; copy never has any
    assert (len(wide) > 0) == (policy != "copy") and all(n >= 2 for _, n in wide)
    runner.cfg.bound = False  # the general path alone
    plain = runner.generate([prompt])[0]
    # some tokens exit (verify: are drafted, then kept or rolled back) and some do not
    assert plain.drafted > 0 if policy == "verify" else _mixed(plain.exit_layers), plain.exit_layers
    assert bound.token_ids == plain.token_ids and bound.exit_layers == plain.exit_layers
    assert (bound.drafted, bound.rejected_drafts) == (plain.drafted, plain.rejected_drafts)
    assert kv_bound is not None and runner.last_kv is not None
    assert (kv_bound.filled == runner.last_kv.filled).all()
    n = int(kv_bound.filled[0].min())  # positions every layer holds
    ours, theirs = kv_bound.batch_keys + kv_bound.batch_values, runner.last_kv.batch_keys + runner.last_kv.batch_values
    for mine, other in zip(ours, theirs, strict=True):
        assert (mine[:, :, :n] == other[:, :, :n]).all()


def _plan_reads(calls) -> list[tuple[str, int, str]]:
    return sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read)


def test_bound_chain_steps_record_their_host_reads(artifacts, monkeypatch):
    """Steps on the bound chain record what they read on the host in the run's placement (`Runner.step_reads`), one
    entry per step, as the device-resident path does. Full depth: each step reads what the binding plan's full-depth
    token sends to the host, the final head's token. With exits (defer: every step decides): the steps the chain
    takes read each decision's `passed` up to the exit that takes the token, then that exit's token (and, for a
    later exit scoring the first's candidate rows, the candidate it names) or the final head's token."""
    loaded, rt = artifacts["llama"]
    L = rt.manifest.num_layers
    prompt = _prompt(6, 9, loaded.adapter.dims.vocab_size)
    head = ("exit_full", L, "token")
    full = _runner(rt, exits=[], new=12, certified_head=False)  # reads as a device plan names them
    gen = full.generate([prompt])[0]
    assert _plan_reads(plan_for(rt.manifest, "cuda", [], "topk-prob").token()) == [head]
    assert len(gen.exit_layers) == 12 and full.step_reads == [[head]] * 12  # the prompt's step included

    runner = _runner(rt, "defer", _median_thresholds(loaded, prompt, 24), new=24, certified_head=False)
    general = []  # steps on the general path: none (the chain takes them, the prompt's included)
    real = Runner._steps
    monkeypatch.setattr(
        Runner, "_steps", lambda self, kv, work, *a: general.append(len(work)) or real(self, kv, work, *a)
    )
    gen = runner.generate([prompt])[0]
    assert general == [] and _mixed(gen.exit_layers), gen.exit_layers  # some tokens exit
    chain = runner._chain(rt.new_kv(1, 64), 1)
    assert chain is not None
    first, later = (chain.exits[rt.segment_of_layer[e]] for e in EXITS)
    assert (first.graph, later.graph) == (
        "candidates" if EXITS[0] in rt.candidate_graphs else "exit_full",
        "exit_local",
    )
    assert len(runner.step_reads) == len(gen.exit_layers)
    # the binding plan of the chain's steps describes the same reads (runtime/binding.py `chain`)
    plan = plan_for(rt.manifest, "cuda", EXITS, runner.cfg.signal, "defer", chain=True)
    for step, (reads, layer) in enumerate(zip(runner.step_reads, gen.exit_layers, strict=True)):
        if step == 0:  # the prompt: full depth on the general path, no exit test, only the token
            assert reads == [head]
            continue
        bound = {e: b for e, b in zip(EXITS, (first, later), strict=True)}
        want = [(bound[e].graph, e, "passed") for e in EXITS if e <= layer]
        if layer == L:
            want.append(head)
        else:
            want.append((bound[layer].graph, layer, "exit_token"))
            if bound[layer].ids is not None:  # its token is a column of the first exit's candidates
                want.append((first.graph, EXITS[0], "candidates"))
        assert sorted(reads) == sorted(want), (step, layer)
        assert sorted(reads) == _plan_reads(plan.token(None if layer == L else layer)), (step, layer)
    assert sum(r[2] == "passed" for reads in runner.step_reads for r in reads) == sum(gen.decided.values())


def _gated(loaded, art, prompt, new, shut_first):
    """A runtime of `art` whose calibration holds a gate at each exit (seeded weights), thresholds that make some
    tokens exit, and the gates (weight, bias, threshold) as the runner and the simulation take them. The gates'
    thresholds: with `shut_first`, exit 2's never opens and exit 4's always does (exit 4 picks every candidate set);
    else quantiles of the logits of the exit's states in the gated decode itself (re-set a few times, as the gates
    change which tokens follow)."""
    thresholds = _median_thresholds(loaded, prompt, new)
    g = torch.Generator().manual_seed(11)
    H = loaded.adapter.dims.hidden_size
    gates = {e: Gate(weight=(torch.randn(H, generator=g) / H**0.5).tolist(), bias=0.0) for e in EXITS}
    if shut_first:
        sim = {e: (*gates[e].arrays(), t) for e, t in zip(EXITS, (float("inf"), float("-inf")), strict=True)}
    else:
        sim = None
        for _ in range(3):
            seen: dict[int, list[torch.Tensor]] = {}
            _torch_simulation(loaded, prompt, new, thresholds, gates=sim, seen=seen)
            sim = {}
            for e, q in zip(EXITS, (0.7, 0.2), strict=True):
                logits = gate_logits(torch.stack(seen[e]), *gates[e].arrays())
                sim[e] = (*gates[e].arrays(), float(logits.quantile(q)) + 1e-4)  # off the logits: no float-noise tie
    assert sim is not None
    rt = ArtifactRuntime(art, provider="cpu")
    rt.manifest.calibration = make_calibration(loaded, {e: {"prob": thresholds[e]} for e in EXITS}).model_copy(
        update={"gates": {str(e): gate for e, gate in gates.items()}}
    )
    run_thr = {e: {"prob": thresholds[e], GATE: sim[e][2]} for e in EXITS}
    return rt, run_thr, thresholds, sim


@pytest.mark.parametrize("shut_first", [True, False], ids=["first-shut", "mixed"])
@pytest.mark.parametrize("policy", ["defer", "verify"])
def test_gated_exits_equal_the_simulation_on_both_paths(exported, family, policy, shut_first, monkeypatch):
    """Gated exits (eectl.exits.gates): a decision runs only where its gate opens, and the first exit whose gate opens
    picks the candidates. The bound chain and the general path make the same decisions, and under defer (exact KV
    when read) the same as the PyTorch simulation of that rule; verify stays lossless."""
    loaded, art = exported[family]
    prompt = _prompt(8, 9, loaded.adapter.dims.vocab_size)
    rt, thr, plain_thr, sim = _gated(loaded, art, prompt, 24, shut_first)
    # the full head's reads (the certified head's own: test_certified_head.py)
    cfg = RunConfig(exits=EXITS, thresholds=thr, policy=policy, top_k=K, max_new_tokens=24, certified_head=False)
    runner = Runner(rt, cfg)
    assert sorted(runner.gates) == EXITS
    bound = runner.generate([prompt])[0]
    # the chain records each gate's read of its exit's state, and each decision the open gates let run
    reads = [r for step in runner.step_reads for r in step]
    assert {r[1] for r in reads if r[0] == "gate"} <= set(EXITS) and sum(r[0] == "gate" for r in reads) >= sum(
        bound.decided.values()
    )
    assert sum(r[2] == "passed" for r in reads) == sum(bound.decided.values())
    runner.cfg.bound = False  # the general path alone
    plain = runner.generate([prompt])[0]
    assert bound.token_ids == plain.token_ids and bound.exit_layers == plain.exit_layers
    assert (bound.decided, bound.picked) == (plain.decided, plain.picked)
    # device-resident states (here CPU OrtValues): the gate reads the exit's state back to the host
    cfg = RunConfig(exits=EXITS, thresholds=thr, policy=policy, top_k=K, max_new_tokens=24, device_resident=True)
    on_device = Runner(rt, cfg)
    resident = on_device.generate([prompt])[0]
    reads = [r for step in on_device.step_reads for r in step if r[0] == "gate"]
    assert {r[1] for r in reads} <= set(EXITS) and len(reads) >= len(resident.exit_layers) - 1  # one per step at least
    assert resident.token_ids == plain.token_ids and resident.exit_layers == plain.exit_layers
    assert (resident.decided, resident.picked) == (plain.decided, plain.picked)
    if shut_first:  # every decode step decides at exit 4 only, on the candidates it picked itself
        steps = len(plain.exit_layers) - 1 + plain.rejected_drafts  # the first token is the prefill's
        assert plain.decided == {4: steps} and plain.picked == {4: steps}
    if policy == "defer":
        tokens, layers = _torch_simulation(loaded, prompt, 24, plain_thr, gates=sim)
        assert plain.token_ids == tokens and plain.exit_layers == layers
    else:
        full = _runner(rt, exits=[], new=24).generate([prompt])[0]
        assert plain.token_ids == full.token_ids


def test_kept_host_bindings_hand_out_copies(artifacts):
    """A host call of a segment, the embedding or the final head keeps its input and outputs bound (kv._Call.kept):
    what it returns must be the caller's, untouched by the next call on the same binding, and equal to a call on a
    fresh runtime (no binding reused)."""
    loaded, rt = artifacts["llama"]
    fresh = ArtifactRuntime(rt.folder, provider="cpu")
    H, L = rt.manifest.dims["hidden_size"], rt.manifest.num_layers
    g = np.random.default_rng(0)
    xs = [g.standard_normal((1, 1, H)).astype(np.float32) for _ in range(2)]
    kv, kv2 = rt.new_kv(1, 8), fresh.new_kv(1, 8)
    first = rt.run_segment(1, xs[0], kv, 0, states=True)
    kept = [np.array(a, copy=True) for a in first]
    kv.seek(0, 0)
    rt.run_segment(1, xs[1], kv, 0, states=True)  # the same binding, another input
    for got, was in zip(first, kept, strict=True):
        np.testing.assert_array_equal(got, was)  # not overwritten: a copy
    want = fresh.run_segment(1, xs[0], kv2, 0, states=True)
    for got, w in zip(first, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    e1 = rt.embed(np.array([[5, 9]], np.int64))
    e1_copy = e1.copy()
    rt.embed(np.array([[7, 3]], np.int64))
    np.testing.assert_array_equal(e1, e1_copy)
    t1 = rt.greedy_token(L, first[0][0])
    t1_copy = t1.copy()
    rt.greedy_token(L, xs[1][0])
    np.testing.assert_array_equal(t1, t1_copy)
    assert t1.tolist() == fresh.greedy_token(L, first[0][0]).tolist()


def test_one_rows_prompts_run_on_the_chain_bound_for_each_prompt_only(artifacts, monkeypatch):
    """One row on the CPU EP: each prompt's step runs on the bound chain (wide calls over its positions; a prompt of
    one token decides at the exits as a decode step does), with the same tokens, exit layers and cache as the
    general path's prefill, and the chain keeps no binding of a prompt's width (prompts come in any length)."""
    loaded, rt = artifacts["llama"]
    V, new = loaded.adapter.dims.vocab_size, 10
    prompts = [_prompt(11, 1, V), _prompt(12, 13, V), _prompt(13, 15, V)]  # longer than any decode step's width
    thresholds = _median_thresholds(loaded, prompts[1], 24)
    chains: list[DecodeChain] = []
    init = DecodeChain.__init__
    monkeypatch.setattr(DecodeChain, "__init__", lambda self, *a, **kw: chains.append(self) or init(self, *a, **kw))
    for policy, exits in (("verify", EXITS), ("defer", EXITS), ("defer", [])):
        runner = _runner(rt, policy, thresholds, exits=exits, new=new)
        chains.clear()
        bound = runner.generate(prompts, slots=1)
        kv_bound = runner.last_kv
        assert len(chains) == 1
        # kept: decode steps' wide calls only (pending positions: at most one per new token, and the token's own)
        assert all(n <= new + 1 for _, n in chains[0].wide), sorted(chains[0].wide)
        assert (chains[0].wide == {}) == (not exits)  # full depth: nothing pending, no wide call kept at all
        runner.cfg.bound = False  # the general path alone
        plain = runner.generate(prompts, slots=1)
        runner.cfg.bound = True
        for a, b in zip(bound, plain, strict=True):
            assert (a.token_ids, a.exit_layers) == (b.token_ids, b.exit_layers)
        if exits:
            # some tokens exit (verify: are drafted) and some do not
            assert any(g.drafted > 0 if policy == "verify" else _mixed(g.exit_layers) for g in bound)
        assert kv_bound is not None and runner.last_kv is not None  # the last prompt's cache, in the slot
        assert (kv_bound.filled == runner.last_kv.filled).all()
        n = int(kv_bound.filled[0].min())
        for mine, other in zip(
            kv_bound.batch_keys + kv_bound.batch_values,
            runner.last_kv.batch_keys + runner.last_kv.batch_values,
            strict=True,
        ):
            assert (mine[:, :, :n] == other[:, :, :n]).all()
