"""llama.cpp's own prompt-lookup decoding (the native `llama-lookup` example) against its plain decoding, on one GGUF.

    python benchmarks/llamacpp_native.py --bin BUILD/bin --gguf FILE.gguf --tokenizer ARTIFACT \
        --data ../shared/data/gsm8k/train.jsonl --offset 3000 --prompts 16 --max-new-tokens 96 --threads 2 --rounds 2

llama-cpp-python (what `eectl bench --peer llama.cpp=FILE` drives) builds the library, not llama.cpp's programs;
its prompt-lookup decoding is Python's. This script runs the native program, built from the same llama.cpp source
(the sdist's vendor/llama.cpp: `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-lookup`), on
the prompts `eectl bench` uses (chat-templated by the artifact's tokenizer, as text), greedy (--temp 0), each
prompt twice per round: plain (`--spec-draft-n-max 0`: the same program, one token a step) and with drafts from
the context (`--spec-draft-n-max D`), in an order that alternates prompt by prompt and round by round. Reported:
pooled ms per decoded token of each, their ratio with a bootstrap interval over prompts, the drafts' acceptance,
and whether both printed the same text (greedy drafts checked by the model are lossless up to the rounding of a
batched pass).

The ratio carries over to `eectl bench`'s llama.cpp rows (llama-cpp-python's plain decoding, the same library) only
as far as the native program's plain decoding runs at llama-cpp-python's speed: both are printed where --python is
given (llama-cpp-python's plain greedy decode of the same prompts, timed per token like eectl's bench).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
DRAFTED = re.compile(r"n_drafted\s+=\s+(\d+)")
ACCEPTED = re.compile(r"n_accept\s+=\s+(\d+)")
STAMP = re.compile(r"^\d+\.\d+\.\d+\.\d+ [A-Z] ")


def prompts_text(args: argparse.Namespace) -> list[str]:
    from transformers import AutoTokenizer

    from eectl.data import load_text_data

    tok = AutoTokenizer.from_pretrained(str(Path(args.tokenizer) / "tokenizer"))
    texts = load_text_data(args.data).prompts[args.offset : args.offset + args.prompts]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]


def lookup(args: argparse.Namespace, prompt: str, drafts: int) -> dict[str, object]:
    """One run of llama-lookup: decoded tokens, seconds, drafted, accepted, the text it printed."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    cmd = [
        str(Path(args.bin) / "llama-lookup"), "-m", args.gguf, "-f", f.name, "-n", str(args.max_new_tokens),
        "--temp", "0", "-t", str(args.threads), "-tb", str(args.threads), "-c", "2048",
        "--spec-draft-n-max", str(drafts),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    Path(f.name).unlink()
    log = done.stdout + done.stderr
    m = DECODED.search(log)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"llama-lookup failed ({done.returncode}): {log[-800:]}")
    drafted, accepted = DRAFTED.search(log), ACCEPTED.search(log)
    after = done.stdout.split(prompt[-20:], 1)[-1]
    text = "\n".join(line for line in after.splitlines() if not STAMP.match(line))  # its log lines carry a time
    return {
        "tokens": int(m[1]),
        "seconds": float(m[2]),
        "drafted": int(drafted[1]) if drafted else 0,
        "accepted": int(accepted[1]) if accepted else 0,
        "text": text.strip(),
    }


def python_plain(args: argparse.Namespace, prompts: list[str]) -> list[tuple[int, float]]:
    """llama-cpp-python's plain greedy decode of each prompt: (tokens after the first, their seconds)."""
    from llama_cpp import Llama

    llm = Llama(
        args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, logits_all=True, verbose=False
    )
    out = []
    for p in prompts:
        llm.reset()
        ids = llm.tokenize(p.encode(), add_bos=False, special=True)
        llm.eval(ids)
        stamps = []
        for _ in range(args.max_new_tokens):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            if tok == llm.token_eos():
                break
            llm.eval([tok])
            stamps.append(time.perf_counter())
        out.append((len(stamps) - 1, stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0))
    return out


def ratio_ci(plain: list[tuple[int, float]], drafted: list[tuple[int, float]], n: int = 2000) -> tuple[float, ...]:
    """Pooled speed ratio (plain ms per token over drafted's) and a bootstrap 95% interval over prompts."""

    def pooled(idx: list[int]) -> float:
        a = sum(plain[i][1] for i in idx) / max(1, sum(plain[i][0] for i in idx))
        b = sum(drafted[i][1] for i in idx) / max(1, sum(drafted[i][0] for i in idx))
        return a / b

    rng = random.Random(0)
    k = len(plain)
    boots = sorted(pooled([rng.randrange(k) for _ in range(k)]) for _ in range(n))
    return pooled(list(range(k))), boots[int(0.025 * n)], boots[int(0.975 * n) - 1]


def common_args(ap: argparse.ArgumentParser) -> None:
    """The options both llama.cpp benchmarks take (this one and llamacpp_server_spec.py)."""
    ap.add_argument("--bin", required=True, help="llama.cpp's build/bin folder (llama-lookup, llama-server)")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokenizer", required=True, help="an eectl artifact of the same model (its tokenizer/ folder)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--offset", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--draft-max", type=int, default=10)
    ap.add_argument("--python", action="store_true", help="also time llama-cpp-python's plain decoding")
    args = ap.parse_args()
    prompts = prompts_text(args)
    runs: dict[str, list[list[dict[str, object]]]] = {"plain": [], "lookup": []}
    for r in range(args.rounds):
        per: dict[str, list[dict[str, object]]] = {"plain": [], "lookup": []}
        for i, p in enumerate(prompts):
            order = [("plain", 0), ("lookup", args.draft_max)]
            if (i + r) % 2:
                order.reverse()
            for name, d in order:
                per[name].append(lookup(args, p, d))
        for name in runs:
            runs[name].append(per[name])
    pooled = {
        name: [
            (sum(int(rr[i]["tokens"]) for rr in rs), sum(float(rr[i]["seconds"]) for rr in rs))
            for i in range(len(prompts))
        ]
        for name, rs in runs.items()
    }
    est, lo, hi = ratio_ci(pooled["plain"], pooled["lookup"])
    same = sum(a["text"] == b["text"] for a, b in zip(runs["plain"][0], runs["lookup"][0], strict=True))
    drafted = sum(int(x["drafted"]) for rs in runs["lookup"] for x in rs)
    accepted = sum(int(x["accepted"]) for rs in runs["lookup"] for x in rs)
    result = {
        name: 1e3 * sum(s for _, s in v) / max(1, sum(t for t, _ in v)) for name, v in pooled.items()
    }  # ms per token
    report = {
        "ms_per_token": result,
        "lookup_speedup": [est, lo, hi],
        "same_text": f"{same}/{len(prompts)}",
        "drafted": drafted,
        "accepted": accepted,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.python:
        py = python_plain(args, prompts)
        report["ms_per_token"]["llama-cpp-python plain"] = 1e3 * sum(s for _, s in py) / max(1, sum(t for t, _ in py))
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(
        f"native llama-lookup ({args.draft_max} drafts) {est:.2f}x [{lo:.2f}, {hi:.2f}] its plain decoding; "
        f"{same}/{len(prompts)} texts equal; accepted {accepted}/{drafted} drafts",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
