"""llama.cpp's server with its n-gram speculation (no draft model) against its plain decoding, on one GGUF.

    python benchmarks/llamacpp_server_spec.py --bin BUILD/bin --gguf FILE.gguf --tokenizer ARTIFACT \
        --data ../shared/data/gsm8k/train.jsonl --offset 3000 --prompts 16 --max-new-tokens 96 --threads 2 --rounds 2

The native `llama-server` (built from llama-cpp-python's vendored llama.cpp: `cmake --build build --target
llama-server`) drafts from the context with `--spec-type` ngram-simple, ngram-map-k, ngram-mod or ngram-cache, each
checked by the model's own greedy choice. One server per type (and one with none) runs at once on localhost; each
prompt goes to every server in a rotating order, round after round (one request at a time: the others idle), as the
token ids eectl feeds (`eectl.data.encode_prompt`, the artifact's chat template) with temperature 0, no prompt
cache, `n_predict` tokens. Reported per type: pooled ms per predicted token from the server's own timings
(`predicted_ms` / `predicted_n`), the ratio to `none` with a bootstrap interval over prompts, and how many answers
equal `none`'s token for token.

`--eectl ARTIFACT` adds eectl in the same rotation, in this process (ONNX Runtime, the same thread count; the
servers idle meanwhile): `eectl` (the artifact's plan default, as `eectl run` picks it), `eectl-no-memory` (the same
without drafts from earlier answers: `--draft-memory 0`) and `eectl-full` (full depth), each prompt's decode time
from the runner's per-token latencies as `eectl bench` reads them; their answers are compared with `eectl-full`'s.
eectl keeps its memory of earlier answers from request to request as the servers keep their pools: round 1 is a
workload of prompts each seen once, round 2 one of prompts seen before, for every runtime alike.

With `--rounds` above 1 each type is also reported round by round (`by_round`): a server keeps its n-gram pool from
request to request (ngram-mod, ngram-cache), so from round 2 on it drafts from its own earlier answers to the same
prompts; round 1 is the workload of prompts each seen once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from llamacpp_native import common_args, ratio_ci  # benchmarks/: the script's own folder

TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def prompt_ids(args: argparse.Namespace) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eectl.data import encode_prompt, load_text_data

    tok = AutoTokenizer.from_pretrained(str(Path(args.tokenizer) / "tokenizer"))
    texts = load_text_data(args.data).prompts[args.offset : args.offset + args.prompts]
    return [encode_prompt(tok, t, False) for t in texts]


def start(args: argparse.Namespace, kind: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        str(Path(args.bin) / "llama-server"), "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port),
        "-t", str(args.threads), "-tb", str(args.threads), "-c", "2048", "-np", "1", "--spec-type", kind,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def eectl_runners(args: argparse.Namespace) -> dict[str, Any]:
    """name -> one prompt's (decoded tokens after the first, their milliseconds, the tokens) on the artifact."""
    from eectl.run.generate import RunOptions, resolve_config
    from eectl.runtime.runner import Runner
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(args.eectl, provider="cpu", threads=args.threads)
    stop = tuple(rt.manifest.eos_token_ids)
    n = args.max_new_tokens
    runners = {
        "eectl": Runner(rt, resolve_config(rt, RunOptions(max_new_tokens=n), stop)),
        "eectl-no-memory": Runner(rt, resolve_config(rt, RunOptions(max_new_tokens=n, draft_memory=0), stop)),
        "eectl-full": Runner(
            rt, resolve_config(rt, RunOptions(exits="none", max_new_tokens=args.max_new_tokens), stop)
        ),
    }
    print(f"eectl: {runners['eectl'].cfg.note or runners['eectl'].cfg.policy}", file=sys.stderr)

    def one(runner: Runner) -> Any:
        def run(prompt: list[int], first: bool) -> tuple[int, float, list[int]]:
            # each prompt fed whole, as the servers get it (no prompt cache); the drafts' memory of earlier answers
            # kept from request to request, as a server's n-gram pool is (`first`: the run starts, nothing remembered)
            runner.forget_prompts(memory=first)
            (g,) = runner.generate([prompt])
            lat = g.latencies_s[1:]
            return len(lat), 1e3 * sum(lat), list(g.token_ids)

        return run

    return {name: one(r) for name, r in runners.items()}


def post(port: int, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(json.loads(r.read()))


def wait_ready(port: int) -> None:
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"llama-server on port {port} did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--eectl", help="an eectl artifact of the same model to run in the same rotation")
    args = ap.parse_args()
    servers_kinds = args.types.split(",")
    ids = prompt_ids(args)
    local = eectl_runners(args) if args.eectl else {}
    kinds = [*servers_kinds, *local]
    servers = {k: (args.port + i, start(args, k, args.port + i)) for i, k in enumerate(servers_kinds)}
    try:
        for port, _ in servers.values():
            wait_ready(port)
        got: dict[str, list[list[tuple[int, float, list[int]]]]] = {k: [[] for _ in ids] for k in kinds}
        body = {"n_predict": args.max_new_tokens, "temperature": 0, "cache_prompt": False, "return_tokens": True}
        for port, _ in servers.values():  # warm-up
            post(port, {**body, "prompt": ids[0], "n_predict": 8})
        for r in range(args.rounds):
            for i, p in enumerate(ids):
                shift = (i + r) % len(kinds)
                for k in kinds[shift:] + kinds[:shift]:
                    if k in local:
                        got[k][i].append(local[k](p, i == 0 and r == 0))
                        continue
                    out = post(servers[k][0], {**body, "prompt": p})
                    t = dict(out["timings"])  # type: ignore[arg-type]
                    toks = [int(x) for x in out.get("tokens", [])]  # type: ignore[union-attr]
                    got[k][i].append((int(t["predicted_n"]), float(t["predicted_ms"]), toks))
    finally:
        for _, proc in servers.values():
            proc.terminate()
    per = {k: [(sum(n for n, _, _ in runs), sum(ms for _, ms, _ in runs)) for runs in got[k]] for k in kinds}

    report: dict[str, object] = {}
    for k in kinds:
        whole = list(range(len(ids)))
        ref = "eectl-full" if k in local else "none"
        same = sum(got[k][i][0][2] == got[ref][i][0][2] for i in whole)
        report[k] = {
            "ms_per_token": sum(ms for _, ms in per[k]) / max(1, sum(n for n, _ in per[k])),
            "vs_none": list(ratio_ci(per["none"], per[k])),
            f"same_tokens_as_{ref}": f"{same}/{len(ids)}",
        }
        if args.rounds > 1:  # a server's n-gram pool outlives a request: from round 2 on it holds round 1's answers
            by_round = {r: [runs[r][:2] for runs in got[k]] for r in range(args.rounds)}
            base = {r: [runs[r][:2] for runs in got["none"]] for r in range(args.rounds)}
            report[k]["by_round"] = [  # type: ignore[index]
                {
                    "ms_per_token": sum(ms for _, ms in v) / max(1, sum(n for n, _ in v)),
                    "vs_none": list(ratio_ci(base[r], v)),
                }
                for r, v in by_round.items()
            ]
        print(f"{k:14s} {report[k]}", file=sys.stderr)
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
