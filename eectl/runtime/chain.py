"""Full-depth greedy decode as a chain of graph calls bound once: nothing is rebound or copied per token.

When no exit is active, a decode step is always the same calls on the same shapes: embed one id, every segment in
order, the final head's in-graph argmax. The chain binds them once per row and cache: each graph's output buffer
is the next graph's input (the hidden state never leaves its buffer between segments: on a GPU it stays on the
device), the KV buffers are bound as in `ArtifactRuntime.run_segment`, and the inputs that change per token (the
token id, `seqlens_k`, `total_sequence_length`) are small host arrays written in place. A step is then the graph
calls and two scalar writes, about what onnxruntime-genai's one-graph decode costs outside its kernels.

What it does not do: exits, sampling, teacher forcing, several positions per call (the prompt), batches of rows:
the runner's general path (`Runner._steps`) handles those, and writes the same cache this chain continues.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.runtime.sessions import ArtifactRuntime, Graph, KVBuffers, _ort


class DecodeChain:
    """Greedy full-depth decode of one row of `kv`, one position per step."""

    def __init__(self, rt: ArtifactRuntime, kv: KVBuffers, row: int) -> None:
        m = rt.manifest
        final = rt.full_graphs[m.num_layers]
        if "token" not in final.io.outputs:  # an artifact exported before the in-graph argmax
            raise UsageError("this artifact's final head has no token output", hint="re-export it")
        self.rt, self.kv, self.row = rt, kv, row
        H, dtype = m.dims["hidden_size"], rt.np_dtype
        self.ids = np.zeros((1, 1), np.int64)  # host inputs, written in place before each step
        self.seqlens_k = np.zeros(1, np.int32)
        self.total = np.zeros((), np.int32)
        self.token = np.zeros(1, np.int64)  # the one output read on the host
        self.calls: list[tuple[Any, Any]] = []  # (session, io binding), in call order
        self._keep: list[Any] = []  # every buffer bound by address must live as long as the bindings
        # one buffer per hop [1, 1, H]: embed -> segment 0 -> ... -> last segment -> final head (viewed as [1, H])
        hops = [self._buffer((1, 1, H), dtype) for _ in range(len(m.segments) + 1)]
        io = self._bind(rt.embedding)
        rt._bind_array(io, rt.embedding.name("input_ids"), self.ids)
        if "weight" in rt.embedding.io.inputs:
            rt._bind_array(io, rt.embedding.name("weight"), rt.weights["embed"])
        rt._bind_array(io, rt.embedding.name("hidden"), hops[0], output=True)
        for s, seg in enumerate(m.segments):
            g = rt.segments[s]
            io = self._bind(g)
            lo, hi = seg.layers
            for j, layer in enumerate(range(lo, hi)):
                k, v = kv.keys[row][layer], kv.values[row][layer]
                rt._bind_array(io, g.names("past_key")[j], k)
                rt._bind_array(io, g.names("past_value")[j], v)
                rt._bind_array(io, g.names("present_key")[j], k, output=True)
                rt._bind_array(io, g.names("present_value")[j], v, output=True)
            rt._bind_array(io, g.name("seqlens_k"), self.seqlens_k)
            rt._bind_array(io, g.name("total_sequence_length"), self.total)
            rt._bind_array(io, g.name("hidden"), hops[s])
            rt._bind_array(io, g.name("hidden_out"), hops[s + 1], output=True)
            # outputs nobody reads this step (the last layer's input for the cosine signal): a scratch buffer
            rt._bind_array(io, g.name("layer_input"), self._buffer((1, 1, H), dtype), output=True)
        io = self._bind(final)
        rt._bind_array(io, final.name("hidden"), self._view(hops[-1], (1, H), dtype))
        if "weight" in final.io.inputs:
            rt._bind_array(io, final.name("weight"), rt.weights["lm_head"])
        rt._bind_array(io, final.name("top_k"), self._host(np.ones(1, np.int64)))
        rt._bind_array(io, final.name("token"), self.token, output=True)
        V = m.dims["vocab_size"]  # the logits and a Top-1 land in scratch buffers (on the device where there is one)
        rt._bind_array(io, final.name("logits"), self._buffer((1, V), dtype), output=True)
        rt._bind_array(io, final.name("candidates"), self._buffer((1, 1), np.int64), output=True)
        rt._bind_array(io, final.name("candidate_logits"), self._buffer((1, 1), dtype), output=True)

    def _bind(self, g: Graph) -> Any:
        io = g.session.io_binding()
        self.calls.append((g.session, io))
        return io

    def _host(self, arr: np.ndarray) -> np.ndarray:
        self._keep.append(arr)
        return arr

    def _buffer(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A buffer where the graphs run: host memory on the CPU, an OrtValue on the EP's device otherwise."""
        if self.rt.device == "cpu":
            buf: Any = np.zeros(shape, dtype)
        else:
            buf = _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.rt.device, 0)
        self._keep.append(buf)
        return buf

    def _view(self, buf: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """The same memory under another shape (the last segment's [1, 1, H] output as the head's [1, H] input)."""
        if isinstance(buf, np.ndarray):
            return buf.reshape(shape)
        from eectl.runtime.sessions import DeviceView

        return DeviceView(buf.device_name(), buf.data_ptr(), shape, np.dtype(dtype))

    def step(self, token: int) -> int:
        """Feed `token` at the row's next position through every layer; return the greedy next token."""
        kv, row, L = self.kv, self.row, self.rt.manifest.num_layers
        # the decoder layers' slots only: block exit heads' slots (after them) are not run when no exit is active
        past = int(kv.filled[row, 0])
        if (kv.filled[row, :L] != past).any():
            raise RuntimeError(f"the layers of row {row} hold different lengths: {kv.filled[row, :L]}")
        total = past + 1
        if total > kv.max_len:
            raise UsageError(f"the sequence reached {total} tokens, beyond the KV buffer of {kv.max_len}")
        self.ids[0, 0] = token
        self.seqlens_k[0] = total - 1
        self.total[()] = total
        for session, io in self.calls:
            session.run_with_iobinding(io)
        kv.filled[row, :L] = total
        return int(self.token[0])
