"""River's ceiling per exit depth: every decode token exits at one exit and rides the int4 river from there.

    flock /tmp/eectl-bench.lock python benchmarks/river_depths.py ARTIFACT --data gsm8k.jsonl --threads 2

For each exit depth E of a `--river` artifact, one `eectl bench` run (run_bench, interleaved with full depth in
fp32, its own baseline) of `river` and `river-exit` with only exit E active and a threshold every token passes
(`--thresholds` of the signal, default 0: Top-K probability >= 0), so the row shows what the river costs and
keeps when the signal lets everything through at E: the speed bound of River at that depth, and the agreement
its int4 engine alone allows. The cost model's prediction at the realized exits is printed beside the measured
ratio (costs re-measured in the same process first with --profile-costs). A real signal exits a share of the
tokens at each depth, so its speed lies between 1.0x and these rows.
"""

from __future__ import annotations

import argparse
import json

from eectl.contracts.manifest import read_manifest
from eectl.data import load_text_data
from eectl.evaluate.bench import run_bench
from eectl.evaluate.results import BenchOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--data", required=True)
    ap.add_argument("--offset", type=int, default=2000)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--exits", default="", help="depths to try (default: every exit of the artifact)")
    ap.add_argument("--signal", default="topk-prob")
    ap.add_argument("--threshold", default="0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile-costs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    text = load_text_data(args.data, None)
    window = slice(args.offset, args.offset + args.prompts)
    depths = [int(x) for x in args.exits.split(",") if x.strip()] or read_manifest(args.artifact).exit_layers[:-1]
    rows = []
    print(
        "| exit | config | ms/token | vs full [95% CI] | model at realized exits | exit histogram | mean layers "
        "| token agreement | exact match | first divergence |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in depths:
        opts = BenchOptions(
            configs=["full", "river", "river-exit"],
            prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            reps=args.reps,
            exits=str(e),
            signal=args.signal,
            thresholds=args.threshold,
            sweep=[],
            ppl_tokens=0,
            threads=args.threads,
            profile_costs=args.profile_costs,
        )
        res = run_bench(args.artifact, text.prompts[window], opts)
        for c in res.configs:
            rows.append({"exit": e, **c.__dict__})
            ci = c.speedup_vs_full_ci
            print(
                f"| {e} | {c.name} | {c.ms_per_token:.1f} | {c.speedup_vs_full or 0:.2f}x"
                f"{f' [{ci[0]:.2f}, {ci[1]:.2f}]' if ci else ''} | "
                f"{f'{c.model_speedup:.2f}x' if c.model_speedup else '-'} | {c.exit_histogram} | "
                f"{c.mean_layers if c.mean_layers is not None else '-'} | {c.token_agreement:.1%} | "
                f"{c.exact_match:.0%} | {c.first_divergence} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
