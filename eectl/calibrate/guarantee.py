"""Learn-then-Test (Angelopoulos et al. 2021) for one threshold over all exits: a sequence-level risk bounded with
probability >= 1 - epsilon over the draw of the calibration prompts (CALM, Schuster et al. 2022, calibrates its
exits this way).

The unit is a prompt: each contributes one loss in [0, 1] per setting of the grid (e.g. 1 when its continuation
differs from full depth's within its first N tokens). For each setting j the null hypothesis H_j says its risk
(expected loss over prompts) exceeds delta; a valid p-value for H_j comes from the n losses:

- binary losses: the exact binomial tail P(Bin(n, delta) <= k_j) (k_j: prompts with loss 1). Under H_j the count
  is Binomial(n, R_j) with R_j > delta, stochastically larger, so P(p_j <= a) <= a.
- losses in [0, 1]: Hoeffding-Bentkus (Bates et al. 2021, RCPS, eq. 7): min(exp(-n h(r, delta)),
  e * P(Bin(n, delta) <= ceil(n r))) with r the mean loss and h the Bernoulli KL divergence, 1 for r >= delta.

The settings are ordered from the most conservative to the most aggressive and tested in that fixed sequence:
H_1, H_2, ... are rejected while p_j <= epsilon, and the first failure stops the test (fixed-sequence testing
controls the family-wise error at epsilon without a multiplicity correction). The certified setting is the last
rejected one: P(its risk > delta) <= epsilon. No rejection: nothing is certified.

What this module does not do: generate or measure losses (calibrate/sequence.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

BINOMIAL = "binomial"
HOEFFDING_BENTKUS = "hoeffding-bentkus"


@dataclass
class Tested:
    """One setting's test: its empirical risk, p-value, and whether the sequence reached and rejected it."""

    index: int
    risk: float
    p_value: float
    rejected: bool


@dataclass
class LTTResult:
    certified: int | None  # index of the certified setting (the last rejected), None when the first test failed
    tested: list[Tested]  # the settings the sequence reached, in order (the last one failed unless all passed)
    n: int
    bound: str


def bound_for(losses: np.ndarray) -> str:
    """The p-value family the losses take: exact binomial for 0/1 losses, Hoeffding-Bentkus otherwise."""
    return BINOMIAL if np.isin(losses, (0.0, 1.0)).all() else HOEFFDING_BENTKUS


def p_value(mean_loss: float, n: int, delta: float, bound: str) -> float:
    """A valid p-value for H: risk > delta, from n losses in [0, 1] with this mean."""
    if bound == BINOMIAL:
        return float(stats.binom.cdf(round(mean_loss * n), n, delta))
    if mean_loss >= delta:
        return 1.0
    hoeffding = math.exp(-n * _kl(mean_loss, delta))
    bentkus = math.e * float(stats.binom.cdf(math.ceil(n * mean_loss), n, delta))
    return min(1.0, hoeffding, bentkus)


def _kl(a: float, b: float) -> float:
    """KL divergence between Bernoulli(a) and Bernoulli(b) (0 log 0 = 0)."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def fixed_sequence(losses: np.ndarray, delta: float, epsilon: float, bound: str | None = None) -> LTTResult:
    """losses [n prompts, m settings], settings from the most conservative to the most aggressive."""
    if losses.ndim != 2 or losses.shape[0] == 0:
        raise ValueError(f"losses must be [prompts, settings], got {losses.shape}")
    if not (0 < delta < 1 and 0 < epsilon < 1):
        raise ValueError(f"delta and epsilon must lie in (0, 1), got {delta}, {epsilon}")
    if (losses < 0).any() or (losses > 1).any():
        raise ValueError("losses must lie in [0, 1]")
    n = losses.shape[0]
    bound = bound or bound_for(losses)
    tested: list[Tested] = []
    certified = None
    for j in range(losses.shape[1]):
        r = float(losses[:, j].mean())
        p = p_value(r, n, delta, bound)
        tested.append(Tested(j, r, p, p <= epsilon))
        if p > epsilon:
            break
        certified = j
    return LTTResult(certified, tested, n, bound)


def naive_choice(losses: np.ndarray, delta: float) -> int | None:
    """The most aggressive setting whose empirical risk is <= delta (no confidence: what LTT replaces)."""
    ok = [j for j in range(losses.shape[1]) if losses[:, j].mean() <= delta]
    return max(ok) if ok else None


def upper_bound(mean_loss: float, n: int, epsilon: float, bound: str) -> float:
    """The (1 - epsilon) upper confidence bound on the risk: the smallest delta whose test the losses pass."""
    lo, hi = mean_loss, 1.0
    if p_value(mean_loss, n, min(1 - 1e-12, hi), bound) > epsilon:
        return 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid <= 0 or p_value(mean_loss, n, mid, bound) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi


def prompts_needed(mean_loss: float, delta: float, epsilon: float, bound: str, limit: int = 10**7) -> int | None:
    """The fewest prompts at which a setting with this empirical risk would be certified at delta (None: never,
    its risk is not below delta)."""
    if mean_loss >= delta:
        return None
    hi = 1
    while p_value(mean_loss, hi, delta, bound) > epsilon:
        hi *= 2
        if hi > limit:
            return None
    lo = hi // 2
    while lo + 1 < hi:  # p at lo fails (or lo = 0), at hi passes; rounding makes it only nearly monotone
        mid = (lo + hi) // 2
        if p_value(mean_loss, mid, delta, bound) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def minimum_prompts(delta: float, epsilon: float) -> int:
    """Prompts below which nothing can be certified: even n losses of 0 leave P(Bin(n, delta) = 0) > epsilon."""
    return math.ceil(math.log(epsilon) / math.log(1 - delta))


def monotone_losses(uniform: Sequence[float] | np.ndarray, risks: Sequence[float]) -> np.ndarray:
    """Synthetic losses with a known risk per setting, nested as real thresholds are (a prompt that fails a setting
    fails every more aggressive one): prompt i fails setting j when u_i < risks[j] (u uniform on [0, 1))."""
    u = np.asarray(uniform, float)[:, None]
    return (u < np.asarray(risks, float)[None, :]).astype(float)
