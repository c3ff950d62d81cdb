"""Whether a wide pass computes what one-position steps compute, bit for bit, on this machine.

Verify's check of drafts, drafts from the context and defer's pending positions run several positions of a row in
one segment call; their output is lossless only if each position comes out as the one-position decode step would
have made it. Where the graphs compute in int8 (int4 segments at accuracy level 4), the last-bit differences of
ONNX Runtime's one-position and several-position kernels (attention everywhere; MatMulNBits on AVX2 CPUs) grow into
other tokens; export --exact-wide pads one-row calls so that both take the same kernels (export/graphs.py
`_RowPad`). This module checks the
result on the graphs themselves: a prompt, then `width` positions once as one call and once one at a time through
every segment, the states after each segment and every layer's K/V compared.

`check_prefix` is the same comparison for a prompt fed after a cached prefix of it (one call whole, or the prefix
then the rest on top), which a runner's kept cache rests on (runtime/slots.py). `wide_refused` runs the check once
per process where an artifact's drafts rest on it (as the certified head's
kernel is checked at load: runtime/certified_bound.py). What this module does not do: decide what an inexact
artifact may run (plan/choose.py `wide_inexact`, run/wide.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from eectl.contracts.manifest import Manifest
    from eectl.runtime.kv import KVBuffers
    from eectl.runtime.sessions import ArtifactRuntime


def check_wide(rt: ArtifactRuntime, ids: Sequence[int], width: int = 8) -> dict[str, Any]:
    """The first len(ids) - width tokens as a prompt, then the last `width` as one wide call and as `width`
    one-position calls, on two caches: {"exact": every state and K/V equal bit for bit, "max_abs_diff", "width",
    "prompt"}. Segments are loaded and released one at a time (as export's validation runs them)."""
    if not 1 < width < len(ids):
        raise ValueError(f"width {width} needs at least {width + 1} tokens, got {len(ids)}")
    n, prompt = len(ids), len(ids) - width
    m = rt.manifest
    wide_kv, step_kv = rt.new_kv(1, n), rt.new_kv(1, n)
    x = np.asarray(rt.embed(np.array([list(ids)], dtype=np.int64)))
    p, wide, steps = x[:, :prompt].copy(), x[:, prompt:].copy(), x[:, prompt:].copy()
    worst = 0.0

    def segment(s: int) -> None:
        nonlocal p, wide, steps, worst
        p_out = _out(rt.run_segment(s, p, wide_kv, row=0))
        rt.run_segment(s, p, step_kv, row=0)  # the same prompt call on the other cache
        wide = _out(rt.run_segment(s, wide, wide_kv, row=0))
        steps = np.concatenate(
            [_out(rt.run_segment(s, steps[:, i : i + 1].copy(), step_kv, row=0)) for i in range(width)], axis=1
        )
        p = p_out
        worst = max(worst, _diff(wide, steps))

    _each_segment(rt, segment)
    worst = max(worst, _kv_diff(wide_kv, step_kv, m.num_layers, n))
    return {"exact": worst == 0.0, "max_abs_diff": worst, "width": width, "prompt": prompt}


def _each_segment(rt: ArtifactRuntime, call: Callable[[int], None]) -> None:
    """`call(s)` for every segment in order, each loaded for it and released after where it was not loaded before (as
    export's validation runs them)."""
    for s in range(len(rt.manifest.segments)):
        loaded = rt.segments[s].session is not None
        rt.load_segment(s)
        try:
            call(s)
        finally:
            if not loaded:
                rt.release_segment(s)


def _kv_diff(a: KVBuffers, b: KVBuffers, layers: int, n: int) -> float:
    """The largest difference between two one-row caches' K and V over their first n positions, every layer."""
    worst = 0.0
    for layer in range(layers):
        for x, y in ((a.keys[0][layer], b.keys[0][layer]), (a.values[0][layer], b.values[0][layer])):
            worst = max(worst, _diff(np.asarray(x)[:, :, :n], np.asarray(y)[:, :, :n]))
    return worst


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference, 0.0 only for arrays equal bit for bit in value (inf where a NaN stands in either)."""
    if np.array_equal(a, b):
        return 0.0
    d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
    return d if np.isfinite(d) and d > 0 else float("inf")


def _out(result: Any) -> np.ndarray:
    return np.array(result[0], copy=True)  # the call's own output array is bound again by the next call


def relies_on_exact_wide(m: Manifest) -> bool:
    """Whether drafts and deferred positions on this artifact are exact only where wide passes compute bit for bit as
    one-position steps: int4 segments whose MatMulNBits compute with int8 activations (accuracy level 4) or in half
    precision (2, 3), which turn the kernels' last-bit differences into other tokens; and int4 segments at levels
    0-1 exported padded (their export asked for exact wide passes)."""
    q = m.quantization
    return q is not None and q.scope == "segments" and (q.accuracy_level not in (0, 1) or bool(m.kv.pad))


_REFUSED: dict[tuple[str, str, bool], str | None] = {}  # (artifact, provider, rows padded) -> this process's verdict
CHECK_TOKENS = 24  # 16 as a prompt, 8 as the wide pass: ~0.1 s on the default model's int4 segments, 2 threads


def wide_refused(rt: ArtifactRuntime) -> str | None:
    """Why wide passes are not exact here, on an artifact whose exactness rests on padded one-row attention (export
    --exact-wide): `check_wide` run once per process and artifact on this machine's kernels (export checked the
    exporting machine's). None where they are exact, or where nothing rests on them."""
    m = rt.manifest
    if not (m.kv.pad and relies_on_exact_wide(m)):
        return None
    if rt.device != "cpu":  # the check reads its buffers on the host
        return f"exact wide passes are checked on the CPU EP only, not on {rt.device}"
    key = (str(rt.folder.resolve()), rt.device, getattr(rt, "pad_rows", False))
    if key not in _REFUSED:
        vocab = m.dims["vocab_size"]
        ids = [3 + (7919 * i) % (vocab - 3) for i in range(CHECK_TOKENS)]
        got = check_wide(rt, ids)
        _REFUSED[key] = (
            None
            if got["exact"]
            else f"a wide pass differs from one-position steps on this machine (by up to {got['max_abs_diff']:.1e})"
        )
    return _REFUSED[key]


def check_prefix(rt: ArtifactRuntime, ids: Sequence[int], keep: int) -> dict[str, Any]:
    """The tokens `ids` as one prompt call, and as its first `keep` tokens then the rest in a second call on top of
    them, through every segment on two caches: {"exact": every state and K/V equal bit for bit, "max_abs_diff"}.
    What reusing a cached prompt prefix rests on: a prompt fed after the positions it shares with the slot's last
    prompt (runtime/slots.py `reused`) computes what feeding it whole computes."""
    if not 0 < keep < len(ids):
        raise ValueError(f"keep {keep} must leave tokens on both sides of {len(ids)}")
    n, m = len(ids), rt.manifest
    whole_kv, split_kv = rt.new_kv(1, n), rt.new_kv(1, n)
    x = np.asarray(rt.embed(np.array([list(ids)], dtype=np.int64)))
    whole, head, tail = x.copy(), x[:, :keep].copy(), x[:, keep:].copy()
    worst = 0.0

    def segment(s: int) -> None:
        nonlocal whole, head, tail, worst
        whole = _out(rt.run_segment(s, whole, whole_kv, row=0))
        head = _out(rt.run_segment(s, head, split_kv, row=0))
        tail = _out(rt.run_segment(s, tail, split_kv, row=0))
        worst = max(worst, _diff(whole[:, :keep], head), _diff(whole[:, keep:], tail))

    _each_segment(rt, segment)
    worst = max(worst, _kv_diff(whole_kv, split_kv, m.num_layers, n))
    return {"exact": worst == 0.0, "max_abs_diff": worst}


_PREFIX: dict[tuple[str, str], str | None] = {}  # (artifact, provider) -> this process's verdict
# a prompt after a cached prefix is fed at least this many positions: fp32 on the default model computes one position
# after a prefix with other kernels than inside a whole prompt (last bits differ), two or more bit for bit
MIN_REST = 2


def prefix_refused(rt: ArtifactRuntime) -> str | None:
    """Why a prompt may not be fed on top of a cached prefix here ("the rest" computed differently), checked once per
    process and artifact on this machine's kernels (`check_prefix`: 16 tokens, then 2 and 8); None where it may.
    Host buffers only: the check reads them on the host; and every segment resident."""
    if rt.device != "cpu":
        return f"cached prompt prefixes are checked on the CPU EP only, not on {rt.device}"
    if rt.tiers is not None:  # the check's own calls would read the slow tier inside a run's measured traffic
        return "segments are read from a slow tier (--memory-budget, --mmap-weights): prompts are fed whole"
    key = (str(rt.folder.resolve()), rt.device)
    if key not in _PREFIX:
        vocab = rt.manifest.dims["vocab_size"]
        ids = [3 + (7919 * i) % (vocab - 3) for i in range(CHECK_TOKENS)]
        # the shortest rest a prompt is fed with (`MIN_REST`: one position takes other kernels) and a longer one
        got = [check_prefix(rt, ids[: keep + rest], keep) for keep, rest in ((16, MIN_REST), (16, 8))]
        worst = max(g["max_abs_diff"] for g in got)
        _PREFIX[key] = (
            None
            if worst == 0.0
            else f"a prompt fed after a cached prefix differs from the prompt fed whole (by up to {worst:.1e})"
        )
    return _PREFIX[key]
