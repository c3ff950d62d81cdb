"""One head-training run's configuration, whichever source its training states come from, and its result.

The states (each exit's hidden state and the final layer's distribution) come from one of two sources:

    the model, on the fly   heads/train.py `train_heads`: the base runs in the loop; per-token designs only
    a state cache           heads/cached.py `train_cached`: the base ran once, when the cache was built
                            (heads/state_cache_build.py); every design, sequence designs (block) included

Both take a `TrainConfig`: the fields every run has once, then each source's own, which the other source ignores.
What only a state cache can train (a sequence design, or a config naming a `cache` folder) the on-the-fly trainer
refuses in one line that names the cache's trainer. heads/stage.py builds one config from a recipe and a request
and dispatches on `TrainConfig.from_cache`.

What this module does not do: train, read data or build a state cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eectl.contracts.heads import HeadsMeta
from eectl.contracts.layers import check_exit_layers
from eectl.errors import UsageError
from eectl.exits.base import DEFAULT_TOP_K
from eectl.exits.designs import BLOCK_INITS, DESIGNS, SEQUENCE_DESIGNS, check_design
from eectl.exits.probe import ProbeConfig
from eectl.heads.losses import DEFAULT_SHORTLIST, DEFAULT_TAIL_SAMPLES, LOSSES
from eectl.models.device import check_device
from eectl.phases import Phases

if TYPE_CHECKING:
    from eectl.heads.state_cache import StateCache

DEFAULT_BATCH_TOKENS = 32  # tokens per optimiser step on the fly (the stage's default)
CACHED_BATCH_TOKENS = 256  # tokens per optimiser step from a state cache (the stage's default)
DEFAULT_EVAL_TOKENS = 4096
DEFAULT_CHUNK_LEN = 256

# What a checkpoint must share with the run that resumes it (with the model, data or cache identity beside it)
_IDENTITY = ("exits", "design", "rank", "steps", "lr", "batch_tokens", "seed")
_ON_THE_FLY_IDENTITY = ("ce_weight", "chunk_len")
_CACHED_IDENTITY = ("block_init", "loss", "tail_samples", "shortlist", "precision", "sources")


@dataclass
class TrainConfig:
    """One run's configuration, for either source of its states (the stage's defaults are in heads/stage.py)."""

    exits: list[int]
    design: str = "residual-linear"
    rank: int | None = None  # low-rank rank / mlp width; None: the design's default
    steps: int = 500
    lr: float = 1e-3
    batch_tokens: int = DEFAULT_BATCH_TOKENS  # tokens per optimiser step (per rank)
    seed: int = 0
    eval_tokens: int = DEFAULT_EVAL_TOKENS  # held-out tokens of the before/after report (a cache may hold more)
    save_every: int = 100  # checkpoint every this many steps (and at the end)
    device: str = "cpu"  # or cuda, or auto: a CUDA GPU when torch sees one (models/device.py; requests default to auto)
    top_k: int = DEFAULT_TOP_K  # local vocabulary of the top-k signal in the report
    target: float = 0.99  # precision at which the report's coverage is measured
    # on the fly only (a state cache's trainer ignores them)
    ce_weight: float = 0.0  # weight of next-token cross-entropy added to the KL
    chunk_len: int = DEFAULT_CHUNK_LEN  # context length the base runs on
    # from a state cache only (the on-the-fly trainer ignores them, and refuses `cache`)
    cache: Path | None = None  # the state cache folder the states come from; None: the model on the fly (or, for a
    #                            sequence design, the stage's default folder)
    block_init: str = "last"  # block: copy of the last layer, of the next layer (l), or identity-initialised
    loss: str = "topk"
    tail_samples: int | None = DEFAULT_TAIL_SAMPLES  # None: the exact normaliser (all LM-head rows)
    shortlist: int = DEFAULT_SHORTLIST  # topk: the most frequent teacher top-1 tokens, always counted exactly
    precision: str = "fp32"  # or "bf16" (autocast on the device)
    sources: tuple[str, ...] = ("text", "gen")
    probe_tokens: int = ProbeConfig.tokens  # the learned signal's probes: training tokens (at most the cache's)

    @property
    def from_cache(self) -> bool:
        """Where the training states come from: a state cache (a folder given, or a sequence design, which reads
        the sequence and has no other source), else the model on the fly."""
        return self.cache is not None or self.design in SEQUENCE_DESIGNS

    def check(self, num_layers: int | None = None) -> None:
        """On the fly: raise UsageError on values no run could use (before the model loads, exits may still be
        empty: the model's default_exits)."""
        if self.design in SEQUENCE_DESIGNS:
            raise UsageError(
                f"{self.design} heads read the sequence: they train from a state cache (heads.cached.train_cached, "
                "train-heads --cache DIR), not on the fly"
            )
        if self.cache is not None:
            raise UsageError(
                f"this configuration trains from the state cache {self.cache}: heads.cached.train_cached trains it, "
                "not the on-the-fly trainer"
            )
        check_design(self.design, self.rank)
        if not self.exits and num_layers is not None:
            raise UsageError("no exits given", hint="pass --exits 8,12,16 (layers 1..L-1)")
        check_exit_layers(self.exits, num_layers)
        self._check_common()
        if self.chunk_len < 2:
            raise UsageError(f"chunk length must be >= 2, got {self.chunk_len}")
        if not self.ce_weight >= 0 or not math.isfinite(self.ce_weight):
            raise UsageError(f"--ce-weight must be >= 0, got {self.ce_weight}")

    def check_cache(self, cache: StateCache) -> None:
        """From a state cache: raise UsageError on values no run could use, or exits the cache has no states for."""
        if self.design not in DESIGNS + SEQUENCE_DESIGNS:
            raise UsageError(f"unknown head design '{self.design}'")
        if self.loss not in LOSSES:
            raise UsageError(f"unknown loss '{self.loss}'", hint=f"choose one of {', '.join(LOSSES)}")
        if self.block_init not in BLOCK_INITS:
            raise UsageError(f"unknown block init '{self.block_init}'", hint=f"choose one of {', '.join(BLOCK_INITS)}")
        if self.precision not in ("fp32", "bf16"):
            raise UsageError(f"precision must be fp32 or bf16, got {self.precision}")
        missing = sorted(set(self.exits) - set(cache.layers))
        if missing:
            raise UsageError(f"the state cache has no states for exits {missing}", hint=f"it has {cache.layers}")
        self._check_common()

    def _check_common(self) -> None:
        for name in ("steps", "batch_tokens", "eval_tokens", "save_every", "top_k"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not 0 < self.target <= 1:
            raise UsageError(f"target precision must be in (0, 1], got {self.target}")
        check_device(self.device)

    def identity(self, from_cache: bool) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it: the common training fields and the source's
        own (the trainer says which source it reads: a library caller may hand `train_cached` an opened cache)."""
        d = asdict(self)
        keys = _IDENTITY + (_CACHED_IDENTITY if from_cache else _ON_THE_FLY_IDENTITY)
        identity = {k: d[k] for k in keys}
        if from_cache:
            identity["sources"] = list(self.sources)
        return identity


@dataclass
class TrainResult:
    meta: HeadsMeta | None  # everything in heads.json (None on the non-main ranks)
    out: Path
    sidecar: Path
    checkpoint: Path
    main: bool = True  # False on the non-zero ranks of a distributed run (they write and print nothing)
    wall_s: float = 0.0
    phases: Phases = field(default_factory=Phases)  # where the time went (from a state cache; eectl/phases.py)

    def to_dict(self) -> dict[str, Any]:
        meta = {} if self.meta is None else self.meta.model_dump(mode="json")
        return {"out": str(self.out), "json": str(self.sidecar), "checkpoint": str(self.checkpoint), **meta}
