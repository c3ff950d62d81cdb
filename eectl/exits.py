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
# LM-head projection at every exit); "cosine" is River-LLM's state transition of the last layer before the exit,
# "cosine-min" River's test over a whole segment: the minimum of that cosine over every block since the previous exit.
# signal -> its criteria: a token exits when every criterion's value is >= its threshold (calibrate writes these).
CRITERIA: dict[str, tuple[str, ...]] = {
    "topk-prob": ("prob",),
    "topk-margin": ("margin",),
    "topk-prob+margin": ("prob", "margin"),
    "full-prob": ("prob",),
    "full-margin": ("margin",),
    "cosine": ("cosine",),
    "cosine-min": ("cosine",),
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

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] logits."""
        logits = F.linear(self.normed(hidden), self.lm_head_weight, self.lm_head_bias)
        return self._cap(logits)

    def local(self, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[N, H], candidate ids [N, K] -> [N, K] logits of just those rows of the LM head."""
        rows = self.lm_head_weight[candidates]  # [N, K, H]
        logits = torch.einsum("nh,nkh->nk", self.normed(hidden), rows)
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias[candidates]
        return self._cap(logits)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.full(hidden)


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


def min_transition_cosine(blocks: torch.Tensor) -> torch.Tensor:
    """River-LLM's exit test over a segment: blocks [n + 1, ..., H], the residual stream before the first block and
    after each one -> [...] the minimum over the n blocks of cos(input, output)."""
    return transition_cosine(blocks[:-1], blocks[1:]).min(dim=0).values


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
