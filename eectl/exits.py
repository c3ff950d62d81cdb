"""Exit heads and exit signals: the ONE definition of what an exit computes and how confident it is.

An exit after layer l maps that layer's hidden state to a prediction: an optional trained head (heads.py) into the
input space of the frozen final norm + LM head, then either

- the full vocabulary (`full`): all V logits, the K best become the token's local vocabulary (FlexEE), or
- the local vocabulary (`local`): only the K candidate rows of the LM head are scored (cheap: K << V).

`ExitHead` is a torch module; export turns exactly these methods into the exit graphs, and calibrate runs them in
torch, so a calibrated threshold means the same thing at run time. The signals (top-1 probability and top-1/top-2
margin of the softmax over the local vocabulary; the state-transition cosine) are computed here too.

What this module does not do: decide (thresholds live in calibrate/runtime), or train heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eectl.models.adapters import Adapter

# Signals an exit can be judged by. "topk-*" use the local vocabulary; "full-*" the full one (costly: a full
# LM-head projection at every exit); "cosine" is River-LLM's state transition of the last layer before the exit.
# signal -> its criteria: a token exits when every criterion's value is >= its threshold (calibrate writes these).
CRITERIA: dict[str, tuple[str, ...]] = {
    "topk-prob": ("prob",),
    "topk-margin": ("margin",),
    "topk-prob+margin": ("prob", "margin"),
    "full-prob": ("prob",),
    "full-margin": ("margin",),
    "cosine": ("cosine",),
}
SIGNALS = tuple(CRITERIA)
DEFAULT_TOP_K = 64


@dataclass
class ExitSignals:
    token: torch.Tensor  # [N] predicted token id (full vocabulary id)
    prob: torch.Tensor  # [N] top-1 probability over the scored vocabulary
    margin: torch.Tensor  # [N] top-1 minus top-2 probability


class ExitHead(nn.Module):
    """Optional trained head + the frozen final norm and LM head of the base model."""

    def __init__(self, adapter: Adapter, head: nn.Module | None = None) -> None:
        super().__init__()
        self.head = head
        self.norm = adapter.norm
        self.lm_head_weight: torch.Tensor = adapter.lm_head.weight  # [V, H], shared with the base model, frozen
        bias = getattr(adapter.lm_head, "bias", None)
        self.lm_head_bias = bias
        self.softcap = getattr(adapter.config, "final_logit_softcapping", None)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden if self.head is None else self.head(hidden)
        return self.norm(x)

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] logits."""
        logits = F.linear(self.normed(hidden), self.lm_head_weight, self.lm_head_bias)
        return self.cap(logits)

    def local(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[N, H], candidate ids [N, K] -> [N, K] logits of just those rows of the LM head."""
        rows = self.lm_head_weight[candidates]  # [N, K, H]
        logits = torch.einsum("nh,nkh->nk", self.normed(hidden), rows)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[candidates]
        return self.cap(logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.full(hidden)


# ---------------------------------------------------------------------------------------------------------------
# Candidate sources: how the first active exit picks the token's K-candidate local vocabulary
# ---------------------------------------------------------------------------------------------------------------
#
# The full LM head is V x H (49,152 x 576 on the default model: ~7 decoder layers of memory traffic per token), so
# projecting it once per token at the first exit costs more than most exits save. A candidate source picks the K
# candidates for less; the K candidate logits are always the exact rows of the LM head (what later exits score
# too), and a token that reaches the final layer still gets the exact full LM head (runtime/).
#
# - full:      the full LM head, Top-K (FlexEE; the exact reference).
# - shortlist: only S rows of the LM head, the S most frequent tokens of the calibration data and of the model's
#              own greedy generations (FR-Spec, VocabTrim); Top-K among them. A token whose final prediction is
#              outside the shortlist cannot exit (its exits predict a shortlist token, which disagrees).
# - int8:      the whole vocabulary ranked by an int8 copy of the LM head (symmetric per-row weights, the input
#              dynamically quantized to uint8 as ONNX DynamicQuantizeLinear does; ORT's MatMulInteger), then the K
#              best rows rescored in full precision.
#
# Each is one torch class here (calibrate runs it) and one exit graph in export.py (the runner runs it), built
# from the same tensors (`shortlist ids`, `quantize_rows_int8`).

CANDIDATE_SOURCES = ("full", "shortlist", "int8")
DEFAULT_CANDIDATES = "shortlist"
DEFAULT_SHORTLIST = 4096  # rows of the shortlist (clamped to the vocabulary)


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (int8 [V, H], scale float32 [V]): symmetric per row, q = round(w / s), s = max|w| / 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dynamic_quantize_uint8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ONNX DynamicQuantizeLinear applied to each row of x [N, H]: (uint8 values as float, scale [N], zero point [N]).

    scale = (max(0, max x) - min(0, min x)) / 255, zero point = saturate(round(-min / scale)),
    q = saturate(round(x / scale) + zero point); round half to even, as ORT does. The runner quantizes one token
    (one row) at a time, so per row here equals ORT's per tensor there.
    """
    x = x.float()
    lo = torch.clamp(x.amin(dim=1), max=0.0)
    hi = torch.clamp(x.amax(dim=1), min=0.0)
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.clamp(torch.round(-lo / scale), 0, 255)
    q = torch.clamp(torch.round(x / scale[:, None]) + zp[:, None], 0, 255)
    return q, scale, zp


def int8_scores(normed: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """[N, H] -> [N, V] approximate logits: (q(x) - zp) @ qweight.T * (x_scale * w_scale), the integer product exact.

    The integer dot products are summed in float32 over halves of H (each partial sum stays below 2^24, so it is
    exact whatever the summation order) and the halves added in float64: the same integers MatMulInteger computes.
    """
    q, xscale, zp = dynamic_quantize_uint8(normed)
    a = q - zp[:, None]  # [N, H] integers in [-255, 255]
    w = qweight.float()
    h = a.shape[1]
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64)
    step = max(1, (1 << 24) // (255 * 127))  # terms per exact float32 partial sum
    for lo in range(0, h, step):
        acc += (a[:, lo : lo + step] @ w[:, lo : lo + step].T).double()
    return acc.float() * (xscale[:, None] * wscale[None, :])


class CandidateSource:
    """Picks each token's K candidates at the first active exit: -> (ids [N, K], their exact logits [N, K])."""

    name = "full"

    def pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = head.full(hidden)  # [N, V]
        top = torch.topk(full, k, dim=-1)
        return top.indices, top.values

    def describe(self) -> dict[str, object]:
        return {"name": self.name}


class Shortlist(CandidateSource):
    """The S most frequent tokens (ids best first); Top-K among their exact logits."""

    name = "shortlist"

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.long()

    def pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = head.lm_head_weight[self.ids]  # [S, H]
        logits = F.linear(head.normed(hidden), rows, None if head.lm_head_bias is None else head.lm_head_bias[self.ids])
        top = torch.topk(head.cap(logits), min(k, self.ids.numel()), dim=-1)
        return self.ids[top.indices], top.values

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "size": int(self.ids.numel())}


class Int8Ranking(CandidateSource):
    """The whole vocabulary ranked by the int8 LM head; the K best rescored with the exact rows."""

    name = "int8"

    def __init__(self, lm_head_weight: torch.Tensor) -> None:
        self.qweight, self.scale = quantize_rows_int8(lm_head_weight)

    def pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        approx = int8_scores(head.normed(hidden), self.qweight, self.scale)
        cand = torch.topk(approx, k, dim=-1).indices
        return cand, head.local(hidden, cand)


def frequency_shortlist(token_ids: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids in `token_ids` (ties: the lower id first), topped up with the lowest unseen
    ids when fewer distinct ids occur. [size] long, most frequent first."""
    size = min(size, vocab_size)
    counts = torch.bincount(token_ids.flatten().long(), minlength=vocab_size)[:vocab_size]
    # a stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices
    return order[:size].clone()


def make_source(name: str, head_weight: torch.Tensor, shortlist: torch.Tensor | None = None) -> CandidateSource:
    if name == "full":
        return CandidateSource()
    if name == "shortlist":
        if shortlist is None:
            raise ValueError("the shortlist source needs its token ids")
        return Shortlist(shortlist)
    if name == "int8":
        return Int8Ranking(head_weight)
    raise ValueError(f"unknown candidate source '{name}' (choose from {', '.join(CANDIDATE_SOURCES)})")


def topk_candidates(full_logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, V] -> [N, K] ids of the K largest logits, best first (the token's local vocabulary)."""
    return torch.topk(full_logits, k, dim=-1).indices


def signals(logits: torch.Tensor, candidates: torch.Tensor | None = None) -> ExitSignals:
    """Top-1 token, probability and top-1/top-2 margin of a softmax over `logits` [N, K or V].

    With `candidates` [N, K], logits are local and the token is mapped back to its vocabulary id.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top2 = torch.topk(probs, 2, dim=-1)
    idx = top2.indices[:, 0]
    token = idx if candidates is None else candidates.gather(1, idx[:, None])[:, 0]
    return ExitSignals(token=token, prob=top2.values[:, 0], margin=top2.values[:, 0] - top2.values[:, 1])


def transition_cosine(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """River-LLM's state transition: cos(input, output) of a decoder layer, [..., H] -> [...]."""
    return F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)


@dataclass
class ThresholdChoice:
    threshold: float  # exit when confidence >= threshold (inf: never exit)
    coverage: float  # share of the given tokens with confidence >= threshold
    precision: float  # agreement with the final layer among those tokens (1.0 when none)


@dataclass
class Prefixes:
    """Tokens sorted by confidence, best first, with the running agreement of each prefix (a candidate exit set)."""

    conf: torch.Tensor  # [N] sorted descending (float64)
    hits: torch.Tensor  # [N] agreeing tokens in the prefix ending here
    counts: torch.Tensor  # [N] prefix sizes 1..N
    precision: torch.Tensor  # [N] hits / counts
    boundary: torch.Tensor  # [N] a prefix may end here: the next confidence is strictly lower (ties kept together)

    @staticmethod
    def of(confidence: torch.Tensor, correct: torch.Tensor) -> Prefixes:
        n = confidence.numel()
        conf, order = torch.sort(confidence.double(), descending=True)
        hits = torch.cumsum(correct[order].double(), 0)
        counts = torch.arange(1, n + 1, dtype=torch.float64)
        boundary = torch.ones(n, dtype=torch.bool)
        boundary[:-1] = conf[:-1] > conf[1:]
        return Prefixes(conf, hits, counts, hits / counts, boundary)

    def choice(self, i: int) -> ThresholdChoice:
        return ThresholdChoice(float(self.conf[i]), (i + 1) / self.conf.numel(), float(self.precision[i]))


NEVER = ThresholdChoice(float("inf"), 0.0, 1.0)


def threshold_for_precision(confidence: torch.Tensor, correct: torch.Tensor, target: float) -> ThresholdChoice:
    """FlexEE's lambda* = min{ lambda : P(correct | confidence >= lambda) >= target } on a sample.

    `confidence` [N] float, `correct` [N] bool (exit's top-1 == final top-1). Ties in confidence are kept together,
    so the threshold is a value that actually splits the sample. Returns threshold inf when no lambda qualifies.
    """
    if confidence.numel() == 0:
        return NEVER
    p = Prefixes.of(confidence, correct)
    ok = torch.nonzero((p.precision >= target) & p.boundary).flatten()
    return NEVER if ok.numel() == 0 else p.choice(int(ok[-1]))
