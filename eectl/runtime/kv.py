"""The KV cache of a run: per row and layer a key and a value buffer, and how many positions each holds.

Each buffer is [1, H_kv, max_len, D], preallocated once and bound as both the past input and the present output of
GroupQueryAttention, which writes the new positions in place (sessions.py; batch.py's batch buffers are views of
one [rows, ...] buffer per layer). The length counters (`filled`) change only through `KVBuffers.span` + `advance`,
`rollback`, `move`, `copy` and `seek`: the one place a row's length is checked and moved.

What this module does not do: bind the buffers to graph calls (`ArtifactRuntime.bind_kv`, the one place a graph's
K/V are bound, over `KVBuffers.rows_of`) or hold a batch's buffers (batch.BatchKV: one [rows, ...] buffer per layer,
viewed per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.contracts.manifest import Manifest
from eectl.errors import UsageError
from eectl.runtime.memory import check_kv
from eectl.runtime.ort import _ort


@dataclass
class _Call:
    """One graph's IO binding kept across calls, with the small inputs it reads from (updated in place)."""

    io: Any
    seqlens_k: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    total: np.ndarray = field(default_factory=lambda: np.zeros((), np.int32))
    scratch: list[np.ndarray] = field(default_factory=list)  # bound arrays whose contents nobody reads
    # host arrays of the call's own, bound for input shape `shape` (None: none kept): graph_calls.GraphCalls._kept
    shape: tuple[int, ...] | None = None
    bufs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class KVBuffers:
    """Per row and layer: key and value buffers [1, H_kv, max_len, D], and how many positions each layer holds."""

    keys: list[list[Any]]  # [row][layer]
    values: list[list[Any]]
    filled: np.ndarray  # [rows, layers] int
    max_len: int
    # the bindings kept on these buffers (they bind them by address): (session, first row, rows, outputs) -> binding
    calls: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def rows_of(self, slot: int, first: int, last: int) -> tuple[Any, Any]:
        """The key and value buffers of rows [first, last) at KV slot `slot`, as one call binds them (no copy). Plain
        buffers are per row: one row at a time (batch.BatchKV spans several)."""
        if last != first + 1:
            raise ValueError(f"rows {first}..{last - 1}: these KV buffers are bound one row at a time")
        return self.keys[first][slot], self.values[first][slot]

    # The length counters change only through these: a call's new positions (`span`, then `advance`), a rollback
    # (verify's rejected drafts), a row moved or copied to another (`move`, `copy`), and `seek` (a timing loop or a
    # check placing a call at a chosen position).
    def span(self, row: int, lo: int, hi: int, n: int) -> tuple[int, int]:
        """(past, total) for n new positions of `row` in slots [lo, hi): the one check that those slots hold one
        length and that the buffers have room for n more."""
        past = int(self.filled[row, lo])
        if (self.filled[row, lo:hi] != past).any():
            raise RuntimeError(f"layers {lo}..{hi - 1} of row {row} hold different lengths: {self.filled[row, lo:hi]}")
        total = past + n
        if total > self.max_len:
            raise UsageError(f"the sequence reached {total} tokens, beyond the KV buffer of {self.max_len}")
        return past, total

    def advance(self, rows: Any, lo: int, hi: int, n: Any = 1) -> None:
        """Slots [lo, hi) of `rows` (an index, a slice, a mask or index array) hold n more positions (n may be per
        row: [rows, 1])."""
        self.filled[rows, lo:hi] += n

    def rollback(self, rows: Any, to: Any, lo: int = 0, hi: int | None = None) -> None:
        """Slots [lo, hi) of `rows` (all slots by default: the block exit heads' too) hold at most `to` positions:
        what was written from `to` on is forgotten (its buffers are overwritten by the next calls)."""
        end = self.filled.shape[1] if hi is None else hi
        self.filled[rows, lo:end] = np.minimum(self.filled[rows, lo:end], to)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s K/V and lengths become row `dst`'s (its positions copied in every slot; `src` is then empty): a
        batch compacting the rows still decoding into its first rows (runtime/slots.py). Host buffers only."""
        self.copy(src, dst, self.filled[src])
        self.filled[src] = 0

    def copy(self, src: int, dst: int, n: Any) -> None:
        """Row `dst` holds row `src`'s first `n` positions (per slot where `n` is an array), K/V copied: a prompt
        beginning like another row's prompt (runtime/slots.py `shared`). Host buffers only."""
        counts = np.broadcast_to(np.asarray(n, dtype=np.int64), self.filled[src].shape)
        if (counts > self.filled[src]).any():
            raise RuntimeError(f"row {src} holds {self.filled[src]} positions, not {counts}")
        for slot, k in enumerate(counts):
            for bufs in (self.keys, self.values):
                if not isinstance(bufs[src][slot], np.ndarray):
                    raise UsageError("rows of a KV cache are copied on the host only")
                bufs[dst][slot][:, :, :k] = bufs[src][slot][:, :, :k]
        self.filled[dst] = counts

    def seek(self, rows: Any, length: int, lo: int = 0, hi: int | None = None) -> None:
        """Slots [lo, hi) of `rows` hold exactly `length` positions, whatever their buffers hold: for measuring a
        call at a chosen position again and again (plan/costs.py) or checking one graph alone (export), never for
        generating."""
        self.filled[rows, lo : self.filled.shape[1] if hi is None else hi] = length


def new_kv(m: Manifest, rows: int, max_len: int, np_dtype: Any, device: str) -> KVBuffers:
    """Zeroed buffers for `rows` rows of up to `max_len` positions in every KV slot (the decoder layers', then the
    block exit heads'), in host memory on the CPU EP, else on `device` (after `check_kv`: room for them)."""
    capacity = max_len + m.kv.pad  # a padded one-row call writes one slot past its positions
    check_kv(m, rows, max_len, capacity, np.dtype(np_dtype).itemsize, device == "cpu")
    shape = (1, m.kv.num_kv_heads, capacity, m.kv.head_dim)

    def buf() -> Any:
        if device == "cpu":
            return np.zeros(shape, dtype=np_dtype)
        return _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), np_dtype, device, 0)

    keys = [[buf() for _ in range(m.kv_slots)] for _ in range(rows)]
    values = [[buf() for _ in range(m.kv_slots)] for _ in range(rows)]
    return KVBuffers(keys, values, np.zeros((rows, m.kv_slots), dtype=np.int64), max_len)
