"""Load on `eectl serve`: throughput, time to first token and per-token latency at 1, 4 and 16 concurrent clients.

    flock /tmp/eectl-heavy.lock timeout 1200 .venv/bin/python benchmarks/serve_load.py ARTIFACT --threads 2 \
        --clients 1,4,16 --requests 2 --max-tokens 48

Starts `eectl serve ARTIFACT` on 127.0.0.1 (a free port, `--max-batch` the largest client count unless given),
then for each client count C runs C client threads, each sending `--requests` streamed chat completions one after the
other (GSM8K questions from --data, in order, each client its own), over the OpenAI API with the `openai` package.
Per request: the time to its first content chunk (TTFT), the mean time between its later tokens (per-token latency:
(last chunk - first chunk) / (completion tokens - 1)), and its completion tokens (the usage chunk). Per client count:
throughput (completion tokens of every request / the wall time of the whole round), p50/p99 of TTFT and per-token
latency, and throughput against one client's. Bounded: at most `--requests` x C requests a round and `--budget-s`
seconds in all (a round past it is not started). Localhost only.

`--compare NAME='SERVE ARGS'` (repeatable) also starts `eectl serve` on the same artifact with those options beside the
first (e.g. `--compare "full=--policy full"`: batched full depth at every batch size, against the server's own
configuration) and runs the same rounds on it, each client count on every server in turn. The JSON holds each eectl
server's /health after the rounds (`batching`: the steps each configuration ran where the plan's default switches
with the batch).

`--llama-cpp FILE.gguf` also starts llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, its `[server]`
extra; n_threads and n_threads_batch = --threads) on the same GGUF and runs the same rounds against it, each client
count on eectl then on llama.cpp, so a burst of other load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Round:
    clients: int
    wall_s: float = 0.0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    errors: int = 0

    def row(self, base: float | None) -> dict[str, float | int | None]:
        tput = self.tokens / self.wall_s if self.wall_s else 0.0
        return {
            "clients": self.clients,
            "requests": len(self.ttft_s),
            "errors": self.errors,
            "tokens": self.tokens,
            "throughput_tok_s": tput,
            "vs_one_client": tput / base if base else None,
            "ttft_p50_ms": _pct(self.ttft_s, 50),
            "ttft_p99_ms": _pct(self.ttft_s, 99),
            "per_token_p50_ms": _pct(self.per_token_s, 50),
            "per_token_p99_ms": _pct(self.per_token_s, 99),
        }


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return 1000 * s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _questions(path: str, n: int) -> list[str]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.append(json.loads(line)["question"])
            if len(out) == n:
                break
    return out


def _one(client, question: str, max_tokens: int, rnd: Round, lock: threading.Lock) -> None:
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = 0
    try:
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or now
                last = now
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # a refused or failed request counts as an error, not a measurement
        print(f"request failed: {exc}", file=sys.stderr)
        with lock:
            rnd.errors += 1
        return
    tokens = tokens or chunks  # a server that sends no usage chunk: one content chunk per token
    with lock:
        rnd.tokens += tokens
        if first is not None:
            rnd.ttft_s.append(first - t0)
            if tokens > 1 and last is not None:
                rnd.per_token_s.append((last - first) / (tokens - 1))


def run_round(url: str, clients: int, questions: list[str], requests: int, max_tokens: int) -> Round:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rnd, lock = Round(clients), threading.Lock()

    def work(c: int) -> None:
        for r in range(requests):
            _one(client, questions[(c * requests + r) % len(questions)], max_tokens, rnd, lock)

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rnd.wall_s = time.perf_counter() - t0
    return rnd


def start_server(artifact: str, port: int, threads: int, max_batch: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eectl.cli", "serve", artifact, "--port", str(port), "-t", str(threads)]
    cmd += ["--max-batch", str(max_batch), "--max-queue", "256", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return _wait(proc, f"http://127.0.0.1:{port}/health")


def start_llama_cpp(gguf: str, port: int, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port)]
    # interrupt_requests off: by default a new request cancels the stream in progress (its server runs one at a time)
    cmd += ["--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048"]
    cmd += ["--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _wait(proc, f"http://127.0.0.1:{port}/v1/models")


def _wait(proc: subprocess.Popen, url: str) -> subprocess.Popen:
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                print(f"server: {r.read().decode()[:200]}", file=sys.stderr)
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=None, help="default: the largest client count")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    ap.add_argument("--budget-s", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-args", default="", help="more `eectl serve` options, e.g. '--policy verify'")
    ap.add_argument("--llama-cpp", default=None, help="a GGUF: llama-cpp-python's server on it, the same rounds")
    ap.add_argument("--compare", action="append", default=[], help="NAME='serve args': another eectl server, e.g. "
                    "\"full=--policy full\"")  # fmt: skip
    ap.add_argument("--reverse", action="store_true", help="each client count on the last server first")
    a = ap.parse_args()
    counts = [int(c) for c in a.clients.split(",")]
    if not (1 <= a.requests <= 64 and all(1 <= c <= 64 for c in counts) and 1 <= a.max_tokens <= 1024):
        raise SystemExit("bounded: --requests and each client count in 1..64, --max-tokens in 1..1024")
    questions = _questions(a.data, max(counts) * a.requests)
    port = _free_port()
    proc = start_server(a.artifact, port, a.threads, a.max_batch or max(counts), shlex.split(a.serve_args))
    servers = {"eectl": (proc, f"http://127.0.0.1:{port}")}
    for spec in a.compare:
        name, _, extra = spec.partition("=")
        other = _free_port()
        args = [*shlex.split(a.serve_args), *shlex.split(extra)]
        servers[name] = (
            start_server(a.artifact, other, a.threads, a.max_batch or max(counts), args),
            f"http://127.0.0.1:{other}",
        )
    if a.llama_cpp:
        peer_port = _free_port()
        servers["llama.cpp"] = (start_llama_cpp(a.llama_cpp, peer_port, a.threads), f"http://127.0.0.1:{peer_port}")
    rounds: dict[str, list[Round]] = {name: [] for name in servers}
    t_start = time.time()
    try:
        for _, url in servers.values():
            run_round(url, 1, questions, 1, 8)  # warm-up: the first request's sessions and buffers
        for c in counts:
            if time.time() - t_start > a.budget_s:
                print(f"budget spent: {c} clients not run", file=sys.stderr)
                break
            for name, (_, url) in reversed(servers.items()) if a.reverse else servers.items():
                rounds[name].append(run_round(url, c, questions, a.requests, a.max_tokens))
                print(f"{name}, {c} clients: {rounds[name][-1].row(None)}", file=sys.stderr)
        health = {name: _health(url) for name, (_, url) in servers.items() if name != "llama.cpp"}
    finally:
        for server, _ in servers.values():
            server.send_signal(signal.SIGTERM)
            server.wait(120)
    rows = {}
    for name, rs in rounds.items():
        base = next((r.tokens / r.wall_s for r in rs if r.clients == 1 and r.wall_s), None)
        rows[name] = [r.row(base) for r in rs]
    if a.json:
        print(json.dumps({"artifact": a.artifact, "threads": a.threads, "rows": rows, "health": health}, indent=1))
        return
    head = ["server", "clients", "requests", "tokens", "throughput (tok/s)", "vs 1 client", "TTFT p50 / p99 (ms)"]
    print("| " + " | ".join([*head, "per token p50 / p99 (ms)"]) + " |")
    print("|---" * (len(head) + 1) + "|")
    for name, rs in rows.items():
        for r in rs:
            vs = f"{r['vs_one_client']:.2f}x" if r["vs_one_client"] else "-"
            ttft = f"{_f(r['ttft_p50_ms'])} / {_f(r['ttft_p99_ms'])}"
            per_token = f"{_f(r['per_token_p50_ms'])} / {_f(r['per_token_p99_ms'])}"
            tput = f"{r['throughput_tok_s']:.1f}"
            cells = [name, r["clients"], r["requests"], r["tokens"], tput, vs, ttft, per_token]
            print("| " + " | ".join(str(c) for c in cells) + " |")


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read().decode())


def _f(x: float | int | None) -> str:
    return "-" if x is None else f"{x:.0f}"


if __name__ == "__main__":
    main()
