"""Old and new runtime code in ONE process on one artifact: is a refactor as fast as the code before it?

    python benchmarks/code_ab_inprocess.py ARTIFACT --old /path/to/old/checkout --reps 4 --prompts 8 \
        --max-new-tokens 32 --configs "full:none;plan:;copy:12,24;defer:12,24;defer-cos:8,16:cosine:0.95"

Across processes the same code reads far apart on a shared 2-core host (benchmarks/code_ab.py: one version's
processes 63-84 tokens/s), so this runs both versions in one process: the old checkout's `eectl` package is copied
into a temporary folder as `eectl_old` (its imports renamed), each version opens its own runtime of the artifact,
and every configuration of every version takes its turn prompt by prompt (the order reversed every other
repetition). A third runtime of the new code is the A/A control: two runtimes of the same code in one process differ
by a few percent (where each one's weights and buffers landed), which bounds what the comparison can resolve.

A configuration is `name:exits[:signal[:thresholds]]`: `full` (no exit), `plan` (the artifact's plan, exits empty),
a policy name (`copy`, `defer`, `verify`, ...; `defer-cos` runs `defer`), exits as `--exits` takes them. Greedy;
only generate calls are timed. Reported per configuration: tokens/s (median over repetitions), new/old per
repetition and its median, the A/A ratio, and whether old and new produced the same tokens.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _renamed_copy(checkout: Path, into: Path) -> None:
    """The checkout's eectl package as `eectl_old` under `into`, every `eectl` import renamed."""
    shutil.copytree(checkout / "eectl", into / "eectl_old", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (into / "eectl_old").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"\beectl\.", "eectl_old.", text)
        text = text.replace("from eectl import", "from eectl_old import")
        text = re.sub(r"^import eectl$", "import eectl_old", text, flags=re.M)
        path.write_text(text, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--old", required=True, help="a checkout of the code before the change")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--offset", type=int, default=7449, help="the first GSM8K question (held out by default)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="full:none;plan:")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="eectl-old-"))
    try:
        _renamed_copy(Path(args.old), tmp)
        sys.path.insert(0, str(tmp))
        run(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    import eectl_old.run.generate as old_gen  # type: ignore[import-not-found]
    import eectl_old.runtime.runner as old_run  # type: ignore[import-not-found]
    import eectl_old.runtime.sessions as old_sessions  # type: ignore[import-not-found]

    import eectl.run.generate as new_gen
    import eectl.runtime.ort as new_ort
    import eectl.runtime.runner as new_run
    import eectl.runtime.sessions as new_sessions
    from eectl.data import encode_prompt, load_text_data

    rt = {"old": old_sessions.ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)}
    new_ort._THREADS = args.threads  # ONNX Runtime's one global pool is the old copy's, with the same size
    rt["new"] = new_sessions.ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    rt["aa"] = new_sessions.ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    tok = new_gen.load_tokenizer(rt["new"])
    texts = load_text_data(args.data, "question").texts[args.offset : args.offset + args.prompts]
    prompts = [encode_prompt(tok, t, False) for t in texts]
    mods = {"old": (old_run, old_gen), "new": (new_run, new_gen), "aa": (new_run, new_gen)}
    configs = [c.split(":") for c in args.configs.split(";")]
    runners = {}
    for version, (run_mod, gen_mod) in mods.items():
        for name, exits, *rest in configs:
            policy = {"plan": None, "full": "defer"}.get(name, name.split("-")[0])
            signal, thresholds = (rest + [None, None])[:2]
            opts = gen_mod.RunOptions(
                policy=policy, exits=exits or None, max_new_tokens=args.max_new_tokens, threads=args.threads,
                signal=signal, thresholds=thresholds,
            )  # fmt: skip
            runners[(version, name)] = run_mod.Runner(rt[version], gen_mod.resolve_config(rt[version], opts, ()))
    rates: dict[tuple[str, str], list[float]] = {k: [] for k in runners}
    tokens: dict[tuple[str, str], list[list[int]]] = {k: [] for k in runners}
    for rep in range(args.reps):
        order = list(runners) if rep % 2 == 0 else list(reversed(list(runners)))
        spent = {k: [0.0, 0] for k in runners}
        for p in prompts:
            for k in order:
                r = runners[k]
                if hasattr(r, "forget_prompts"):  # a cached prompt prefix would favour the runner that met it
                    r.forget_prompts()
                t0 = time.perf_counter()
                g = r.generate([p])[0]
                spent[k][0] += time.perf_counter() - t0
                spent[k][1] += len(g.token_ids)
                if rep == 0:
                    tokens[k].append(g.token_ids)
        for k, (seconds, n) in spent.items():
            rates[k].append(n / seconds)
        print(f"rep {rep}: " + ", ".join(f"{v}/{c} {rates[(v, c)][-1]:.1f}" for v, c in runners), flush=True)
    print(
        f"{args.reps} interleaved reps, {args.prompts} prompts x {args.max_new_tokens} tokens, {args.threads} threads"
    )
    print("| config | old tok/s | new tok/s | new/old (median; per rep) | A/A (aa/new) | tokens equal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, *_ in configs:
        old, new, aa = rates[("old", name)], rates[("new", name)], rates[("aa", name)]
        ratios = [b / a for a, b in zip(old, new, strict=True)]
        same = tokens[("old", name)] == tokens[("new", name)]
        per = ", ".join(f"{x:.3f}" for x in ratios)
        control = statistics.median([b / a for a, b in zip(new, aa, strict=True)])
        print(
            f"| {name} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
            f"{statistics.median(ratios):.3f}; {per} | {control:.3f} | {same} |"
        )


if __name__ == "__main__":
    main()
