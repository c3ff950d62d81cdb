"""A device provider's bindings and host inputs (runtime/ort.py `HostInputs`), checked on the CPU EP.

ONNX Runtime copies an input given in host memory to the device when it is bound, not when the graph runs. The
runtime keeps bindings across calls and rewrites their host arrays in place (the bound chain's token and lengths,
the kept exit bindings), so on CUDA every later run saw the values of the bind: the first H200 run decoded token 0
after every prompt. The CPU EP reads a bound host array where it lies, so here `_CopyAtBind` does what a device
provider does (a copy at bind), and every decode path must give the tokens it gives without the copy."""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest
import torch

from eectl.errors import ArtifactError
from eectl.runtime.ort import CheckedSession, HostInputs
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K


class _CopyAtBind:
    """An ORT IO binding on the CPU EP that copies every host input when it is bound, as ORT does for a device
    provider's session (IOBinding::BindInput copies the value to where the graph reads it)."""

    def __init__(self, io) -> None:
        self.io = io
        self.kept: list[object] = []  # the copies, bound by pointer

    def __getattr__(self, name):
        return getattr(self.io, name)

    def bind_input(self, name, device_type, device_id, element_type, shape, ptr) -> None:
        if device_type == "cpu":
            dtype = np.dtype(element_type)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            raw = (ctypes.c_uint8 * max(n, 1)).from_address(ptr)
            copy = np.frombuffer(bytes(raw)[:n], dtype=dtype).reshape(shape).copy()
            self.kept.append(copy)
            ptr = copy.ctypes.data
        self.io.bind_input(name, device_type, device_id, element_type, shape, ptr)

    def bind_cpu_input(self, name, arr) -> None:
        copy = np.array(arr, copy=True)
        self.kept.append(copy)
        self.io.bind_cpu_input(name, copy)

    def bind_ortvalue_input(self, name, value) -> None:
        if value.device_name().lower() == "cpu":
            value = ort.OrtValue.ortvalue_from_numpy(value.numpy().copy())
            self.kept.append(value)
        self.io.bind_ortvalue_input(name, value)


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (4 + 3 * i,), generator=g).tolist() for i in range(n)]


def _generate(folder, policy: str | None, rows: list[list[int]], resident: bool = False) -> list[list[int]]:
    rt = ArtifactRuntime(folder, provider="cpu")  # fresh: its sessions bind after the patch below
    exits = list(EXPORT_EXITS) if policy else []
    # thresholds that let some tokens exit on random weights: a top-K probability above 0 at the first exit
    thresholds = {e: {"prob": 0.0 if i == 0 else 2.0} for i, e in enumerate(exits)}
    cfg = RunConfig(
        exits=exits,
        thresholds=thresholds,
        signal="topk-prob",
        policy=policy or "defer",
        top_k=EXPORT_TOP_K,
        max_new_tokens=10,
        device_resident=resident,
    )
    return [g.token_ids for g in Runner(rt, cfg).generate(rows)]


CASES = [(None, 1, False), (None, 3, False), ("copy", 1, False), ("defer", 1, False), ("verify", 1, False)]
CASES += [("copy", 3, False), ("defer", 1, True), ("verify", 3, True)]


@pytest.mark.parametrize("fam", ["llama", "gemma3_text"])
def test_every_decode_path_refreshes_its_host_inputs_on_a_device_provider(exported, fam, monkeypatch):
    """Full depth (the bound chain, one row and a batch), copy/defer/verify with some tokens exiting (the chain's
    exit steps, one row and a batch), and the device-resident path: with a copy at bind their tokens are those of
    the plain CPU EP. Without the refresh, the same emulation changes them or fails on the values of the bind (the
    check can fail)."""
    loaded, folder = exported[fam]
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    want = {case: _generate(folder, case[0], prompts[: case[1]], case[2]) for case in CASES}
    made: list[HostInputs] = []

    def device_binding(self):
        io = HostInputs(_CopyAtBind(self._session.io_binding()))
        made.append(io)
        return io

    monkeypatch.setattr(CheckedSession, "io_binding", device_binding)
    for case in CASES:
        assert _generate(folder, case[0], prompts[: case[1]], case[2]) == want[case], case
    assert made
    monkeypatch.setattr(HostInputs, "refresh", lambda self: None)  # the bug: host inputs as they were bound
    for case in CASES[:2]:
        try:
            stale = _generate(folder, case[0], prompts[: case[1]], case[2])
        except ArtifactError:  # the values of the bind (lengths 0, a kept buffer not yet written): the CPU kernels
            continue  # refuse what CUDA's ran on
        assert stale != want[case], case


def test_only_device_sessions_wrap_their_bindings(exported):
    """On the CPU EP a session hands out ORT's own binding (nothing refreshed, nothing added per run)."""
    _, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu")
    session = rt.embedding.session
    assert isinstance(session, CheckedSession) and not session.on_device
    assert not isinstance(rt.embedding.binding(), HostInputs)


def test_a_run_binds_every_host_input_again_and_no_device_value():
    """Before each run every host input is bound again, also one bound just before it (the runtime binds a kept
    array and writes it afterwards: the chain's lengths, GraphCalls._kept's inputs); a device value never is."""
    calls: list[str] = []

    class _IO:
        def bind_input(self, name, *a):
            calls.append(name)

        def bind_cpu_input(self, name, arr):
            calls.append(name)

        def bind_ortvalue_input(self, name, value):
            calls.append(name)

    class _Device:
        def device_name(self):
            return "Cuda"

    io = HostInputs(_IO())
    kept = np.zeros(2, np.int32)
    io.bind_input("lengths", "cpu", 0, np.int32, [2], kept.ctypes.data)
    io.bind_input("kv", "cuda", 0, np.float16, [4], 1234)
    io.bind_ortvalue_input("weights", _Device())
    io.bind_input("kv", "cuda", 0, np.float16, [4], 1234)
    calls.clear()
    for _ in range(3):
        io.bind_cpu_input("ids", np.ones(1, np.int64))
        io.refresh()
    assert calls == ["ids", "lengths", "ids"] * 3
    io.bind_input("lengths", "cuda", 0, np.int32, [2], 99)  # now a device value: no longer bound again
    calls.clear()
    io.refresh()
    assert calls == ["ids"]
