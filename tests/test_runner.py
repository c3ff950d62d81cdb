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
from eectl.exits.gates import gate_logits
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
from tests.simulation import Simulation, assert_cache

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


def test_an_artifact_without_the_in_graph_token_is_refused(artifacts, tmp_path):
    """An artifact whose final exit graph lists no greedy token output (exported before it existed), or whose
    segments output no block states for the cosine-min signal: one line naming the fix, before anything runs; the
    same artifact's graphs otherwise load and run (full depth and a signal that needs no block states)."""
    import shutil

    loaded, rt = artifacts["llama"]
    old = tmp_path / "old"
    shutil.copytree(rt.folder, old)
    doc = json.loads((old / "manifest.json").read_text())
    for e in doc["exits"]:
        del e["full"]["outputs"]["token"]
    (old / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="exported by an older eectl") as err:
        _runner(ArtifactRuntime(old, provider="cpu"), exits=[], new=12)
    assert "export the artifact again" in str(err.value.hint)
    shutil.rmtree(old)
    shutil.copytree(rt.folder, old)
    doc = json.loads((old / "manifest.json").read_text())
    for seg in doc["segments"]:
        seg["graph"]["outputs"].pop("layer_states", None)
    (old / "manifest.json").write_text(json.dumps(doc))
    stale = ArtifactRuntime(old, provider="cpu", verify=False)
    with pytest.raises(ArtifactError, match="exported by an older eectl"):
        Runner(stale, RunConfig(exits=EXITS, thresholds={e: {"cosine": 0.9} for e in EXITS}, signal="cosine-min"))
    prompt = _prompt(3, 9, loaded.adapter.dims.vocab_size)
    want = _runner(rt, exits=[], new=8).generate([prompt])[0].token_ids
    assert _runner(stale, exits=[], new=8).generate([prompt])[0].token_ids == want


def _thr(thresholds: dict[int, float]) -> dict[int, dict[str, float]]:
    return {e: {"prob": t} for e, t in thresholds.items()}


def _sim(loaded, thresholds, policy="defer", exits=EXITS, **kw) -> Simulation:
    """The runner's torch reference (tests/simulation.py) under topk-prob at `exits` of the five-family artifacts."""
    return Simulation(loaded.adapter, exits, _thr(thresholds), policy=policy, top_k=K, cuts=EXPORT_EXITS, **kw)


def _median_thresholds(loaded, prompt, new=20):
    """Thresholds that make some tokens exit and others not: 80th percentile of each exit's probability."""
    probs = _sim(loaded, {e: float("inf") for e in EXITS}).generate([prompt], new)[0].values
    return {e: float(torch.tensor(p).quantile(0.8)) for e, p in probs.items()}


def _mixed(layers: list[int]) -> bool:
    return any(x < 6 for x in layers[1:]) and any(x == 6 for x in layers[1:])


@pytest.mark.parametrize("resident", [False, True], ids=["host", "device-buffers"])
@pytest.mark.parametrize("policy", ["defer", "copy"])
def test_exits_equal_the_torch_simulation(artifacts, family, policy, resident):
    """The executor, its states in host buffers or in device buffers (device-resident; on the CPU EP device memory is
    host memory), against the PyTorch simulation (tests/simulation.py): defer's cache is the full model's, copy's
    skipped layers hold K/V projected from the exit state. The same tokens, exit layers, decisions and cache."""
    loaded, rt = artifacts[family]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    thresholds = _median_thresholds(loaded, prompt)
    runner = _runner(rt, policy, thresholds, new=20, device_resident=resident)
    gen = runner.generate([prompt])[0]
    ref = _sim(loaded, thresholds, policy).generate([prompt], 20)[0]
    assert _mixed(ref.layers), ref.layers  # some tokens exit early and some do not: deferred or copied KV exercised
    assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers and gen.decided == ref.decided
    assert runner.last_kv is not None
    assert_cache(runner.last_kv, 0, ref, rt.manifest)


def test_some_tokens_exit_early(artifacts):
    loaded, rt = artifacts["llama"]
    prompt = _prompt(2, 9, loaded.adapter.dims.vocab_size)
    gen = _runner(rt, "defer", {2: 0.0, 4: 0.0}, new=10).generate([prompt])[0]
    assert gen.exit_layers == [6] + [2] * 9  # threshold 0: every decode token takes the first exit


@pytest.mark.parametrize("resident", [False, True], ids=["host", "device-buffers"])
def test_verify_equals_full_depth(artifacts, family, resident):
    """Verify, its states in host or device buffers, against full depth (tested against transformers' greedy
    above)."""
    loaded, rt = artifacts[family]
    prompt = _prompt(3, 10, loaded.adapter.dims.vocab_size)
    full = _runner(rt, exits=[], new=30).generate([prompt])[0]
    kw = {"device_resident": resident}
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
    deeper calls, or waiting with ride_along off) give each row exactly its tokens and exits alone, every policy;
    under defer and copy those of the PyTorch simulation of the rows, with its cache, row by row."""
    from eectl.runtime import chain_rows

    loaded, rt = artifacts[family]
    v = loaded.adapter.dims.vocab_size
    prompts = [_prompt(5, 7, v), _prompt(6, 12, v), _prompt(7, 3, v), _prompt(8, 5, v)]
    thresholds = _median_thresholds(loaded, prompts[0], 15)
    rides: list[int] = []  # the deeper calls an exited row's state rode in
    rode = chain_rows._rode
    monkeypatch.setattr(chain_rows, "_rode", lambda *a: rides.append(1) or rode(*a))
    mixed = []
    for policy in rt.manifest.kv_policies:  # river needs an artifact with river copies: tests/test_river.py
        alone = [_runner(rt, policy, thresholds, new=15).generate([p])[0] for p in prompts]
        ref = _sim(loaded, thresholds, policy).generate(prompts, 15) if policy in ("defer", "copy") else None
        for ride_along in (True, False):
            runner = _runner(rt, policy, thresholds, new=15, ride_along=ride_along)
            batch = runner.generate(prompts)
            mixed.append(any(_mixed(g.exit_layers) for g in batch))
            assert [g.token_ids for g in batch] == [g.token_ids for g in alone], (policy, ride_along)
            assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone], (policy, ride_along)
            if ref is not None:
                assert [g.token_ids for g in batch] == [r.tokens for r in ref], (policy, ride_along)
                assert [g.exit_layers for g in batch] == [r.layers for r in ref], (policy, ride_along)
                for row, r in enumerate(ref):
                    assert_cache(runner.last_kv, row, r, rt.manifest)
    assert any(mixed) and rides  # rows exited at different depths, and their states rode along


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
def test_sampled_decode_equals_the_simulation(artifacts, family, policy):
    """Sampling (temperature, top-p): one row at full depth or with exits decided in the graphs (the exiting token
    sampled from its K candidates), and a batch of rows, its prompts included (every row's final logits picked in
    row order) and prompts joining freed slots. Same seed, same tokens, exit layers and KV cache as the PyTorch
    simulation drawing from one generator in the runner's order."""
    loaded, rt = artifacts[family]
    V = loaded.adapter.dims.vocab_size
    prompts = [_prompt(31, 7, V), _prompt(32, 5, V), _prompt(33, 9, V)]
    exits = [] if policy == "full" else EXITS
    thresholds = {} if policy == "full" else _median_thresholds(loaded, prompts[0], 20)
    how = "defer" if policy == "full" else policy
    # (prompts, slots): one, all at once, and 3 prompts in 2 slots (a batch with exits: runtime/chain_rows.py)
    for batch, slots in [(prompts[:1], None), (prompts, None), (prompts, 2)]:
        sampled = {"temperature": 1.3, "top_p": 0.9, "seed": 7}
        runner = _runner(rt, how, thresholds, exits, 20, **sampled)
        got = runner.generate(batch, slots=slots)
        ref = _sim(loaded, thresholds, how, exits, **sampled).generate(batch, 20, slots=slots)
        assert [g.token_ids for g in got] == [r.tokens for r in ref], slots
        assert [g.exit_layers for g in got] == [r.layers for r in ref], slots
        if exits and slots is None:
            assert any(_mixed(r.layers) for r in ref), [r.layers for r in ref]
        assert_cache(runner.last_kv, 0, ref[-1] if slots else ref[0], rt.manifest)
    # sampled, not greedy: the greedy answer differs
    greedy = _runner(rt, how, thresholds, exits, 20).generate(prompts[:1])[0]
    assert greedy.token_ids != _sim(loaded, thresholds, how, exits, **sampled).generate(prompts[:1], 20)[0].tokens


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


def test_full_depth_cache_equals_the_torch_model(artifacts, family):
    """Full-depth greedy decode of one row on the bound chain, its prompt included (wide calls): the tokens and the
    KV cache of the torch model decoding the same sequence."""
    loaded, rt = artifacts[family]
    prompt = _prompt(5, 7, loaded.adapter.dims.vocab_size)
    runner = _runner(rt, exits=[], new=16)
    gen = runner.generate([prompt])[0]
    ref = _sim(loaded, {}, exits=[]).generate([prompt], 16)[0]
    assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers == [6] * 16
    assert runner.last_kv is not None
    assert runner.last_kv.filled[0, :6].tolist() == [len(prompt) + 15] * 6  # every token fed but the last
    assert_cache(runner.last_kv, 0, ref, rt.manifest)


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_exit_steps_meet_pending_positions_in_wide_calls(artifacts, family, policy, monkeypatch):
    """Steps with active exits (decisions inside the exit graphs), steps that meet pending positions included
    (defer's flush, verify's drafts: wide segment calls): the tokens, exit layers, decisions and cache of the
    PyTorch simulation (defer, copy), or full depth's tokens and cache (verify: drafts checked, wrong ones rolled
    back)."""
    loaded, rt = artifacts[family]
    prompt = _prompt(6, 9, loaded.adapter.dims.vocab_size)
    thresholds = _median_thresholds(loaded, prompt, 24)
    runner = _runner(rt, policy, thresholds, new=24)
    wide = []
    wide_call = DecodeChain._wide
    monkeypatch.setattr(
        DecodeChain, "_wide", lambda self, s, n, keep=True: keep and wide.append((s, n)) or wide_call(self, s, n, keep)
    )
    gen = runner.generate([prompt])[0]
    # defer and verify met pending positions; copy never has any
    assert (len(wide) > 0) == (policy != "copy") and all(n >= 2 for _, n in wide)
    assert runner.last_kv is not None
    if policy == "verify":
        ref = _sim(loaded, {}, exits=[]).generate([prompt], 24)[0]
        assert gen.drafted > 0 and gen.rejected_drafts > 0  # drafts were kept and rolled back
        assert gen.token_ids == ref.tokens
    else:
        ref = _sim(loaded, thresholds, policy).generate([prompt], 24)[0]
        assert _mixed(ref.layers), ref.layers  # some tokens exit and some do not
        assert (gen.token_ids, gen.exit_layers, gen.decided) == (ref.tokens, ref.layers, ref.decided)
    assert_cache(runner.last_kv, 0, ref, rt.manifest)


def _plan_reads(calls) -> list[tuple[str, int, str]]:
    return sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read)


def test_bound_chain_steps_record_their_host_reads(artifacts):
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
    gen = runner.generate([prompt])[0]
    assert _mixed(gen.exit_layers), gen.exit_layers  # some tokens exit
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
        if step == 0:  # the prompt: full depth, no exit test, only the token
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
            seen = _sim(loaded, thresholds, gates=sim).generate([prompt], new)[0].states
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
def test_gated_exits_equal_the_simulation(exported, family, policy, shut_first):
    """Gated exits (eectl.exits.gates): a decision runs only where its gate opens, and the first exit whose gate opens
    picks the candidates. Under defer, the states in host or device buffers, the same tokens, exit layers and
    decisions as the PyTorch simulation of that rule; verify stays lossless."""
    loaded, art = exported[family]
    prompt = _prompt(8, 9, loaded.adapter.dims.vocab_size)
    rt, thr, plain_thr, sim = _gated(loaded, art, prompt, 24, shut_first)
    # the full head's reads (the certified head's own: test_certified_head.py)
    cfg = RunConfig(exits=EXITS, thresholds=thr, policy=policy, top_k=K, max_new_tokens=24, certified_head=False)
    runner = Runner(rt, cfg)
    assert sorted(runner.gates) == EXITS
    host = runner.generate([prompt])[0]
    # the chain records each gate's read of its exit's state, and each decision the open gates let run
    reads = [r for step in runner.step_reads for r in step]
    assert {r[1] for r in reads if r[0] == "gate"} <= set(EXITS) and sum(r[0] == "gate" for r in reads) >= sum(
        host.decided.values()
    )
    assert sum(r[2] == "passed" for r in reads) == sum(host.decided.values())
    # device-resident states (here CPU OrtValues): the gate reads the exit's state back to the host
    cfg = RunConfig(exits=EXITS, thresholds=thr, policy=policy, top_k=K, max_new_tokens=24, device_resident=True)
    on_device = Runner(rt, cfg)
    resident = on_device.generate([prompt])[0]
    reads = [r for step in on_device.step_reads for r in step if r[0] == "gate"]
    assert {r[1] for r in reads} <= set(EXITS) and len(reads) >= len(resident.exit_layers) - 1  # one per step at least
    assert resident.token_ids == host.token_ids and resident.exit_layers == host.exit_layers
    assert (resident.decided, resident.picked) == (host.decided, host.picked)
    if shut_first:  # every decode step decides at exit 4 only, on the candidates it picked itself
        steps = len(host.exit_layers) - 1 + host.rejected_drafts  # the first token is the prefill's
        assert host.decided == {4: steps} and host.picked == {4: steps}
    if policy == "defer":
        ref = _sim(loaded, plain_thr, gates=sim).generate([prompt], 24)[0]
        assert (host.token_ids, host.exit_layers, host.decided) == (ref.tokens, ref.layers, ref.decided)
    else:
        full = _runner(rt, exits=[], new=24).generate([prompt])[0]
        assert host.token_ids == full.token_ids


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
    one token decides at the exits as a decode step does), with the tokens, exit layers and cache of the PyTorch
    simulation (defer, full depth) or of full depth (verify), and the chain keeps no binding of a prompt's width
    (prompts come in any length)."""
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
        got = runner.generate(prompts, slots=1)
        assert len(chains) == 1
        # kept: decode steps' wide calls only (pending positions: at most one per new token, and the token's own)
        assert all(n <= new + 1 for _, n in chains[0].wide), sorted(chains[0].wide)
        assert (chains[0].wide == {}) == (not exits)  # full depth: nothing pending, no wide call kept at all
        ref = _sim(loaded, thresholds, exits=[] if policy == "verify" else exits).generate(prompts, new, slots=1)
        assert [g.token_ids for g in got] == [r.tokens for r in ref], (policy, exits)
        if policy != "verify":
            assert [g.exit_layers for g in got] == [r.layers for r in ref], (policy, exits)
        if exits:
            # some tokens exit (verify: are drafted) and some do not; the one-token prompt decided at the exits
            assert any(g.drafted > 0 if policy == "verify" else _mixed(g.exit_layers) for g in got)
            assert sum(got[0].decided.values()) > 0
        assert runner.last_kv is not None  # the last prompt's cache, in the slot
        assert_cache(runner.last_kv, 0, ref[-1], rt.manifest)
