"""Decision cost of each candidate source on a real model: the exit graphs export builds, timed in ONNX Runtime.

    flock /tmp/eectl-heavy.lock python benchmarks/candidate_sources.py [MODEL] --threads 2 --layer 20

Times, for one token (N = 1), the graph the first active exit runs: the full LM head + Top-K (`full`), the
frequency shortlist at several sizes (`shortlist`; the ids here are arbitrary, the cost does not depend on which
rows), the int8 ranking + exact rescoring (`int8`), and the K-row local exit later exits run. Medians of 200 calls
after 20, interleaved per round so drift hits every graph alike; the decode step these compete with is in the
artifact's costs (`eectl export`). Coverage and agreement of each source come from `eectl calibrate --candidates`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from eectl.exits.base import DEFAULT_TOP_K
from eectl.exits.candidates import Int8Ranking, Shortlist
from eectl.export.candidate_graphs import build_candidates
from eectl.export.graphs import build_exit
from eectl.models import load_model
from eectl.runtime.ort import _ort, session_options


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layer", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    ap.add_argument("--sizes", default="1024,2048,4096,8192")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    adapter = loaded.adapter
    so = session_options(args.threads)
    ort = _ort()
    rows = adapter.lm_head.weight.detach().float().numpy()  # [V, H]: the artifact's lm_head_rows
    weight = np.ascontiguousarray(rows.T)  # [H, V]: the artifact's lm_head (the full projection's layout)
    hidden = np.random.default_rng(0).standard_normal((1, adapter.dims.hidden_size)).astype(np.float32)
    k = np.array([args.top_k], dtype=np.int64)
    graphs = {}
    with tempfile.TemporaryDirectory() as tmp:

        def session(name: str, model: onnx.ModelProto) -> object:
            path = Path(tmp) / f"{name}.onnx"
            onnx.save(model, str(path))
            return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])

        full, _ = build_exit(adapter, args.layer, "fp32", local=False)
        graphs["full (V rows + Top-K)"] = (
            session("full", full),
            {"hidden_states": hidden, "top_k": k, "lm_head_weight": weight},
        )
        local, _ = build_exit(adapter, args.layer, "fp32", local=True)
        # K ids spread over the vocabulary, as a token's candidates are (K neighbouring rows would flatter a gather)
        vocab = adapter.dims.vocab_size
        cand = np.sort(np.random.default_rng(1).choice(vocab, args.top_k, replace=False)).astype(np.int64)[None]
        graphs[f"local (K = {args.top_k} rows)"] = (
            session("local", local),
            {"hidden_states": hidden, "candidates": cand, "lm_head_rows": rows},
        )
        for size in [int(s) for s in args.sizes.split(",")]:
            g, _ = build_candidates(adapter, args.layer, "fp32", Shortlist(torch.arange(size)))
            graphs[f"shortlist S = {size}"] = (session(f"s{size}", g), {"hidden_states": hidden, "top_k": k})
        g, _ = build_candidates(adapter, args.layer, "fp32", Int8Ranking(adapter.lm_head.weight))
        graphs["int8 (V rows int8 + K exact)"] = (
            session("int8", g),
            {"hidden_states": hidden, "top_k": k, "lm_head_rows": rows},
        )
        times: dict[str, list[float]] = {n: [] for n in graphs}
        for _ in range(20):
            for sess, feed in graphs.values():
                sess.run(None, feed)
        for _ in range(args.calls):
            for name, (sess, feed) in graphs.items():
                t0 = time.perf_counter()
                sess.run(None, feed)
                times[name].append(time.perf_counter() - t0)
    print(f"{loaded.source.name}, exit after layer {args.layer}, {args.threads} threads, median of {args.calls}")
    print("| graph | ms per token |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.3f} |")


if __name__ == "__main__":
    main()
