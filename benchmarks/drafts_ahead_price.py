"""The run-ahead drafter's price per exit and bound on an artifact (docs/results/2026-12-07-drafts-ahead.md).

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/drafts_ahead_price.py ARTIFACT \
        --data ../shared/data/gsm8k/train.jsonl --start 4992 --prompts 8 --max-new-tokens 64 --threads 2

Generates the prompts' full-depth greedy answers, traces every exit that ends a segment (runtime/ahead.py `traces`:
its top-1 probability and whether its token is the answer's next, per position), and prints per exit its accuracy
and, per bound of plan/ahead.py's grid, the predicted speedup with the manifest's costs and the drafts and kept drafts
per check pass; then the exit's choice (`choose_ahead`, with its interval and the kept share by draft position).
This is bench's pricing of its `ahead` row (evaluate/ahead.py) spelled out per bound.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from eectl.data import encode_prompt, load_text_data
from eectl.plan.ahead import BOUNDS, choose_ahead, price, replay_ahead
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.ahead import traces
from eectl.runtime.ort import init_ort
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--start", type=int, default=4992)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    init_ort(a.threads)
    rt = ArtifactRuntime(a.artifact, provider="cpu", threads=a.threads)
    m = rt.manifest
    assert m.costs is not None, "the artifact has no costs to price with"
    tok = load_tokenizer(rt)
    texts = load_text_data(a.data, None).prompts[a.start : a.start + a.prompts]
    ids = [encode_prompt(tok, p) for p in texts]
    full = resolve_config(rt, RunOptions(exits="none", max_new_tokens=a.max_new_tokens), tuple(m.eos_token_ids))
    full = replace(full, prompt_drafts=0)
    pairs = list(zip(ids, (g.token_ids for g in Runner(rt, full).generate(ids)), strict=True))
    boundaries = [s.layers[1] for s in m.segments]
    block = full.verify_block
    print(f"full step {m.costs.baseline_ms():.2f} ms; records {a.start}..{a.start + len(pairs) - 1}")
    for e in boundaries[:-1]:
        tr = traces(rt, e, pairs, full.top_k)
        right = np.concatenate([np.array(r, dtype=bool) for _, r in tr])
        print(f"exit {e}: accuracy {right.mean():.3f}")
        for b in BOUNDS:
            cycles = [replay_ahead(p, r, b, block) for p, r in tr]
            flat = [c for per in cycles for c in per]
            pred = price(m.costs, boundaries, e, cycles, block)
            drafts, kept = (sum(x[i] for x in flat) / max(len(flat), 1) for i in (0, 1))
            print(f"  bound {b}: {pred.speedup:.3f}x, {drafts:.2f} drafts and {kept:.2f} kept per check")
        choice = choose_ahead(m.costs, boundaries, {e: tr}, block)
        if choice is not None:
            print(f"  {choice.describe()}; kept by position {choice.by_position}")


if __name__ == "__main__":
    main()
