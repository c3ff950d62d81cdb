"""Rows joining and leaving between steps: throughput over a prompt file with ragged answers.

    python benchmarks/batch_slots.py ARTIFACT --threads 2 --prompts 32 --batch 16 --max-new-tokens 96 --reps 3

One process, one runtime, interleaved repetitions of three full-depth configurations over the same prompts
(GSM8K questions in the chat template, every other one asking for the bare number: answers stopping at EOS or
the token budget, ragged lengths):
batch 1 (one prompt at a time), batch B in chunks (B prompts per generate call, the next chunk after the longest
answer of the last: what `eectl run --batch-size` did before slots), and batch B slots (`Runner.generate(...,
slots=B)`: a finished row's slot takes the next prompt). Throughput = generated tokens / wall time of the whole
configuration (prefills included); every configuration's tokens are checked against batch 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eectl.data import encode_prompt, load_text_data
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rt = ArtifactRuntime(a.artifact, provider="cpu", threads=a.threads)
    tok = load_tokenizer(rt)
    texts = load_text_data(a.data, "question").texts[: a.prompts]
    # every other prompt asks for the bare answer: short answers beside long ones (ragged, as real prompt files are)
    texts = [t + (" Reply with the final number only." if i % 2 else "") for i, t in enumerate(texts)]
    ids = [encode_prompt(tok, t, False) for t in texts]
    opts = RunOptions(exits="none", max_new_tokens=a.max_new_tokens, threads=a.threads)
    runner = Runner(rt, resolve_config(rt, opts, tuple(rt.manifest.eos_token_ids)))

    def batch1() -> list[list[int]]:
        return [runner.generate([p])[0].token_ids for p in ids]

    def chunks() -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(ids), a.batch):
            out += [g.token_ids for g in runner.generate(ids[i : i + a.batch])]
        return out

    def slots() -> list[list[int]]:
        return [g.token_ids for g in runner.generate(ids, slots=a.batch)]

    configs = {"batch 1": batch1, f"batch {a.batch} chunks": chunks, f"batch {a.batch} slots": slots}
    ref = batch1()  # warm-up and the reference
    lengths = [len(t) for t in ref]
    print(f"{len(ids)} prompts, answers {min(lengths)}..{max(lengths)} tokens (mean {statistics.mean(lengths):.1f})")
    for f in configs.values():
        f()  # warm-up of every shape
    rates: dict[str, list[float]] = {n: [] for n in configs}
    names = list(configs)
    for r in range(a.reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            got = configs[name]()
            wall = time.perf_counter() - t0
            assert got == ref, f"{name}: tokens differ from batch 1"
            rates[name].append(sum(len(t) for t in got) / wall)
    base = statistics.median(rates["batch 1"])
    print(f"threads {a.threads}, {a.reps} interleaved reps, tokens identical to batch 1 in every configuration")
    for name, rs in rates.items():
        med = statistics.median(rs)
        print(f"{name:>22}: {med:7.1f} tokens/s  ({med / base:.2f}x batch 1; reps {', '.join(f'{x:.1f}' for x in rs)})")


if __name__ == "__main__":
    main()
