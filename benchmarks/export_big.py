"""Time and peak memory of exporting a model whose one segment is past protobuf's 2 GB limit (external data).

    flock /tmp/eectl-bench.lock timeout 1200 /usr/bin/time -v python benchmarks/export_big.py --threads 2 --out DIR

The model is tests/test_export_big.py's: one wide Llama layer of seeded random weights (hidden 4096, MLP 44,032,
384-token vocabulary), 2.33 GB in fp32. Prints the seconds to build the model, to export it (graphs built and
written one at a time, validated segment by segment against PyTorch: the manifest's validation.export_seconds) and
to load and run the artifact (4 greedy tokens), the process's peak RSS after each (the manifest records the
export's as validation.peak_rss_mb), and the model's own size. The artifact is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

import torch

from eectl.export.exporter import ExportOptions, export_artifact
from eectl.runtime.ort import init_ort
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.test_export_big import wide_model


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="artifacts/wide")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    init_ort(args.threads)
    t0 = time.perf_counter()
    loaded = wide_model()
    size_mb = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 2**20
    print(f"model: {size_mb:.0f} MB of weights, built in {time.perf_counter() - t0:.1f} s, peak RSS {peak_mb():.0f} MB")
    out = Path(args.out)
    t0 = time.perf_counter()
    m = export_artifact(loaded, out, ExportOptions(exits=[]))
    v = m.validation
    data = out / str(m.segments[0].graph.data)
    print(
        f"export: {time.perf_counter() - t0:.1f} s (manifest: {v.get('export_seconds')} s), validation passed "
        f"{v['passed']}, segment weights file {data.stat().st_size / 2**20:.0f} MB, peak RSS {v.get('peak_rss_mb')} MB"
    )
    del loaded
    t0 = time.perf_counter()
    rt = ArtifactRuntime(out, provider="cpu", threads=args.threads)
    tokens = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=4)).generate([[5, 6, 7, 8]])[0].token_ids
    took = time.perf_counter() - t0
    print(f"load (hashes checked) + run 4 tokens: {took:.1f} s, {tokens}, peak RSS {peak_mb():.0f} MB")
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
