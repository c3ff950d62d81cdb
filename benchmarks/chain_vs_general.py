"""The bound chain against the runner's general path (`RunConfig.bound=False`) in ONE process, interleaved.

    python benchmarks/chain_vs_general.py ARTIFACT --mode batch --reps 5      # 16 prompts in 4 slots x 32 tokens
    python benchmarks/chain_vs_general.py ARTIFACT --mode resident --reps 3   # one row, device buffers (CPU EP)
    python benchmarks/chain_vs_general.py ARTIFACT --mode padded --reps 5     # prompts padded into one call
    python benchmarks/chain_vs_general.py ARTIFACT --mode scoring --reps 6    # teacher-forced, token by token

One `ArtifactRuntime`; for each configuration a `Runner` on the chain and one with `bound=False`, each taking its turn
on the same held-out GSM8K prompts (questions from line `--offset`, raw, greedy), the order reversed every other
repetition, after `--warmup` untimed rounds (a runner's first call binds its chains and allocates); `batch` adds a
second chain runner of verify as the A/A control, `padded` one of full depth. Configurations are the plan's resolutions
of `--policy` (batch: verify, defer, lookup and full depth at `--batch-size 4`; resident: verify, defer, copy with
`device_resident`; padded: full depth with `batch_prompts`; scoring: copy at [12, 24]). Reported per configuration:
tokens/s (ms per position for scoring) per repetition, chain/general per repetition and its median, and whether both
produced the same tokens (layers for scoring).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime

MODES = {
    "batch": {
        "full": RunOptions(exits="none", policy="defer", max_new_tokens=32, batch_size=4),
        "verify": RunOptions(policy="verify", max_new_tokens=32, batch_size=4),
        "defer": RunOptions(policy="defer", max_new_tokens=32, batch_size=4),
        "lookup": RunOptions(policy="verify", exits="none", prompt_drafts=6, max_new_tokens=32, batch_size=4),
    },
    "resident": {
        "verify": RunOptions(policy="verify", max_new_tokens=32),
        "defer": RunOptions(policy="defer", max_new_tokens=32),
        "copy": RunOptions(policy="copy", max_new_tokens=32),
    },
    "padded": {"full": RunOptions(exits="none", policy="defer", max_new_tokens=8, batch_size=4)},
    "scoring": {"copy": RunOptions(policy="copy", exits="12,24", max_new_tokens=8)},
}
PROMPTS = {"batch": 16, "resident": 8, "padded": 16, "scoring": 8}
AA = {"batch": "verify/chain", "padded": "full/chain"}  # the A/A control's partner: the same configuration's chain


def _runners(rt: ArtifactRuntime, mode: str) -> dict[str, Runner]:
    runners = {}
    for name, opts in MODES[mode].items():
        cfg = resolve_config(rt, opts, ())
        if mode == "resident":
            cfg = dataclasses.replace(cfg, device_resident=True)
        if mode == "padded":
            cfg = dataclasses.replace(cfg, batch_prompts=True)
        runners[f"{name}/chain"] = Runner(rt, cfg)
        runners[f"{name}/general"] = Runner(rt, dataclasses.replace(cfg, bound=False))
        if AA.get(mode) == f"{name}/chain":
            runners["aa/chain"] = Runner(rt, cfg)
    return runners


def _one(mode: str, runner: Runner, prompts: list[list[int]]) -> tuple[float, Any]:
    """One configuration's turn: (tokens/s, or ms per scored position; what it produced)."""
    runner.forget_prompts()
    if mode == "scoring":
        t0 = time.perf_counter()
        got = runner.score_many([(p[:64], 8) for p in prompts])
        dt = time.perf_counter() - t0
        return 1000 * dt / sum(len(g.nll) for g in got), [g.layers for g in got]
    if mode == "resident":
        t, n, out = 0.0, 0, []
        for p in prompts:  # one row each
            runner.forget_prompts()
            t0 = time.perf_counter()
            g = runner.generate([p])[0]
            t += time.perf_counter() - t0
            n, out = n + len(g.token_ids), [*out, g.token_ids]
        return n / t, out
    t0 = time.perf_counter()
    gens = runner.generate(prompts, slots=4)
    dt = time.perf_counter() - t0
    return sum(len(g.token_ids) for g in gens) / dt, [g.token_ids for g in gens]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--mode", choices=sorted(MODES), default="batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (the first call binds and allocates)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--offset", type=int, default=7449, help="the first GSM8K question (held out by default)")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    args = ap.parse_args()
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    tok = load_tokenizer(rt)
    texts = load_text_data(args.data, "question").texts[args.offset : args.offset + PROMPTS[args.mode]]
    prompts = [encode_prompt(tok, t, False) for t in texts]
    runners = _runners(rt, args.mode)
    res: dict[str, list[float]] = {k: [] for k in runners}
    made: dict[str, Any] = {}
    for _ in range(args.warmup):
        for runner in runners.values():
            _one(args.mode, runner, prompts)
    for rep in range(args.reps):
        items = list(runners.items()) if rep % 2 == 0 else list(reversed(runners.items()))
        for name, runner in items:
            value, out = _one(args.mode, runner, prompts)
            res[name].append(value)
            made.setdefault(name, out)
    unit = "ms/position" if args.mode == "scoring" else "tok/s"
    print(f"{args.mode}: {args.reps} interleaved reps, {len(prompts)} prompts, {args.threads} threads ({unit})")
    for name in [*MODES[args.mode], *(["aa"] if "aa/chain" in runners else [])]:
        other = f"{name}/general" if name != "aa" else AA[args.mode]
        mine, theirs = res[f"{name}/chain"], res[other]
        ratio = [b / a if args.mode == "scoring" else a / b for a, b in zip(mine, theirs, strict=True)]
        print(
            f"{name}: chain {[round(x, 2) for x in mine]} vs {other} {[round(x, 2) for x in theirs]}; chain/other "
            f"{[round(x, 3) for x in ratio]} median {statistics.median(ratio):.3f}; same output "
            f"{made[f'{name}/chain'] == made[other]}"
        )


if __name__ == "__main__":
    main()
