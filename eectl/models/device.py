"""Where the torch stages run: `--device auto|cpu|cuda` resolved once, the same way for profile, the state cache,
train-heads and calibrate.

`auto` is a CUDA GPU when torch sees one, else the CPU; `cuda` on a machine without one is a one-line UsageError.
What this module does not do: move anything (each stage moves its model and tensors to the device it resolved), or
know about ONNX Runtime providers (runtime/ picks those).
"""

from __future__ import annotations

import torch

from eectl.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")


def check_device(name: str) -> None:
    """A UsageError for a name that is not one of DEVICES (before anything loads)."""
    if name not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got '{name}'")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` -> the GPU of this process's `local_rank` (a launcher's
    rank), or a UsageError when there is none."""
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda asked for, but torch sees no CUDA GPU",
                hint="run on a machine with a GPU and a CUDA build of torch, or pass --device auto or cpu",
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """How logs and JSON name a device: cpu, cuda, or cuda:N beyond the first GPU."""
    return device.type if device.index in (None, 0) else f"{device.type}:{device.index}"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host data (a state cache's rows, token ids) onto `device` without making the host wait: on a GPU through
    pinned memory and asynchronously (a copy from pageable memory first waits for everything queued on the device);
    on the CPU as is."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
