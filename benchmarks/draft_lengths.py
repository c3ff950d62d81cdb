"""Drafts from the context at several longest runs, realized and priced, on one artifact (the plan's run-length
choice, runtime/drafts.py LONGEST_RUNS).

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/draft_lengths.py ARTIFACT \
        --data ../shared/data/gsm8k/train.jsonl --offset 5600 --prompts 32 --max-new-tokens 96 --lengths 4,8,12

One process, one runtime: full depth and lookup at each `--lengths` value (drafts per step, shortest run 1) as
runners that take turns prompt by prompt (the order rotated each prompt), `--rounds` times over the prompts, each
round starting with empty draft memories (`Runner.forget_prompts(memory=True)`; memory on as `eectl run`'s default).
Per configuration: decode milliseconds per token summed over every prompt and round, the speedup against full depth
(the ratio of those sums; per round too), whether every answer equals full depth's, and the price calibration's
replay gives the same answers with the artifact's costs (plan/lookup.py `predict_lookup` on `lookup_stats`).
"""

from __future__ import annotations

import argparse

from eectl.contracts.plan import DRAFT_MEMORY
from eectl.data import encode_prompt, load_text_data
from eectl.plan.lookup import predict_lookup
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.drafts import lookup_stats
from eectl.runtime.ort import init_ort
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--offset", type=int, default=5600)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--lengths", default="4,8,12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    init_ort(a.threads)
    rt = ArtifactRuntime(a.artifact, provider="cpu", threads=a.threads)
    stop = tuple(rt.manifest.eos_token_ids)
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, t, False) for t in load_text_data(a.data).prompts[a.offset : a.offset + a.prompts]]
    n = a.max_new_tokens
    runners = {"full": Runner(rt, resolve_config(rt, RunOptions(exits="none", max_new_tokens=n), stop))}
    for d in (int(x) for x in a.lengths.split(",")):
        opts = RunOptions(policy="lookup", max_new_tokens=n, prompt_drafts=d, draft_min=1, draft_memory=DRAFT_MEMORY)
        runners[f"lookup-{d}"] = Runner(rt, resolve_config(rt, opts, stop))
    names = list(runners)
    ms = {k: [0.0] * a.rounds for k in names}
    tokens = {k: [0] * a.rounds for k in names}
    answers: dict[str, list[list[int]]] = {k: [] for k in names}
    for r in range(a.rounds):
        for runner in runners.values():
            runner.forget_prompts(memory=True)
        for i, prompt in enumerate(ids):
            for k in names[i % len(names) :] + names[: i % len(names)]:
                (g,) = runners[k].generate([prompt])
                lat = g.latencies_s[1:]
                ms[k][r] += 1e3 * sum(lat)
                tokens[k][r] += len(lat)
                if r == 0:
                    answers[k].append(list(g.token_ids))
    costs = rt.manifest.costs
    full = sum(ms["full"]) / sum(tokens["full"])
    print(f"{a.artifact}: {len(ids)} prompts x {n} tokens, {a.rounds} rounds, {a.threads} threads")
    print("| configuration | ms/token | vs full depth (per round) | answers equal full depth's | priced (replay) |")
    print("|---|---|---|---|---|")
    for k in names:
        per_token = sum(ms[k]) / sum(tokens[k])
        rounds = ", ".join(
            f"{(ms['full'][r] / tokens['full'][r]) / (ms[k][r] / tokens[k][r]):.3f}" for r in range(a.rounds)
        )
        same = sum(x == y for x, y in zip(answers[k], answers["full"], strict=True))
        priced = "-"
        if k != "full" and costs is not None:
            cfg = runners[k].cfg
            pairs = list(zip(ids, answers["full"], strict=True))
            stats = lookup_stats(pairs, cfg.prompt_drafts, stop, min_draft=cfg.draft_min, memory=cfg.draft_memory)
            pred = predict_lookup(costs, stats)
            priced = f"{pred.speedup:.3f}x" if pred is not None else "-"
        print(f"| {k} | {per_token:.2f} | {full / per_token:.3f}x ({rounds}) | {same}/{len(ids)} | {priced} |")


if __name__ == "__main__":
    main()
