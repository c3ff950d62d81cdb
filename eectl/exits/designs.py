"""Exit head designs and heads files: what a trained head is, and how it is saved and loaded.

One head per exit: a small trainable map from the exit's hidden state [.., H] into the input space of the frozen
final norm + LM head, so `ExitHead(adapter, head)` (exits/signals.py) scores it exactly as it scores the plain logit
lens.
Every design is residual and starts at the identity (its last map is zero-initialised):

    residual-linear   h + W h + b                 H*H + H parameters
    low-rank          h + B (A h)                 2*r*H        (r = --rank, default 64)
    mlp               h + W2 gelu(W1 h + b1) + b2 2*m*H + m + H (m = --rank, default H/2)

A heads file is `<name>.safetensors` with tensors `exit_{l}.<param>` (float32); its metadata header holds the
same JSON (heads_meta.HeadsMeta) as the `<name>.json` written next to it, both written atomically.

What this module does not do: train heads (heads/train.py) or choose thresholds (calibrate/calibrator.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from eectl.contracts.heads import FORMAT, HeadsMeta, sidecar_path
from eectl.contracts.layers import check_exit_layers
from eectl.errors import ArtifactError, EectlError, UsageError
from eectl.exits.base import ExitHead, attach_probe
from eectl.exits.probe import PROBE_FEATURES, attach_probe_tensors, probe_tensors
from eectl.files import atomic_write_group, existing_file
from eectl.models.adapters import Adapter
from eectl.parsing import parse_json

BLOCK_INITS = ("last", "next", "identity")
DEFAULT_LOW_RANK = 64


# ---------------------------------------------------------------------------------------------------------------
# Head designs
# ---------------------------------------------------------------------------------------------------------------


class ResidualLinear(nn.Module):
    """h + W h + b, W and b zero-initialised (starts as the logit lens)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden, hidden))  # [H, H]
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.linear(h, self.weight, self.bias)


class LowRank(nn.Module):
    """h + B (A h): A [r, H] small random, B [H, r] zero (LoRA-style, starts as the logit lens)."""

    def __init__(self, hidden: int, rank: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, hidden, generator=generator) / math.sqrt(hidden))  # A
        self.up = nn.Parameter(torch.zeros(hidden, rank))  # B

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.linear(F.linear(h, self.down), self.up)


class ResidualMLP(nn.Module):
    """h + W2 gelu(W1 h + b1) + b2 with W2, b2 zero-initialised (starts as the logit lens)."""

    def __init__(self, hidden: int, width: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, width)
        self.fc2 = nn.Linear(width, hidden)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.randn(width, hidden, generator=generator) / math.sqrt(hidden))
            self.fc1.bias.zero_()
            self.fc2.weight.zero_()
            self.fc2.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(F.gelu(self.fc1(h)))


class BlockHead(nn.Module):
    """A decoder block of the model's own layer shape on the exit's hidden states (EE-LLM's block heads, Kangaroo's
    adapter): attention + MLP over the sequence at that exit, then the frozen final norm + LM head.

    Unlike the per-token designs it reads a SEQUENCE: `forward(h)` takes [S, H] (or [B, S, H]) states of positions
    0..S-1 of one sequence. At run time its attention needs the keys and values of every earlier position at this
    exit: every token passes the exit's layer, so the block runs for every token (its cost is a decoder layer per
    token, paid whether or not the token exits here).
    """

    sequence = True

    def __init__(self, adapter: Adapter, init_layer: int, identity: bool) -> None:
        super().__init__()
        self.block = adapter.new_block(init_layer, identity)
        self.init_layer = init_layer
        self._adapter = [adapter]  # a list: not registered as a submodule, not in the state dict

    def step(
        self, h: torch.Tensor, positions: torch.Tensor, cache: Any = None, key_padding: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, S, H] new positions at `positions` [B, S] on top of the block's own past in `cache` (a KVCache, None
        for a whole sequence): what decoding runs per token."""
        return self._adapter[0].block_forward(self.block, h, positions, self.init_layer, cache, key_padding)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h if h.dim() == 3 else h[None]
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        out = self._adapter[0].block_forward(self.block, x, positions, self.init_layer)
        return out if h.dim() == 3 else out[0]


@dataclass(frozen=True)
class HeadDesign:
    """One exit-head design: how a fresh head is built and what it costs. A `sequence` design reads the exit's
    states of earlier positions (trained from a state cache only, exported as a block graph with its own K/V)."""

    name: str
    build: Callable[[int, int | None, torch.Generator | None], nn.Module] | None = None  # (hidden, width, generator)
    cost: Callable[[int, int], tuple[int, int]] | None = None  # (hidden, width) -> (params, multiply-adds per token)
    default_width: Callable[[int], int] | None = None  # hidden -> width; None: the design takes no --rank
    max_width: Callable[[int], int] | None = None  # hidden -> the largest width it takes (low-rank: its rank <= H)
    sequence: bool = False

    @property
    def takes_rank(self) -> bool:
        return self.default_width is not None


HEAD_DESIGNS: dict[str, HeadDesign] = {}


def register_design(design: HeadDesign) -> HeadDesign:
    """Add a head design: train-heads, the heads file and export pick it up by name."""
    HEAD_DESIGNS[design.name] = design
    return design


register_design(HeadDesign("residual-linear", lambda h, w, g: ResidualLinear(h), lambda h, w: (h * h + h, h * h)))
register_design(
    HeadDesign(
        "low-rank",
        lambda h, w, g: LowRank(h, int(w or DEFAULT_LOW_RANK), g),
        lambda h, w: (2 * w * h, 2 * w * h),
        default_width=lambda h: DEFAULT_LOW_RANK,
        max_width=lambda h: h,  # a rank above H factors nothing: H x H parameters at most
    )
)
register_design(
    HeadDesign(
        "mlp",
        lambda h, w, g: ResidualMLP(h, int(w or max(1, h // 2)), g),
        lambda h, w: (2 * w * h + w + h, 2 * w * h),
        default_width=lambda h: max(1, h // 2),
    )
)
# built from the model's own layer by the adapter (heads/cached.py), not from a width
register_design(HeadDesign("block", sequence=True))
DESIGNS = tuple(n for n, d in HEAD_DESIGNS.items() if not d.sequence)  # per token
SEQUENCE_DESIGNS = tuple(n for n, d in HEAD_DESIGNS.items() if d.sequence)


def check_design(design: str, rank: int | None) -> None:
    """A per-token design (the ones `make_head` builds) and a rank it accepts."""
    if design not in DESIGNS:
        raise UsageError(f"unknown head design '{design}'", hint=f"choose one of: {', '.join(DESIGNS)}")
    if rank is not None:
        if not HEAD_DESIGNS[design].takes_rank:
            ranked = [n for n in DESIGNS if HEAD_DESIGNS[n].takes_rank]
            raise UsageError(f"--rank applies to {' and '.join(ranked)} heads, not {design}")
        if rank < 1:
            raise UsageError(f"--rank must be >= 1, got {rank}")


def head_width(design: str, rank: int | None, hidden: int) -> int | None:
    """The rank (low-rank) or hidden width (mlp) a head gets: the given one or the design's default. A given rank
    above the design's bound for this model (low-rank: the hidden size) is a UsageError, before any head is built."""
    bound = HEAD_DESIGNS[design].max_width if design in HEAD_DESIGNS else None
    if rank is not None and bound is not None and rank > bound(hidden):
        raise UsageError(
            f"--rank {rank} is larger than the model's hidden size {hidden}: a {design} head's rank is at most "
            f"{bound(hidden)}",
            hint=f"choose a rank in 1..{bound(hidden)}",
        )
    default = HEAD_DESIGNS[design].default_width if design in HEAD_DESIGNS else None
    return None if default is None else rank or default(hidden)


def make_head(design: str, hidden: int, rank: int | None = None, generator: torch.Generator | None = None) -> nn.Module:
    """A fresh head of a design, at the identity. Random parts (low-rank A, mlp W1) come from `generator`."""
    check_design(design, rank)
    build = HEAD_DESIGNS[design].build
    assert build is not None  # every per-token design builds from a width
    return build(hidden, head_width(design, rank, hidden), generator)


def head_cost(design: str, rank: int | None, hidden: int) -> dict[str, int]:
    """Parameters per exit and multiply-adds per token of one head (the LM head costs H*V per token on top)."""
    cost = HEAD_DESIGNS[design].cost
    if cost is None:
        raise UsageError(f"the {design} design's cost is its decoder layer's, not a formula")
    params, macs = cost(hidden, head_width(design, rank, hidden) or 0)
    return {"params": params, "macs_per_token": macs}


class HeadStack(nn.Module):
    """The trainable part only: one head per exit, registered as `exit_{l}`.

    Its state dict keys are exactly the tensor names in heads.safetensors (`exit_{l}.<param>`); `forward` maps
    {l: h_l} to {l: head_l(h_l)} so that DistributedDataParallel can wrap the whole set in one module.
    """

    def __init__(self, heads: dict[int, nn.Module]) -> None:
        super().__init__()
        self.exits = sorted(heads)
        for layer in self.exits:
            self.add_module(f"exit_{layer}", heads[layer])

    def head(self, layer: int) -> nn.Module:
        return self.get_submodule(f"exit_{layer}")

    def forward(self, states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {layer: self.head(layer)(h) for layer, h in states.items()}


def build_heads(design: str, hidden: int, exits: list[int], rank: int | None, seed: int) -> HeadStack:
    generator = torch.Generator().manual_seed(seed)
    return HeadStack({layer: make_head(design, hidden, rank, generator) for layer in sorted(exits)})


# ---------------------------------------------------------------------------------------------------------------
# Saved heads
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class HeadSet:
    """Trained heads read back from disk: exit layer -> head module (eval, frozen, on the adapter's dtype/device)."""

    heads: dict[int, nn.Module]
    meta: HeadsMeta

    @property
    def exits(self) -> list[int]:
        return sorted(self.heads)

    def exit_head(self, adapter: Adapter, layer: int) -> ExitHead:
        """The exit after `layer` with its head: `.full(h)` and `.local(h, candidates)` as for the logit lens."""
        return ExitHead(adapter, self.heads[layer])


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors that hold NaN or infinity, sorted (a diverged training run's)."""
    return sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))


def check_trained(stack: HeadStack, steps: int) -> None:
    """Refuse heads whose training diverged (NaN or infinite weights) before anything is written or fitted on them:
    every exit decision on them would be NaN, and calibrate would refuse the file later."""
    bad = sorted({int(k.split(".")[0].removeprefix("exit_")) for k in nonfinite(stack.state_dict())})
    if bad:
        raise EectlError(
            f"head training diverged: the heads at exits {bad} have non-finite weights after {steps} steps",
            hint="lower --lr, or check the model's states at those layers (a state cache built by an older eectl may "
            "hold float16 overflows: delete it and build it again)",
        )


def save_heads(stack: HeadStack, meta: HeadsMeta, path: Path) -> Path:
    """Write `path` (.safetensors, tensors exit_{l}.<param>, float32) and its .json sidecar, atomically and together
    (files.atomic_write_group): a disk that fills at the sidecar publishes neither."""
    from safetensors.torch import save

    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in stack.state_dict().items()}
    tensors.update(probe_tensors({layer: stack.head(layer) for layer in meta.exits}))  # the learned signal's
    doc = meta.model_dump(mode="json")
    blob = save(tensors, metadata={"format": FORMAT, "eectl": json.dumps(doc, sort_keys=True)})
    side = sidecar_path(path)
    text = json.dumps(doc, indent=2) + "\n"
    # written by Python: a full disk is a one-line OutputError
    atomic_write_group(
        [(path, lambda tmp: tmp.write_bytes(blob)), (side, lambda tmp: tmp.write_text(text, encoding="utf-8"))]
    )
    return side


def load_heads(path: str | Path, adapter: Any, sha256: str | None = None) -> HeadSet:
    """Read heads.safetensors for the model behind `adapter` (an Adapter, or a LoadedModel).

    Checks the file's dimensions against the adapter (layers, hidden size, vocabulary) and the base model hash
    against `sha256` (pass `loaded.source.sha256`; a LoadedModel passed as `adapter` supplies it): heads only mean
    something on the checkpoint they were trained on. Raises ArtifactError (an EectlError) on any mismatch.
    """
    from safetensors import SafetensorError, safe_open

    from eectl.models.loading import LoadedModel

    if isinstance(adapter, LoadedModel):
        sha256 = sha256 or adapter.source.sha256
        adapter = adapter.adapter
    assert isinstance(adapter, Adapter)
    p = existing_file(path, "heads file", ArtifactError, hint="train heads with `eectl train-heads`")
    try:
        with safe_open(str(p), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"not a readable safetensors file: {p} ({exc})") from exc
    if header.get("format") != FORMAT or "eectl" not in header:
        raise ArtifactError(f"not an eectl heads file: {p}", hint="train heads with `eectl train-heads`")
    try:
        # strict, as a manifest is read ("8" is not 8); a key given twice refused (parse_json), not the last kept
        raw = parse_json(header["eectl"], f"heads in {p.name} have invalid metadata", ArtifactError)
        meta = HeadsMeta.model_validate_json(json.dumps(raw), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ArtifactError(f"heads in {p.name} have invalid metadata: {where}: {first['msg']}") from None
    dims = adapter.dims
    want = {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size}
    have = meta.dimensions.model_dump()
    wrong = [f"{k} {have.get(k)} (model: {v})" for k, v in want.items() if have.get(k) != v]
    base = meta.base_model
    if wrong:
        raise ArtifactError(
            f"heads in {p.name} do not fit this model: {', '.join(wrong)}",
            hint=f"they were trained on {base.get('name')} ({str(base.get('sha256'))[:12]})",
        )
    if sha256 is not None and base.get("sha256") != sha256:
        raise ArtifactError(
            f"heads in {p.name} were trained on another checkpoint: base model hash "
            f"{str(base.get('sha256'))[:12]}, this model {sha256[:12]}",
            hint=f"train heads for this model, or load {base.get('spec')}",
        )
    exits = list(meta.exits)
    try:
        check_exit_layers(exits, dims.num_layers, "exits")
        if meta.design in SEQUENCE_DESIGNS:
            inits = {int(k): int(v) for k, v in (meta.block_layers or {}).items()}
            if set(inits) != set(exits):
                raise ArtifactError(f"heads in {p.name}: block heads without their source layers in the metadata")
            stack = HeadStack({layer: BlockHead(adapter, inits[layer], identity=False) for layer in exits})
        else:
            stack = HeadStack({layer: make_head(meta.design, dims.hidden_size, meta.rank) for layer in exits})
    except UsageError as exc:  # the file's content, not the user's options, is wrong
        raise ArtifactError(f"heads in {p.name} have invalid metadata: {exc.message}") from None
    probes = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("probe.")]}
    bad = nonfinite(tensors)
    if bad:  # a diverged training run: every exit decision on them would be NaN
        raise ArtifactError(f"heads in {p.name} have non-finite weights: {', '.join(bad[:3])}", hint="retrain them")
    try:
        stack.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ArtifactError(f"heads in {p.name} do not match their own metadata: {str(exc).splitlines()[0]}") from exc
    stack.to(device=adapter.device, dtype=adapter.dtype).eval().requires_grad_(False)
    heads = {layer: stack.head(layer) for layer in exits}
    _attach_probes(p, meta, heads, probes, dims.hidden_size)
    return HeadSet(heads, meta)


def _attach_probes(
    p: Path, meta: HeadsMeta, heads: dict[int, nn.Module], probes: dict[str, torch.Tensor], hidden: int
) -> None:
    """The learned signal's probes stored beside the heads, attached after checking them and their metadata (which
    names only features a probe reads, and no probes that are not there): ArtifactError. Probes without metadata
    load (files of tests and early versions have them; the metadata only describes the fit)."""
    unknown = [f for f in (meta.probe.features if meta.probe else []) if f not in PROBE_FEATURES]
    if unknown:
        raise ArtifactError(
            f"heads in {p.name} have invalid metadata: unknown probe feature {unknown[0]!r} "
            f"(a probe reads {', '.join(PROBE_FEATURES)})"
        )
    try:
        if meta.probe is not None and not probes:
            raise ValueError("probe metadata but no probe tensors")
        attach_probe_tensors(heads, probes, hidden)
    except ValueError as exc:
        raise ArtifactError(f"heads in {p.name} have invalid probes: {exc}") from None


def merge_heads(paths: list[Path], loaded: Any, out: Path) -> HeadsMeta:
    """One heads file from several trained on the same model with the same design and shape at disjoint exits (e.g.
    later exits trained after the first ones), written to `out` with its sidecar.

    Each head is kept as trained; the metadata names the union of the exits and keeps each input's data, training
    and report under `merged_from` (their reports were measured per file). Probes are not carried over: a probe
    is fitted with the other exits' candidates in view, so fit them onto the merged file (`eectl train-heads
    --probe-only`). Heads of other models, designs, shapes or overlapping exits are refused (ArtifactError)."""
    if len(paths) < 2:
        raise UsageError("merging heads needs two heads files or more")
    sets = [load_heads(p, loaded) for p in paths]
    first = sets[0].meta
    same = ("design", "rank", "width", "head_cost", "dimensions", "block_init")
    heads: dict[int, nn.Module] = {}
    for path, hs in zip(paths, sets, strict=True):
        differ = [k for k in same if getattr(hs.meta, k) != getattr(first, k)]
        if hs.meta.base_model.get("sha256") != first.base_model.get("sha256"):
            differ.insert(0, "base model")
        if differ:
            raise ArtifactError(f"heads in {Path(path).name} differ from {Path(paths[0]).name} in {', '.join(differ)}")
        overlap = sorted(set(hs.exits) & set(heads))
        if overlap:
            raise ArtifactError(f"heads in {Path(path).name} repeat exits {overlap} of another file")
        for layer, head in hs.heads.items():
            attach_probe(head, None)
            heads[layer] = head
    exits = sorted(heads)
    blocks = {k: v for hs in sets for k, v in (hs.meta.block_layers or {}).items()}

    def merged(what: str) -> dict[str, Any]:
        return {
            "merged_from": [
                {"file": str(p), "exits": hs.exits, what: getattr(hs.meta, what)}
                for p, hs in zip(paths, sets, strict=True)
            ]
        }

    meta = first.model_copy(
        update={
            "exits": exits,
            "data": merged("data"),
            "training": merged("training"),
            "report": merged("report"),
            "steps": max(hs.meta.steps for hs in sets),
            "block_layers": blocks or None,
            "probe": None,
        }
    )
    save_heads(HeadStack(heads), meta, out)
    return meta
