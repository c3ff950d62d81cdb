"""eectl full depth side by side with the runtimes a CPU user would pick, in one interleaved run.

    python benchmarks/peers.py                       # build what is missing, then measure (2 threads, 3 x 128 tokens)
    python benchmarks/peers.py --rounds 5 --tokens 64 --threads 1 --json peers.json

What it builds (once, under benchmarks/.peers/, git-ignored):
- a virtual environment with onnxruntime-genai (it installs its own `onnxruntime`, which cannot share a venv with
  eectl's onnxruntime-gpu), onnx_ir (its model builder needs it) and the CPU build of torch;
- genai's fp32 graph and its int4 graph (builder `-p int4`, block size and accuracy level below) of the default
  model, from eectl's GGUF cache folder (a Hugging Face folder with the tokenizer);
- eectl artifacts with `eectl export` (fp32; int4 with `--weights int4` where this eectl has it).

What it measures: every configuration runs in its own worker process (genai in its venv, eectl in this one), all
with the same prompt token ids (the chat template applied once, here) and greedy decoding; rounds interleave the
configurations (A B C, A B C, ...) after a warm-up. Per round and configuration: decode ms/token (median over the
prompts of each prompt's mean decode latency); speed vs eectl full depth = eectl's ms/token / the config's, within
the round; the table reports the median over rounds and the range. Greedy agreement: whether each prompt's tokens
equal eectl fp32 full depth's, and the first position where they differ.

`--overhead` adds eectl's own split of a full-depth token: wall time per token vs time inside ONNX Runtime's run
calls (the rest is Python, binding and copies), and `--ort-profile` adds ORT's session profiler by op type, for
eectl and genai fp32 (kernel time per token). Both run after the timed rounds, outside them.

This is a benchmark script, not part of the package; llama.cpp is not included (it compiles for ~30 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / ".peers"
VENV = WORK / "venv"
GENAI = "onnxruntime-genai==0.18.0"
PROMPTS = [
    "What is 12 * 7? Explain step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain in a few sentences why the sky is blue.",
    "List three differences between a list and a tuple in Python.",
]


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


# ---------------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------------


def model_folder() -> Path:
    """The default model as an HF folder with its tokenizer: eectl's GGUF cache folder (converted on first use)."""
    sys.path.insert(0, str(ROOT))
    from eectl.cache import cache_dir
    from eectl.models.loading import load_model, resolve_source

    gguf = resolve_source(None).path
    assert gguf is not None
    folders = sorted((cache_dir() / "gguf").glob(f"{gguf.stem}-*"))
    if not folders:
        load_model(None)  # converts the GGUF into the cache once
        folders = sorted((cache_dir() / "gguf").glob(f"{gguf.stem}-*"))
    return folders[-1]


def ensure_venv() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        run([sys.executable, "-m", "venv", str(VENV)])
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
        run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"])  # the CPU build, as setup.sh
        run([str(py), "-m", "pip", "install", "-q", GENAI, "onnx_ir>=0.1", "onnx>=1.19,<2", "transformers>=5.23,<6"])
    return py


def ensure_genai(py: Path, model: Path, precision: str, block: int, accuracy: int, threads: int) -> Path:
    out = WORK / (f"genai-int4-b{block}-a{accuracy}" if precision == "int4" else "genai-fp32")
    if not (out / "genai_config.json").exists():
        cmd = [str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(model), "-o", str(out)]
        cmd += ["-p", precision, "-e", "cpu", "-c", str(WORK / "hf-cache")]
        if precision == "int4":
            cmd += ["--extra_options", f"block_size={block}", f"accuracy_level={accuracy}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(WORK / f"build-{out.name}.log", "w") as f:
            run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return out


def eectl_has_int4() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "eectl.cli", "export", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    return "--weights" in out.stdout


def ensure_eectl(path: Path, exits: str, threads: int, extra: list[str]) -> Path:
    if not (path / "manifest.json").exists():
        cmd = [sys.executable, "-m", "eectl.cli", "export", "--exits", exits, "--out", str(path)]
        run([*cmd, "--threads", str(threads), "--force", *extra], env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


# ---------------------------------------------------------------------------------------------------------------
# Workers: one process per configuration, JSON lines on stdin/stdout
# ---------------------------------------------------------------------------------------------------------------

EECTL_WORKER = r"""
import json, sys, time
import numpy as np
from eectl.runtime.runner import RunConfig, Runner
from eectl.runtime.sessions import ArtifactRuntime
art, threads, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
variant = json.loads(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else {}
if variant:  # ORT session settings to A/B against eectl's own (--variant): applied to every session it creates
    from eectl.runtime import sessions
    if variant.get("per_session"):  # ORT refuses per-session pools once the process-wide one exists
        from onnxruntime.capi import _pybind_state
        _pybind_state.set_global_thread_pool_sizes = lambda *a: None
    own = sessions.session_options
    def patched(n=None):
        so = own(n)
        if variant.get("per_session"):  # each session its own pool instead of the process-wide one
            so.use_per_session_threads = True
            so.intra_op_num_threads = n or 1
            so.inter_op_num_threads = 1
        for k, v in variant.get("config", {}).items():
            so.add_session_config_entry(k, str(v))
        return so
    sessions.session_options = patched
rt = ArtifactRuntime(art, provider="cpu", threads=threads)
inside = [0.0]
if mode in ("overhead", "profile"):
    import onnxruntime as ort
    from eectl.runtime import sessions
    graphs = [rt.embedding, *rt.segments, *rt.full_graphs.values()]
    if mode == "profile":
        so = sessions.session_options(threads)
        so.enable_profiling = True
        so.profile_file_prefix = sys.argv[4]
        for g in graphs:
            g.session = ort.InferenceSession(str(rt.folder / g.io.file), sess_options=so,
                                             providers=["CPUExecutionProvider"])
    class Timed:
        def __init__(self, s):
            self._s = s
        def run_with_iobinding(self, *a):
            t = time.perf_counter()
            self._s.run_with_iobinding(*a)
            inside[0] += time.perf_counter() - t
        def __getattr__(self, k):
            return getattr(self._s, k)
    for g in graphs:
        g.session = Timed(g.session)
eos = tuple(rt.manifest.eos_token_ids)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("quit"):
        break
    runner = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=req["max_new"], stop_ids=eos))
    inside[0] = 0.0
    marks = []
    g = runner.generate([req["ids"]], on_step=lambda row, confirmed: marks.append(inside[0]))[0]
    decode = g.latencies_s[1:]
    # time inside ORT's run calls during decode: from the first step's end (the prefill) to the last one's
    out = {"tokens": g.token_ids, "decode_s": decode, "inside_s": marks[-1] - marks[0] if marks else 0.0}
    if mode == "profile":
        out["profiles"] = [s.end_profiling() for s in (gg.session._s for gg in [rt.embedding, *rt.segments,
                           *rt.full_graphs.values()])]
    print(json.dumps(out), flush=True)
"""

GENAI_WORKER = r"""
import json, sys, time
import onnxruntime_genai as og
path, threads, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = og.Config(path)
opts = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
if mode == "profile":
    opts["enable_profiling"] = sys.argv[4]
config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
model = og.Model(config)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("quit"):
        break
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(req["ids"]) + req["max_new"], do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(req["ids"])  # the prefill
    tokens, decode = [], []
    while not gen.is_done():
        t = time.perf_counter()
        gen.generate_next_token()
        decode.append(time.perf_counter() - t)
        tokens.append(int(gen.get_next_tokens()[0]))
    # the first call picks from the prefill's logits; every later one runs the model on one token
    print(json.dumps({"tokens": tokens, "decode_s": decode[1:]}), flush=True)
"""


class Worker:
    def __init__(self, name: str, python: str, script: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        # cwd: `python -c` puts the working directory first on sys.path, before PYTHONPATH (the tree to run)
        self.proc = subprocess.Popen(
            [python, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=WORK
        )
        ready = self._read()
        assert ready.get("ready"), ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.name} died (exit {self.proc.wait()})")
        return json.loads(line)

    def generate(self, ids: list[int], max_new: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "max_new": max_new}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def eectl_worker(
    name: str,
    artifact: Path,
    threads: int,
    mode: str = "time",
    extra: str = "",
    src: Path = ROOT,
    variant: dict[str, Any] | None = None,
) -> Worker:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    args = [str(artifact), str(threads), mode, extra, json.dumps(variant) if variant else ""]
    return Worker(name, sys.executable, EECTL_WORKER, args, env)


def genai_worker(name: str, folder: Path, threads: int, mode: str = "time", extra: str = "") -> Worker:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)
    return Worker(name, str(VENV / "bin" / "python"), GENAI_WORKER, [str(folder), str(threads), mode, extra], env)


# ---------------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------------


def prompt_ids(artifact: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from eectl.contracts.manifest import read_manifest

    m = read_manifest(artifact, verify_hashes=False)
    tok = AutoTokenizer.from_pretrained(str(artifact / m.tokenizer_dir))
    out = []
    for p in PROMPTS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def ms_per_token(result: dict[str, Any]) -> float:
    d = result["decode_s"]
    return 1000.0 * sum(d) / len(d) if d else float("nan")


def interleaved(workers: list[Worker], ids: list[list[int]], tokens: int, rounds: int) -> dict[str, Any]:
    for w in workers:  # warm-up: first-run allocations, page faults in the weights
        w.generate(ids[0], 8)
    per_round: dict[str, list[float]] = {w.name: [] for w in workers}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for w in workers:
            results = [w.generate(p, tokens) for p in ids]
            per_round[w.name].append(statistics.median(ms_per_token(x) for x in results))
            if r == 0:
                outputs[w.name] = [x["tokens"] for x in results]
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in per_round.items()))
    return {"ms_per_token": per_round, "tokens": outputs}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def table(result: dict[str, Any], base: str, labels: dict[str, str]) -> str:
    ms, toks = result["ms_per_token"], result["tokens"]
    lines = [
        "| runtime · precision | ms/token (median, min-max over rounds) | speed vs eectl full depth | "
        "greedy output vs eectl |",
        "|---|---|---|---|",
    ]
    for name, label in labels.items():
        if name not in ms:
            lines.append(f"| {label} | – | – | {result.get('skipped', {}).get(name, 'skipped')} |")
            continue
        ratios = [b / x for b, x in zip(ms[base], ms[name], strict=True)]
        speed = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        if name == base:
            agree = "—"
        else:
            div = [first_divergence(a, b) for a, b in zip(toks[name], toks[base], strict=True)]
            prompts = list(zip(toks[name], toks[base], strict=True))
            same = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in prompts)
            total = sum(max(len(a), len(b)) for a, b in prompts)
            agree = (
                "identical"
                if all(d is None for d in div)
                else f"{100 * same / total:.0f}% of positions; first divergence at "
                + ", ".join("never" if d is None else str(d) for d in div)
            )
        lines.append(
            f"| {label} | {statistics.median(ms[name]):.2f} ({min(ms[name]):.2f}-{max(ms[name]):.2f}) | "
            f"{speed} | {agree} |"
        )
    return "\n".join(lines)


def pairs(result: dict[str, Any]) -> list[str]:
    """eectl against the genai build of the same precision, per round (the issue's targets): speed ratio."""
    ms, out = result["ms_per_token"], []
    for ours, theirs in [("eectl", "genai-fp32")] + [(n, "genai-int4") for n in ms if n.startswith("eectl-int4")]:
        if ours in ms and theirs in ms:
            r = [b / a for a, b in zip(ms[ours], ms[theirs], strict=True)]
            out.append(f"{ours} vs {theirs}: {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f} over rounds)")
    return out


def overhead(artifact: Path, ids: list[list[int]], tokens: int, threads: int, src: Path = ROOT) -> dict[str, float]:
    """Wall ms per token vs ms inside ORT's run calls, full depth (the worker times each run call)."""
    w = eectl_worker("overhead", artifact, threads, "overhead", src=src)
    w.generate(ids[0], 8)
    walls, insides = [], []
    for p in ids:
        r = w.generate(p, tokens)
        n = len(r["decode_s"])
        walls.append(sum(r["decode_s"]) / n)
        insides.append(r["inside_s"] / n)
    w.close()
    wall, inside = statistics.median(walls), statistics.median(insides)
    return {"wall_ms": 1000 * wall, "inside_ort_ms": 1000 * inside, "outside_share": (wall - inside) / wall}


def ort_profile(artifact: Path, genai_fp32: Path, ids: list[int], tokens: int, threads: int) -> dict[str, Any]:
    """ORT's session profiler, kernel time per decoded token by op type, eectl full depth and genai fp32."""
    prof = WORK / "profiles"
    prof.mkdir(exist_ok=True)
    for f in prof.glob("*.json"):
        f.unlink()
    out: dict[str, Any] = {}
    w = eectl_worker("eectl-prof", artifact, threads, "profile", str(prof / "eectl"))
    r = w.generate(ids, tokens)
    w.close()
    files = sorted({Path(p) for p in r["profiles"]})  # sessions ended in the same millisecond share a file name
    out["eectl"] = _by_op(files)
    w = genai_worker("genai-prof", genai_fp32, threads, "profile", str(prof / "genai"))
    r = w.generate(ids, tokens)
    w.close()
    files = sorted(Path.cwd().glob("genai*.json")) + sorted(prof.glob("genai*.json"))
    out["genai-fp32"] = _by_op(files)
    return out


def _by_op(files: list[Path]) -> dict[str, Any]:
    """Kernel time per decoded token by op type: in each session's profile, the first run (the prefill) is left
    out and the rest is divided by that session's number of decode runs (one per token), then sessions add up."""
    ops: dict[str, float] = {}
    run_ms = 0.0
    for f in files:
        events = json.loads(f.read_text())
        runs = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run"
        )
        if len(runs) < 2:
            continue
        start, n = runs[1][0], len(runs) - 1
        run_ms += sum(b - a for a, b in runs[1:]) / 1000 / n
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
                op = e["args"]["op_name"]
                ops[op] = ops.get(op, 0.0) + e["dur"] / 1000 / n
    return {
        "kernel_ms_per_token": sum(ops.values()),
        "model_run_ms_per_token": run_ms,
        "by_op_ms_per_token": {k: round(v, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
        "files": [str(f) for f in files],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exits", default="8,12,16,20,24", help="eectl artifact's exits (its segment cuts)")
    ap.add_argument(
        "--artifact", type=Path, default=WORK / "eectl-fp32", help="eectl fp32 artifact (exported if missing)"
    )
    ap.add_argument("--block-size", type=int, default=32, help="int4 block size (genai and eectl)")
    ap.add_argument("--accuracy-level", type=int, default=4, help="MatMulNBits accuracy level (4: int8 activations)")
    ap.add_argument(
        "--int4-lm-heads",
        default="fp32,int4",
        help="eectl int4 rows, one per final LM-head precision (genai's int4 build quantizes its LM head too)",
    )
    ap.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=ARTIFACT[@SRC]",
        help="another eectl artifact at full depth in the same run, run by the eectl source tree SRC "
        "(default this one): e.g. an older commit's export and runtime, for before/after ratios",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="eectl fp32 full depth again, with ORT session settings changed, e.g. "
        'nospin=\'{"per_session": true, "config": {"session.intra_op.allow_spinning": 0}}\' (A/B of settings)',
    )
    ap.add_argument("--no-genai", action="store_true")
    ap.add_argument("--no-int4", action="store_true", help="fp32 rows only")
    ap.add_argument("--overhead", action="store_true", help="also measure eectl's time outside ORT's run calls")
    ap.add_argument("--ort-profile", action="store_true", help="also profile eectl and genai fp32 by op type")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()
    WORK.mkdir(exist_ok=True)

    labels = {"eectl": f"eectl full depth, fp32 ({len(args.exits.split(',')) + 1} segments)"}
    workers: list[Worker] = []
    skipped: dict[str, str] = {}
    artifact = ensure_eectl(args.artifact, args.exits, args.threads, [])
    genai_fp32 = genai_int4 = None
    if not args.no_genai:
        py = ensure_venv()
        model = model_folder()
        genai_fp32 = ensure_genai(py, model, "fp32", args.block_size, args.accuracy_level, args.threads)
        genai_int4 = ensure_genai(py, model, "int4", args.block_size, args.accuracy_level, args.threads)
    int4_artifacts: dict[str, Path] = {}
    for head in [] if args.no_int4 else args.int4_lm_heads.split(","):
        name = "eectl-int4" if head == "fp32" else f"eectl-int4-lm{head}"
        labels[name] = (
            f"eectl int4 full depth (block {args.block_size}, accuracy level {args.accuracy_level}, LM head {head})"
        )
        if not eectl_has_int4():
            skipped[name] = "skipped: this eectl has no `export --weights int4` yet"
            log(skipped[name])
            continue
        int4_artifacts[name] = ensure_eectl(
            WORK / f"{name}-b{args.block_size}-a{args.accuracy_level}",
            args.exits,
            args.threads,
            ["--weights", "int4", "--int4-block-size", str(args.block_size)]
            + ["--int4-accuracy-level", str(args.accuracy_level), "--lm-head", head],
        )
    ids = prompt_ids(artifact, args.prompts)
    workers.append(eectl_worker("eectl", artifact, args.threads))
    compared: dict[str, tuple[Path, Path]] = {"eectl": (artifact, ROOT)}
    for spec in args.compare:
        name, rest = spec.split("=", 1)
        path, _, src = rest.partition("@")
        path, src = str(Path(path).resolve()), str(Path(src).resolve()) if src else ""  # workers start elsewhere
        labels[name] = f"{name} ({path}{' run by ' + src if src else ''})"
        try:
            workers.append(eectl_worker(name, Path(path), args.threads, src=Path(src) if src else ROOT))
        except SystemExit as exc:  # another tree's runtime may not load this artifact: say so, measure the rest
            skipped[name] = f"skipped: its worker did not start ({exc})"
            log(skipped[name])
            continue
        compared[name] = (Path(path), Path(src) if src else ROOT)
    for spec in args.variant:
        name, settings = spec.split("=", 1)
        labels[name] = f"{name}: eectl fp32 full depth, ORT settings {settings}"
        workers.append(eectl_worker(name, artifact, args.threads, variant=json.loads(settings)))
    for name, path in int4_artifacts.items():
        workers.append(eectl_worker(name, path, args.threads))
    if genai_fp32 is not None:
        labels["genai-fp32"] = "onnxruntime-genai 0.18 fp32 (its model builder, one graph)"
        workers.append(genai_worker("genai-fp32", genai_fp32, args.threads))
    if genai_int4 is not None and not args.no_int4:
        labels["genai-int4"] = (
            f"onnxruntime-genai 0.18 int4 (builder -p int4, block {args.block_size}, "
            f"accuracy level {args.accuracy_level}, LM head int4)"
        )
        workers.append(genai_worker("genai-int4", genai_int4, args.threads))
    log(
        f"{len(workers)} configurations, {args.prompts} prompts x {args.tokens} tokens, {args.rounds} rounds, "
        f"{args.threads} threads"
    )
    started = time.perf_counter()
    result = interleaved(workers, ids, args.tokens, args.rounds)
    for w in workers:
        w.close()
    result["skipped"] = skipped
    result["settings"] = {
        "threads": args.threads,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "exits": args.exits,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(table(result, "eectl", labels))
    result["pairs"] = pairs(result)
    print("\n".join(["", *result["pairs"]]))
    if args.overhead:
        result["overhead"] = {}
        for name, (path, src) in compared.items():
            o = result["overhead"][name] = overhead(path, ids, args.tokens, args.threads, src)
            print(
                f"\n{name} full depth: {o['wall_ms']:.2f} ms/token wall, {o['inside_ort_ms']:.2f} inside ORT's run "
                f"calls: {100 * o['outside_share']:.1f}% outside (Python, binding, copies)"
            )
    if args.ort_profile and genai_fp32 is not None:
        result["ort_profile"] = ort_profile(artifact, genai_fp32, ids[0], args.tokens, args.threads)
        for name, p in result["ort_profile"].items():
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(p["by_op_ms_per_token"].items())[:8])
            print(
                f"\n{name}: kernels {p['kernel_ms_per_token']:.2f} ms/token "
                f"(model_run {p['model_run_ms_per_token']:.2f}); by op: {top}"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
