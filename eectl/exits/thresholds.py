"""Exit thresholds from measurements: FlexEE's lambda*, the Clopper-Pearson bound, and the sequential fit.

The rule every threshold here serves is the runner's: a token exits at the FIRST exit whose every criterion value
is >= its threshold (`eectl.exits.signals.passes`). So exits are fitted sequentially, each on the tokens no earlier exit
took. Per exit, lambda* = min{ lambda : P(correct | value >= lambda) >= target } on those tokens
(`threshold_for_precision`); with a confidence level the one-sided Clopper-Pearson lower bound on that precision
must reach the target instead (`threshold_with_bound`). A threshold of inf means "never exits here": that is the
one in-memory representation (files write it as null, see contracts/calibration.py).

The bound is per threshold: it treats the chosen threshold as fixed in advance; the search over thresholds (and
over exits, sequentially) is not corrected for. Held-out replay (calibrate/fit.py) is the check.

What this module does not do: measure signals (exits/measure.py, exits/signals.py) or read and write files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy import special, stats

from eectl.exits.base import passes

MARGIN_GRID = 32  # margin thresholds tried for "+margin" signals (0 and 31 quantiles)


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


# ---------------------------------------------------------------------------------------------------------------
# Clopper-Pearson (scipy's beta quantile and regularized incomplete beta)
# ---------------------------------------------------------------------------------------------------------------


def _f64(*values: Any) -> list[np.ndarray]:
    tensors = torch.broadcast_tensors(*(torch.as_tensor(v, dtype=torch.float64) for v in values))
    return [t.numpy() for t in tensors]


def betainc(a: Any, b: Any, x: Any) -> torch.Tensor:
    """Regularized incomplete beta I_x(a, b) (a, b > 0, 0 <= x <= 1), elementwise in float64, broadcasting."""
    a_, b_, x_ = _f64(a, b, x)
    return torch.from_numpy(np.asarray(special.betainc(a_, b_, x_), dtype=np.float64))


def binomial_upper_tail(k: Any, n: Any, p: Any) -> torch.Tensor:
    """P(X >= k) for X ~ Binomial(n, p), elementwise: I_p(k, n - k + 1) for k >= 1, and 1 for k <= 0."""
    k_, n_, p_ = _f64(k, n, p)
    tail = special.betainc(np.maximum(k_, 1.0), np.maximum(n_ - k_ + 1, 1.0), p_)
    return torch.from_numpy(np.asarray(np.where(k_ <= 0, 1.0, tail), dtype=np.float64))


def clopper_pearson_lower(k: Any, n: Any, confidence: float) -> torch.Tensor:
    """One-sided Clopper-Pearson lower bound on a binomial proportion after k successes in n trials.

    The bound p_L solves P(X >= k | n, p_L) = 1 - confidence: the (1 - confidence) quantile of Beta(k, n - k + 1)
    (0 when k = 0; (1 - confidence)^(1/n) when k = n, written exactly).
    """
    k_, n_ = _f64(k, n)
    alpha = 1.0 - confidence
    with np.errstate(all="ignore"):
        q = stats.beta.ppf(alpha, np.maximum(k_, 1.0), np.maximum(n_ - k_ + 1, 1.0))
        exact_all = alpha ** (1.0 / np.maximum(n_, 1.0))
    out = np.where(k_ <= 0, 0.0, np.where(k_ >= n_, exact_all, q))
    return torch.from_numpy(np.asarray(out, dtype=np.float64))


def min_tokens_for(target: float, confidence: float) -> int:
    """The fewest exiting tokens whose Clopper-Pearson bound can reach `target` (all of them correct)."""
    if target >= 1.0:
        return 2**62
    alpha = 1.0 - confidence
    n = max(1, math.ceil(math.log(alpha) / math.log(target)))
    while alpha ** (1.0 / n) < target:  # float rounding of the ratio
        n += 1
    while n > 1 and alpha ** (1.0 / (n - 1)) >= target:
        n -= 1
    return n


def threshold_with_bound(
    confidence: torch.Tensor, correct: torch.Tensor, target: float, level: float
) -> ThresholdChoice:
    """The lowest threshold whose exiting tokens have a Clopper-Pearson lower bound (at `level`) >= target.

    Same tie handling as `threshold_for_precision`; returns threshold inf when none qualifies. The bound reaches the
    target exactly when P(X >= hits | n, target) <= 1 - level, so one binomial tail per candidate prefix decides.
    """
    if confidence.numel() == 0:
        return NEVER
    p = Prefixes.of(confidence, correct)
    # the point estimate bounds the lower bound, and n_min tokens are needed even with no error
    cand = torch.nonzero(p.boundary & (p.precision >= target) & (p.counts >= min_tokens_for(target, level))).flatten()
    alpha = 1.0 - level
    for end in range(cand.numel(), 0, -256):  # the largest qualifying prefix is usually among the largest few
        block = cand[max(0, end - 256) : end]
        ok = block[binomial_upper_tail(p.hits[block], p.counts[block], target) <= alpha]
        if ok.numel():
            return p.choice(int(ok[-1]))
    return NEVER


# ---------------------------------------------------------------------------------------------------------------
# The sequential fit over exits
# ---------------------------------------------------------------------------------------------------------------


def assign_exits(values: dict[str, torch.Tensor], thresholds: list[dict[str, float]]) -> torch.Tensor:
    """values {criterion: [E, N]} -> [N] long: the exit each token takes under the sequential rule, E for none."""
    num_exits, n = next(iter(values.values())).shape
    taken = torch.full((n,), num_exits, dtype=torch.long)
    for e in range(num_exits - 1, -1, -1):  # the earliest passing exit wins: write it last
        taken[passes({c: v[e] for c, v in values.items()}, thresholds[e])] = e
    return taken


def _search_one(conf: torch.Tensor, correct: torch.Tensor, target: float, level: float | None) -> float:
    if level is None:
        return threshold_for_precision(conf, correct, target).threshold
    return threshold_with_bound(conf, correct, target, level).threshold


def search_thresholds(
    values: dict[str, torch.Tensor], correct: torch.Tensor, target: float, level: float | None = None
) -> dict[str, float]:
    """Thresholds for one exit on the tokens that reach it; inf everywhere when no threshold qualifies.

    One criterion: lambda* (or the bounded search). "prob" AND "margin" (FlexEE's two tests): for each of a grid of
    margin thresholds (0 = no margin test, then the margins at 31 quantiles of these tokens) the lowest qualifying
    probability threshold; the pair that exits the most tokens wins (on ties, the smaller margin threshold).
    """
    never = {c: float("inf") for c in values}
    if correct.numel() == 0:
        return never
    if len(values) == 1:
        ((c, v),) = values.items()
        return {c: _search_one(v, correct, target, level)}
    prob, margin = values["prob"], values["margin"]
    ordered = torch.sort(margin).values
    levels = torch.linspace(0.0, 0.97, MARGIN_GRID - 1, dtype=torch.float64)
    grid = {0.0} | {float(ordered[int(q * (ordered.numel() - 1))]) for q in levels}
    best, best_count = never, 0
    for m in sorted(grid):
        keep = margin >= m
        t = _search_one(prob[keep], correct[keep], target, level)
        count = int((keep & (prob >= t)).sum())
        if count > best_count:
            best, best_count = {"prob": t, "margin": m}, count
    return best


def fit_thresholds(
    values: dict[str, torch.Tensor],
    correct: torch.Tensor,
    target: float,
    level: float | None = None,
    mask: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """values {criterion: [E, N]}, correct [E, N]: exit e's thresholds are searched on the (masked) tokens that no
    earlier exit took and that exit e decides: a value of -inf marks a decision that does not run (its gate failed:
    eectl.exits.gates), which no threshold lets pass."""
    num_exits, n = correct.shape
    remaining = torch.ones(n, dtype=torch.bool) if mask is None else mask.clone()
    out: list[dict[str, float]] = []
    for e in range(num_exits):
        decided = torch.stack([v[e] > float("-inf") for v in values.values()]).all(0)
        idx = torch.nonzero(remaining & decided).flatten()
        thr = search_thresholds({c: v[e, idx] for c, v in values.items()}, correct[e, idx], target, level)
        out.append(thr)
        remaining &= ~passes({c: v[e] for c, v in values.items()}, thr)
    return out
