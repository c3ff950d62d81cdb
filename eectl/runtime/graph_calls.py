"""The graph calls an artifact runtime makes besides its segments: the binding helpers every call uses (arrays and
device values bound by pointer, outputs into fresh or kept arrays, a value read on the host recorded in the run's
placement, the shared tables bound) and the exit graphs' calls (the full head with its Top-K, the in-graph greedy
token, the local K-row logits, the candidate source). `GraphCalls` is `sessions.ArtifactRuntime`'s base: the
runtime loads the sessions and tables these calls read (the attributes declared below) and runs the segments.

What this module does not do: load sessions or tables (sessions.py, tables.py), bind KV buffers or run segments
(sessions.py), or decide exits (decide.py, graph_decide.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from eectl.contracts.manifest import LM_HEAD_ROWS, Manifest
from eectl.runtime.certified_head import CertifiedHead
from eectl.runtime.kv import _Call
from eectl.runtime.ort import DeviceView, Graph, _ort
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.tables import PackedHeads


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


class GraphCalls:
    """Binding helpers and the exit graphs' calls; the attributes are the runtime's (sessions.ArtifactRuntime)."""

    manifest: Manifest
    np_dtype: Any
    device: str
    weights: dict[str, Any]
    full_graphs: dict[int, Graph]
    river_heads: dict[int, Graph]
    local_graphs: dict[int, Graph]
    candidate_graphs: dict[int, Graph]
    packed_heads: PackedHeads
    tiers: Any  # runtime/tiers.WeightTiers where the run maps, budgets or places the weights
    exit_scores: dict[int, np.ndarray]
    _calls: dict[tuple[str, int], _Call]
    _bounds: dict[tuple[Any, ...], _Bound]
    certified_head: Graph | None  # the certified final head (export/certified_head.py), on the CPU EP
    certified_refused: str | None  # why an artifact's certified head is not used here (runtime/certified_bound.py)
    _certified_calls: dict[int, Any]  # rows -> (CertifiedHead, its input buffer): greedy_token's

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

    def packed_head(self, layer: int) -> Any:
        """Exit `layer`'s full head with its LM-head table packed once, for calls over several rows (tables.py
        PackedHeads), or None: where it does not apply, and where the run keeps its weights mapped or under a memory
        budget (runtime/tiers.py), which a packed copy of the table (its size again, in anonymous memory) would
        break."""
        tiers = self.tiers
        if tiers is not None and (tiers.mapped or tiers.budget is not None):
            return None
        g = self.full_graphs[layer]
        return self.packed_heads.get(layer, g, self.weight_feeds(g, "lm_head"), self.device)

    def bind_weights(self, io: Any, g: Graph, weight: str = "lm_head") -> None:
        """Bind the shared tables graph `g` takes (`weight_feeds`)."""
        for name, table in self.weight_feeds(g, weight).items():
            self._bind_array(io, name, table)

    def _kept(
        self, call: _Call, g: Graph, shape: tuple[int, ...], arrays: Callable[[], dict[str, tuple[Any, Any, bool]]]
    ) -> dict[str, np.ndarray]:
        """Host arrays of `call`'s own (`arrays()`: name -> (shape, dtype, is an output)), allocated and bound on the
        first call with input `shape` and kept while calls keep it: a call then copies its input in and its outputs
        out and binds nothing. Binding after a graph's run costs 15-20x what it costs warm
        (docs/results/2026-12-04-decisions.md: ~70 us a bind after a segment, the host work between calls)."""
        if call.shape != shape:
            wanted = arrays()
            call.bufs = {name: np.empty(s, dtype) for name, (s, dtype, _) in wanted.items()}
            for name, (_, _, output) in wanted.items():
                self._bind_array(call.io, g.name(name), call.bufs[name], output=output)
            call.shape = shape
        return call.bufs

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

    # --- the exit graphs -----------------------------------------------------------------------------------------
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

    def greedy_token(
        self, layer: int, hidden: Any, river: bool = False, *, place: Placement = HOST, certified: bool = False
    ) -> np.ndarray:
        """hidden [N, H] -> the argmax token [N] at exit `layer`, computed in the graph.

        Only the token is copied out; the logits and a Top-1 (k = 1: a scan, not a sort) land in scratch arrays
        that stay bound across calls. `certified`: at the final layer, from the certified head where the runtime has
        one and every row passes (`_certified_tokens`), else from the full head.
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
        if certified and not river and layer == self.manifest.num_layers and self.certified_head is not None:
            proven = self._certified_tokens(x, place)
            if proven is not None:
                return proven
        place.read(("exit_full", layer, "token"))  # host states: recorded where the run keeps a record (the chain's)
        packed = self.packed_head(layer) if n > 1 and not river else None  # several rows: verify's check
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
        if not isinstance(x, np.ndarray):  # a device value read through the host's head (bound per call)
            call.shape = None
            self._bind_array(call.io, g.name("hidden"), x)
            token = self._out(call.io, g.name("token"), (n,), np.int64)
            g.session.run_with_iobinding(call.io)
            return token
        bufs = self._kept(
            call, g, x.shape, lambda: {"hidden": (x.shape, self.np_dtype, False), "token": ((n,), np.int64, True)}
        )
        np.copyto(bufs["hidden"], x, casting="unsafe")
        g.session.run_with_iobinding(call.io)
        return bufs["token"].copy()

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

    def _certified_tokens(self, x: np.ndarray, place: Placement) -> np.ndarray | None:
        """The certified head's tokens for host rows x [N, H], bound once per row count; None where a row did not
        pass (the caller runs the full head)."""
        n = x.shape[0]
        if n not in self._certified_calls:
            buf = np.empty(x.shape, self.np_dtype)
            self._certified_calls[n] = (CertifiedHead.bind(self, buf, n), buf)
        head, buf = self._certified_calls[n]
        np.copyto(buf, x)
        return head.token.copy() if head.run(place) else None
