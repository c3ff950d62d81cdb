"""FlexEE's setting measured (#32): configurations of one artifact interleaved in one process, under one weight
setting (runtime/tiers.py), decode speed as ratios against the first configuration, slow-tier bytes per token
measured (/proc/self/io, mincore) and predicted from the exit histogram, resident memory, tokens against the first.

    # no budget: today's packed sessions against mapped ones (two runtimes in one process)
    python benchmarks/offload.py artifacts/smollm2-135m-instruct --threads 2 --mapping
    # a budget: full depth, the artifact's default and verify, all under the same budget
    python benchmarks/offload.py artifacts/smollm2-135m-instruct --threads 2 --budget 50% --configs full,default,verify

A budgeted run must be its own process: another runtime mapping the same files keeps their pages cached.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.ort import init_ort
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.tiers import WeightOptions, load_tiers, memory_status


def _runtime(folder: str, threads: int, weights: WeightOptions) -> ArtifactRuntime:
    rt = ArtifactRuntime(folder, provider="cpu", threads=threads, lazy_segments=weights.active)
    if weights.active:
        load_tiers(rt, weights)
    return rt


def _config(rt: ArtifactRuntime, name: str, new: int):
    """full, default (the artifact's plan), a policy (the plan's choice for it), or policy@exits (e.g. verify@8+12:
    calibrated thresholds at those exits)."""
    policy, _, exits = name.partition("@")
    policy = {"full": "full", "full-aa": "full", "default": None}.get(policy, policy)  # full-aa: A/A control
    opts = RunOptions(policy=policy, exits=exits.replace("+", ",") or None, max_new_tokens=new, provider="cpu")
    return resolve_config(rt, opts, tuple(rt.manifest.eos_token_ids))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", default=None)
    ap.add_argument("--mapping", action="store_true", help="full depth: packed (today) vs mapped, no budget")
    ap.add_argument("--configs", default="full,default,verify")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    init_ort(a.threads)
    if a.mapping:
        runtimes = {
            "full (packed, today)": _runtime(a.artifact, a.threads, WeightOptions()),
            "full (mapped)": _runtime(a.artifact, a.threads, WeightOptions(mmap=True)),
        }
        cells = {name: (rt, _config(rt, "full", a.new)) for name, rt in runtimes.items()}
    else:
        rt = _runtime(a.artifact, a.threads, WeightOptions(budget=a.budget))
        print(rt.tiers.describe())
        cells = {name: (rt, _config(rt, name, a.new)) for name in a.configs.split(",")}
    first = next(iter(cells.values()))[0]
    tok = load_tokenizer(first)
    prompts = load_text_data("humaneval").prompts[: a.prompts]
    ids = [encode_prompt(tok, p) for p in prompts]
    names = list(cells)
    stats: dict[str, dict] = {
        n: {"decode_s": [], "tokens": [], "measured": 0, "predicted": 0, "layers": []} for n in names
    }
    answers: dict[str, list[list[int]]] = {}
    for name in names:  # warm-up, and each configuration's tokens
        rt, cfg = cells[name]
        answers[name] = [g.token_ids for g in Runner(rt, cfg).generate([ids[0]])]
    for rep in range(a.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order if rep % 2 == 0 else order[::-1]:
            rt, cfg = cells[name]
            runner = Runner(rt, cfg)
            s = stats[name]
            for p in ids:
                if rt.tiers is not None:
                    rt.tiers.reset()
                t0 = time.perf_counter()
                g = runner.generate([p])[0]
                wall = time.perf_counter() - t0
                s["decode_s"].append(float(np.sum(g.latencies_s[1:])))
                s["tokens"].append(len(g.token_ids) - 1)
                s.setdefault("wall_s", []).append(wall)
                s["layers"] += g.exit_layers
                if rep == 0:
                    answers.setdefault(name + "/all", []).append(g.token_ids)
                if rt.tiers is not None and rt.tiers.slow:
                    c = rt.tiers.counters
                    s["measured"] += c.read_bytes
                    s.setdefault("paged", 0)
                    s["paged"] += c.paged_bytes
                    s["predicted"] += rt.tiers.predicted_bytes(g.exit_layers, g.latencies_s)
                    s.setdefault("n_tokens", 0)
                    s["n_tokens"] += len(g.token_ids)
    base = names[0]
    base_tps = sum(stats[base]["tokens"]) / sum(stats[base]["decode_s"])
    out = {"threads": a.threads, "budget": a.budget, "prompts": a.prompts, "new": a.new, "reps": a.reps, "rows": []}
    for name in names:
        s = stats[name]
        rt, cfg = cells[name]
        tps = sum(s["tokens"]) / sum(s["decode_s"])
        same = answers[name + "/all"] == answers[base + "/all"]
        row = {
            "config": name,
            "policy": cfg.policy,
            "exits": cfg.exits,
            "drafts": cfg.prompt_drafts,
            "decode_speed_vs_first": tps / base_tps,
            "mean_layers": float(np.mean(s["layers"])),
            "tokens_identical_to_first": same,
        }
        if "n_tokens" in s:
            row["slow_MB_per_token_measured_io"] = s["measured"] / s["n_tokens"] / 1e6
            row["slow_MB_per_token_measured_mincore"] = s["paged"] / s["n_tokens"] / 1e6
            row["slow_MB_per_token_predicted"] = s["predicted"] / s["n_tokens"] / 1e6
            row["measured_over_predicted"] = s["measured"] / s["predicted"] if s["predicted"] else None
        out["rows"].append(row)
    for name, (rt, _) in cells.items():
        if rt.tiers is not None:
            r = rt.tiers.resident()
            out.setdefault("resident", {})[name] = {k: v / 1e6 for k, v in r.items()}
    out["process"] = {k: v / 1e6 for k, v in memory_status().items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
