"""Two checkouts of eectl on one artifact, interleaved: is a refactor as fast as the code before it?

    python benchmarks/code_ab.py ARTIFACT --old /path/to/old/checkout --new . --reps 4 --threads 2 [--batched]

Each repetition runs one process per code version (PYTHONPATH set to that checkout; the order rotates between
repetitions), plus a second process of the new code as an A/A control. A process loads the artifact once and decodes
the same prompts under full depth and each KV policy at the given exits and threshold (greedy), timing only the
generate calls. Reported per configuration: tokens/s (median over repetitions) and new/old and A/A ratios, and
whether every version produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch
art, exits, thr = sys.argv[1], sys.argv[5], sys.argv[6]
threads, prompts, new_tokens = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
try:
    from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
except ImportError:  # the layout before eectl/run/
    from eectl.runtime.generate import RunOptions, load_tokenizer, resolve_config
from eectl.data import encode_prompt, load_text_data
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
rt = ArtifactRuntime(art, provider="cpu", threads=threads)
tok = load_tokenizer(rt)
texts = load_text_data(sys.argv[7], "question").texts[:prompts]
ids = [encode_prompt(tok, t, False) for t in texts]
out = {}
configs = [("full", RunOptions(exits="none", max_new_tokens=new_tokens, threads=threads))]
configs += [
    (p, RunOptions(exits=exits, thresholds=thr, policy=p, max_new_tokens=new_tokens, threads=threads))
    for p in ("copy", "defer", "verify")
]
batched = sys.argv[8] == "1" if len(sys.argv) > 8 else False
if batched:  # the same configurations with every prompt in one batch (batched calls; exits on the general path)
    configs += [(f"{name} batch", opts) for name, opts in configs]
for name, opts in configs:
    runner = Runner(rt, resolve_config(rt, opts, tuple(rt.manifest.eos_token_ids)))
    runner.generate([ids[0]])  # warm-up
    t0 = time.perf_counter()
    gens = runner.generate(ids) if name.endswith(" batch") else [runner.generate([p])[0] for p in ids]
    wall = time.perf_counter() - t0
    n = sum(len(g.token_ids) for g in gens)
    exited = sum(sum(1 for e in g.exit_layers[1:] if e < rt.manifest.num_layers) for g in gens)
    out[name] = {"tps": n / wall, "tokens": [g.token_ids for g in gens], "exited": exited / max(1, n)}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=".")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--exits", default="16,24")
    ap.add_argument("--thresholds", default="0.6")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--batched", action="store_true", help="also every configuration with all prompts in one batch")
    a = ap.parse_args()
    versions = {"old": Path(a.old).resolve(), "new": Path(a.new).resolve(), "new-aa": Path(a.new).resolve()}
    data = str(Path(a.data).resolve())
    runs: dict[str, list[dict]] = {v: [] for v in versions}
    names = list(versions)
    for r in range(a.reps):
        for v in names[r % 3 :] + names[: r % 3]:
            env = {**os.environ, "PYTHONPATH": str(versions[v]), "OMP_NUM_THREADS": str(a.threads)}
            argv = [sys.executable, "-c", CHILD, a.artifact, str(a.threads), str(a.prompts), str(a.max_new_tokens)]
            argv += [a.exits, a.thresholds, data, "1" if a.batched else "0"]
            res = subprocess.run(argv, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{v}: {res.stderr.strip().splitlines()[-1]}")
            runs[v].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(
                f"rep {r + 1} {v}: " + ", ".join(f"{c} {d['tps']:.1f}" for c, d in runs[v][-1].items()), file=sys.stderr
            )
    print(
        f"{a.reps} interleaved reps, {a.prompts} prompts x {a.max_new_tokens} tokens, threads {a.threads}, "
        f"exits {a.exits} at {a.thresholds}"
    )
    print("| config | old tok/s | new tok/s | new/old | A/A (new-aa/new) | exited | tokens equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in runs["old"][0]:
        med = {v: statistics.median(x[c]["tps"] for x in runs[v]) for v in versions}
        same = all(x[c]["tokens"] == runs["old"][0][c]["tokens"] for v in versions for x in runs[v])
        print(
            f"| {c} | {med['old']:.1f} | {med['new']:.1f} | {med['new'] / med['old']:.3f} | "
            f"{med['new-aa'] / med['new']:.3f} | {runs['new'][0][c]['exited']:.1%} | {same} |"
        )


if __name__ == "__main__":
    main()
