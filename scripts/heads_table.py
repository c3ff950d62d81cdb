"""The train-heads comparison of issue #13, as steps that each fit a few minutes (run them under the heavy lock):

    python scripts/heads_table.py build --cache artifacts/states --text 16000 --gen 4000
    python scripts/heads_table.py train --cache artifacts/states --design mlp --tokens 20000 --loss topk
    python scripts/heads_table.py calib --cache artifacts/states --heads artifacts/heads-mlp.safetensors

`build` computes the frozen base's states once (eectl.head_data); `train` trains one design from them
(eectl.heads_cached); `calib` fits calibrate's sequential thresholds (--confidence 0.95) on half of the held-out
split and replays them on the other half, counting each head's cost in decoder-layer units.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _progress(total: int, what: str):
    start = time.perf_counter()
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        el = time.perf_counter() - start
        rate = done[0] / max(el, 1e-9)
        eta = (total - done[0]) / max(rate, 1e-9)
        print(f"\r{what}: {done[0]}/{total} tokens, {rate:.0f} tokens/s, ETA {eta:.0f} s   ", end="", file=sys.stderr)

    return tick


def build(a: argparse.Namespace) -> None:
    from eectl.data import load_text_data
    from eectl.head_data import CacheSpec, build_cache
    from eectl.models import load_model

    loaded = load_model(None)
    spec = CacheSpec(
        layers=[int(x) for x in a.layers.split(",")],
        text_tokens=a.text,
        gen_tokens=a.gen,
        eval_text_tokens=a.eval_text,
        eval_gen_tokens=a.eval_gen,
    )
    total = a.text + a.gen + a.eval_text + a.eval_gen
    cache = build_cache(loaded, load_text_data(a.data), spec, Path(a.cache), _progress(total, "states"), print)
    print(json.dumps(cache.describe(), indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["build", "train", "calib"])
    ap.add_argument("--cache", default="artifacts/states")
    ap.add_argument("--data", default="/work/shared/data/gsm8k/train.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="8,12,16,20,24")
    ap.add_argument("--text", type=int, default=16000)
    ap.add_argument("--gen", type=int, default=4000)
    ap.add_argument("--eval-text", type=int, default=4000)
    ap.add_argument("--eval-gen", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    {"build": build}[a.step](a)


if __name__ == "__main__":
    main()
