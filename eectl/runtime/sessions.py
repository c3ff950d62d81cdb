"""ONNX Runtime sessions of an exported artifact: one process-wide thread pool, IO binding, in-place KV buffers.

The single-row graph calls go through here (export's validation and `eectl run` alike); the batched calls
(batch.py, blocks.py), the bound chain (chain.py: one row, or a batch at full depth) and the device ops bind the same
`Graph` sessions' IO themselves, their K/V always through `bind_kv` (the one place a call's KV buffers are bound).
The KV cache (kv.py) is bound in place: nothing is concatenated or copied per token. The shared tables and the
packed heads are tables.py's.

Per-token cost outside the kernels is kept small: each (graph, row) keeps one IO binding with its KV buffers and
its scalar inputs bound once (the scalars are updated in place), so a call rebinds only the hidden states and
outputs, which ORT writes straight into arrays allocated here (no output lists, no copies out).

What this module does not do: choose exits or policies (runtime/runner.py), tokenise, or touch torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.manifest import LM_HEAD_ROWS, GraphIO, Manifest, graph_axes, read_manifest
from eectl.errors import ArtifactError, UsageError
from eectl.files import confined
from eectl.runtime.kv import KVBuffers, _Call, new_kv
from eectl.runtime.ort import (
    PROVIDERS,
    CheckedSession,
    DeviceView,
    Graph,
    _check_names,
    _first_line,
    _ort,
    init_ort,
    resolve_provider,
    session_options,
)
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.tables import PackedHeads, load_weight


@dataclass
class _Bound:
    """An exit graph's IO binding for one input shape, bound once to host arrays kept here: a call copies its
    inputs into `inputs` and ORT writes `outputs` in place, so a decision rebinds nothing (like chain.py)."""

    io: Any
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]


_Shapes = dict[str, tuple[tuple[int, ...], Any]]  # a graph input's/output's manifest key -> (shape, dtype)

# Rows up to which an exit graph's binding is kept per shape (decode: one row, or a batch's rows); longer inputs
# (export's validation over a whole prompt) get a binding per call instead of host buffers held for good.
_KEEP_ROWS = 16
_TOP_1 = np.ones(1, np.int64)  # bound by pointer: lives as long as the module


class ArtifactRuntime:
    """Loads what the manifest lists (after checking it), creates the sessions, and runs graphs."""

    def __init__(
        self,
        folder: str | Path,
        provider: str = "auto",
        threads: int | None = None,
        verify: bool = True,
        lazy_segments: bool = False,
    ) -> None:
        """lazy_segments: create no segment session until load_segment(i) (a big model's export validates one
        segment at a time, so its peak memory is the torch model plus one segment, not plus the whole artifact)."""
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder, verify_hashes=verify)
        m = self.manifest
        self.provider = resolve_provider(provider, m.dtype)
        self.threads = init_ort(threads)
        self.np_dtype = np.float16 if m.dtype == "fp16" else np.float32
        ep = PROVIDERS[self.provider]
        self.device = ep.device
        so = session_options(threads)

        def session(io: GraphIO, options: Any = so, providers: Sequence[str] = ep.ort_providers) -> Any:
            """options/providers: a segment's own (runtime/tiers.py: mapped weights, placement)."""
            path = confined(self.folder, io.file, ArtifactError)
            if io.data is not None:  # ORT reads it beside the graph; a name leaving the folder is refused here
                confined(self.folder, io.data, ArtifactError)
            try:
                sess = _ort().InferenceSession(str(path), sess_options=options, providers=list(providers))
            except Exception as exc:  # ORT raises its own pybind types (InvalidProtobuf, Fail, ...) for bad graphs
                raise ArtifactError(f"cannot load the graph {io.file}: {_first_line(exc)}") from None
            _check_names(io, sess, graph_axes(m))  # names, and the dimensions the manifest states
            return CheckedSession(sess, io.file)  # its run errors are one line (ArtifactError naming the graph)

        def load(io: GraphIO) -> Graph:
            return Graph(io, session(io), self.device)

        self._session = session
        self.tiers: Any = None  # runtime/tiers.WeightTiers where run/bench asked for mapped, budgeted or placed weights
        self.packed_heads = PackedHeads(self.folder, threads)  # several rows at the final head (verify's check)
        self.embedding = load(m.embedding)
        self.segments = [Graph(s.graph, None, self.device) for s in m.segments]
        self.kv_segments = [Graph(s.kv_graph, None, self.device) for s in m.segments]
        self.river_segments = {i: Graph(s.river, None, self.device) for i, s in enumerate(m.segments) if s.river}
        if not lazy_segments:
            for i in range(len(m.segments)):
                self.load_segment(i)
        self.full_graphs = {e.layer: load(e.full) for e in m.exits}
        self.river_heads = {e.layer: load(e.river) for e in m.exits if e.river is not None}
        self.local_graphs = {e.layer: load(e.local) for e in m.exits}
        self.candidate_graphs = {e.layer: load(e.candidates) for e in m.exits if e.candidates is not None}
        # block exit heads: (the block graph, its K/V-only graph) per exit; one decoder layer each (runtime/blocks.py)
        self.block_graphs = {e.layer: (load(e.block.graph), load(e.block.kv_graph)) for e in m.exits if e.block}
        self.weights = {k: load_weight(self.folder, w, self.np_dtype, self.device) for k, w in m.shared_weights.items()}
        self.segment_of_layer = {s.layers[1]: i for i, s in enumerate(m.segments)}
        self._calls: dict[tuple[str, int], _Call] = {}  # (graph kind, exit layer) -> binding with its weight bound
        self._bounds: dict[tuple[Any, ...], _Bound] = {}  # (graph kind, exit layer, shapes) -> exit graph binding
        # Where a call's states go, and the record of its host reads, are the run's (`place`: runtime/placement.py),
        # not this runtime's: several runs share it.
        self._ops: Any = None
        # exit layer -> the `score` output [N] of the last exit-graph call there (graphs with a probe: the learned
        # signal's score, computed in the graph from the same local logits the call returned; OrtExitLogits reads it)
        self.exit_scores: dict[int, np.ndarray] = {}

    # --- setup ---------------------------------------------------------------------------------------------------
    def load_segment(self, index: int) -> None:
        """Create segment `index`'s sessions (its graph, its K/V-only graph, its river copy) if not loaded."""
        for g in self._segment_graphs(index):
            if g.session is None:
                g.session = self._session(g.io)

    def release_segment(self, index: int) -> None:
        """Drop segment `index`'s sessions and the weights they hold."""
        for g in self._segment_graphs(index):
            g.session = None

    def _segment_graphs(self, index: int) -> list[Graph]:
        river = [self.river_segments[index]] if index in self.river_segments else []
        return [self.segments[index], self.kv_segments[index], *river]

    def new_kv(self, rows: int, max_len: int) -> KVBuffers:
        """KV buffers for `rows` sequences of up to `max_len` positions (kv.py), where this runtime's graphs run."""
        return new_kv(self.manifest, rows, max_len, self.np_dtype, self.device)

    # --- binding helpers -------------------------------------------------------------------------------------------
    def _bind_array(self, io: Any, name: str, arr: Any, output: bool = False) -> None:
        if isinstance(arr, np.ndarray | DeviceView):
            device, ptr = ("cpu", arr.ctypes.data) if isinstance(arr, np.ndarray) else (arr.device, arr.ptr)
            if output:
                io.bind_output(name, device, 0, arr.dtype, list(arr.shape), ptr)
            else:
                io.bind_input(name, device, 0, arr.dtype, list(arr.shape), ptr)
        elif output:
            io.bind_ortvalue_output(name, arr)
        else:
            io.bind_ortvalue_input(name, arr)

    def _host(self, arr: Any, dtype: Any) -> Any:
        """A C-contiguous array of dtype, the same object when it already is one (no copy per call); a device-resident
        state (DeviceView) as it is."""
        if isinstance(arr, DeviceView):
            assert np.dtype(arr.dtype) == np.dtype(dtype), (arr.dtype, dtype)
            return arr
        return np.ascontiguousarray(arr, dtype=dtype)

    @property
    def ops(self) -> Any:
        """The device pieces (runtime/device_ops.py) on this runtime's provider, created on first use."""
        if self._ops is None:
            from eectl.runtime.device_ops import DeviceOps

            self._ops = DeviceOps(self.provider, self.np_dtype, self.threads)
        return self._ops

    def _state_out(self, io: Any, name: str, shape: tuple[int, ...], place: Placement) -> Any:
        """Output `name`, a hidden state or logits: a fresh host array, or for a device-resident run a fresh OrtValue
        on the provider's device (as a DeviceView) that the next graph takes as it is."""
        if not place.device:
            return self._out(io, name, shape, self.np_dtype)
        value = _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), self.np_dtype, self.device, 0)
        io.bind_ortvalue_output(name, value)
        return DeviceView.of(value)

    def _read(
        self, io: Any, name: str, shape: tuple[int, ...], dtype: Any, where: tuple[str, int, str], place: Placement
    ) -> np.ndarray:
        """Output `name` into a fresh host array: the one way a value leaves the device of a device-resident run
        (recorded in its placement)."""
        place.read(where)
        return self._out(io, name, shape, dtype)

    def _out(self, io: Any, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A fresh host array bound as output `name`: ORT writes into it (fresh: callers may keep what it returns)."""
        arr = np.empty(shape, dtype=dtype)
        io.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        return arr

    def weight_feeds(self, g: Graph, weight: str = "lm_head") -> dict[str, Any]:
        """The shared tables graph `g` takes, by its input names: `weight` (the LM head stored [H, V], or the
        embedding) and `rows` (the LM head row-major, [V, H]: local exits and the int8 source gather their K
        candidates' rows from it; artifacts before it gather columns of `weight`)."""
        tables = {"weight": weight, "rows": LM_HEAD_ROWS}
        return {g.name(key): self.weights[table] for key, table in tables.items() if key in g.io.inputs}

    def bind_weights(self, io: Any, g: Graph, weight: str = "lm_head") -> None:
        """Bind the shared tables graph `g` takes (`weight_feeds`)."""
        for name, table in self.weight_feeds(g, weight).items():
            self._bind_array(io, name, table)

    def _call(self, kind: str, layer: int, g: Graph, weight: str) -> _Call:
        call = self._calls.get((kind, layer))
        if call is None:
            call = _Call(g.binding())
            self.bind_weights(call.io, g, weight)
            self._calls[(kind, layer)] = call
        return call

    def _bound(
        self,
        kind: str,
        layer: int,
        g: Graph,
        inputs: _Shapes,
        outputs: _Shapes,
    ) -> _Bound:
        """The binding of exit graph `g` for these input/output shapes, created and bound on first use (the weight
        too); every input and output it names is bound to a host array of its own, so no call sees another's."""
        rows = next(iter(inputs.values()))[0][0]
        key = (kind, layer, *(shape for shape, _ in inputs.values()), *(shape for shape, _ in outputs.values()))
        bound = self._bounds.get(key)
        if bound is None:
            io = g.binding()
            self.bind_weights(io, g)
            bound = _Bound(io, {}, {})
            for names, arrays, out in ((inputs, bound.inputs, False), (outputs, bound.outputs, True)):
                for name, (shape, dtype) in names.items():
                    arrays[name] = np.zeros(shape, dtype)
                    self._bind_array(io, g.name(name), arrays[name], output=out)
            if rows <= _KEEP_ROWS:
                self._bounds[key] = bound
        return bound

    # --- graph calls -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: np.ndarray, *, place: Placement = HOST) -> Any:
        """[N, S] int64 -> [N, S, H] hidden states."""
        g = self.embedding
        call = self._call("embed", 0, g, "embed")
        ids = self._host(input_ids, np.int64)
        self._bind_array(call.io, g.name("input_ids"), ids)
        out = self._state_out(call.io, g.name("hidden"), (*ids.shape, self.manifest.dims["hidden_size"]), place)
        g.session.run_with_iobinding(call.io)
        return out

    def bind_kv(self, io: Any, g: Graph, kv: KVBuffers, slots: Sequence[int], first: int, last: int) -> None:
        """Bind graph `g`'s layers' K/V to rows [first, last) of the buffers at `slots` (its j-th layer at slots[j]),
        past and present the same memory: GQA writes the new positions in place. The one place a graph call's K/V
        are bound (single-row calls, batched calls, padded prompts, the bound chain; segments and block exit heads)."""
        for j, slot in enumerate(slots):
            k, v = kv.rows_of(slot, first, last)
            self._bind_array(io, g.names("past_key")[j], k)
            self._bind_array(io, g.names("past_value")[j], v)
            self._bind_array(io, g.names("present_key")[j], k, output=True)
            self._bind_array(io, g.names("present_value")[j], v, output=True)

    def kv_call(self, g: Graph, kv: KVBuffers, row: int, slots: Sequence[int], states: bool = False) -> _Call:
        """The kept binding of graph `g` for `row`: its layers' K/V bound to the row's buffers at `slots` (past and
        present share them) and the scalars, bound on the first call. Segments and block exit heads alike."""
        key = (g.session, row, 1, states)
        call = kv.calls.get(key)
        if call is None:
            call = _Call(g.binding())
            self.bind_kv(call.io, g, kv, slots, row, row + 1)
            self._bind_array(call.io, g.name("seqlens_k"), call.seqlens_k)
            self._bind_array(call.io, g.name("total_sequence_length"), call.total)
            kv.calls[key] = call
        return call

    def run_segment(
        self,
        index: int,
        hidden: np.ndarray,
        kv: KVBuffers,
        row: int,
        kv_only: bool = False,
        river: bool = False,
        states: bool = False,
        *,
        place: Placement = HOST,
    ) -> Any:
        """Run segment `index` on hidden [1, S, H] for one row, appending S positions to its layers' KV in place.

        Returns (hidden_out, last_layer_input), or None with kv_only (the `copy` policy's K/V projection). With
        `river`, the segment's int4 copy runs instead, on the same KV buffers. With `states`, a third item: the
        residual stream at every block boundary, [n_layers + 1, S, H].
        """
        seg = self.manifest.segments[index]
        if river and index not in self.river_segments:
            raise UsageError(f"segment {index} has no int4 river copy", hint="export with --river")
        g = self.river_segments[index] if river else self.kv_segments[index] if kv_only else self.segments[index]
        lo, hi = seg.layers
        s = hidden.shape[1]
        _, total = kv.span(row, lo, hi, s)
        # a binding per session (graph), row and output set (`states` binds one more output); keyed by the session
        # itself, so buffers shared by two runtimes (an int4 reference beside fp32) never reuse the other's binding
        call = self.kv_call(g, kv, row, range(lo, hi), states)
        call.seqlens_k[0] = total - 1
        call.total[()] = total
        x = self._host(hidden, self.np_dtype)
        self._bind_array(call.io, g.name("hidden"), x)
        if kv_only:
            g.session.run_with_iobinding(call.io)
            kv.advance(row, lo, hi, s)
            return None
        out = self._state_out(call.io, g.name("hidden_out"), x.shape, place)
        layer_in = self._state_out(call.io, g.name("layer_input"), x.shape, place)
        blocks = None
        if states:  # [1, (n + 1) * S, H] from the graph, returned as [n + 1, S, H]
            shape = (x.shape[0], (hi - lo + 1) * s, x.shape[2])
            blocks = self._state_out(call.io, g.name("layer_states"), shape, place)
        g.session.run_with_iobinding(call.io)
        kv.advance(row, lo, hi, s)
        if blocks is not None:
            return out, layer_in, blocks[0].reshape(hi - lo + 1, s, x.shape[2])
        return out, layer_in

    def exit_full(
        self, layer: int, hidden: np.ndarray, top_k: int, river: bool = False, *, place: Placement = HOST
    ) -> tuple[Any, np.ndarray, np.ndarray]:
        """hidden [N, H] -> (logits [N, V], candidates [N, K] int64, candidate logits [N, K]). With `river`, the
        exit's quantized river head where the artifact has one (its own table: no weight to bind). A device-resident
        run's logits stay on the device (a DeviceView)."""
        river = river and layer in self.river_heads
        g = self.river_heads[layer] if river else self.full_graphs[layer]
        if place.device:
            graph = "river_head" if river else "exit_full"
            return self._resident_exit(g, graph, layer, hidden, top_k, "river-head" if river else "full", place)
        n, dt = hidden.shape[0], self.np_dtype
        outputs: _Shapes = {
            "logits": ((n, self.manifest.dims["vocab_size"]), dt),
            "candidates": ((n, top_k), np.int64),
            "candidate_logits": ((n, top_k), dt),
        }
        if "token" in g.io.outputs:  # bound too: every output of the graph has a buffer
            outputs["token"] = ((n,), np.int64)
        if "score" in g.io.outputs:
            outputs["score"] = ((n,), np.float32)
        b = self._bound("river-head" if river else "full", layer, g, self._exit_inputs(hidden), outputs)
        self._run_bound(g, b, hidden)
        out = b.outputs  # copies: callers keep them across calls (the next call writes these buffers)
        self._keep_score(layer, out)
        return out["logits"].copy(), out["candidates"].copy(), out["candidate_logits"].copy()

    def _resident_exit(
        self, g: Graph, graph: str, layer: int, hidden: Any, top_k: int, kind: str, place: Placement
    ) -> Any:
        """An exit graph's Top-K with the hidden rows and the full logits on the device: (logits as a DeviceView,
        candidates [N, K], their logits [N, K]) — only the K ids and scores are read on the host."""
        call = self._call(f"resident-{kind}", layer, g, "lm_head")
        n = hidden.shape[0]
        self._bind_array(call.io, g.name("hidden"), self._host(hidden, self.np_dtype))
        k = np.array([top_k], np.int64)
        if "top_k" in g.io.inputs:
            self._bind_array(call.io, g.name("top_k"), k)
        logits = None
        if "logits" in g.io.outputs:
            logits = self._state_out(call.io, g.name("logits"), (n, self.manifest.dims["vocab_size"]), place)
        if "token" in g.io.outputs:  # computed in the graph, never read here
            call.io.bind_output(g.name("token"), self.device)
        cand = self._read(call.io, g.name("candidates"), (n, top_k), np.int64, (graph, layer, "candidates"), place)
        where = (graph, layer, "candidate_logits")
        cand_logits = self._read(call.io, g.name("candidate_logits"), (n, top_k), self.np_dtype, where, place)
        score = self._read_score(call.io, g, graph, layer, n, place)
        g.session.run_with_iobinding(call.io)
        self._keep_score(layer, {"score": score})
        return logits, cand, cand_logits

    def _read_score(self, io: Any, g: Graph, graph: str, layer: int, n: int, place: Placement) -> np.ndarray | None:
        """A graph's probe `score` [N] into a host array (device-resident: one more read of N floats), where it has
        one."""
        if "score" not in g.io.outputs:
            return None
        return self._read(io, g.name("score"), (n,), np.float32, (graph, layer, "score"), place)

    def _keep_score(self, layer: int, outputs: dict[str, Any]) -> None:
        score = outputs.get("score")
        if score is not None:
            self.exit_scores[layer] = score.copy()
        else:
            self.exit_scores.pop(layer, None)

    def _exit_inputs(self, hidden: np.ndarray) -> _Shapes:
        """The inputs of a graph that picks Top-K: the hidden rows and K (set from the bound outputs' width)."""
        return {"hidden": (hidden.shape, self.np_dtype), "top_k": ((1,), np.int64)}

    def _run_bound(self, g: Graph, b: _Bound, hidden: np.ndarray, **small: Any) -> None:
        """Copy the hidden rows (and the small inputs) into `b`'s bound arrays, then run `g` on them."""
        np.copyto(b.inputs["hidden"], hidden, casting="unsafe")  # the cast np.ascontiguousarray(dtype=) made
        if "top_k" in b.inputs:  # the K of this binding: its outputs' width
            b.inputs["top_k"][0] = b.outputs["candidates"].shape[1]
        for name, value in small.items():
            np.copyto(b.inputs[name], value, casting="unsafe")
        g.session.run_with_iobinding(b.io)

    def greedy_token(self, layer: int, hidden: Any, river: bool = False, *, place: Placement = HOST) -> np.ndarray:
        """hidden [N, H] -> the argmax token [N] at exit `layer`, computed in the graph.

        Only the token is copied out; the logits and a Top-1 (k = 1: a scan, not a sort) land in scratch arrays
        that stay bound across calls.
        """
        river = river and layer in self.river_heads  # the river's own quantized head where the artifact has one
        g = self.river_heads[layer] if river else self.full_graphs[layer]
        if "token" not in g.io.outputs or river and not place.device:  # no in-graph argmax (or its binding) here
            if place.device:  # its Top-1: the logits stay on the device
                return self.exit_full(layer, hidden, 2, river=river, place=place)[1][:, 0]
            return self.exit_full(layer, hidden, 2, river=river)[0].argmax(-1)
        x = self._host(hidden, self.np_dtype)
        n = x.shape[0]
        if place.device:  # the logits and the Top-1 stay on the device; the token is read
            bound = self._call("resident-greedy-river" if river else "resident-greedy", layer, g, "lm_head")
            self._bind_array(bound.io, g.name("top_k"), _TOP_1)  # k = 1: a scan, not a sort
            for key in ("logits", "candidates", "candidate_logits"):
                bound.io.bind_output(g.name(key), self.device)
            self._bind_array(bound.io, g.name("hidden"), x)
            where = ("river_head" if river else "exit_full", layer, "token")
            token = self._read(bound.io, g.name("token"), (n,), np.int64, where, place)
            g.session.run_with_iobinding(bound.io)
            return token
        place.read(("exit_full", layer, "token"))  # host states: recorded where the run keeps a record (the chain's)
        packed = None
        if n > 1 and not river:  # several rows (verify's check): the head with its table packed once
            packed = self.packed_heads.get(layer, g, self.weight_feeds(g, "lm_head"), self.device)
        if packed is not None:  # several rows (verify's check): the packed table, not the shared one packed per call
            return packed.run([g.name("token")], {g.name("hidden"): x, g.name("top_k"): _TOP_1})[0]
        call = self._calls.get(("greedy", layer))
        if call is None or call.scratch[1].shape[0] != n:
            call = self._call("greedy", layer, g, "lm_head")
            call.scratch = [
                np.ones(1, np.int64),
                np.empty((n, self.manifest.dims["vocab_size"]), self.np_dtype),
                np.empty((n, 1), np.int64),
                np.empty((n, 1), self.np_dtype),
            ]
            for key, arr in zip(("top_k", "logits", "candidates", "candidate_logits"), call.scratch, strict=True):
                self._bind_array(call.io, g.name(key), arr, output=key != "top_k")
        self._bind_array(call.io, g.name("hidden"), x)
        token = self._out(call.io, g.name("token"), (n,), np.int64)
        g.session.run_with_iobinding(call.io)
        return token

    def exit_local(
        self, layer: int, hidden: np.ndarray, candidates: np.ndarray, *, place: Placement = HOST
    ) -> np.ndarray:
        """hidden [N, H], candidates [N, K] -> candidate logits [N, K]."""
        g = self.local_graphs[layer]
        shape = candidates.shape
        if place.device:  # the hidden rows on the device, the K candidate ids in, their K logits out
            call = self._call("resident-local", layer, g, "lm_head")
            self._bind_array(call.io, g.name("hidden"), self._host(hidden, self.np_dtype))
            ids = np.ascontiguousarray(candidates, np.int64)
            self._bind_array(call.io, g.name("candidates"), ids)
            where = ("exit_local", layer, "candidate_logits")
            out = self._read(call.io, g.name("candidate_logits"), shape, self.np_dtype, where, place)
            score = self._read_score(call.io, g, "exit_local", layer, shape[0], place)
            g.session.run_with_iobinding(call.io)
            self._keep_score(layer, {"score": score})
            return out
        inputs = {"hidden": (hidden.shape, self.np_dtype), "candidates": (shape, np.int64)}
        outputs: _Shapes = {"candidate_logits": (shape, self.np_dtype)}
        if "score" in g.io.outputs:
            outputs["score"] = ((shape[0],), np.float32)
        b = self._bound("local", layer, g, inputs, outputs)
        self._run_bound(g, b, hidden, candidates=candidates)
        self._keep_score(layer, b.outputs)
        return b.outputs["candidate_logits"].copy()

    def exit_candidates(
        self, layer: int, hidden: np.ndarray, top_k: int, *, place: Placement = HOST
    ) -> tuple[np.ndarray, np.ndarray]:
        """hidden [N, H] -> (candidates [N, K] int64, their exact logits [N, K]) by the artifact's candidate source
        (the full exit graph's Top-K where the artifact has no candidate graph)."""
        g = self.candidate_graphs.get(layer)
        if g is None:
            _, cand, cand_logits = self.exit_full(layer, hidden, top_k, place=place)
            return cand, cand_logits
        if place.device:
            _, cand, cand_logits = self._resident_exit(g, "candidates", layer, hidden, top_k, "candidates", place)
            return cand, cand_logits
        n = hidden.shape[0]
        outputs: _Shapes = {"candidates": ((n, top_k), np.int64), "candidate_logits": ((n, top_k), self.np_dtype)}
        if "score" in g.io.outputs:
            outputs["score"] = ((n,), np.float32)
        b = self._bound("candidates", layer, g, self._exit_inputs(hidden), outputs)
        self._run_bound(g, b, hidden)
        self._keep_score(layer, b.outputs)
        return b.outputs["candidates"].copy(), b.outputs["candidate_logits"].copy()
