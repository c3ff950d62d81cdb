"""Steps with active exits executed as the binding plan says (`RunConfig.device_resident`): hidden states, KV and
full logits stay device values between graphs (here CPU OrtValues on the CPU EP: the same code as on CUDA), and the
tokens equal the host path's for every policy and signal, one row and batched rows. What the executing path reads
on the host per step is recorded in the run's own placement (runtime/placement.py, `Runner.step_reads`) and checked
against the plan."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from eectl.exits.signals import get_signal
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.binding import plan_for
from eectl.runtime.ort import DeviceView, cuda_usable
from eectl.runtime.placement import HOST
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K
from tests.simulation import Simulation

FAMILIES = ["llama", "qwen3", "gemma3_text"]
CASES = [
    ("copy", "topk-prob"),
    ("defer", "topk-prob"),
    ("verify", "topk-prob"),
    ("defer", "full-prob"),
    ("copy", "full-margin"),
    ("defer", "cosine"),
    ("verify", "cosine-min"),
    ("copy", "cosine-min"),
]


@pytest.fixture(scope="module")
def runtimes(exported):
    return {fam: (exported[fam][0], ArtifactRuntime(exported[fam][1], provider="cpu")) for fam in FAMILIES}


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (3 + 4 * i,), generator=g).tolist() for i in range(n)]


def _config(signal: str, policy: str, thresholds: dict, resident: bool, new: int = 14) -> RunConfig:
    return RunConfig(
        exits=list(EXPORT_EXITS),
        thresholds=thresholds,
        signal=signal,
        policy=policy,
        top_k=EXPORT_TOP_K,
        max_new_tokens=new,
        device_resident=resident,
    )


def _simulation(loaded, signal: str, policy: str, thresholds: dict, **kw) -> Simulation:
    """The run's reference (tests/simulation.py) with the artifact's exits active: its signal, policy, K and
    thresholds (`kw`: heads, gates, sampling)."""
    return Simulation(
        loaded.adapter,
        EXPORT_EXITS,
        thresholds,
        signal=signal,
        policy=policy,
        top_k=EXPORT_TOP_K,
        cuts=EXPORT_EXITS,
        **kw,
    )


def _thresholds(loaded, signal: str, prompts, heads: dict | None = None, new: int = 14) -> dict:
    """Per exit, the 70th percentile of the signal's values where nothing exits (the simulation's record of each
    test, `Row.values`): some tokens exit."""
    criterion = get_signal(signal).criteria[0]
    never = {e: {criterion: float("inf")} for e in EXPORT_EXITS}
    rows = _simulation(loaded, signal, "defer", never, heads=heads).generate(prompts, new)
    seen = {e: [v for r in rows for v in r.values.get(e, [])] for e in EXPORT_EXITS}
    assert all(seen.values()), seen  # every exit tested some tokens
    return {e: {criterion: float(np.quantile(v, 0.7))} for e, v in seen.items()}


@pytest.mark.parametrize("fam", FAMILIES)
def test_resident_exit_steps_equal_the_host_path(runtimes, fam):
    """Every policy and signal family, one row and four rows: the plan-executing path's tokens and exit layers are
    the host path's, and some tokens exit (so exit steps, deferred positions and rollbacks run resident)."""
    loaded, rt = runtimes[fam]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 4)
    thresholds = {s: _thresholds(loaded, s, prompts) for s in {s for _, s in CASES}}
    for policy, signal in CASES:
        for rows in (prompts[:1], prompts):
            host = Runner(rt, _config(signal, policy, thresholds[signal], False)).generate(rows)
            runner = Runner(rt, _config(signal, policy, thresholds[signal], True))
            got = runner.generate(rows)
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (policy, signal, len(rows))
            assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (policy, signal, len(rows))
            assert runner.step_reads and runner.place is HOST  # it ran resident; calls after it run on the host
        exited = any(e < rt.manifest.num_layers for g in host for e in g.exit_layers[1:])
        assert exited or any(g.drafted for g in host), (policy, signal)  # verify: drafts rolled back still exited


@pytest.mark.parametrize(("policy", "signal"), [("defer", "topk-prob"), ("copy", "full-prob"), ("defer", "cosine")])
def test_what_the_executor_reads_per_step_is_what_the_plan_sends_to_the_host(runtimes, policy, signal, monkeypatch):
    """One row: a device-resident run steps on the bound chain with device buffers (its states OrtValues; on the CPU
    EP, device memory is host memory), and each step's host reads, recorded where an output is copied to host
    memory, are exactly the host outputs of the chain's plan for that token (its exit layer): none is a hidden state,
    KV or the full logits. States handed to a host-decided exit test are DeviceViews."""
    import onnxruntime as ort

    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 1)
    thresholds = _thresholds(loaded, signal, prompts)
    cfg = dataclasses.replace(_config(signal, policy, thresholds, True, new=16), certified_head=False)
    runner = Runner(rt, cfg)
    states = []
    real = runner.exit_test.rows

    def spy(layer, asks, place):
        states.extend(a.hidden for a in asks.values())
        return real(layer, asks, place)

    monkeypatch.setattr(runner.exit_test, "rows", spy)
    gen = runner.generate(prompts)[0]
    chain = runner._kept.chain if runner._kept is not None else None
    assert chain is not None and chain.device and all(isinstance(h, ort.OrtValue) for h in chain.hops)
    in_graph = signal == "topk-prob"  # the exit graphs decide the softmax signals (runtime/graph_decide.py)
    assert chain.in_graph == in_graph and bool(states) != in_graph
    assert all(isinstance(h, DeviceView) for h in states)
    plan = plan_for(rt.manifest, "cuda", EXPORT_EXITS, signal, policy, chain=True)
    L = rt.manifest.num_layers
    assert len(runner.step_reads) == len(gen.exit_layers)
    for step, (reads, layer) in enumerate(zip(runner.step_reads, gen.exit_layers, strict=True)):
        calls = plan.token(None if layer == L else layer)
        want = sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read)
        if step == 0:  # the prompt: full depth with no exit test, only the token
            want = [("exit_full", L, "token")]
        assert sorted(reads) == want, (step, layer)
    assert any(layer < L for layer in gen.exit_layers)


def _in_turns(runners: list[Runner], prompts: list[list[int]]) -> tuple[list, list[int]]:
    """Each runner's generate in a thread of its own, taking turns one `on_step` at a time (as bench's configurations
    do, evaluate/timing.py `_turns`). Returns each runner's generations and the order the turns were taken in."""
    n = len(runners)
    cond = threading.Condition()
    at, done, order = [0], set(), []
    out: list = [None] * n
    failed: list[BaseException] = []

    def wait(i: int) -> None:
        assert cond.wait_for(lambda: at[0] == i, timeout=300), "a turn never came"

    def hand_on(i: int, finished: bool = False) -> None:
        with cond:
            if finished:
                done.add(i)
            else:
                order.append(i)
            nxt = [j for j in [*range(i + 1, n), *range(i + 1)] if j not in done]
            at[0] = nxt[0] if nxt else -1
            cond.notify_all()
            if not finished:
                wait(i)

    def run(i: int) -> None:
        with cond:
            wait(i)
        try:
            out[i] = runners[i].generate(prompts, on_step=lambda p, confirmed: hand_on(i))
        except BaseException as exc:  # re-raised in the test's thread
            failed.append(exc)
        finally:
            hand_on(i, finished=True)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if failed:
        raise failed[0]
    return out, order


@pytest.mark.parametrize(
    ("policy", "signal"), [("defer", "topk-prob"), ("verify", "topk-prob"), ("copy", "full-prob"), ("defer", "cosine")]
)
def test_runners_sharing_a_runtime_keep_their_own_placement(runtimes, policy, signal):
    """#28: where a run's states live is the run's, not the runtime's. Two Runners on one ArtifactRuntime, one
    device-resident and one not, stepping in turns from two threads, each give exactly the tokens and exit layers
    they give alone, and each records only its own host reads, one row and batched."""
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    thresholds = _thresholds(loaded, signal, prompts)
    exited = False  # some tokens exit (verify: drafts rolled back still exited), so exit steps run in turns
    for rows in (prompts[:1], prompts):
        alone = {}
        for resident in (True, False):
            runner = Runner(rt, _config(signal, policy, thresholds, resident))
            alone[resident] = (runner.generate(rows), runner.step_reads)
        # both step on the bound chain (the resident one on device buffers) and record what they read on the host
        assert alone[True][1] and alone[False][1]
        L = rt.manifest.num_layers
        exited |= any(g.drafted or min(g.exit_layers[1:], default=L) < L for g in alone[True][0])
        runners = [Runner(rt, _config(signal, policy, thresholds, r)) for r in (True, False)]
        got, order = _in_turns(runners, rows)
        assert order[:4] == [0, 1, 0, 1]  # they did take turns, step by step
        for runner, gens, resident in zip(runners, got, (True, False), strict=True):
            want, reads = alone[resident]
            assert [g.token_ids for g in gens] == [g.token_ids for g in want], (resident, len(rows))
            assert [g.exit_layers for g in gens] == [g.exit_layers for g in want], (resident, len(rows))
            assert runner.step_reads == reads, (resident, len(rows))
            assert runner.place is HOST
    assert exited
    assert HOST.reads == [] and HOST.steps == []  # the host's placement records nothing


def test_device_views_take_only_contiguous_indexing():
    """A DeviceView is indexed like the numpy arrays the host path slices, and refuses strided forms."""
    arr = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    import onnxruntime as ort

    view = DeviceView.of(ort.OrtValue.ortvalue_from_numpy(arr))
    item = arr.dtype.itemsize
    cases = [((0, slice(-1, None)), arr[0, -1:]), ((1, -1), arr[1, -1]), ((0, slice(None, -1)), arr[0, :-1])]
    for index, want in cases:
        got = view[index]
        offset = (got.ptr - view.ptr) // item
        assert got.shape == want.shape and np.array_equal(arr.ravel()[offset : offset + want.size], want.ravel())
    assert view[1:2].shape == (1, 3, 4) and view[1].reshape(3, 1, 4).shape == (3, 1, 4)
    with pytest.raises(IndexError):
        view[:, -1]  # noqa: B018 (strided: every row's last position)


@pytest.fixture(scope="module")
def block_runtime(tiny_dirs, tmp_path_factory):
    from tests.test_block_exits import EXITS, K, _block_heads

    loaded = load_model(str(tiny_dirs["qwen3"]))
    root = tmp_path_factory.mktemp("resident-blocks")
    opts = ExportOptions(exits=EXITS, top_k=K, profile_costs=False, validate=False)
    heads = _block_heads(loaded.adapter)
    export_artifact(loaded, root / "a", opts, heads=heads)
    return loaded, heads, ArtifactRuntime(root / "a", provider="cpu")


def test_block_heads_run_resident_and_are_in_the_plan(block_runtime):
    """Block exit heads: the plan lists each active block after its segment (and its K/V-only twin under copy), with
    nothing read on the host; the resident path gives the host path's tokens, one row and batched."""
    loaded, heads, rt = block_runtime
    plan = plan_for(rt.manifest, "cuda", EXPORT_EXITS, "topk-prob", "copy")
    calls = plan.token(EXPORT_EXITS[0])
    assert [c.at for c in calls if c.graph == "block"] == [EXPORT_EXITS[0]]
    assert [c.at for c in calls if c.graph == "block_kv"] == [EXPORT_EXITS[1]]
    assert not plan.host_copies([c for c in calls if c.graph.startswith("block")])
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    thresholds = _thresholds(loaded, "topk-prob", prompts, heads=heads)
    for policy in ("defer", "verify", "copy"):
        for rows in (prompts[:1], prompts):
            host = Runner(rt, _config("topk-prob", policy, thresholds, False)).generate(rows)
            got = Runner(rt, _config("topk-prob", policy, thresholds, True)).generate(rows)
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (policy, len(rows))
            assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (policy, len(rows))


@pytest.mark.parametrize("fam", FAMILIES)
def test_the_chain_binds_and_steps_device_buffers(runtimes, fam, monkeypatch):
    """On a device provider the bound chain's hops, logits and scratch outputs are OrtValues (`DecodeChain._buffer`),
    stood in here by CPU OrtValues: the chain binds them (an OrtValue's shape is a method, not an attribute: the
    first CUDA run failed there, in export's cost timing and in every CUDA test) and its full-depth steps give the
    host buffers' tokens, one position at a time from an empty cache; export's timed chain step runs too."""
    import onnxruntime as ort

    from eectl.plan.step_calls import chain_step_call
    from eectl.runtime.chain import DecodeChain

    loaded, rt = runtimes[fam]
    tokens = _prompts(loaded.adapter.dims.vocab_size, 3)[2]  # 11 tokens

    def steps() -> list[int]:
        kv = rt.new_kv(1, 16)
        chain = DecodeChain(rt, kv, 0)
        return [chain.step({0: t})[0] for t in tokens]

    host = steps()
    made: list[object] = []

    def device_buffer(self, shape, dtype):
        buf = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, "cpu", 0)
        self._keep.append(buf)
        made.append(buf)
        return buf

    monkeypatch.setattr(DecodeChain, "_buffer", device_buffer)
    assert steps() == host and len(host) == len(tokens)
    assert made and all(isinstance(b, ort.OrtValue) for b in made)  # the stand-in did bind OrtValues
    call = chain_step_call(rt, 4)
    assert call is not None and list(call()) == [0]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_resident_exit_steps_on_cuda_equal_the_host_buffers_and_the_simulation(tiny_dirs, tmp_path):
    """On the CUDA EP, fp16: exit steps on the bound chain with the states in device buffers (resident) give the
    tokens and exit layers of the chain with them in host buffers (the same graphs on the same device), one row and a
    batch in slots; verify's are full depth's; the resident runs read only scalars per row on the host. fp32: greedy
    (resident) and sampled runs under defer and copy give the simulation's tokens and exit layers (tests/simulation.py:
    fp16 rounding is not the torch model's, so only fp32 is held to it)."""
    loaded = load_model(str(tiny_dirs["llama"]))
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    scalars = {"token", "passed", "exit_token", "candidates", "candidate_logits", "logsumexp", "cosine"}
    L = loaded.adapter.num_layers
    rts = {}
    for dtype in ("fp16", "fp32"):
        export_artifact(loaded, tmp_path / dtype, ExportOptions(exits=EXPORT_EXITS, top_k=EXPORT_TOP_K, dtype=dtype))
        rts[dtype] = ArtifactRuntime(tmp_path / dtype, provider="cuda")
    for signal in ("topk-prob", "full-prob", "cosine"):
        thresholds = _thresholds(loaded, signal, prompts)
        exited = False
        for slots in (None, 2):
            full = Runner(rts["fp16"], RunConfig(exits=[], thresholds={}, max_new_tokens=14))
            want_full = [g.token_ids for g in full.generate(prompts, slots=slots)]
            for policy in ("copy", "defer", "verify"):
                cfg = _config(signal, policy, thresholds, False)
                host = Runner(rts["fp16"], cfg).generate(prompts, slots=slots)
                runner = Runner(rts["fp16"], dataclasses.replace(cfg, device_resident=True))
                got = runner.generate(prompts, slots=slots)
                assert [g.token_ids for g in got] == [g.token_ids for g in host], (signal, policy, slots)
                assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (signal, policy, slots)
                assert {key for reads in runner.step_reads for _, _, key in reads} <= scalars
                if policy == "verify":  # lossless: full depth's tokens, its drafts proposed and checked
                    assert [g.token_ids for g in got] == want_full, (signal, slots)
                    assert any(g.drafted for g in got), (signal, slots)
                exited |= any(e < L for g in got for e in g.exit_layers[1:])
        assert exited, signal
        for policy in ("copy", "defer"):
            for temperature in (0.0, 0.8):  # greedy runs resident; sampled ones keep their states on the host
                cfg = dataclasses.replace(_config(signal, policy, thresholds, True), temperature=temperature)
                got = Runner(rts["fp32"], cfg).generate(prompts, slots=2)
                sim = _simulation(loaded, signal, policy, thresholds, temperature=temperature, seed=cfg.seed)
                want = sim.generate(prompts, cfg.max_new_tokens, slots=2)
                assert [g.token_ids for g in got] == [w.tokens for w in want], (signal, policy, temperature)
                assert [g.exit_layers for g in got] == [w.layers for w in want], (signal, policy, temperature)
                assert any(e < L for w in want for e in w.layers[1:]), (signal, policy, temperature)


@pytest.mark.parametrize("fam", FAMILIES)
def test_device_buffers_take_prompts_drafts_and_sampling_with_host_states(runtimes, fam, monkeypatch):
    """A chain whose buffers are device memory (as full depth's on a device provider) in a run whose states are on
    the host (nothing resident: `Runner._on_device` False) takes its prompts on the chain too (embedded on the host,
    joined into the device buffers): one row and a batch in slots, greedy and sampled, the tokens of the host chain's
    run. A device-resident run with drafts from the context (no exit) steps on a device chain, drafts proposed, with
    full depth's tokens (verify is lossless)."""
    from eectl.runtime.chain import DecodeChain

    loaded, rt = runtimes[fam]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 4)

    def full(temperature: float, device: bool):
        cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=10, temperature=temperature, seed=3)
        runner = Runner(rt, cfg)
        got = [runner.generate(prompts[:1])[0].token_ids, [g.token_ids for g in runner.generate(prompts, slots=3)]]
        chain = runner._kept.chain if runner._kept is not None else None
        assert chain is not None and chain.device == device
        return got

    host = {t: full(t, False) for t in (0.0, 0.9)}
    real = DecodeChain.__init__

    def on_device(self, *args, **kwargs):  # full depth's default off the CPU EP: device buffers
        asked = kwargs.pop("device", args[9] if len(args) > 9 else None)
        real(self, *args[:9], **kwargs, device=True if asked is None else asked)

    monkeypatch.setattr(DecodeChain, "__init__", on_device)
    for t in (0.0, 0.9):
        assert full(t, True) == host[t], t
    monkeypatch.undo()
    repetitive = [p * 3 for p in prompts[:2]]
    cfg = RunConfig(exits=[], thresholds={}, policy="verify", max_new_tokens=12, prompt_drafts=4, device_resident=True)
    runner = Runner(rt, cfg)
    got = runner.generate(repetitive, slots=2)
    assert runner._kept is not None and runner._kept.chain is not None and runner._kept.chain.device
    assert runner.step_reads and sum(g.prompt_drafted for g in got) > 0  # resident, and drafts were proposed
    want = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=12)).generate(repetitive, slots=2)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
