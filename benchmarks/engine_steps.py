"""Where a batch's time goes under concurrent clients: every engine step recorded, prefills apart from decode (#67).

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/engine_steps.py ARTIFACT --clients 16 --requests 2 \
        --max-tokens 48 --threads 2

`--clients` threads, each sending `--requests` chat requests one after the other (GSM8K train questions in order,
each client its own) to one `eectl.load(ARTIFACT, max_batch=16)` model at full depth (`exits="none"`, greedy; a new
request is seated at the next step with every other free slot: the API's default), after one warm-up request. Each
step of the engine's runner is timed (runtime/chain_steps.py `chain_tokens`, wrapped): the steps that prefill a new
prompt (with the decode rows beside it) and the decode-only steps, their rows, the prompt tokens fed (after the
chat header's positions reused from another row: runtime/slots.py), and the wall time outside the steps. Prints one
JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

GSM8K = "/work/shared/data/gsm8k/train.jsonl"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", default=GSM8K)
    args = p.parse_args()

    import eectl
    from eectl.runtime import runner as runner_module

    n = args.clients * args.requests + 1
    with open(args.data, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line, _ in zip(f, range(n), strict=False)]
    steps: list[tuple[float, int, int, int]] = []  # seconds, rows, new prompts, prompt tokens fed
    chain_tokens = runner_module.chain_tokens

    def timed(run: Any, chain: Any, kv: Any, live: Any, fresh: Any, *rest: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = chain_tokens(run, chain, kv, live, fresh, *rest, **kwargs)
        fed = sum(live[s][0].prompt_len - live[s][0].reused for s in fresh)
        steps.append((time.perf_counter() - t0, len(live), len(fresh), fed))
        return out

    runner_module.chain_tokens = timed
    model = eectl.load(args.artifact, max_batch=16, threads=args.threads, exits="none", context=512)
    model.generate(questions[-1], max_new_tokens=8)  # warm-up (the engine's first batch)
    steps.clear()

    def client(i: int) -> None:
        for j in range(args.requests):
            q = questions[i * args.requests + j]
            model.generate([{"role": "user", "content": q}], max_new_tokens=args.max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    model.close()
    prefill = [s for s in steps if s[2]]
    decode = [s for s in steps if not s[2]]
    tokens = args.clients * args.requests * args.max_tokens
    print(
        json.dumps(
            {
                "eectl": os.path.dirname(eectl.__file__),
                "clients": args.clients,
                "wall_s": wall,
                "tokens_per_s": tokens / wall,
                "outside_steps_s": wall - sum(s[0] for s in steps),
                "prefill_steps": len(prefill),
                "prefill_steps_s": sum(s[0] for s in prefill),
                "prompt_tokens_fed": sum(s[3] for s in prefill),
                "decode_steps": len(decode),
                "decode_steps_s": sum(s[0] for s in decode),
                "decode_rows_mean": sum(s[1] for s in decode) / max(1, len(decode)),
                "load": os.getloadavg()[0],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
