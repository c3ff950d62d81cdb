"""Where train-heads' time goes on the CPU: one base pass per chunk, and one optimiser step per loss and precision.

    flock /tmp/eectl-heavy.lock python scripts/heads_speed.py --threads 2

Interleaved repetitions (A B C A B C ...), median seconds; the states are real (one base pass over GSM8K text).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from eectl.data import load_text_data, token_chunks
from eectl.exits.base import ExitHead
from eectl.exits.designs import build_heads
from eectl.heads.losses import TeacherTopK, topk_tail_kl
from eectl.heads.report import base_pass as _base_pass
from eectl.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--data", default="/work/shared/data/gsm8k/train.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_model(None)
    adapter = loaded.adapter
    loaded.model.eval().requires_grad_(False)
    exits = [8, 12, 16, 20, 24]
    chunk = token_chunks(loaded.tokenizer, load_text_data(a.data), 255, 256)[0]

    def amp(on: bool) -> contextlib.AbstractContextManager[object]:
        return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()

    run = _base_pass(adapter, chunk, exits, 1)
    lens = ExitHead(adapter)
    states = {layer: run.states[layer][: a.batch] for layer in exits}
    probs = run.probs[: a.batch]
    final_logits = run.probs[: a.batch].log()
    teacher = TeacherTopK.of(final_logits, 32)
    stack = build_heads("residual-linear", adapter.dims.hidden_size, exits, None, 0)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step(loss: str, bf16: bool, tail: int | None) -> None:
        with amp(bf16):
            mapped = stack(states)
            x = torch.stack([mapped[layer] for layer in exits])  # [E, B, H]
            if loss == "exact":
                logits = lens.full(x.flatten(0, 1)).float().view(len(exits), a.batch, -1)
                total = sum(F.cross_entropy(logits[e], probs) for e in range(len(exits)))
            else:
                total = topk_tail_kl(lens, x, teacher, tail, g)[0].sum()
        opt.zero_grad()
        total.backward()
        opt.step()

    def base(bf16: bool) -> None:
        with amp(bf16):
            _base_pass(adapter, chunk, exits, 1)

    cases = {
        "base pass fp32 (256 tokens)": lambda: base(False),
        "base pass bf16 (256 tokens)": lambda: base(True),
        "step exact fp32": lambda: step("exact", False, None),
        "step exact bf16": lambda: step("exact", True, None),
        "step topk32 full-Z fp32": lambda: step("topk", False, None),
        "step topk32 +1024 tail fp32": lambda: step("topk", False, 1024),
        "step topk32 +1024 tail bf16": lambda: step("topk", True, 1024),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(a.reps):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"threads {a.threads}, batch {a.batch} tokens x {len(exits)} exits, {a.reps} interleaved reps")
    for name, ts in times.items():
        med = statistics.median(ts)
        per = 255 if name.startswith("base") else a.batch
        print(f"{name:32s} median {med * 1000:8.1f} ms  ({per / med:8.0f} tokens/s)  min {min(ts) * 1000:.1f}")


if __name__ == "__main__":
    main()
