"""`eectl train-heads`: light exit heads trained against the frozen model's own final layer.

One head per exit: a small trainable map from the exit's hidden state [.., H] into the input space of the frozen
final norm + LM head, so `ExitHead(adapter, head)` (exits.py) scores it, full vocabulary or Top-K local vocabulary,
exactly as it scores the plain logit lens. Every design is residual and starts at the identity (its last map is
zero-initialised), so training starts from the logit lens:

    residual-linear   h + W h + b                 H*H + H parameters
    low-rank          h + B (A h)                 2*r*H        (r = --rank, default 64)
    mlp               h + W2 gelu(W1 h + b1) + b2 2*m*H + m + H (m = --rank, default H/2)

One training step, all exits in one pass (the base runs once per chunk of text, under no_grad):

    ids --embed--> layers 1..L (frozen) --final norm + LM head--> p_final  (teacher, [T, V])
                     | on_layer keeps h_l after each exit layer l
                     v
                   head_l (trainable) --final norm + LM head (frozen)--> q_l ;  loss = sum_l KL(p_final || q_l)
                                                                                  (+ w * next-token CE)

The base weights are frozen and never written: only head parameters are given to the optimiser. Data order is a
function of (seed, step) only, so a run resumed from a checkpoint reads the same tokens as an uninterrupted one
and, on the CPU, ends with bit-identical heads. Under `torchrun` / `accelerate launch` (WORLD_SIZE > 1) each rank
trains on its own shard of the chunks and the heads are wrapped in DistributedDataParallel.

Output: `<name>.safetensors` with tensors `exit_{l}.<param>` (the metadata header holds the same JSON as the
`<name>.json` written next to it), both written atomically. `load_heads` reads them back for calibrate and export.

What this module does not do: choose exit thresholds (calibrate), build ONNX graphs (export), load checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eectl.errors import ArtifactError, DataError, EectlError, UsageError
from eectl.exits import DEFAULT_TOP_K, ExitHead, signals, threshold_for_precision, topk_candidates
from eectl.models.adapters import Adapter

DESIGNS = ("residual-linear", "low-rank", "mlp")  # per token
SEQUENCE_DESIGNS = ("block",)  # need the exit's states of earlier positions (the state cache supplies them)
BLOCK_INITS = ("last", "next", "identity")
FORMAT = "eectl-heads"
FORMAT_VERSION = 1
CHECKPOINT_FORMAT = "eectl-heads-checkpoint"
DEFAULT_LOW_RANK = 64
DEFAULT_BATCH_TOKENS = 32
DEFAULT_EVAL_TOKENS = 4096
DEFAULT_CHUNK_LEN = 256
DEVICES = ("cpu", "cuda")


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


def check_design(design: str, rank: int | None) -> None:
    if design not in DESIGNS:
        raise UsageError(f"unknown head design '{design}'", hint=f"choose one of: {', '.join(DESIGNS)}")
    if rank is not None:
        if design == "residual-linear":
            raise UsageError("--rank applies to low-rank and mlp heads, not residual-linear")
        if rank < 1:
            raise UsageError(f"--rank must be >= 1, got {rank}")


def head_width(design: str, rank: int | None, hidden: int) -> int | None:
    """The rank (low-rank) or hidden width (mlp) a head gets: the given one or the design's default."""
    if design == "low-rank":
        return rank or DEFAULT_LOW_RANK
    if design == "mlp":
        return rank or max(1, hidden // 2)
    return None


def make_head(design: str, hidden: int, rank: int | None = None, generator: torch.Generator | None = None) -> nn.Module:
    """A fresh head of a design, at the identity. Random parts (low-rank A, mlp W1) come from `generator`."""
    check_design(design, rank)
    width = head_width(design, rank, hidden)
    if design == "residual-linear":
        return ResidualLinear(hidden)
    assert width is not None
    if design == "low-rank":
        return LowRank(hidden, width, generator)
    return ResidualMLP(hidden, width, generator)


def head_cost(design: str, rank: int | None, hidden: int) -> dict[str, int]:
    """Parameters per exit and multiply-adds per token of one head (the LM head costs H*V per token on top)."""
    width = head_width(design, rank, hidden) or 0
    if design == "residual-linear":
        params = hidden * hidden + hidden
        macs = hidden * hidden
    elif design == "low-rank":
        params = macs = 2 * width * hidden
    else:
        params = 2 * width * hidden + width + hidden
        macs = 2 * width * hidden
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
# Losses: the exact KL over the full vocabulary, or the teacher's top-k plus a tail bucket (not bound by the LM head)
# ---------------------------------------------------------------------------------------------------------------

LOSSES = ("exact", "topk")
DEFAULT_TEACHER_K = 32
DEFAULT_TAIL_SAMPLES = 1024


@dataclass
class TeacherTopK:
    """The final layer's distribution kept as its k most likely tokens; the rest is one tail bucket."""

    ids: torch.Tensor  # [T, k] long, most likely first
    logp: torch.Tensor  # [T, k] float32 log-probabilities (the tail's mass is 1 - sum(exp(logp)))

    @staticmethod
    def of(final_logits: torch.Tensor, k: int) -> TeacherTopK:
        logp = F.log_softmax(final_logits.float(), dim=-1)
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
        return TeacherTopK(top.indices, top.values)

    def slice(self, a: int, b: int) -> TeacherTopK:
        return TeacherTopK(self.ids[a:b], self.logp[a:b])

    @staticmethod
    def cat(parts: list[TeacherTopK]) -> TeacherTopK:
        return TeacherTopK(torch.cat([p.ids for p in parts]), torch.cat([p.logp for p in parts]))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_tail_kl(
    lens: ExitHead,
    mapped: torch.Tensor,
    teacher: TeacherTopK,
    tail_samples: int | None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL over buckets {teacher's top-k tokens one by one, everything else}, for E exits at once.

    `mapped` [E, B, H] is each exit's head output (before the final norm). The student's probabilities need its
    normaliser Z = sum over V of exp(z): with `tail_samples` None it is exact (every LM-head row, as costly as the
    exact KL's forward); otherwise Z = sum over S (the union of the batch's teacher top-k ids) + an unbiased
    estimate of the rest from `tail_samples` rows drawn uniformly outside S, so only |S| + tail_samples rows of
    the LM head are read (about 1.5K of 49K for SmolLM2 at k = 32, B = 32). Returns (soft cross-entropy, KL)
    per exit [E], means over the B tokens; KL = soft CE - the teacher's bucket entropy.
    """
    E, B, _ = mapped.shape
    V = lens.lm_head_weight.shape[0]
    normed = lens.norm(mapped)  # [E, B, H]
    support = torch.unique(teacher.ids)  # [M] sorted
    if tail_samples is None:
        rows = torch.arange(V, device=mapped.device)
        pos = teacher.ids  # row index = token id
        extra = None
    else:
        perm = torch.randperm(V, generator=generator).to(mapped.device)
        outside = perm[~torch.isin(perm, support)][:tail_samples]
        rows = torch.cat([support, outside])
        pos = torch.searchsorted(support, teacher.ids)  # [B, k] index into rows
        extra = math.log(max(1, V - support.numel()) / max(1, outside.numel()))
    z = F.linear(normed, lens.lm_head_weight[rows], None if lens.lm_head_bias is None else lens.lm_head_bias[rows])
    z = lens._cap(z).float()  # [E, B, R]
    if extra is None:
        log_z = torch.logsumexp(z, dim=-1)
    else:
        m = support.numel()
        log_z = torch.logaddexp(torch.logsumexp(z[..., :m], -1), torch.logsumexp(z[..., m:], -1) + extra)
    z_top = z.gather(-1, pos[None].expand(E, -1, -1))  # [E, B, k]
    logq_top = z_top - log_z[..., None]
    logq_tail = _log1mexp(torch.logsumexp(logq_top, -1))  # [E, B]
    p_top = teacher.logp.exp()  # [B, k]
    p_tail = (1 - p_top.sum(-1)).clamp_min(0)  # [B]
    soft_ce = -((p_top * logq_top).sum(-1) + p_tail * logq_tail)  # [E, B]
    entropy = -((p_top * teacher.logp).sum(-1) + torch.xlogy(p_tail, p_tail))  # [B]
    return soft_ce.mean(-1), (soft_ce - entropy).mean(-1).detach()


# ---------------------------------------------------------------------------------------------------------------
# Saved heads
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class HeadSet:
    """Trained heads read back from disk: exit layer -> head module (eval, frozen, on the adapter's dtype/device)."""

    heads: dict[int, nn.Module]
    meta: dict[str, Any]

    @property
    def exits(self) -> list[int]:
        return sorted(self.heads)

    def exit_head(self, adapter: Adapter, layer: int) -> ExitHead:
        """The exit after `layer` with its head: `.full(h)` and `.local(h, candidates)` as for the logit lens."""
        return ExitHead(adapter, self.heads[layer])


def sidecar_path(path: Path) -> Path:
    """heads.safetensors -> heads.json (the human-readable copy of the metadata)."""
    return path.with_suffix(".json")


def save_heads(stack: HeadStack, meta: dict[str, Any], path: Path) -> Path:
    """Write `path` (.safetensors, tensors exit_{l}.<param>, float32) and its .json sidecar, each atomically."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in stack.state_dict().items()}
    header = {"format": FORMAT, "eectl": json.dumps(meta, sort_keys=True)}
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    side = sidecar_path(path)
    _atomic_write(side, lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8"))
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
    p = Path(path)
    if not p.is_file():
        raise ArtifactError(f"heads file not found: {p}", hint="train heads with `eectl train-heads`")
    try:
        with safe_open(str(p), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"not a readable safetensors file: {p} ({exc})") from exc
    if header.get("format") != FORMAT or "eectl" not in header:
        raise ArtifactError(f"not an eectl heads file: {p}", hint="train heads with `eectl train-heads`")
    meta: dict[str, Any] = json.loads(header["eectl"])
    dims = adapter.dims
    want = {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size}
    have = meta.get("dimensions", {})
    wrong = [f"{k} {have.get(k)} (model: {v})" for k, v in want.items() if have.get(k) != v]
    base = meta.get("base_model", {})
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
    exits = [int(e) for e in meta["exits"]]
    if meta["design"] in SEQUENCE_DESIGNS:
        inits = {int(k): int(v) for k, v in meta["block_layers"].items()}
        stack = HeadStack({layer: BlockHead(adapter, inits[layer], identity=False) for layer in exits})
    else:
        stack = HeadStack({layer: make_head(meta["design"], dims.hidden_size, meta.get("rank")) for layer in exits})
    try:
        stack.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ArtifactError(f"heads in {p.name} do not match their own metadata: {str(exc).splitlines()[0]}") from exc
    stack.to(device=adapter.device, dtype=adapter.dtype).eval().requires_grad_(False)
    return HeadSet({layer: stack.head(layer) for layer in exits}, meta)


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    exits: list[int]
    design: str = "residual-linear"
    rank: int | None = None  # low-rank rank / mlp width; None: the design's default
    steps: int = 500
    lr: float = 1e-3
    batch_tokens: int = DEFAULT_BATCH_TOKENS  # tokens per optimiser step (per rank)
    seed: int = 0
    ce_weight: float = 0.0  # weight of next-token cross-entropy added to the KL
    eval_tokens: int = DEFAULT_EVAL_TOKENS  # held-out tokens for the before/after report
    chunk_len: int = DEFAULT_CHUNK_LEN  # context length the base runs on
    save_every: int = 100  # checkpoint every this many steps (and at the end)
    device: str = "cpu"
    top_k: int = DEFAULT_TOP_K  # local vocabulary of the top-k signal in the report
    target: float = 0.99  # precision at which the report's coverage is measured

    def check(self, num_layers: int | None = None) -> None:
        """Raise UsageError on values no run could use (exits checked when the model's depth is known)."""
        check_design(self.design, self.rank)
        if not self.exits:
            raise UsageError("no exits given", hint="pass --exits 8,12,16 (layers 1..L-1)")
        if len(set(self.exits)) != len(self.exits):
            raise UsageError(f"--exits has repeated layers: {self.exits}")
        if num_layers is not None:
            bad = [e for e in self.exits if not 1 <= e <= num_layers - 1]
            if bad:
                raise UsageError(
                    f"exits {bad} outside 1..{num_layers - 1}",
                    hint=f"the model has {num_layers} layers; an exit after layer l reads the state after l layers",
                )
        for name in ("steps", "batch_tokens", "eval_tokens", "save_every", "top_k"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.chunk_len < 2:
            raise UsageError(f"chunk length must be >= 2, got {self.chunk_len}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not self.ce_weight >= 0 or not math.isfinite(self.ce_weight):
            raise UsageError(f"--ce-weight must be >= 0, got {self.ce_weight}")
        if not 0 < self.target <= 1:
            raise UsageError(f"target precision must be in (0, 1], got {self.target}")
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got '{self.device}'")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it."""
        d = asdict(self)
        for k in ("save_every", "eval_tokens", "top_k", "target", "device"):
            d.pop(k)
        return d


@dataclass
class ExitMetrics:
    layer: int
    tokens: int
    agreement: float  # top-1 == final top-1
    kl: float  # KL(final || exit), nats, mean over tokens
    coverage_full: float  # share of tokens exiting at `target` precision, full-vocabulary top-1 probability
    threshold_full: float
    coverage_topk: float  # same with the top-k local-vocabulary probability (candidates from the first exit)
    threshold_topk: float


@dataclass
class EvalResult:
    tokens: int
    exits: list[ExitMetrics]
    oracle_mean_layers: float  # exit at the first exit whose top-1 equals the final one
    sequential_mean_layers: float  # exit at the first exit whose full-vocab prob passes its threshold (in-sample)
    sequential_agreement: float  # agreement of the tokens produced that way with the final layer


@dataclass
class TrainResult:
    meta: dict[str, Any]  # everything in heads.json
    out: Path
    sidecar: Path
    checkpoint: Path
    main: bool = True  # False on the non-zero ranks of a distributed run (they write and print nothing)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "json": str(self.sidecar), "checkpoint": str(self.checkpoint), **self.meta}


# ---------------------------------------------------------------------------------------------------------------
# Data: held-out split, and a resumable token stream over the training chunks
# ---------------------------------------------------------------------------------------------------------------


def split_records(tokenizer: Any, data: Any, eval_tokens: int) -> tuple[Any, Any]:
    """(train, held-out): the last records of `data`, enough for `eval_tokens` tokens, are held out."""
    from eectl.data import TextData

    assert isinstance(data, TextData)
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0
    n = 0
    k = len(data.texts)
    while k > 0 and n < eval_tokens:
        k -= 1
        n += len(tokenizer(data.texts[k], add_special_tokens=False)["input_ids"]) + eos
    if n < eval_tokens or k == 0:
        raise DataError(
            f"{data.name} is too small: {len(data.texts)} records cannot give {eval_tokens} held-out tokens "
            "and still leave training records",
            hint="pass more data or lower --eval-tokens",
        )
    train = TextData(data.name, data.description, data.texts[:k], data.prompts[:k])
    held = TextData(data.name, data.description, data.texts[k:], data.prompts[k:])
    return train, held


def count_tokens(tokenizer: Any, data: Any, up_to: int) -> int:
    """Tokens in the data's stream (records + EOS), counting stops once `up_to` is reached."""
    eos = 1 if getattr(tokenizer, "eos_token_id", None) is not None else 0
    n = 0
    for text in data.texts:
        n += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos
        if n >= up_to:
            break
    return min(n, up_to)


class TokenStream:
    """The training tokens of one rank in a seeded order: step s reads tokens [s*B, (s+1)*B) of an endless
    sequence of epochs, each epoch a seeded permutation of the rank's chunks. Stateless in the step, so a resumed
    run reads exactly what an uninterrupted one would. Positions before `skip_first` (BOS) are never used.
    """

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int) -> None:
        self.lengths = lengths  # measured positions per chunk
        self.per_epoch = sum(lengths)
        self.batch_tokens = batch_tokens
        self.seed = seed
        self._orders: dict[int, tuple[list[int], list[int]]] = {}

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.lengths), generator=g).tolist()
            starts, pos = [], 0
            for c in order:
                starts.append(pos)
                pos += self.lengths[c]
            self._orders = {epoch: (order, starts)}  # keep one epoch: steps only move forward
        return self._orders[epoch]

    def batch(self, step: int) -> list[tuple[int, int, int]]:
        """(chunk, start, end) pieces of measured positions that make up step `step`'s batch."""
        import bisect

        g, end = step * self.batch_tokens, (step + 1) * self.batch_tokens
        pieces: list[tuple[int, int, int]] = []
        while g < end:
            epoch, offset = divmod(g, self.per_epoch)
            order, starts = self._epoch(epoch)
            i = bisect.bisect_right(starts, offset) - 1
            chunk = order[i]
            a = offset - starts[i]
            b = min(self.lengths[chunk], a + (end - g))
            pieces.append((chunk, a, b))
            g += b - a
        return pieces

    def epochs(self, steps: int) -> float:
        return steps * self.batch_tokens / self.per_epoch


@dataclass
class _ChunkPass:
    states: dict[int, torch.Tensor]  # exit layer -> [T, H] hidden states after that layer
    probs: torch.Tensor  # [T, V] final-layer distribution (teacher), float32
    entropy: torch.Tensor  # [T] its entropy, nats
    next_ids: torch.Tensor  # [T] next token id, -100 where the chunk ends
    # sequence designs (block) read every position of the sequence: states of all S positions, and which of
    # them are the T measured ones (None: `states` is all there is)
    context: dict[int, torch.Tensor] | None = None  # exit layer -> [S, H]
    measured: torch.Tensor | None = None  # [T] indices into S


@torch.no_grad()
def _base_pass(adapter: Adapter, ids: torch.Tensor, exits: list[int], skip_first: int) -> _ChunkPass:
    """The frozen base on one chunk [1, S]: exit states and the teacher distribution at the measured positions."""
    wanted = set(exits)
    states: dict[int, torch.Tensor] = {}

    def on_layer(i: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        if i + 1 in wanted:  # layer index i produces the state after i + 1 layers
            states[i + 1] = h_out[0, skip_first:]

    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    final = adapter.forward_layers(adapter.embed(ids), positions, 0, adapter.num_layers, None, on_layer=on_layer)
    logp = F.log_softmax(adapter.logits(final[0, skip_first:]).float(), dim=-1)  # [T, V]
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    next_ids = torch.full((logp.shape[0],), -100, dtype=torch.long, device=ids.device)
    next_ids[:-1] = ids[0, skip_first + 1 :]
    return _ChunkPass(states, probs, entropy, next_ids)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation: before (logit lens) and after (heads), on held-out chunks
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    adapter: Adapter,
    variants: dict[str, dict[int, nn.Module | None]],
    chunks: list[torch.Tensor],
    skip_first: int,
    top_k: int = DEFAULT_TOP_K,
    target: float = 0.99,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    passes: Iterable[_ChunkPass] | None = None,
) -> dict[str, EvalResult]:
    """Per exit and per variant (a name -> {exit layer: head or None for the logit lens}): agreement with the final
    layer, KL, and the coverage at `target` precision that FlexEE's lambda* gives on these tokens, for the
    full-vocabulary top-1 probability and for the top-k local vocabulary (candidates: top-k of the first exit's full
    logits, as the runner picks them). The base runs once per chunk for all variants.
    """
    L = adapter.num_layers
    exits = sorted(next(iter(variants.values())))
    device = adapter.device
    acc: dict[str, dict[str, list[torch.Tensor]]] = {
        v: {k: [] for k in ("agree", "kl", "conf", "conf_topk", "correct_topk")} for v in variants
    }
    exit_heads = {name: {layer: ExitHead(adapter, h) for layer, h in heads.items()} for name, heads in variants.items()}
    lens = ExitHead(adapter)

    def base_passes() -> Iterator[_ChunkPass]:
        for ids in chunks:
            with autocast():
                yield _base_pass(adapter, ids.to(device), exits, skip_first)

    n = 0
    for run in passes if passes is not None else base_passes():
        top_final = run.probs.argmax(-1)
        logp_final = run.probs.clamp_min(1e-38).log()
        n += top_final.shape[0]
        for name, heads in exit_heads.items():
            agree, kl, conf, conf_k, corr_k = [], [], [], [], []
            candidates: torch.Tensor | None = None
            for layer in exits:
                head = heads[layer]
                h = run.states[layer]
                raw = variants[name][layer]
                if getattr(raw, "sequence", False):  # a block reads the whole sequence at its exit
                    assert raw is not None and run.context is not None and run.measured is not None
                    with autocast():
                        h = raw(run.context[layer].float())[run.measured]
                    head = lens
                with autocast():
                    logits = head.full(h).float()
                    if candidates is None:
                        candidates = topk_candidates(logits, min(top_k, logits.shape[-1]))
                    local = head.local(h, candidates).float()
                logq = F.log_softmax(logits, dim=-1)
                agree.append(logq.argmax(-1) == top_final)
                kl.append((run.probs * (logp_final - logq)).sum(-1).double())
                conf.append(logq.max(-1).values.exp())
                sig = signals(local, candidates)
                conf_k.append(sig.prob)
                corr_k.append(sig.token == top_final)
            for key, vals in (
                ("agree", agree),
                ("kl", kl),
                ("conf", conf),
                ("conf_topk", conf_k),
                ("correct_topk", corr_k),
            ):
                acc[name][key].append(torch.stack(vals).cpu())  # [E, T]
    if n == 0:
        raise DataError("no held-out tokens to evaluate on")
    results: dict[str, EvalResult] = {}
    for name in variants:
        a = {k: torch.cat(v, dim=1) for k, v in acc[name].items()}  # [E, N]
        metrics = []
        thresholds = []
        for e, layer in enumerate(exits):
            full = threshold_for_precision(a["conf"][e], a["agree"][e], target)
            topk = threshold_for_precision(a["conf_topk"][e], a["correct_topk"][e], target)
            thresholds.append(full.threshold)
            metrics.append(
                ExitMetrics(
                    layer=layer,
                    tokens=n,
                    agreement=float(a["agree"][e].double().mean()),
                    kl=float(a["kl"][e].mean()),
                    coverage_full=full.coverage,
                    threshold_full=full.threshold,
                    coverage_topk=topk.coverage,
                    threshold_topk=topk.threshold,
                )
            )
        layers = torch.tensor(exits + [L], dtype=torch.float64)
        ones = torch.ones(1, n, dtype=torch.bool)
        oracle = torch.cat([a["agree"], ones]).double().argmax(0)  # first True: the first exit that agrees
        passes = torch.cat([a["conf"] >= torch.tensor(thresholds)[:, None], ones]).double().argmax(0)
        taken_agree = torch.cat([a["agree"], ones]).gather(0, passes[None])[0]
        results[name] = EvalResult(
            tokens=n,
            exits=metrics,
            oracle_mean_layers=float(layers[oracle].mean()),
            sequential_mean_layers=float(layers[passes].mean()),
            sequential_agreement=float(taken_agree.double().mean()),
        )
    return results


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def _dist_from_env() -> _Dist:
    """torchrun and `accelerate launch` set WORLD_SIZE / RANK / LOCAL_RANK; a plain run has world size 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    return _Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))


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


def _amp_dtype(device: torch.device) -> torch.dtype | None:
    """Mixed precision on a GPU (bf16 where supported, else fp16 with loss scaling); fp32 on the CPU."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _lr_at(step: int, config: TrainConfig) -> float:
    return lr_at(step, config.steps, config.lr)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of --lr (a function of the step only)."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoint_path(out: Path) -> Path:
    """heads.safetensors -> heads.ckpt (optimiser state, step, RNG: what --resume needs)."""
    return out.with_suffix(".ckpt")


def _save_checkpoint(path: Path, identity: dict[str, Any], stack: HeadStack, optimizer: Any, **rest: Any) -> None:
    state = {
        "format": CHECKPOINT_FORMAT,
        "version": FORMAT_VERSION,
        "identity": json.dumps(identity, sort_keys=True),
        "heads": {k: v.detach().cpu() for k, v in stack.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        **rest,
    }
    _atomic_write(path, lambda tmp: torch.save(state, tmp))


def _load_checkpoint(path: Path, identity: dict[str, Any]) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle / zip / runtime errors for files it cannot read
        raise UsageError(f"not a readable checkpoint: {path} ({str(exc).splitlines()[0]})") from exc
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"not an eectl train-heads checkpoint: {path}")
    saved = json.loads(state["identity"])
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in identity.items() if saved.get(k) != v]
    if diff:
        raise UsageError(
            f"checkpoint {path.name} is from a different run: {'; '.join(diff)}",
            hint="resume with the same model, data and options, or start afresh without --resume",
        )
    return state


def train_heads(
    loaded: Any,
    data: Any,
    config: TrainConfig,
    out: Path,
    resume: Path | None = None,
    on_step: Callable[[int, dict[int, float]], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """The stage as a library call: a LoadedModel, TextData and a TrainConfig in; heads on disk and a report out.

    Moves the model to `config.device`. Writes `out` (.safetensors) and its .json sidecar, and a checkpoint
    (`out` with suffix .ckpt) every `config.save_every` steps and at the end. `on_step(step, kl_per_exit)` is
    called after each optimiser step (1-based), on the main rank only.
    """
    from eectl.data import TextData, token_chunks
    from eectl.models.loading import LoadedModel

    assert isinstance(loaded, LoadedModel) and isinstance(data, TextData)
    say = log or (lambda _msg: None)
    adapter = loaded.adapter
    L = adapter.num_layers
    config.check(L)
    if out.suffix != ".safetensors":
        raise UsageError(f"--out must name a .safetensors file, got {out}")
    dist = _dist_from_env()
    device = resolve_device(config.device, dist.local_rank)
    amp = _amp_dtype(device)
    exits = sorted(config.exits)
    ckpt = checkpoint_path(out)
    start = time.perf_counter()

    # The base: frozen, eval, never handed to the optimiser.
    model = loaded.model
    model.eval().requires_grad_(False).to(device)

    # Data: held-out records at the end; training chunks from the start, sharded over ranks.
    tok = loaded.tokenizer
    skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
    train_data, held_data = split_records(tok, data, config.eval_tokens)
    body = config.chunk_len - skip_first  # measured tokens per chunk
    need = math.ceil(config.steps * config.batch_tokens / body) * body * dist.world  # whole chunks on every rank
    n_train = count_tokens(tok, train_data, need)
    all_chunks = token_chunks(tok, train_data, n_train, config.chunk_len) if n_train > 0 else []
    if len(all_chunks) < dist.world:
        raise DataError(f"{data.name} leaves too few training tokens ({n_train}) after the held-out part")
    all_chunks = all_chunks[: len(all_chunks) - len(all_chunks) % dist.world]  # the same number on every rank
    n_train = sum(c.shape[1] - skip_first for c in all_chunks)
    chunks = all_chunks[dist.rank :: dist.world]
    stream = TokenStream([c.shape[1] - skip_first for c in chunks], config.batch_tokens, config.seed)
    identity = {
        **config.identity(),
        "exits": exits,
        "base_sha256": loaded.source.sha256,
        "data": data.name,
        "train_tokens": n_train,
        "world_size": dist.world,
    }

    # Heads, optimiser, and (multi-process) DDP.
    torch.manual_seed(config.seed)
    stack = build_heads(config.design, adapter.dims.hidden_size, exits, config.rank, config.seed).to(device)
    trainer: nn.Module = stack
    if dist.world > 1:
        import torch.distributed as tdist
        from torch.nn.parallel import DistributedDataParallel

        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        trainer = DistributedDataParallel(stack, device_ids=[device.index] if device.type == "cuda" else None)
    if any(p.requires_grad for p in model.parameters()):
        raise EectlError("internal: a base model parameter requires grad")
    optimizer = torch.optim.AdamW(stack.parameters(), lr=config.lr, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
    step = 0
    history: list[list[float]] = []  # per step, KL per exit
    if resume is not None:
        state = _load_checkpoint(resume, identity)
        stack.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        history = [list(h) for h in state["history"]]
        _set_rng_state(state["rng"], device)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        say(f"resumed from {resume} at step {step}/{config.steps}")

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if amp is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp)

    lens = ExitHead(adapter)  # frozen final norm + LM head; ExitHead(adapter, head).full(h) == lens.full(head(h))
    cache: OrderedDict[int, _ChunkPass] = OrderedDict()

    def chunk_pass(c: int) -> _ChunkPass:
        if c not in cache:
            with autocast():
                cache[c] = _base_pass(adapter, chunks[c].to(device), exits, skip_first)
            while len(cache) > 2:
                cache.popitem(last=False)
        return cache[c]

    stack.train()
    while step < config.steps:
        pieces = [(chunk_pass(c), a, b) for c, a, b in stream.batch(step)]
        states = {layer: torch.cat([p.states[layer][a:b] for p, a, b in pieces]) for layer in exits}
        probs = torch.cat([p.probs[a:b] for p, a, b in pieces])
        entropy = torch.cat([p.entropy[a:b] for p, a, b in pieces]).mean()
        next_ids = torch.cat([p.next_ids[a:b] for p, a, b in pieces])
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        with autocast():
            mapped = trainer({layer: s.float() for layer, s in states.items()})
            # All exits through the LM head in one matmul: on a CPU, reading the [V, H] weight dominates small batches.
            logits = lens.full(torch.cat([mapped[layer] for layer in exits])).float()
            logits = logits.view(len(exits), -1, logits.shape[-1])  # [E, B, V]
            losses, kls = [], []
            for e in range(len(exits)):
                soft_ce = F.cross_entropy(logits[e], probs)  # -sum p log q; KL(p || q) = this - H(p)
                loss = soft_ce
                if config.ce_weight > 0 and bool((next_ids >= 0).any()):
                    loss = loss + config.ce_weight * F.cross_entropy(logits[e], next_ids, ignore_index=-100)
                losses.append(loss)
                kls.append(soft_ce.detach() - entropy)
            total = torch.stack(losses).sum()
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(total).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            total.backward()
            optimizer.step()
        step += 1
        kl_now = [float(k) for k in kls]
        history.append(kl_now)
        if dist.main and (step % config.save_every == 0 or step == config.steps):
            _save_checkpoint(
                ckpt,
                identity,
                stack,
                optimizer,
                step=step,
                history=history,
                rng=_rng_state(device),
                scaler=scaler.state_dict() if scaler is not None else None,
            )
        if dist.main and on_step is not None:
            on_step(step, dict(zip(exits, kl_now, strict=True)))
    stack.eval()
    train_s = time.perf_counter() - start

    if any(p.requires_grad for p in model.parameters()):
        raise EectlError("internal: a base model parameter was unfrozen during training")

    result = TrainResult({}, out, sidecar_path(out), ckpt, main=dist.main)
    if dist.world > 1:
        import torch.distributed as tdist

        if not dist.main:
            tdist.barrier()  # wait for the main rank's evaluation and files
            tdist.destroy_process_group()
            result.wall_s = time.perf_counter() - start
            return result
    # Report on held-out data, before (logit lens) and after (heads), in one pass of the base.
    held_chunks = token_chunks(tok, held_data, config.eval_tokens, config.chunk_len)
    say(f"evaluating on {config.eval_tokens} held-out tokens ({len(held_data.texts)} records at the end of the data)")
    report = evaluate(
        adapter,
        {"before": dict.fromkeys(exits), "after": {layer: stack.head(layer) for layer in exits}},
        held_chunks,
        skip_first,
        config.top_k,
        config.target,
        autocast,
    )
    tail = history[-max(1, min(50, len(history))) :]
    dims = adapter.dims
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "exits": exits,
        "design": config.design,
        "rank": config.rank,
        "width": head_width(config.design, config.rank, dims.hidden_size),
        "head_cost": head_cost(config.design, config.rank, dims.hidden_size),
        "dimensions": {"num_layers": L, "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size},
        "base_model": {**loaded.source.to_dict(), "family": adapter.family},
        "data": {
            **data.to_dict(),
            "train_records_available": len(train_data.texts),
            "train_tokens": n_train,
            "epochs": round(stream.epochs(config.steps), 4),
            "held_out_records": len(held_data.texts),
            "held_out_tokens": config.eval_tokens,
            "chunk_len": config.chunk_len,
            "held_out": "the last records of the data; training reads the records before them",
        },
        "training": {
            "steps": config.steps,
            "lr": config.lr,
            "schedule": "linear warm-up 5%, cosine to 10%",
            "batch_tokens": config.batch_tokens,
            "ce_weight": config.ce_weight,
            "seed": config.seed,
            "device": device.type,
            "precision": "fp32" if amp is None else f"autocast {str(amp).removeprefix('torch.')}",
            "world_size": dist.world,
            "threads": torch.get_num_threads(),
            "train_s": round(train_s, 2),
            "final_kl": {str(layer): sum(h[e] for h in tail) / len(tail) for e, layer in enumerate(exits)},
        },
        "steps": config.steps,
        "seed": config.seed,
        "report": {
            "tokens": report["after"].tokens,
            "target_precision": config.target,
            "top_k": config.top_k,
            "signals": (
                "coverage_full: exit's full-vocabulary top-1 probability; coverage_topk: its probability over the "
                "top-k local vocabulary picked at the first exit; coverage = share of held-out tokens at or above "
                "the lowest threshold whose exits agree with the final layer at the target precision"
            ),
            "before": asdict(report["before"]),
            "after": asdict(report["after"]),
        },
    }
    result.wall_s = time.perf_counter() - start
    meta["training"]["wall_s"] = round(result.wall_s, 2)  # training + held-out evaluation
    save_heads(stack, meta, out)
    result.meta = meta
    if dist.world > 1:
        import torch.distributed as tdist

        tdist.barrier()
        tdist.destroy_process_group()
    return result


def iter_report(meta: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(before, after) metrics per exit from a heads.json report."""
    report = meta["report"]
    yield from zip(report["before"]["exits"], report["after"]["exits"], strict=True)
