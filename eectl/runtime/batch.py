"""A batch's KV buffers (`BatchKV`) and its padded prompt calls (`run_prefill`); the bound chain (chain.py,
chain_rows.py) runs its batched decode calls on them: one graph call for the rows of a batch, each at its own length.

KV of each layer is one buffer [B, H_kv, capacity, D] for the whole batch. GroupQueryAttention takes per-row
`seqlens_k` (a row's total length - 1), so rows of different lengths share one call and each row's new K/V lands at
its own position, in place; the weights are read once per call instead of once per row (decode is memory-bound).

Two limits of the op shape how calls are made (ONNX Runtime 1.31):

- GQA refuses batch > 1 with more than one new position on a past ("batch_size must be 1 when sequence_length > 1
  and past context is given"). Batched calls therefore carry one position per row (decode); a row with several
  positions (prefill, deferred positions, verify's flush) runs as a single-row call (ArtifactRuntime.run_segment)
  on its own row of the buffers, a view (rows are contiguous in [B, ...]): no copy.
- GQA cannot skip rows. A row that does not take part in a batched call still rides along: its input is zeros, it
  writes its would-be K/V to the slot just past its length (the scratch slot: never counted as filled, overwritten
  by the row's next real position), its outputs are ignored and its length does not advance. Hence capacity =
  the longest sequence + 1. A call spans only the rows from the first to the last active one (a contiguous view),
  so finished rows at the ends of the batch cost nothing (chain_rows.py `_part`).

What this module does not do: decide exits or policies, or bind the decode calls (chain.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.runtime.kv import KVBuffers
from eectl.runtime.memory import check_kv
from eectl.runtime.ort import DeviceView, _ort
from eectl.runtime.sessions import ArtifactRuntime


@dataclass
class BatchKV(KVBuffers):
    """One buffer [B, H_kv, capacity, D] per layer for the whole batch (`batch_keys`), and, as `keys[row][layer]`,
    each row's view of it [1, H_kv, capacity, D]: the single-row path (ArtifactRuntime.run_segment, the policies)
    runs on the views unchanged, with no copy. filled[row, layer] positions hold real K/V."""

    batch_keys: list[Any] = field(default_factory=list)  # [layer] numpy array (CPU) or device OrtValue
    batch_values: list[Any] = field(default_factory=list)
    dtype: Any = np.float32  # the buffers' element type (a device buffer's rows are addressed by it)

    @property
    def rows(self) -> int:
        return int(self.filled.shape[0])

    @property
    def capacity(self) -> int:
        return self.max_len + 1  # the scratch slot of rows riding along

    def rows_of(self, slot: int, first: int, last: int) -> tuple[Any, Any]:
        """Rows [first, last) of the batch buffers at `slot`: a contiguous view (numpy) or pointer (device)."""
        if last == first + 1:  # a row's own views
            return super().rows_of(slot, first, last)
        keys, values = (_rows(b[slot], first, last, self.dtype) for b in (self.batch_keys, self.batch_values))
        return keys, values


def new_batch_kv(rt: ArtifactRuntime, rows: int, max_len: int) -> BatchKV:
    m = rt.manifest
    check_kv(m, rows, max_len, max_len + 1, np.dtype(rt.np_dtype).itemsize, rt.device == "cpu")
    shape = (rows, m.kv.num_kv_heads, max_len + 1, m.kv.head_dim)

    def buf() -> Any:
        if rt.device == "cpu":
            return np.zeros(shape, dtype=rt.np_dtype)
        return _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), rt.np_dtype, rt.device, 0)

    L = m.kv_slots  # the decoder layers', then the block exit heads'
    keys, values = [buf() for _ in range(L)], [buf() for _ in range(L)]
    return BatchKV(
        keys=[[_row_view(k, r, rt.np_dtype) for k in keys] for r in range(rows)],
        values=[[_row_view(v, r, rt.np_dtype) for v in values] for r in range(rows)],
        filled=np.zeros((rows, L), np.int64),
        max_len=max_len,
        batch_keys=keys,
        batch_values=values,
        dtype=np.dtype(rt.np_dtype),
    )


def _row_view(buf: Any, row: int, dtype: Any) -> Any:
    """Row `row` of a [B, ...] buffer as a [1, ...] buffer."""
    return _rows(buf, row, row + 1, dtype)


def _rows(buf: Any, first: int, last: int, dtype: Any) -> Any:
    """Rows [first, last) of a [B, ...] buffer: contiguous, so a view (numpy) or a pointer (device), no copy."""
    if isinstance(buf, np.ndarray):
        return buf[first:last]
    shape = tuple(buf.shape())
    nbytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    return DeviceView(buf.device_name(), buf.data_ptr() + first * nbytes, (last - first, *shape[1:]), np.dtype(dtype))


def _past(kv: KVBuffers, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    past = kv.filled[rows, lo]
    if (kv.filled[rows, lo:hi] != past[:, None]).any():
        raise RuntimeError(f"layers {lo}..{hi - 1} hold different lengths within a row: {kv.filled[rows, lo:hi]}")
    return past


def prefill_runs(kv: BatchKV, rows: list[int], lo: int, hi: int) -> list[list[int]]:
    """The rows (of those with several new positions) that can share one padded first-prompt call: rows holding no
    K/V yet in layers [lo, hi), grouped into runs of consecutive indices (a call spans a contiguous range of the
    buffers, and a row with K/V inside that range would have its positions overwritten from 0)."""
    empty = sorted(r for r in rows if not kv.filled[r, lo:hi].any())
    runs: list[list[int]] = []
    for r in empty:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def run_prefill(
    rt: ArtifactRuntime, index: int, xs: dict[int, np.ndarray], kv: BatchKV
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Segment `index` on several rows' prompts in one call: xs maps consecutive rows holding no K/V yet to their
    hidden states [1, S_r, H]. Returns per row (hidden_out, last_layer_input), each [1, S_r, H].

    GroupQueryAttention takes several new positions per row at batch > 1 only as a first prompt (no past: total
    length == the new positions), so the prompts are right-padded to the longest, S, with seqlens_k = S_r - 1 per
    row: each row attends to its own S_r positions, and its K/V land at positions [0, S_r) (the padding's K/V
    beyond a row's length are never counted, and its next positions overwrite them)."""
    seg = rt.manifest.segments[index]
    g = rt.segments[index]
    lo, hi = seg.layers
    rows = sorted(xs)
    first, last = rows[0], rows[-1] + 1
    if rows != list(range(first, last)) or kv.filled[first:last, lo:hi].any():
        raise ValueError(f"a padded prompt call takes consecutive rows holding no K/V yet, got {rows}")
    lengths = np.array([xs[r].shape[1] for r in rows])
    S = int(lengths.max())
    if kv.max_len < S:
        raise UsageError(f"the sequence reached {S} tokens, beyond the KV buffer of {kv.max_len}")
    H = xs[first].shape[-1]
    x = np.zeros((len(rows), S, H), dtype=rt.np_dtype)
    for i, r in enumerate(rows):
        x[i, : lengths[i]] = xs[r][0]
    io = g.binding()
    io.bind_cpu_input(g.name("hidden"), x)
    io.bind_cpu_input(g.name("seqlens_k"), (lengths - 1).astype(np.int32))
    io.bind_cpu_input(g.name("total_sequence_length"), np.array(S, dtype=np.int32))
    rt.bind_kv(io, g, kv, range(lo, hi), first, last)
    out, layer_in = np.empty_like(x), np.empty_like(x)
    rt._bind_array(io, g.name("hidden_out"), out, output=True)
    rt._bind_array(io, g.name("layer_input"), layer_in, output=True)
    g.session.run_with_iobinding(io)
    kv.advance(slice(first, last), lo, hi, lengths[:, None])
    return {r: (out[i : i + 1, : lengths[i]], layer_in[i : i + 1, : lengths[i]]) for i, r in enumerate(rows)}
