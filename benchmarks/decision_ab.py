"""One token's exit decisions before and after #11's numpy decision path, interleaved on the same exit graphs.

    flock /tmp/eectl-bench.lock python benchmarks/decision_ab.py ARTIFACT --first 8 --later 24

`before` re-creates the runner's earlier decision: the exit graphs' outputs wrapped as torch tensors, a torch
softmax + top-2 (+ gather) per decision and torch's thread count switched to one around it; `now` is the runner's
code path (eectl.exits.signals.ExitScoring on OrtExitLogits: numpy throughout); `graphs` the two exit graph calls alone
(the first exit's candidate pick, a later exit's local rows). Medians of 40 interleaved rounds of 25 calls.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from eectl.exits.candidates import CANDIDATE_SOURCES
from eectl.exits.signals import ExitScoring, get_signal
from eectl.runtime.exit_logits import OrtExitLogits, _one_torch_thread
from eectl.runtime.sessions import ArtifactRuntime


class _TorchBackend:
    """The runner's exit backend before: numpy from ONNX Runtime, wrapped as torch tensors."""

    def __init__(self, rt: ArtifactRuntime) -> None:
        self.rt = rt

    def full_topk(self, layer: int, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, c, cl = self.rt.exit_full(layer, hidden.numpy(), k)
        return torch.from_numpy(c), torch.from_numpy(cl)

    def local(self, layer: int, hidden: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.rt.exit_local(layer, hidden.numpy(), cand.numpy()))

    def candidates(self, source: Any, layer: int, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, cl = self.rt.exit_candidates(layer, hidden.numpy(), k)
        return torch.from_numpy(c), torch.from_numpy(cl)


def _torch_prob(logits: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """The earlier exits.signals: torch softmax, top-2, gather; returns the top-1 probability."""
    probs = torch.softmax(logits.float(), dim=-1)
    top2 = torch.topk(probs, 2, dim=-1)
    cand.gather(1, top2.indices[:, :1])  # the token
    top2.values[:, 0] - top2.values[:, 1]  # the margin
    return top2.values[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--first", type=int, required=True)
    ap.add_argument("--later", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=64)
    args = ap.parse_args()
    rt = ArtifactRuntime(args.artifact, provider="cpu", threads=args.threads)
    torch.set_num_threads(args.threads)
    source = CANDIDATE_SOURCES.get(str(rt.manifest.candidate_source.get("name")), CANDIDATE_SOURCES["first-exit-topk"])
    signal, k, threshold = get_signal("topk-prob"), args.top_k, {"prob": 0.9}
    h = np.random.default_rng(0).standard_normal((1, rt.manifest.dims["hidden_size"])).astype(np.float32)
    old, new = _TorchBackend(rt), OrtExitLogits(rt)

    def before() -> None:
        x = torch.from_numpy(np.stack([h[0]]))
        with _one_torch_thread():
            cand, logits = source.pick(old, args.first, SimpleNamespace(hidden=x), k)
            bool((_torch_prob(logits, cand) >= threshold["prob"])[0])
        with _one_torch_thread():
            bool((_torch_prob(old.local(args.later, x, cand[0:1]), cand[0:1]) >= threshold["prob"])[0])

    def now() -> None:
        first = ExitScoring(signal, new, k, source)
        bool(signal.passes(first.score(args.first, h).values, threshold)[0])
        later = ExitScoring(signal, new, k, source)
        later.candidates = first.candidates
        bool(signal.passes(later.score(args.later, h).values, threshold)[0])

    def graphs() -> None:
        cand, _ = rt.exit_candidates(args.first, h, k)
        rt.exit_local(args.later, h, cand)

    runs: dict[str, Callable[[], None]] = {"before": before, "now": now, "graphs": graphs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for f in runs.values():
        f()
    for _ in range(40):
        for name, f in runs.items():
            t0 = time.perf_counter_ns()
            for _ in range(25):
                f()
            times[name].append((time.perf_counter_ns() - t0) / 25 / 1000)
    med = {name: float(np.median(v)) for name, v in times.items()}
    print(f"two decisions (exit {args.first}: candidate pick, exit {args.later}: local rows), {rt.threads} ORT threads")
    for name, v in med.items():
        print(f"  {name}: {v:.0f} us")
    py_before, py_now = med["before"] - med["graphs"], med["now"] - med["graphs"]
    print(f"Python around the graphs: before {py_before:.0f} us, now {py_now:.0f} us")


if __name__ == "__main__":
    main()
