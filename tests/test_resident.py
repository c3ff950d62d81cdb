"""Steps with active exits executed as the binding plan says (`RunConfig.device_resident`): hidden states, KV and
full logits stay device values between graphs (here CPU OrtValues on the CPU EP: the same code as on CUDA), and the
tokens equal the host path's for every policy and signal, one row and batched rows. What the executing path reads
on the host per step is recorded by the runtime itself (`ArtifactRuntime.host_reads`) and checked against the plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.exits.signals import Signal
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.binding import plan_for
from eectl.runtime.ort import DeviceView, cuda_usable
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K

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


def _thresholds(rt, signal: str, prompts, monkeypatch) -> dict:
    """Per exit, the 70th percentile of the signal's values on the host path (nothing exiting): some tokens exit."""
    seen: dict[int, list[float]] = {}
    real = Signal.passes

    def record(self, values, thresholds):
        layer = next(e for e, t in never.items() if t is thresholds)
        seen.setdefault(layer, []).extend(np.asarray(values[self.criteria[0]], np.float64).ravel().tolist())
        return real(self, values, thresholds)

    criteria = {"topk-prob": "prob", "full-prob": "prob", "full-margin": "margin"}.get(signal, "cosine")
    never = {e: {criteria: float("inf")} for e in EXPORT_EXITS}
    with monkeypatch.context() as m:
        m.setattr(Signal, "passes", record)
        m.setattr(Runner, "_chain", lambda self, kv, rows: None)  # the general host path (one row: not the chain)
        Runner(rt, _config(signal, "defer", never, False)).generate(prompts)
    return {e: {criteria: float(np.quantile(v, 0.7))} for e, v in seen.items()}


@pytest.mark.parametrize("fam", FAMILIES)
def test_resident_exit_steps_equal_the_host_path(runtimes, fam, monkeypatch):
    """Every policy and signal family, one row and four rows: the plan-executing path's tokens and exit layers are
    the host path's, and some tokens exit (so exit steps, deferred positions and rollbacks run resident)."""
    loaded, rt = runtimes[fam]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 4)
    thresholds = {s: _thresholds(rt, s, prompts, monkeypatch) for s in {s for _, s in CASES}}
    for policy, signal in CASES:
        for rows in (prompts[:1], prompts):
            host = Runner(rt, _config(signal, policy, thresholds[signal], False)).generate(rows)
            runner = Runner(rt, _config(signal, policy, thresholds[signal], True))
            got = runner.generate(rows)
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (policy, signal, len(rows))
            assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (policy, signal, len(rows))
            assert runner.step_reads and not rt.resident  # it ran resident, and the runtime is back to host mode
        exited = any(e < rt.manifest.num_layers for g in host for e in g.exit_layers[1:])
        assert exited or any(g.drafted for g in host), (policy, signal)  # verify: drafts rolled back still exited


@pytest.mark.parametrize(("policy", "signal"), [("defer", "topk-prob"), ("copy", "full-prob"), ("defer", "cosine")])
def test_what_the_executor_reads_per_step_is_what_the_plan_sends_to_the_host(runtimes, policy, signal, monkeypatch):
    """One row: each step's host reads, recorded where the runtime copies an output to host memory, are exactly
    the host outputs of the plan's calls for that token (its exit layer), and none is a hidden state, KV or the full
    logits. The states handed between graphs are DeviceViews, which have no host read at all."""
    loaded, rt = runtimes["llama"]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 1)
    thresholds = _thresholds(rt, signal, prompts, monkeypatch)
    runner = Runner(rt, _config(signal, policy, thresholds, True, new=16))
    states = []
    real = rt.exit_local if signal == "topk-prob" else rt.exit_full

    def spy(layer, hidden, *a, **k):
        states.append(hidden)
        return real(layer, hidden, *a, **k)

    monkeypatch.setattr(rt, real.__name__, spy)
    gen = runner.generate(prompts)[0]
    assert states and all(isinstance(h, DeviceView) for h in states)
    plan = plan_for(rt.manifest, "cuda", EXPORT_EXITS, signal, policy)
    L = rt.manifest.num_layers
    assert len(runner.step_reads) == len(gen.exit_layers)
    for step, (reads, layer) in enumerate(zip(runner.step_reads, gen.exit_layers, strict=True)):
        calls = plan.token(None if layer == L else layer)
        want = sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read)
        if step == 0:  # the prompt: full depth with no exit test, only the token
            want = [("exit_full", L, "token")]
        assert sorted(reads) == want, (step, layer)
    assert any(layer < L for layer in gen.exit_layers)


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
    export_artifact(loaded, root / "a", opts, heads=_block_heads(loaded.adapter))
    return loaded, ArtifactRuntime(root / "a", provider="cpu")


def test_block_heads_run_resident_and_are_in_the_plan(block_runtime, monkeypatch):
    """Block exit heads: the plan lists each active block after its segment (and its K/V-only twin under copy), with
    nothing read on the host; the resident path gives the host path's tokens, one row and batched."""
    loaded, rt = block_runtime
    plan = plan_for(rt.manifest, "cuda", EXPORT_EXITS, "topk-prob", "copy")
    calls = plan.token(EXPORT_EXITS[0])
    assert [c.at for c in calls if c.graph == "block"] == [EXPORT_EXITS[0]]
    assert [c.at for c in calls if c.graph == "block_kv"] == [EXPORT_EXITS[1]]
    assert not plan.host_copies([c for c in calls if c.graph.startswith("block")])
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    thresholds = _thresholds(rt, "topk-prob", prompts, monkeypatch)
    for policy in ("defer", "verify", "copy"):
        for rows in (prompts[:1], prompts):
            host = Runner(rt, _config("topk-prob", policy, thresholds, False)).generate(rows)
            got = Runner(rt, _config("topk-prob", policy, thresholds, True)).generate(rows)
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (policy, len(rows))
            assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (policy, len(rows))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_resident_exit_steps_on_cuda_equal_the_host_path(tiny_dirs, tmp_path, monkeypatch):
    """On the CUDA EP (fp16), exit steps with the states on the device give the host-bound path's tokens, and only
    the plan's host outputs are read."""
    loaded = load_model(str(tiny_dirs["llama"]))
    export_artifact(loaded, tmp_path / "a", ExportOptions(exits=EXPORT_EXITS, top_k=EXPORT_TOP_K, dtype="fp16"))
    rt = ArtifactRuntime(tmp_path / "a", provider="cuda")
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    for signal in ("topk-prob", "full-prob", "cosine"):
        thresholds = _thresholds(rt, signal, prompts, monkeypatch)
        for policy in ("copy", "defer", "verify"):
            host = Runner(rt, _config(signal, policy, thresholds, False)).generate(prompts)
            runner = Runner(rt, _config(signal, policy, thresholds, True))
            got = runner.generate(prompts)
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (signal, policy)
            keys = {key for reads in runner.step_reads for _, _, key in reads}
            assert keys <= {"token", "candidates", "candidate_logits", "logsumexp", "cosine"}
