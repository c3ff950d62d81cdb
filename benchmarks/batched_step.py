"""A full-depth decode step by rows, and where its time goes (#67): the graphs' calls, ONNX Runtime's ops, the host.

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/batched_step.py ARTIFACT --rows 1,4,16 --steps 48 \
        --threads 2 [--reps 3] [--profile DIR]

Per row count B: the first B GSM8K train questions through the chat template, prefilled by the runner (greedy, full
depth: `--exits none`), then `--steps` decode steps of the batch's bound chain as the engine runs them
(`DecodeChain.step` on the chain the runner kept, each row feeding its last token), every step timed. Each graph call
of the step is timed too (a proxy around its session's `run_with_iobinding`): the embedding, the segments, the
certified head, the full head (where a row of the step does not pass); the host is the step's time less its calls.
Row counts run interleaved, `--reps` times, each repetition from the same prompts; every row's tokens must equal the
first repetition's and the same row's at the other row counts (greedy rows are the same alone or batched).

`--profile DIR`: after the timed repetitions, the same steps once more per row count on a second runtime whose
sessions run ONNX Runtime's profiler (`SessionOptions.enable_profiling`; the cache prefilled by the first runtime,
so only decode steps are profiled): per op type, ms per step (the first `--warmup` steps left out), each session's
runs (`model_run`) against its nodes (what ORT does around them). The profiler adds a little to every node.

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

GSM8K = "/work/shared/data/gsm8k/train.jsonl"


class Timed:
    """A session whose `run_with_iobinding` calls add their seconds to `clock[label]`."""

    def __init__(self, session: Any, label: str, clock: dict[str, float]) -> None:
        self.session, self.label, self.clock = session, label, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def run_with_iobinding(self, io: Any, *args: Any, **kwargs: Any) -> Any:
        return self.wrap(self.session.run_with_iobinding)(io, *args, **kwargs)

    def wrap(self, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = call(*args, **kwargs)
            self.clock[self.label] += time.perf_counter() - t0
            return out

        return timed


def questions(n: int) -> list[str]:
    with open(GSM8K, encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f, strict=False)]


def prefilled(runner: Any, prompts: list[list[int]], steps: int) -> tuple[Any, dict[int, int]]:
    """The runner's batch over `prompts` after their prefill (one new token each), its cache with room for `steps`
    more: its kept chain, row -> token."""
    runner._buffers(len(prompts), max(map(len, prompts)) + steps + 2)  # what generate then keeps
    gens = runner.generate(prompts)
    return runner._kept.chain, {r: g.token_ids[-1] for r, g in enumerate(gens)}


def timed_steps(chain: Any, tokens: dict[int, int], steps: int) -> tuple[list[float], dict[str, float], list[list]]:
    """`steps` full-depth steps: each step's ms, the calls' ms summed by kind, each row's tokens."""
    clock: dict[str, float] = defaultdict(float)
    labels = ["embed"] + [f"segment {s}" for s in range(len(chain.calls) - 2)] + ["full head"]
    chain.calls[:] = [(Timed(s, label, clock), io) for (s, io), label in zip(chain.calls, labels, strict=True)]
    if chain.certified is not None:
        chain.certified.session = Timed(chain.certified.session, "certified head", clock)
    rt, greedy = chain.rt, chain.rt.greedy_token
    rt.greedy_token = Timed(None, "full head", clock).wrap(greedy)  # the rows a certified head missed, alone
    times, got = [], [[t] for t in tokens.values()]
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = chain.step(tokens)
        times.append((time.perf_counter() - t0) * 1000.0)
        for r, t in tokens.items():
            got[r].append(t)
    chain.calls[:] = [(s.session, io) for s, io in chain.calls]
    del rt.greedy_token
    if chain.certified is not None:
        chain.certified.session = chain.certified.session.session
    return times, {k: v * 1000.0 / steps for k, v in clock.items()}, got


def profiled_chain(artifact: str, folder: Path, threads: int, kv: Any, rows: int, certified: bool) -> Any:
    """A chain over `rows` rows of `kv` on a second runtime whose sessions all profile (eectl's own session options,
    profiling on; the packed head's too, made as the chain binds it)."""
    from eectl.runtime import ort, sessions, tables
    from eectl.runtime.chain import DecodeChain
    from eectl.runtime.sessions import ArtifactRuntime

    def options(t: int | None = None) -> Any:
        so = ort.session_options(t)
        so.enable_profiling = True
        so.profile_file_prefix = str(folder / "ort")
        return so

    onnxruntime, count = ort._ort(), itertools.count()
    made = onnxruntime.InferenceSession

    def session(*args: Any, sess_options: Any = None, **kwargs: Any) -> Any:
        """A file of its own per session (the runtime's sessions share one options object)."""
        if sess_options is not None and sess_options.enable_profiling:
            sess_options.profile_file_prefix = str(folder / f"ort{next(count):03d}")
        return made(*args, sess_options=sess_options, **kwargs)

    sessions.session_options = tables.session_options = options
    onnxruntime.InferenceSession = session
    try:
        rt = ArtifactRuntime(artifact, threads=threads)
        return DecodeChain(rt, kv, 0, rows=rows, certified_head=certified)
    finally:
        sessions.session_options = tables.session_options = ort.session_options
        onnxruntime.InferenceSession = made


def profile_rows(args: argparse.Namespace, runner: Any, prompts: list[list[int]], tokens: list[list[int]]) -> dict:
    """The profiled steps over len(prompts) rows (module docstring): ms per step by graph and op type."""
    b = len(prompts)
    folder = Path(args.profile) / f"rows{b}"
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.json"):
        f.unlink()
    runner.forget_prompts()
    chain, first = prefilled(runner, prompts, args.steps)
    pchain = profiled_chain(args.artifact, folder, args.threads, chain.kv, b, chain.certified is not None)
    t0 = time.perf_counter()
    cur, got = first, [[t] for t in first.values()]
    for _ in range(args.steps):
        cur = pchain.step(cur)
        for r, t in cur.items():
            got[r].append(t)
    wall = (time.perf_counter() - t0) * 1000.0
    if got != tokens:
        sys.exit(f"rows {b}: the profiled steps' tokens differ")
    prt = pchain.rt
    files = {"embed": prt.embedding.session.end_profiling()}
    files |= {f"segment {i}": g.session.end_profiling() for i, g in enumerate(prt.segments)}
    files["full head"] = prt.full_graphs[prt.manifest.num_layers].session.end_profiling()
    if pchain.calls[-1][0] is not prt.full_graphs[prt.manifest.num_layers].session:
        files["full head (packed)"] = pchain.calls[-1][0].end_profiling()
    if pchain.certified is not None:
        files["certified head"] = pchain.certified.session.end_profiling()
    ops, runs_ms, nodes_ms = op_times(files, args.steps, args.warmup)
    return {
        "wall_ms_per_step": wall / args.steps,
        "runs_ms_per_step": runs_ms,
        "nodes_ms_per_step": nodes_ms,
        "ops_ms_per_step": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
    }


def op_times(files: dict[str, str], steps: int, skip: int) -> tuple[dict[str, float], float, float]:
    """Per (graph, op type), ms per step; runs' and nodes' ms per step. A graph run every step leaves its first
    `skip` runs out (the steps are `steps` - `skip` then); one that runs on some steps (the full head where a row
    does not pass) keeps them all, over `steps`."""
    ops: dict[str, float] = defaultdict(float)
    runs_ms = nodes_ms = 0.0
    for label, f in files.items():
        events = json.loads(Path(f).read_text())
        runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
        if not runs:
            continue
        every = len(runs) == steps
        start, n = (runs[skip]["ts"], steps - skip) if every else (runs[0]["ts"], steps)
        runs_ms += sum(e["dur"] for e in runs if e["ts"] >= start) / 1000.0 / n
        for e in events:
            if e.get("cat") == "Node" and e["ts"] >= start and e["name"].endswith("_kernel_time"):
                ms = e["dur"] / 1000.0 / n
                ops[f"{label}: {e.get('args', {}).get('op_name', '?')}"] += ms
                nodes_ms += ms
    return dict(ops), runs_ms, nodes_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--profile", default=None, help="a folder for ONNX Runtime's profiles (made fresh per row count)")
    p.add_argument("--warmup", type=int, default=4, help="profiled steps left out per session")
    args = p.parse_args()

    import eectl
    from eectl.data import encode_prompt
    from eectl.run.generate import RunOptions, load_tokenizer, runner_for
    from eectl.runtime.ort import init_ort
    from eectl.runtime.sessions import ArtifactRuntime

    sizes = [int(b) for b in args.rows.split(",")]
    init_ort(args.threads)
    rt = ArtifactRuntime(args.artifact, threads=args.threads)
    tok = load_tokenizer(rt)
    prompts = [encode_prompt(tok, q) for q in questions(max(sizes))]
    opts = RunOptions(exits="none", threads=args.threads, max_new_tokens=1)
    _, runner = runner_for(rt, opts)
    out: dict[str, Any] = {
        "eectl": str(Path(eectl.__file__).parent),
        "artifact": args.artifact,
        "threads": args.threads,
        "load_before": os.getloadavg()[0],
        "segments": len(rt.manifest.segments),
        "sizes": {},
    }
    steps: dict[int, list[float]] = {b: [] for b in sizes}
    calls: dict[int, list[dict[str, float]]] = {b: [] for b in sizes}
    tokens: dict[int, list[list]] = {}
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for b in sizes[rep % len(sizes) :] + sizes[: rep % len(sizes)]:
            runner.forget_prompts()
            chain, first = prefilled(runner, prompts[:b], args.steps)
            times, clock, got = timed_steps(chain, first, args.steps)
            if b in tokens and got != tokens[b]:
                sys.exit(f"rows {b}: tokens differ between repetitions")
            tokens[b] = got
            if rep:
                steps[b].extend(times)
                calls[b].append(clock)
    for b in sizes:
        if tokens[b] != tokens[max(sizes)][:b]:
            sys.exit(f"rows {b}: a row's tokens differ from the same row's at {max(sizes)} rows")
        med = statistics.median(steps[b])
        kinds = sorted({k for c in calls[b] for k in c})
        per = {k: statistics.median(c.get(k, 0.0) for c in calls[b]) for k in kinds}
        seg = sum(v for k, v in per.items() if k.startswith("segment"))
        mean = statistics.mean(steps[b])
        out["sizes"][b] = {
            "step_ms_median": med,
            "step_ms_mean": mean,
            "calls_ms_per_step": per,
            "segments_ms": seg,
            "host_ms": mean - sum(per.values()),
        }
    if args.profile:
        for b in sizes:
            out["sizes"][b]["profile"] = profile_rows(args, runner, prompts[:b], tokens[b])
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
