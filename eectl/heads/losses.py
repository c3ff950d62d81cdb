"""Distillation losses for exit heads: the exact KL over the full vocabulary is F.cross_entropy with soft targets
(heads/train.py); this module holds the one that is not bound by the LM head: the teacher's top-k tokens plus a tail
bucket,
with the student's normaliser over those rows and an unbiased estimate of the rest from a few sampled rows.

What this module does not do: compute the teacher (the base pass, heads/state_cache.py), or train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eectl.exits.base import ExitHead
from eectl.models.device import to_device

LOSSES = ("exact", "topk")
DEFAULT_TEACHER_K = 32
# 4,096 sampled + the 4,096 most frequent tokens: held-out agreement within 0.3 points of the exact KL at 4.8x its
# tokens/s on the default model (README, train-heads); 1,024 alone is 20x but about one point lower
DEFAULT_TAIL_SAMPLES = 4096
DEFAULT_SHORTLIST = 4096


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
    shortlist: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL over buckets {teacher's top-k tokens one by one, everything else}, for E exits at once.

    `mapped` [E, B, H] is each exit's head output (before the final norm). The student's probabilities need its
    normaliser Z = sum over V of exp(z): with `tail_samples` None it is exact (every LM-head row, as costly as the
    exact KL's forward); otherwise Z = sum over S (the union of the batch's teacher top-k ids) + an unbiased
    estimate of the rest from `tail_samples` rows drawn uniformly outside S, so only |S| + tail_samples rows of
    the LM head are read (about 1.5K of 49K for SmolLM2 at k = 32, B = 32). `shortlist` (token ids, e.g. the most
    frequent teacher tokens of the training data) joins S: the rows where a student's tail mass mostly sits are
    then counted exactly, not estimated (the sampled estimate's variance is what biases log Z). Returns (soft
    cross-entropy, KL) per exit [E], means over the B tokens; KL = soft CE - the teacher's bucket entropy.
    """
    E, B, _ = mapped.shape
    V = lens.lm_head_weight.shape[0]
    normed = lens.norm(mapped)  # [E, B, H]
    # which rows: index arithmetic where the teacher's ids are (the host, for a state cache's: unique and masks on
    # a GPU would make it wait), then the rows and positions copied to the heads' device
    ids = teacher.ids
    support = torch.unique(ids if shortlist is None else torch.cat([ids.flatten(), shortlist.to(ids.device)]))
    if tail_samples is None:
        rows = torch.arange(V, device=ids.device)
        pos = ids  # row index = token id
        extra = None
    else:
        perm = torch.randperm(V, generator=generator).to(ids.device)
        outside = perm[~torch.isin(perm, support)][:tail_samples]
        rows = torch.cat([support, outside])
        pos = torch.searchsorted(support, ids)  # [B, k] index into rows
        extra = math.log(max(1, V - support.numel()) / max(1, outside.numel()))
    rows, pos, teacher_logp = (to_device(t, mapped.device) for t in (rows, pos, teacher.logp))
    z = F.linear(normed, lens.lm_head_weight[rows], None if lens.lm_head_bias is None else lens.lm_head_bias[rows])
    z = lens.cap(z).float()  # [E, B, R]
    if extra is None:
        log_z = torch.logsumexp(z, dim=-1)
    else:
        m = support.numel()
        log_z = torch.logaddexp(torch.logsumexp(z[..., :m], -1), torch.logsumexp(z[..., m:], -1) + extra)
    z_top = z.gather(-1, pos[None].expand(E, -1, -1))  # [E, B, k]
    logq_top = z_top - log_z[..., None]
    logq_tail = _log1mexp(torch.logsumexp(logq_top, -1))  # [E, B]
    p_top = teacher_logp.exp()  # [B, k]
    p_tail = (1 - p_top.sum(-1)).clamp_min(0)  # [B]
    soft_ce = -((p_top * logq_top).sum(-1) + p_tail * logq_tail)  # [E, B]
    entropy = -((p_top * teacher_logp).sum(-1) + torch.xlogy(p_tail, p_tail))  # [B]
    return soft_ce.mean(-1), (soft_ce - entropy).mean(-1).detach()
