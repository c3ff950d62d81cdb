"""Where and how a head-training run runs: its rank among the launcher's processes, mixed precision on the device
(resolved by models/device.py), the learning-rate schedule and the RNG state a checkpoint keeps, shared by
heads/train.py and heads/cached.py.

What this module does not do: build heads, read data or train (heads/train.py, heads/cached.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Dist:
    """This process's place among the launcher's: rank 0 of 1 in a plain run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_from_env() -> Dist:
    """torchrun and `accelerate launch` set WORLD_SIZE / RANK / LOCAL_RANK; a plain run has world size 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    return Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


def amp_dtype(device: torch.device) -> torch.dtype | None:
    """Mixed precision on a GPU (bf16 where supported, else fp16 with loss scaling); fp32 on the CPU."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of --lr (a function of the step only)."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class KLLog:
    """Each optimiser step's KL per exit, kept on the device and brought to the host in blocks: one transfer per
    `every` steps (and at every `flush`: before a checkpoint, at the end), not a read per step (which would make
    the host wait for the device every step). `history` is extended in place: one list of floats per step."""

    def __init__(self, history: list[list[float]], every: int = 16) -> None:
        self.history = history
        self.every = every
        self.pending: list[torch.Tensor] = []  # [E] per step not yet on the host

    def add(self, kl: torch.Tensor) -> None:
        self.pending.append(kl.detach())
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.history.extend(torch.stack(self.pending).tolist())  # one copy for the block
            self.pending.clear()

    def last(self, exits: list[int]) -> dict[int, float]:
        """The latest KL on the host by exit (empty before the first block arrives)."""
        return dict(zip(exits, self.history[-1], strict=True)) if self.history else {}
