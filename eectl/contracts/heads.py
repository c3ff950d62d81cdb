"""The metadata of a heads file (heads.safetensors header and its .json sidecar), typed.

`eectl train-heads` writes it, `load_heads` validates it, export records it in the manifest (`Manifest.heads`).
What this module does not do: build, train or load the head modules (heads/train.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FORMAT = "eectl-heads"
FORMAT_VERSION = 1


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeadCost(_M):
    params: int  # per exit
    macs_per_token: int  # of the head alone (the LM head costs H*V per token on top)
    layers: float | None = None  # macs_per_token in decoder-layer units (a block is 1.0)


class HeadDims(_M):
    num_layers: int
    hidden_size: int
    vocab_size: int


class ProbeMeta(_M):
    """What fitted the `learned` signal's probes stored beside the heads (eectl.exits.probe.ProbeFit, as a dict)."""

    features: list[str]  # what a probe reads: "normed", then the softmax scalars (exits.PROBE_FEATURES)
    top_k: int = Field(ge=2)  # the candidates whose local softmax the scalars come from
    candidates: dict[str, Any]  # the candidate source (CandidateSource.describe)
    tokens: int = Field(ge=0)
    agreement: dict[str, float]  # per exit: the share of training tokens whose label is 1
    train_s: float
    config: dict[str, Any]  # ProbeConfig without top_k
    chosen: dict[str, str] = {}  # per exit: "mlp" or "logistic" (files before MLP probes: {})
    validation: dict[str, dict[str, float]] = {}  # per exit: both fits' tail coverage on the validation tokens
    cache: dict[str, Any] | None = None  # `train-heads --probe-only`: the state cache's identity


class HeadsMeta(_M):
    format: str = FORMAT
    version: int = FORMAT_VERSION
    exits: list[int]
    design: str
    rank: int | None  # as asked for; None: the design's default
    width: int | None  # the rank (low-rank) or hidden width (mlp) the heads got
    head_cost: HeadCost
    dimensions: HeadDims
    base_model: dict[str, Any]  # the checkpoint's identity (ModelSource.to_dict) and family
    data: dict[str, Any]  # what was trained on and held out
    training: dict[str, Any]  # optimiser, schedule, device, precision, timings, final KL per exit
    steps: int
    seed: int
    report: dict[str, Any]  # held-out before/after metrics per exit (heads_report.EvalResult as dicts)
    block_init: str | None = None  # block design: last | next | identity
    block_layers: dict[str, int] | None = None  # block design: exit layer -> the decoder layer index it copies
    # the `learned` signal's probes stored beside the heads (what fitted them); None in files without probes
    probe: ProbeMeta | None = None


def sidecar_path(path: Path) -> Path:
    """heads.safetensors -> heads.json (the human-readable copy of the metadata)."""
    return path.with_suffix(".json")
