"""Where a decision's time goes: the runner's exit decisions on an artifact, split into the exit graphs' own time
and the Python around them.

    flock /tmp/eectl-bench.lock python benchmarks/decision_profile.py ARTIFACT --threads 2 --policy verify

Generates greedily with the artifact's plan (or --exits/--thresholds) and wraps, by instrumentation only (no code
change in the runner): `Runner._decide_rows` (the whole decision, what bench's "decide share" counts) and the ONNX
Runtime calls it makes (`exit_candidates`, `exit_local`, `exit_full`). Prints per decision: total, graph time,
Python around it, and the decision share of decode time, for the runner as it is. With --cprofile, the top
functions under the decisions (cProfile; slows everything, so only for the split, not the share).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


class _Timer:
    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns += time.perf_counter_ns() - t0
                self.calls += 1

        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--data", default="humaneval")
    ap.add_argument("--offset", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--policy", default="verify")
    ap.add_argument("--exits", default=None)
    ap.add_argument("--thresholds", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    tok = load_tokenizer(rt)
    prompts = load_text_data(args.data).prompts[args.offset : args.offset + args.prompts]
    ids = [encode_prompt(tok, p, False) for p in prompts]
    opts = RunOptions(
        exits=args.exits, thresholds=args.thresholds, policy=args.policy, max_new_tokens=args.tokens, provider="cpu"
    )
    runner = Runner(rt, resolve_config(rt, opts, tuple(rt.manifest.eos_token_ids)))
    print(f"{args.policy}: exits {runner.cfg.exits}, {rt.threads} ORT threads; {runner.cfg.note}")
    runner.generate(ids[:1])  # warm-up
    graphs, decide = _Timer(), _Timer()
    for name in ("exit_candidates", "exit_local", "exit_full"):
        setattr(rt, name, graphs.wrap(getattr(rt, name)))
    runner._decide_rows = decide.wrap(runner._decide_rows)  # type: ignore[method-assign]
    prof = cProfile.Profile() if args.cprofile else None
    if prof is not None:
        prof.enable()
    gens = [runner.generate([p])[0] for p in ids]
    if prof is not None:
        prof.disable()
    decode = sum(sum(g.latencies_s[1:]) for g in gens)
    tokens = sum(len(g.latencies_s) - 1 for g in gens)
    exited = sum(1 for g in gens for e in g.exit_layers[1:] if e < rt.manifest.num_layers)
    n = max(1, decide.calls)
    per_token = decide.calls / max(1, tokens)
    print(f"{tokens} decode tokens, {exited} exited, {decide.calls} decisions ({per_token:.2f}/token)")
    print(f"decode {1000 * decode / max(1, tokens):.2f} ms/token")
    print(
        f"per decision: {decide.ns / n / 1000:.0f} us total = {graphs.ns / n / 1000:.0f} us in exit graphs "
        f"({graphs.calls} calls) + {(decide.ns - graphs.ns) / n / 1000:.0f} us Python around them"
    )
    print(
        f"decision share of decode time: {decide.ns / 1e9 / decode:.1%} (graphs {graphs.ns / 1e9 / decode:.1%}, "
        f"Python {(decide.ns - graphs.ns) / 1e9 / decode:.1%})"
    )
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
