"""Per-step time of decode steps that meet pending positions (defer's flush of deferred states, verify's check of
its drafts), against the other steps, on one artifact: the before/after check for binding those steps on the decode
chain (#11). Run it once per source tree (PYTHONPATH), alternating, and compare the medians.

    /work/wt/measure timeout 900 sh -c 'for t in OLD NEW OLD NEW; do PYTHONPATH=$t python \
        benchmarks/handover_steps.py ARTIFACT --exits 24 --thresholds 0.9; done'

One process: 2 ORT threads (--threads), greedy, one row, a warm-up generation, then each policy on every prompt
(HumanEval prompts from --data, chat template off), no stop tokens (every run the same length). A step "meets
pending" when the token before it exited (its state waits after the exit) and it did not exit itself (so it runs
the segments after the exit, carrying the waiting states along). Prints one JSON line per policy: median ms of
those steps and of full-depth steps with nothing pending, their counts, and the exit rate.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import load_tokenizer
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--exits", default="24")
    ap.add_argument("--thresholds", type=float, default=0.9)
    ap.add_argument("--policies", default="defer,verify")
    ap.add_argument("--data", default="humaneval")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    L = rt.manifest.num_layers
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, False) for p in load_text_data(args.data).prompts[: args.prompts]]
    exits = [int(e) for e in args.exits.split(",")]
    for policy in args.policies.split(","):
        cfg = RunConfig(
            exits=exits,
            thresholds={e: {"prob": args.thresholds} for e in exits},
            policy=policy,
            top_k=rt.manifest.top_k,
            max_new_tokens=args.max_new_tokens,
        )
        runner = Runner(rt, cfg)
        runner.generate([ids[0]])  # warm-up
        pending: list[float] = []
        plain: list[float] = []
        exited = steps = 0
        for prompt in ids:
            g = runner.generate([prompt])[0]
            layers, lat = g.exit_layers, g.latencies_s
            for i in range(1, min(len(layers), len(lat))):
                steps += 1
                exited += layers[i] < L
                if layers[i] == L:
                    (pending if layers[i - 1] < L else plain).append(1000 * lat[i])
        out = {
            "tag": args.tag,
            "policy": policy,
            "meets_pending_ms": statistics.median(pending) if pending else None,
            "meets_pending_n": len(pending),
            "full_nothing_pending_ms": statistics.median(plain) if plain else None,
            "full_n": len(plain),
            "exit_rate": exited / max(1, steps),
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
