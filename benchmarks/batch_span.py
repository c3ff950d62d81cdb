"""What one batched segment call costs as a function of the rows it spans: the deep-pass sharing question.

    flock /tmp/eectl-bench.lock timeout 600 python benchmarks/batch_span.py ARTIFACT --threads 2 --batch 16

Rows that exited at different depths share the deep segments either by riding along (one call over the whole span
of rows, the exited rows writing only their scratch slot) or by gathering the deep rows into a smaller call (their
K/V copied into a compact buffer and back). Riding pays when a call costs about the same whatever rows it spans;
gathering pays when the cost grows with the rows. This times the default model's first segment at decode shape
(one new position per row, every row at `--past` positions) over spans of 1, 2, 4, 8, 16 rows (medians of
`--calls` calls, interleaved per round), and the copy a gather needs (the span's K/V rows of the segment's layers
copied out and back, numpy) for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from eectl.runtime.batch import new_batch_kv
from eectl.runtime.chain import DecodeChain
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--past", type=int, default=160)
    ap.add_argument("--segment", type=int, default=0)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    m = rt.manifest
    lo, hi = m.segments[args.segment].layers
    B = args.batch
    kv = new_batch_kv(rt, B, args.past + 8)
    rng = np.random.default_rng(0)
    spans = [n for n in (1, 2, 4, 8, 16, 32) if n <= B]
    # the segment's call as a batch's decode step binds it: over the first n rows of the buffers (the chain's own)
    chains = {n: DecodeChain(rt, kv, 0, rows=n) for n in spans}
    for chain in chains.values():
        chain.hops[args.segment][...] = rng.standard_normal(chain.hops[args.segment].shape).astype(rt.np_dtype)
    times: dict[int, list[float]] = {n: [] for n in spans}
    copies: dict[int, list[float]] = {n: [] for n in spans}
    for k in range(args.calls + 3):
        for n in spans:
            chain = chains[n]
            kv.filled[:] = args.past  # every row at the same length; the call writes one position per row
            chain.seqlens_k[:] = args.past
            chain.total[()] = args.past + 1
            session, io = chain.segment_calls[args.segment]
            t0 = time.perf_counter()
            session.run_with_iobinding(io)
            took = time.perf_counter() - t0
            t0 = time.perf_counter()
            for layer in range(lo, hi):  # a gather's copy out and back of the span's K/V (up to the past)
                for buf in (kv.batch_keys[layer], kv.batch_values[layer]):
                    compact = buf[:n, :, : args.past + 1].copy()
                    buf[:n, :, : args.past + 1] = compact
            copy = time.perf_counter() - t0
            if k >= 3:
                times[n].append(took)
                copies[n].append(copy)
    base = statistics.median(times[1])
    print(
        f"segment {args.segment} (layers {lo}-{hi - 1}), one new position per row on {args.past} past, ORT threads "
        f"{args.threads}, medians of {args.calls} interleaved calls"
    )
    print("| rows in the call | ms per call | vs 1 row | ms per row | K/V copy out and back (ms) |")
    print("|---|---|---|---|---|")
    for n in spans:
        t = statistics.median(times[n]) * 1000
        c = statistics.median(copies[n]) * 1000
        print(f"| {n} | {t:.2f} | {t / (base * 1000):.2f}x | {t / n:.2f} | {c:.2f} |")


if __name__ == "__main__":
    main()
