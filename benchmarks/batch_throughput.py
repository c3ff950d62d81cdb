"""Batched rows on a real artifact: throughput at batch B vs batch 1, and each policy against full depth at batch B.

    flock /tmp/eectl-bench.lock timeout 1200 python benchmarks/batch_throughput.py ARTIFACT --threads 2 \
        --prompts 16 --batch 16 --max-new-tokens 48 --reps 3

One process, one runtime, one interleaved run: full depth at batch 1 and at batch B, and every early-exit policy
(the artifact's plan for it, as `eectl run --policy P` picks) at batch B (and at batch 1 with --policies-b1). The
same prompts (HumanEval's, in the chat template) in every configuration; a warm-up, then `--reps` repetitions, each
starting one configuration later. Per configuration: throughput (decoded tokens of all rows / decode wall time: a
batch's steps are shared by its rows), a row's latency per decode step (median), prefill wall time, and the ratio
of throughput to full depth at the same batch size. Tokens are checked against full depth at batch 1 (full at batch
B and verify must be identical). `--profile` instead profiles one batch-B full-depth generate (cProfile, top 25).
`--resident` adds each policy at batch B executed as the binding plan says (`RunConfig.device_resident`: the states
as OrtValues between graphs, the CUDA path's code on the CPU EP), `--exits 24 --thresholds 0.9` overrides the
artifact's plan (an artifact without calibration).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from dataclasses import dataclass, field

import torch

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import Generation


@dataclass
class Rep:
    decode_s: float = 0.0  # wall time of the decode steps (per batch: its longest row's, rows share steps)
    prefill_s: float = 0.0
    tokens: int = 0  # decoded tokens (the first, from the prefill, not counted)
    step_s: list[float] = field(default_factory=list)  # a row's latency per decode step
    gens: list[list[int]] = field(default_factory=list)
    exits: int = 0  # tokens decided before the final layer


def once(runner: Runner, ids: list[list[int]], batch: int, num_layers: int) -> Rep:
    rep = Rep()
    for i in range(0, len(ids), batch):
        gens: list[Generation] = runner.generate(ids[i : i + batch])
        rep.decode_s += max(sum(g.latencies_s[1:]) for g in gens)
        rep.prefill_s += gens[0].latencies_s[0]
        for g in gens:
            rep.tokens += len(g.latencies_s) - 1
            rep.step_s.extend(g.latencies_s[1:])
            rep.gens.append(g.token_ids)
            rep.exits += sum(1 for e in g.exit_layers[1:] if e < num_layers)
    return rep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", default="copy,defer,verify")
    ap.add_argument("--policies-b1", action="store_true", help="also run each policy at batch 1")
    ap.add_argument("--no-ride", action="store_true", help="also run defer with riding along off")
    ap.add_argument("--row-prefill", action="store_true", help="also run full depth at batch B with per-row prefill")
    ap.add_argument("--resident", action="store_true", help="also run each policy device-resident at batch B")
    ap.add_argument("--exits", default=None, help="active exits, e.g. 24 (default: the artifact's plan)")
    ap.add_argument("--thresholds", default=None, help="e.g. 0.9 (default: the calibration's)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    tok = load_tokenizer(rt)
    prompts = load_text_data("humaneval").prompts[: args.prompts]
    ids = [encode_prompt(tok, p) for p in prompts]
    stop = tuple(rt.manifest.eos_token_ids)
    L = rt.manifest.num_layers

    def runner(policy: str | None, ride: bool = True, batch_prompts: bool = True, resident: bool = False) -> Runner:
        exits = "none" if policy is None else args.exits
        opts = RunOptions(
            policy=policy, max_new_tokens=args.max_new_tokens, exits=exits, thresholds=args.thresholds, raw=False
        )
        cfg = resolve_config(rt, opts, stop)
        cfg.ride_along, cfg.batch_prompts, cfg.device_resident = ride, batch_prompts, resident
        if policy is not None:
            print(f"{policy}: {cfg.note or f'exits {cfg.exits}'}")
        return Runner(rt, cfg)

    full = runner(None)
    if args.profile:
        once(full, ids[: args.batch], args.batch, L)  # warm
        prof = cProfile.Profile()
        prof.enable()
        rep = once(full, ids[: args.batch], args.batch, L)
        prof.disable()
        print(f"batch {args.batch}: decode {rep.decode_s:.2f} s, prefill {rep.prefill_s:.2f} s, {rep.tokens} tokens")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    configs: dict[str, tuple[Runner, int]] = {"full b1": (full, 1), f"full b{args.batch}": (full, args.batch)}
    if args.row_prefill:
        configs[f"full b{args.batch} row-prefill"] = (runner(None, batch_prompts=False), args.batch)
    for p in [q for q in args.policies.split(",") if q]:
        r = runner(p)
        configs[f"{p} b{args.batch}"] = (r, args.batch)
        if args.policies_b1:
            configs[f"{p} b1"] = (r, 1)
        if args.resident:
            configs[f"{p} b{args.batch} resident"] = (runner(p, resident=True), args.batch)
        if args.no_ride and p == "defer":
            configs[f"{p} b{args.batch} no-ride"] = (runner(p, ride=False), args.batch)
    order = list(configs)
    print(
        f"{rt.manifest.model.get('name', args.artifact)}: {len(ids)} prompts (HumanEval, chat template, "
        f"{min(map(len, ids))}-{max(map(len, ids))} tokens), {args.max_new_tokens} new tokens, "
        f"ORT and torch threads {args.threads}, {args.reps} interleaved reps (rotated), configs: {', '.join(order)}"
    )
    for name in order:  # warm-up
        r, b = configs[name]
        once(r, ids[:b], b, L)
    reps: dict[str, list[Rep]] = {n: [] for n in order}
    t0 = time.perf_counter()
    for k in range(args.reps):
        shift = k % len(order)
        for name in order[shift:] + order[:shift]:
            r, b = configs[name]
            reps[name].append(once(r, ids, b, L))
            last = reps[name][-1]
            print(f"  rep {k + 1} {name}: {last.tokens / last.decode_s:.1f} tokens/s", flush=True)
        print(f"after {k + 1} rep(s), {time.perf_counter() - t0:.0f} s:")
        table(reps, configs, order)


def table(reps: dict[str, list[Rep]], configs: dict[str, tuple[Runner, int]], order: list[str]) -> None:
    ref = reps["full b1"][0].gens if reps["full b1"] else None
    tput = {n: statistics.median(x.tokens / x.decode_s for x in v) for n, v in reps.items()}
    print(
        "\n| config | throughput (tokens/s, median; min-max) | vs full b1 | vs full, same batch | row ms/step (median) "
        "| prefill s | tokens | exited | same tokens as full b1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in order:
        v = reps[name]
        b = configs[name][1]
        ts = [x.tokens / x.decode_s for x in v]
        step = statistics.median(s for x in v for s in x.step_s) * 1000
        same = "-" if ref is None else f"{sum(a == r for a, r in zip(v[0].gens, ref, strict=True))}/{len(ref)}"
        print(
            f"| {name} | {tput[name]:.1f} ({min(ts):.1f}-{max(ts):.1f}) | {tput[name] / tput['full b1']:.2f}x | "
            f"{tput[name] / tput[f'full b{b}']:.2f}x | {step:.1f} | {statistics.median(x.prefill_s for x in v):.2f} | "
            f"{v[0].tokens} | {v[0].exits / max(1, v[0].tokens):.1%} | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
