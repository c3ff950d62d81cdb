"""The train-heads checkpoint (`--resume`): one safetensors file, like everything eectl writes, so no pickle exists.

Tensors: the heads (`heads.<param>`), AdamW's moments (`optimizer.<param index>.<name>`) and the RNG states
(`rng.torch`, `rng.cuda`). The JSON header: format and version, the run identity (what a resumed run must share:
model hash, data, options), step, KL history, the optimiser's param groups and non-tensor state, the loss scaler.

What this module does not do: train (heads/train.py) or decide what a run's identity is (TrainConfig.identity).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eectl.errors import UsageError
from eectl.exits.designs import HeadStack
from eectl.files import atomic_write, existing_file

CHECKPOINT_FORMAT = "eectl-heads-checkpoint"
CHECKPOINT_VERSION = 2  # 2: safetensors + JSON header (1 was a torch pickle, no longer read)


def checkpoint_path(out: Path) -> Path:
    """heads.safetensors -> heads.ckpt.safetensors (optimiser state, step, RNG: what --resume needs)."""
    return out.with_suffix(".ckpt.safetensors")


def save_checkpoint(path: Path, identity: dict[str, Any], stack: HeadStack, optimizer: Any, **rest: Any) -> None:
    """One safetensors file, like everything eectl writes (no pickle): the tensors (heads, AdamW moments, RNG
    states) and, in its JSON header, the run identity, step, KL history, optimiser hyper-parameters and scaler."""
    from safetensors.torch import save

    tensors = {f"heads.{k}": v.detach().cpu().contiguous() for k, v in stack.state_dict().items()}
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in opt["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    for name, value in rest.pop("rng").items():
        tensors[f"rng.{name}"] = value.detach().cpu().contiguous()
    state = {**rest, "param_groups": opt["param_groups"], "optimizer_scalars": scalars}
    header = {
        "format": CHECKPOINT_FORMAT,
        "version": str(CHECKPOINT_VERSION),
        "identity": json.dumps(identity, sort_keys=True),
        "state": json.dumps(state),
    }
    blob = save(tensors, metadata=header)  # bytes, written by Python: a full disk is an OSError, mapped to one line
    atomic_write(path, lambda tmp: tmp.write_bytes(blob))


def check_checkpoint(path: Path) -> None:
    """Before the model loads: `path` is an eectl checkpoint of this format (its header only; the run identity is
    checked by load_checkpoint once the model and data are known)."""
    _read_checkpoint(path, tensors=False)


def _read_checkpoint(path: Path, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    existing_file(path, "checkpoint", UsageError)
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            found = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (no __iter__)
    except (SafetensorError, OSError) as exc:
        raise UsageError(
            f"not a readable checkpoint: {path} ({str(exc).splitlines()[0]})",
            hint="eectl checkpoints are .ckpt.safetensors files written by train-heads; older pickled ones are "
            "not read: start afresh",
        ) from None
    if header.get("format") != CHECKPOINT_FORMAT or header.get("version") != str(CHECKPOINT_VERSION):
        raise UsageError(f"not an eectl train-heads checkpoint (format {CHECKPOINT_VERSION}): {path}")
    return header, found


def load_checkpoint(path: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written by save_checkpoint, checked to belong to this run; UsageError (one line) otherwise."""
    header, tensors = _read_checkpoint(path)
    try:
        saved = json.loads(header["identity"])
        state = json.loads(header["state"])
        groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in state["param_groups"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"damaged checkpoint {path.name}: bad header ({type(exc).__name__}: {exc})") from None
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in identity.items() if saved.get(k) != v]
    if diff:
        raise UsageError(
            f"checkpoint {path.name} is from a different run: {'; '.join(diff)}",
            hint="resume with the same model, data and options, or start afresh without --resume",
        )
    per_param: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in state["optimizer_scalars"].items()}
    for key, value in tensors.items():
        part, _, name = key.partition(".")
        if part == "optimizer":
            idx, _, field = name.partition(".")
            per_param.setdefault(int(idx), {})[field] = value
    return {
        **state,
        "heads": {k.removeprefix("heads."): v for k, v in tensors.items() if k.startswith("heads.")},
        "optimizer": {"state": per_param, "param_groups": groups},
        "rng": {k.removeprefix("rng."): v for k, v in tensors.items() if k.startswith("rng.")},
    }
