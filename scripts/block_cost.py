"""What a block exit head costs at run time on this machine: the default model (or --model) exported with block
heads at the given exits, validated, its graphs timed (export's cost model); prints each block's ms and its cost in
decoder layers (run it under the bench lock: flock /tmp/eectl-bench.lock python scripts/block_cost.py).

Without --heads the blocks are untrained copies of the last layer: the cost depends on the shape only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--heads", default=None, help="trained block heads (default: copies of the last layer)")
    ap.add_argument("--exits", default="8,12,16,20,24")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from eectl.runtime.ort import init_ort

    torch.set_num_threads(a.threads)
    init_ort(a.threads)
    from eectl.exits.designs import BlockHead, load_heads
    from eectl.export.exporter import ExportOptions, describe, export_artifact
    from eectl.models import load_model

    loaded = load_model(a.model)
    adapter = loaded.adapter
    exits = [int(x) for x in a.exits.split(",")]
    if a.heads:
        heads = load_heads(a.heads, loaded).heads
    else:
        last = adapter.num_layers - 1
        heads = {e: BlockHead(adapter, last, identity=False).to(adapter.dtype).eval() for e in exits}
    out = Path(tempfile.mkdtemp()) / "block-art"
    t0 = time.perf_counter()
    manifest = export_artifact(loaded, out, ExportOptions(exits=exits), heads=heads)
    d = describe(manifest, out)
    c = d["costs"]
    print(f"export {time.perf_counter() - t0:.1f} s; threads {c['threads']}, past {c['past']}")
    print("block heads (decoder layers per token):", json.dumps(d["block_heads"]))
    print("segment ms", [round(x, 3) for x in c["segment_ms"]], "block ms", c["block_ms"])
    print("full step ms", round(c["full_step_ms"], 3))
    print("validation", {k: v for k, v in d["validation"].items() if "diff" in k or k == "passed"})
    shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
