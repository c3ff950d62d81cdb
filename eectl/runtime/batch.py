"""Batched segment calls: one graph call for all rows of a batch, each row at its own length.

KV of each layer is one buffer [B, H_kv, capacity, D] for the whole batch. GroupQueryAttention takes per-row
`seqlens_k` (a row's total length - 1), so rows of different lengths share one call and each row's new K/V lands at
its own position, in place; the weights are read once per call instead of once per row (decode is memory-bound).

Two limits of the op shape how calls are made (ONNX Runtime 1.31):

- GQA refuses batch > 1 with more than one new position on a past ("batch_size must be 1 when sequence_length > 1
  and past context is given"). Batched calls therefore carry one position per row (decode); a row with several
  positions (prefill, deferred positions, verify's flush) runs as a single-row call on its own row of the buffers,
  a view (rows are contiguous in [B, ...]): no copy.
- GQA cannot skip rows. A row that does not take part in a batched call still rides along: its input is zeros, it
  writes its would-be K/V to the slot just past its length (the scratch slot: never counted as filled, overwritten
  by the row's next real position), its outputs are ignored and its length does not advance. Hence capacity =
  the longest sequence + 1.

What this module does not do: decide exits or policies (runner.py); it only runs segments for chosen rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.runtime.sessions import ArtifactRuntime, _ort


@dataclass
class BatchKV:
    """Per layer: key and value buffers [B, H_kv, capacity, D]; filled[row, layer] positions hold real K/V."""

    keys: list[Any]  # [layer] numpy array (CPU) or device OrtValue (CUDA)
    values: list[Any]
    filled: np.ndarray  # [rows, layers] int
    capacity: int  # max_len + 1 (the scratch slot of rows riding along)

    @property
    def rows(self) -> int:
        return int(self.filled.shape[0])


def new_batch_kv(rt: ArtifactRuntime, rows: int, max_len: int) -> BatchKV:
    m = rt.manifest
    if max_len > m.max_positions:
        raise UsageError(f"context of {max_len} tokens exceeds the model's maximum of {m.max_positions}")
    shape = [rows, m.kv.num_kv_heads, max_len + 1, m.kv.head_dim]

    def buf() -> Any:
        if rt.device == "cpu":
            return np.zeros(shape, dtype=rt.np_dtype)
        return _ort().OrtValue.ortvalue_from_shape_and_type(shape, rt.np_dtype, "cuda", 0)

    L = m.num_layers
    return BatchKV([buf() for _ in range(L)], [buf() for _ in range(L)], np.zeros((rows, L), np.int64), max_len + 1)


def _rows_view(buf: Any, first: int, count: int) -> tuple[str, int, list[int]]:
    """(device, pointer, shape) of rows [first, first + count) of a [B, ...] buffer: contiguous, so no copy."""
    shape = list(buf.shape() if callable(getattr(buf, "shape", None)) else buf.shape)
    per_row = int(np.prod(shape[1:]))
    if isinstance(buf, np.ndarray):
        return "cpu", buf.ctypes.data + first * per_row * buf.itemsize, [count, *shape[1:]]
    itemsize = np.dtype(np.float16 if "float16" in buf.data_type() else np.float32).itemsize
    return "cuda", buf.data_ptr() + first * per_row * itemsize, [count, *shape[1:]]


def _bind_kv(rt: ArtifactRuntime, g: Any, io: Any, kv: BatchKV, lo: int, hi: int, first: int, count: int) -> None:
    for j, layer in enumerate(range(lo, hi)):
        for key, buf in (("key", kv.keys[layer]), ("value", kv.values[layer])):
            device, ptr, shape = _rows_view(buf, first, count)
            io.bind_input(g.names(f"past_{key}")[j], device, 0, rt.np_dtype, shape, ptr)
            io.bind_output(g.names(f"present_{key}")[j], device, 0, rt.np_dtype, shape, ptr)


def _past(kv: BatchKV, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    past = kv.filled[rows, lo]
    if (kv.filled[rows, lo:hi] != past[:, None]).any():
        raise RuntimeError(f"layers {lo}..{hi - 1} hold different lengths within a row: {kv.filled[rows, lo:hi]}")
    return past


def run_rows(
    rt: ArtifactRuntime, index: int, hidden: np.ndarray, kv: BatchKV, active: np.ndarray, kv_only: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Segment `index` for every row in one call: hidden [B, 1, H] (rows not `active` ignored, zeros fed).

    Active rows append one position to their K/V; the others write only their scratch slot. Returns
    (hidden_out [B, 1, H], last_layer_input [B, 1, H]) with the inactive rows' entries meaningless, or None with
    kv_only (the `copy` policy's K/V projection).
    """
    seg = rt.manifest.segments[index]
    g = rt.kv_segments[index] if kv_only else rt.segments[index]
    lo, hi = seg.layers
    B = kv.rows
    if hidden.shape[:2] != (B, 1) or active.shape != (B,):
        raise ValueError(f"batched calls take [B={B}, 1, H] hidden states and B flags, got {hidden.shape}")
    past = _past(kv, np.arange(B), lo, hi)
    longest = int(past[active].max(initial=0)) + 1
    if longest > kv.capacity - 1:
        raise UsageError(f"the sequence reached {longest} tokens, beyond the KV buffer of {kv.capacity - 1}")
    if int(past.max()) + 1 > kv.capacity:  # an idle row already at its maximum has no scratch slot
        raise RuntimeError(f"row lengths {past} leave no scratch slot in a buffer of {kv.capacity}")
    x = np.where(active[:, None, None], hidden, 0).astype(rt.np_dtype)
    io = g.binding()
    io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(x))
    io.bind_cpu_input(g.name("seqlens_k"), past.astype(np.int32))  # total length - 1, the new position included
    io.bind_cpu_input(g.name("total_sequence_length"), np.array(int(past.max()) + 1, dtype=np.int32))
    _bind_kv(rt, g, io, kv, lo, hi, 0, B)
    if not kv_only:
        io.bind_output(g.name("hidden_out"), "cpu")
        io.bind_output(g.name("layer_input"), "cpu")
    g.session.run_with_iobinding(io)
    kv.filled[active, lo:hi] += 1
    if kv_only:
        return None
    outs = io.get_outputs()
    n = 2 * (hi - lo)  # the present K/V outputs were bound first
    return outs[n].numpy(), outs[n + 1].numpy()


def run_row(
    rt: ArtifactRuntime, index: int, hidden: np.ndarray, kv: BatchKV, row: int, kv_only: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Segment `index` for one row on its view of the batch buffers: hidden [1, S, H], any S (prefill, chunks)."""
    seg = rt.manifest.segments[index]
    g = rt.kv_segments[index] if kv_only else rt.segments[index]
    lo, hi = seg.layers
    past = int(_past(kv, np.array([row]), lo, hi)[0])
    total = past + hidden.shape[1]
    if total > kv.capacity - 1:
        raise UsageError(f"the sequence reached {total} tokens, beyond the KV buffer of {kv.capacity - 1}")
    io = g.binding()
    io.bind_cpu_input(g.name("hidden"), np.ascontiguousarray(hidden, dtype=rt.np_dtype))
    io.bind_cpu_input(g.name("seqlens_k"), np.array([total - 1], dtype=np.int32))
    io.bind_cpu_input(g.name("total_sequence_length"), np.array(total, dtype=np.int32))
    _bind_kv(rt, g, io, kv, lo, hi, row, 1)
    if not kv_only:
        io.bind_output(g.name("hidden_out"), "cpu")
        io.bind_output(g.name("layer_input"), "cpu")
    g.session.run_with_iobinding(io)
    kv.filled[row, lo:hi] = total
    if kv_only:
        return None
    outs = io.get_outputs()
    n = 2 * (hi - lo)
    return outs[n].numpy(), outs[n + 1].numpy()
