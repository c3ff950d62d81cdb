"""Where and how a head-training run runs: its rank among the launcher's processes, the device, mixed precision, the
learning-rate schedule and the RNG state a checkpoint keeps, shared by heads/train.py and heads/cached.py.

What this module does not do: build heads, read data or train (heads/train.py, heads/cached.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from eectl.errors import UsageError

DEVICES = ("cpu", "cuda")


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


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got '{name}'")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda asked for, but torch sees no CUDA GPU",
                hint="run on a machine with a GPU and a CUDA build of torch, or use --device cpu",
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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
