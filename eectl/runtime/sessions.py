"""ONNX Runtime sessions of an exported artifact: one process-wide thread pool, IO binding, in-place KV buffers.

The single-row graph calls go through here (export's validation and `eectl run` alike): the embedding and the
segments here, the exit graphs and the binding helpers in graph_calls.py (`GraphCalls`, this runtime's base); the
batched calls (batch.py, blocks.py), the bound chain (chain.py: one row, or a batch at full depth) and the device ops
bind the same `Graph` sessions' IO themselves, their K/V always through `bind_kv` (the one place a call's KV buffers
are bound). The KV cache (kv.py) is bound in place: nothing is concatenated or copied per token. The shared tables
and the packed heads are tables.py's.

Per-token cost outside the kernels is kept small: each (graph, row) keeps one IO binding with its KV buffers and
its scalar inputs bound once (the scalars are updated in place); on host arrays it keeps its hidden input and outputs
bound too (`GraphCalls._kept`), so a call copies its input in and its outputs out and binds nothing (a bind after a
graph's run costs 15-20x a warm one: docs/results/2026-12-04-decisions.md).

What this module does not do: choose exits or policies (runtime/runner.py), tokenise, or touch torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.manifest import GraphIO, Manifest, graph_axes, read_manifest
from eectl.errors import ArtifactError, UsageError
from eectl.files import confined
from eectl.runtime.certified_bound import check_kernel
from eectl.runtime.graph_calls import GraphCalls, _Bound
from eectl.runtime.kv import KVBuffers, _Call, new_kv
from eectl.runtime.ort import (
    PROVIDERS,
    CheckedSession,
    Graph,
    _check_names,
    _first_line,
    _ort,
    init_ort,
    resolve_provider,
    session_options,
)
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.rows import rows_padded
from eectl.runtime.tables import PackedHeads, load_weight, row_embedding


class ArtifactRuntime(GraphCalls):
    """Loads what the manifest lists (after checking it), creates the sessions, and runs graphs."""

    def __init__(
        self,
        folder: str | Path,
        provider: str = "auto",
        threads: int | None = None,
        verify: bool = True,
        lazy_segments: bool = False,
        pad_rows: bool | None = None,
    ) -> None:
        """lazy_segments: create no segment session until load_segment(i) (a big model's export validates one
        segment at a time, so its peak memory is the torch model plus one segment, not plus the whole artifact).
        pad_rows: padded segments (export --exact-wide) pad every MatMul's rows (True) or attention only (False);
        None: rows only where this CPU computes one row otherwise than two (runtime/rows.py `rows_padded`)."""
        self.folder = Path(folder)
        self.manifest: Manifest = read_manifest(self.folder, verify_hashes=verify)
        m = self.manifest
        self.provider = resolve_provider(provider, m.dtype)
        self.threads = init_ort(threads)
        self.np_dtype = np.float16 if m.dtype == "fp16" else np.float32
        ep = PROVIDERS[self.provider]
        self.device = ep.device
        self.pad_rows = rows_padded(m, pad_rows)
        self._pad_value: Any = None
        so = self.segment_options(session_options(threads))

        def session(io: GraphIO, options: Any = so, providers: Sequence[str] = ep.ort_providers) -> Any:
            """options/providers: a segment's own (runtime/tiers.py: mapped weights, placement)."""
            path = confined(self.folder, io.file, ArtifactError)
            if io.data is not None:  # ORT reads it beside the graph; a name leaving the folder is refused here
                confined(self.folder, io.data, ArtifactError)
            try:
                sess = _ort().InferenceSession(str(path), sess_options=options, providers=list(providers))
            except Exception as exc:  # ORT raises its own pybind types (InvalidProtobuf, Fail, ...) for bad graphs
                raise ArtifactError(f"cannot load the graph {io.file}: {_first_line(exc)}") from None
            _check_names(io, sess, graph_axes(m), m.dtype)  # names, the dimensions and dtype the manifest states
            return CheckedSession(sess, io.file)  # its run errors are one line (ArtifactError naming the graph)

        def load(io: GraphIO) -> Graph:
            return Graph(io, session(io), self.device)

        self._session = session
        self.tiers: Any = None  # runtime/tiers.WeightTiers where run/bench asked for mapped, budgeted or placed weights
        self.packed_heads = PackedHeads(self.folder, threads)  # several rows at the final head (verify's check)
        # the embedding: LM head rows gathered where it is that table (tables.py `row_embedding`), else the graph's
        self.embedding = row_embedding(self.folder, m, so, self.device) or load(m.embedding)
        self.segments = [Graph(s.graph, None, self.device) for s in m.segments]
        self.kv_segments = [Graph(s.kv_graph, None, self.device) for s in m.segments]
        self.river_segments = {i: Graph(s.river, None, self.device) for i, s in enumerate(m.segments) if s.river}
        if not lazy_segments:
            for i in range(len(m.segments)):
                self.load_segment(i)
        self.full_graphs = {e.layer: load(e.full) for e in m.exits}
        self.river_heads = {e.layer: load(e.river) for e in m.exits if e.river is not None}
        # the final head's greedy token certified from an 8-bit ranking (export/certified_head.py), on the CPU EP
        final = m.exits[-1]
        self.certified_head = load(final.certified) if final.certified and self.device == "cpu" else None
        # ... where this machine's 8-bit kernel keeps to its bound (runtime/certified_bound.py: once per process)
        self.certified_refused = None if self.certified_head is None else check_kernel(m.dims["hidden_size"], so)
        if self.certified_refused:  # the full head runs instead: slower, never wrong
            self.certified_head = None
        self.local_graphs = {e.layer: load(e.local) for e in m.exits}
        self.candidate_graphs = {e.layer: load(e.candidates) for e in m.exits if e.candidates is not None}
        # block exit heads: (the block graph, its K/V-only graph) per exit; one decoder layer each (runtime/blocks.py)
        self.block_graphs = {e.layer: (load(e.block.graph), load(e.block.kv_graph)) for e in m.exits if e.block}
        self.weights = {k: load_weight(self.folder, k, w, self.device) for k, w in m.shared_weights.items()}
        self.segment_of_layer = {s.layers[1]: i for i, s in enumerate(m.segments)}
        self._calls: dict[tuple[str, int], _Call] = {}  # (graph kind, exit layer) -> binding with its weight bound
        self._bounds: dict[tuple[Any, ...], _Bound] = {}  # (graph kind, exit layer, shapes) -> exit graph binding
        self._certified_calls = {}
        # Where a call's states go, and the record of its host reads, are the run's (`place`: runtime/placement.py),
        # not this runtime's: several runs share it.
        self._ops: Any = None
        # exit layer -> the `score` output [N] of the last exit-graph call there (graphs with a probe: the learned
        # signal's score, computed in the graph from the same local logits the call returned; OrtExitLogits reads it)
        self.exit_scores: dict[int, np.ndarray] = {}

    # --- setup ---------------------------------------------------------------------------------------------------
    def segment_options(self, so: Any) -> Any:
        """Session options `so` with the padded segments' switch (manifest `kv.pad_switch`) set to attention only
        where this runtime does not pad rows (`pad_rows`); graphs without the initializer ignore it."""
        switch = self.manifest.kv.pad_switch
        if switch and self.manifest.kv.pad and not self.pad_rows:
            if self._pad_value is None:  # ORT reads it at each session's creation: kept while the runtime lives
                self._pad_value = _ort().OrtValue.ortvalue_from_numpy(np.zeros(1, dtype=np.int64))
            so.add_initializer(switch, self._pad_value)
        return so

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

    @property
    def ops(self) -> Any:
        """The device pieces (runtime/device_ops.py) on this runtime's provider, created on first use."""
        if self._ops is None:
            from eectl.runtime.device_ops import DeviceOps

            self._ops = DeviceOps(self.provider, self.np_dtype, self.threads)
        return self._ops

    # --- graph calls -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: np.ndarray, *, place: Placement = HOST) -> Any:
        """[N, S] int64 -> [N, S, H] hidden states."""
        g = self.embedding
        call = self._call("embed", 0, g, "embed")
        ids, dt = self._host(input_ids, np.int64), self.np_dtype
        shape = (*ids.shape, self.manifest.dims["hidden_size"])
        if not place.device:  # the call's own arrays, bound once per shape (GraphCalls._kept)
            bufs = self._kept(
                call, g, ids.shape, lambda: {"input_ids": (ids.shape, np.int64, False), "hidden": (shape, dt, True)}
            )
            np.copyto(bufs["input_ids"], ids)
            g.session.run_with_iobinding(call.io)
            return bufs["hidden"].copy()
        call.shape = None  # a device run binds its own values
        self._bind_array(call.io, g.name("input_ids"), ids)
        out = self._state_out(call.io, g.name("hidden"), shape, place)
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
        if not place.device and isinstance(hidden, np.ndarray):  # host: the call's own arrays, bound once per shape
            return self._segment_kept(call, g, hidden, kv, row, (lo, hi), kv_only, states)
        call.shape = None  # device values are bound per call
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

    def _segment_kept(
        self, call: Any, g: Graph, hidden: Any, kv: KVBuffers, row: int, layers: tuple[int, int], kv_only: bool,
        states: bool,
    ) -> Any:  # fmt: skip
        """`run_segment` on host arrays: the input copied into the call's kept array, the outputs copied out."""
        (lo, hi), shape, dt = layers, tuple(hidden.shape), self.np_dtype

        def arrays() -> dict[str, tuple[Any, Any, bool]]:  # built only when the shape changes
            wanted = {"hidden": (shape, dt, False)}
            if not kv_only:
                wanted |= {"hidden_out": (shape, dt, True), "layer_input": (shape, dt, True)}
            if states:  # [1, (n + 1) * S, H] from the graph, returned as [n + 1, S, H]
                wanted["layer_states"] = ((shape[0], (hi - lo + 1) * shape[1], shape[2]), dt, True)
            return wanted

        bufs = self._kept(call, g, shape, arrays)
        np.copyto(bufs["hidden"], hidden, casting="unsafe")
        g.session.run_with_iobinding(call.io)
        kv.advance(row, lo, hi, shape[1])
        if kv_only:
            return None
        out, layer_in = bufs["hidden_out"].copy(), bufs["layer_input"].copy()
        if states:
            return out, layer_in, bufs["layer_states"][0].reshape(hi - lo + 1, shape[1], shape[2]).copy()
        return out, layer_in
