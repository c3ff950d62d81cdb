"""River's fidelity without timing: token agreement, exact match, exits taken and K/V cosine, per configuration.

    nice -n 19 python benchmarks/river_fidelity.py ARTIFACT --data gsm8k.jsonl --signal cosine-min \
        --exits 12,16,20,24 --thresholds 0.965 --compare int4=PATH

Greedy output is deterministic, so what `eectl bench` reports besides speed can be computed once, at any priority,
with no lock: each configuration generates once (the same prompts, chat template and exits as bench), and is compared
position-wise with eectl at full depth in fp32; river also gets bench's per-layer K/V cosine against the exact K/V
(first prompt). Speed comes from `eectl bench` under the bench lock.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from eectl.data import encode_prompt, load_text_data
from eectl.evaluate.river_kv import river_kv_cosine
from eectl.evaluate.stats import agreement as _agreement
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--data", required=True)
    ap.add_argument("--offset", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--signal", required=True)
    ap.add_argument("--exits", required=True)
    ap.add_argument("--thresholds", required=True)
    ap.add_argument("--policies", default="river,river-exit,defer,verify")
    ap.add_argument("--compare", default="", help="NAME=PATH,...: other artifacts at full depth")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    tok = load_tokenizer(rt)
    text = load_text_data(args.data, None)
    ids = [encode_prompt(tok, p) for p in text.prompts[args.offset : args.offset + args.prompts]]
    stop = tuple(rt.manifest.eos_token_ids)
    base = RunOptions(exits="none", max_new_tokens=args.max_new_tokens)
    full = [g.token_ids for g in Runner(rt, resolve_config(rt, base, stop)).generate(ids)]
    rows = []
    kv = None
    runners: dict[str, Runner] = {}
    for name in [p for p in args.policies.split(",") if p]:
        opts = RunOptions(
            exits=args.exits,
            signal=args.signal,
            thresholds=args.thresholds,
            policy="river" if name == "river-exit" else name,
            river_predict="exit" if name == "river-exit" else "end",
            max_new_tokens=args.max_new_tokens,
        )
        runners[name] = Runner(rt, resolve_config(rt, opts, stop))
    for pair in [c for c in args.compare.split(",") if c]:
        name, path = pair.split("=", 1)
        other = ArtifactRuntime(path, provider="cpu", threads=args.threads)
        runners[name] = Runner(other, resolve_config(other, base, stop))
    for name, runner in runners.items():
        gens = runner.generate(ids)
        tokens = [g.token_ids for g in gens]
        layers = [e for g in gens for e in g.exit_layers[1:]]
        agreement, exact, first = _agreement(tokens, full)
        hist = {str(k): layers.count(k) for k in sorted(set(layers))}
        L = rt.manifest.num_layers
        row = {
            "config": name,
            "token_agreement": agreement,
            "exact_match": exact,
            "first_divergence": first,
            "exited": float(np.mean([e < L for e in layers])) if layers else 0.0,
            "mean_layers": float(np.mean(layers)) if layers else float(L),
            "exit_histogram": hist,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if name == "river":
            kv = river_kv_cosine(runner, ids[0])
            print(json.dumps({"river_kv": kv}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "river_kv": kv, "prompts": len(ids), "tokens": args.max_new_tokens}, f, indent=1)


if __name__ == "__main__":
    main()
