"""ONNX Runtime sessions of an exported artifact: one process-wide thread pool, IO binding, in-place KV buffers.

Every graph call goes through here (export's validation and `eectl run` alike). The KV cache of each row and layer
is one preallocated buffer [1, H_kv, max_len, D] bound as both the past input and the present output of
GroupQueryAttention, which writes the new positions in place: nothing is concatenated or copied per token.

What this module does not do: choose exits or policies (runtime/runner.py), tokenise, or touch torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.manifest import GraphIO, Manifest, read_manifest

_THREADS: int | None = None


def _ort() -> Any:
    import onnxruntime as ort

    return ort


def init_ort(threads: int | None = None) -> int:
    """Create ORT's environment once, with one global intra-op pool of `threads` shared by every session.

    Measured on 2 cores: per-session pools fighting over the cores cost several times more per token than one
    shared pool (see the export issue notes). Later calls must ask for the same size.
    """
    global _THREADS
    n = threads or os.cpu_count() or 1
    if _THREADS is None:
        ort = _ort()
        ort.set_default_logger_severity(3)
        from onnxruntime.capi import _pybind_state as C

        C.set_global_thread_pool_sizes(n, 1)
        _THREADS = n
    elif threads is not None and threads != _THREADS:
        raise UsageError(
            f"ONNX Runtime's thread pool already has {_THREADS} threads in this process; cannot switch to {threads}"
        )
    return _THREADS


def cuda_usable() -> bool:
    """True only where the CUDA EP can actually load: a visible NVIDIA device and the EP in this build.

    Checked without creating a CUDA session, so machines without a GPU never see the EP's library-load errors.
    """
    if "CUDAExecutionProvider" not in _ort().get_available_providers():
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


@dataclass(frozen=True)
class ExecutionProvider:
    """An ONNX Runtime execution provider as `--provider` names it. To add one (e.g. TensorRT, DirectML): one
    `register_provider(...)` entry below; buffers on a non-CPU device are bound as OrtValues on `device`."""

    name: str
    ort_providers: tuple[str, ...]  # handed to InferenceSession, in preference order
    device: str  # where bound inputs and KV buffers live: "cpu", or an OrtValue device name ("cuda")
    usable: Callable[[], bool]  # checked without creating a session
    auto_dtypes: tuple[str, ...] = ()  # artifact dtypes `--provider auto` picks it for


PROVIDERS: dict[str, ExecutionProvider] = {}


def register_provider(provider: ExecutionProvider) -> ExecutionProvider:
    PROVIDERS[provider.name] = provider
    return provider


register_provider(ExecutionProvider("cpu", ("CPUExecutionProvider",), "cpu", lambda: True))
register_provider(
    ExecutionProvider("cuda", ("CUDAExecutionProvider", "CPUExecutionProvider"), "cuda", cuda_usable, ("fp16",))
)


def resolve_provider(requested: str, dtype: str) -> str:
    """auto -> the first registered provider that is usable and meant for this dtype (cuda for fp16 artifacts where
    CUDA is usable), else cpu. An explicit provider that cannot load here is an error."""
    if requested == "auto":
        return next((p.name for p in PROVIDERS.values() if dtype in p.auto_dtypes and p.usable()), "cpu")
    if requested not in PROVIDERS:
        raise UsageError(f"--provider must be auto or one of {', '.join(PROVIDERS)}, got '{requested}'")
    provider = PROVIDERS[requested]
    if not provider.usable():
        raise UsageError(
            f"the {provider.ort_providers[0]} execution provider is not available on this machine",
            hint="use --provider cpu",
        )
    return requested


def session_options(threads: int | None = None) -> Any:
    ort = _ort()
    init_ort(threads)
    so = ort.SessionOptions()
    so.use_per_session_threads = False  # the process-wide pool from init_ort
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


@dataclass
class Graph:
    """One graph's session and its names from the manifest."""

    io: GraphIO
    session: Any
    device: str

    def name(self, key: str) -> str:
        value = self.io.inputs.get(key, self.io.outputs.get(key))
        assert isinstance(value, str), key
        return value

    def names(self, key: str) -> list[str]:
        value = self.io.inputs.get(key, self.io.outputs.get(key))
        assert isinstance(value, list), key
        return value

    def binding(self) -> Any:
        return self.session.io_binding()


@dataclass
class KVBuffers:
    """Per row and layer: key and value buffers [1, H_kv, max_len, D], and how many positions each layer holds."""

    keys: list[list[Any]]  # [row][layer]
    values: list[list[Any]]
    filled: np.ndarray  # [rows, layers] int
    max_len: int


class ArtifactRuntime:
    """Loads what the manifest lists (after checking it), creates the sessions, and runs graphs."""

    def __init__(
        self, folder: str | Path, provider: str = "auto", threads: int | None = None, verify: bool = True
    ) -> None:
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder, verify_hashes=verify)
        m = self.manifest
        self.provider = resolve_provider(provider, m.dtype)
        self.threads = init_ort(threads)
        self.np_dtype = np.float16 if m.dtype == "fp16" else np.float32
        ep = PROVIDERS[self.provider]
        self.device = ep.device
        so = session_options(threads)

        def load(io: GraphIO) -> Graph:
            ort = _ort()
            sess = ort.InferenceSession(str(self.folder / io.file), sess_options=so, providers=list(ep.ort_providers))
            return Graph(io, sess, self.device)

        self.embedding = load(m.embedding)
        self.segments = [load(s.graph) for s in m.segments]
        self.kv_segments = [load(s.kv_graph) for s in m.segments]
        self.full_graphs = {e.layer: load(e.full) for e in m.exits}
        self.local_graphs = {e.layer: load(e.local) for e in m.exits}
        self.candidate_graphs = {e.layer: load(e.candidates) for e in m.exits if e.candidates is not None}
        self.weights = {k: self._load_weight(w.file) for k, w in m.shared_weights.items()}
        self.segment_of_layer = {s.layers[1]: i for i, s in enumerate(m.segments)}

    # --- setup ---------------------------------------------------------------------------------------------------
    def _load_weight(self, file: str) -> Any:
        arr = np.load(self.folder / file)
        if self.device == "cpu":
            return np.ascontiguousarray(arr)
        return _ort().OrtValue.ortvalue_from_numpy(arr, self.device, 0)

    def new_kv(self, rows: int, max_len: int) -> KVBuffers:
        m = self.manifest
        if max_len > m.max_positions:
            raise UsageError(f"context of {max_len} tokens exceeds the model's maximum of {m.max_positions}")
        shape = (1, m.kv.num_kv_heads, max_len, m.kv.head_dim)
        L = m.num_layers

        def buf() -> Any:
            if self.device == "cpu":
                return np.zeros(shape, dtype=self.np_dtype)
            return _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), self.np_dtype, self.device, 0)

        keys = [[buf() for _ in range(L)] for _ in range(rows)]
        values = [[buf() for _ in range(L)] for _ in range(rows)]
        return KVBuffers(keys, values, np.zeros((rows, L), dtype=np.int64), max_len)

    # --- binding helpers -------------------------------------------------------------------------------------------
    def _bind_array(self, io: Any, name: str, arr: Any, output: bool = False) -> None:
        if isinstance(arr, np.ndarray):
            if output:
                io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            else:
                io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        elif output:
            io.bind_ortvalue_output(name, arr)
        else:
            io.bind_ortvalue_input(name, arr)

    # --- graph calls -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """[N, S] int64 -> [N, S, H] hidden states."""
        g = self.embedding
        io = g.binding()
        io.bind_cpu_input(g.name("input_ids"), np.ascontiguousarray(input_ids, dtype=np.int64))
        self._bind_array(io, g.name("weight"), self.weights["embed"])
        io.bind_output(g.name("hidden"), "cpu")
        g.session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()

    def run_segment(self, index: int, hidden: np.ndarray, kv: KVBuffers, row: int, kv_only: bool = False) -> Any:
        """Run segment `index` on hidden [1, S, H] for one row, appending S positions to its layers' KV in place.

        Returns (hidden_out, last_layer_input), or None with kv_only (the `copy` policy's K/V projection).
        """
        seg = self.manifest.segments[index]
        g = self.kv_segments[index] if kv_only else self.segments[index]
        lo, hi = seg.layers
        past = int(kv.filled[row, lo])
        if (kv.filled[row, lo:hi] != past).any():
            raise RuntimeError(f"layers {lo}..{hi - 1} of row {row} hold different lengths: {kv.filled[row, lo:hi]}")
        s = hidden.shape[1]
        total = past + s
        if total > kv.max_len:
            raise UsageError(f"the sequence reached {total} tokens, beyond the KV buffer of {kv.max_len}")
        io = g.binding()
        io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(hidden, dtype=self.np_dtype))
        io.bind_cpu_input(g.name("seqlens_k"), np.array([total - 1], dtype=np.int32))
        io.bind_cpu_input(g.name("total_sequence_length"), np.array(total, dtype=np.int32))
        for j, layer in enumerate(range(lo, hi)):
            k, v = kv.keys[row][layer], kv.values[row][layer]
            self._bind_array(io, g.names("past_key")[j], k)
            self._bind_array(io, g.names("past_value")[j], v)
            self._bind_array(io, g.names("present_key")[j], k, output=True)
            self._bind_array(io, g.names("present_value")[j], v, output=True)
        if not kv_only:
            io.bind_output(g.name("hidden_out"), "cpu")
            io.bind_output(g.name("layer_input"), "cpu")
        g.session.run_with_iobinding(io)
        kv.filled[row, lo:hi] = total
        if kv_only:
            return None
        outs = io.get_outputs()
        n = 2 * (hi - lo)  # the present K/V outputs were bound first
        return outs[n].numpy(), outs[n + 1].numpy()

    def exit_full(self, layer: int, hidden: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """hidden [N, H] -> (logits [N, V], candidates [N, K] int64, candidate logits [N, K])."""
        g = self.full_graphs[layer]
        io = g.binding()
        io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(hidden, dtype=self.np_dtype))
        io.bind_cpu_input(g.name("top_k"), np.array([top_k], dtype=np.int64))
        self._bind_array(io, g.name("weight"), self.weights["lm_head"])
        for key in ("logits", "candidates", "candidate_logits"):
            io.bind_output(g.name(key), "cpu")
        g.session.run_with_iobinding(io)
        logits, cand, cand_logits = (o.numpy() for o in io.get_outputs())
        return logits, cand, cand_logits

    def exit_local(self, layer: int, hidden: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """hidden [N, H], candidates [N, K] -> candidate logits [N, K]."""
        g = self.local_graphs[layer]
        io = g.binding()
        io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(hidden, dtype=self.np_dtype))
        io.bind_cpu_input(g.name("candidates"), np.ascontiguousarray(candidates, dtype=np.int64))
        self._bind_array(io, g.name("weight"), self.weights["lm_head"])
        io.bind_output(g.name("candidate_logits"), "cpu")
        g.session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()

    def exit_candidates(self, layer: int, hidden: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """hidden [N, H] -> (candidates [N, K] int64, their exact logits [N, K]) by the artifact's candidate source
        (the full exit graph's Top-K where the artifact has no candidate graph)."""
        g = self.candidate_graphs.get(layer)
        if g is None:
            _, cand, cand_logits = self.exit_full(layer, hidden, top_k)
            return cand, cand_logits
        io = g.binding()
        io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(hidden, dtype=self.np_dtype))
        io.bind_cpu_input(g.name("top_k"), np.array([top_k], dtype=np.int64))
        if "weight" in g.io.inputs:
            self._bind_array(io, g.name("weight"), self.weights["lm_head"])
        for key in ("candidates", "candidate_logits"):
            io.bind_output(g.name(key), "cpu")
        g.session.run_with_iobinding(io)
        cand, cand_logits = (o.numpy() for o in io.get_outputs())
        return cand, cand_logits
