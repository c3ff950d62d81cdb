"""Does the plan's choice hold from one cost measurement to the next? Re-measures an artifact's costs and re-plans
(`eectl run --profile-costs`'s `replan`) several times in one process, and prints per run: each policy's choice
with its predicted speedup and interval and whether the timing left it undecided, the plan's line, the rounds and
batches timed, the seconds it took, and what the point-estimate rule (before #11's intervals) would have chosen.
`--fresh` opens a new runtime for every run (new sessions and buffers, as a separate `eectl run` would).

    flock /tmp/eectl-heavy.lock python benchmarks/plan_stability.py ARTIFACT --runs 5 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eectl.contracts.plan import MIN_GAIN
from eectl.run.generate import replan
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=None, help="re-timing budget (default: the runner's)")
    ap.add_argument("--fresh", action="store_true", help="a new runtime for every run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    for run in range(args.runs):
        if args.fresh and run:
            rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
        t0 = time.perf_counter()
        replan(rt, args.budget_s)
        took = time.perf_counter() - t0
        m = rt.manifest
        assert m.plan is not None and m.costs is not None
        bests = {p: c.best for p, c in m.plan.choices.items() if c.best is not None and p != "copy"}
        top = max(bests.values(), key=lambda b: b.speedup, default=None)
        point = "full" if top is None or top.speedup < 1 + MIN_GAIN else f"{top.policy} {top.exits}"
        doc = {
            "run": run,
            "default": m.plan.default,
            "choices": {
                p: {
                    "exits": c.exits,
                    "speedup": round(c.prediction.speedup, 4),
                    "interval": c.prediction.interval,
                    "undecided": c.undecided,
                }
                for p, c in m.plan.choices.items()
            },
            "unresolved": m.plan.unresolved,
            "plan": m.plan.summary(),
            "rounds": m.costs.rounds(),
            "batches": m.costs.batch_count(),
            "seconds": round(took, 1),
            "chain_step_ms": round(m.costs.baseline_ms(), 2),
            "point_rule_would_run": point,
            "best": {p: [b.exits, round(b.speedup, 4), b.interval] for p, b in bests.items()},
        }
        print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
