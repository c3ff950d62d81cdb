"""The statistics bench reports: one speed statistic with its interval, agreement, exact match.

Speed ratios are ONE paired statistic (`block_ratios`, `ratio_estimate`, `ratio_ci`): bench runs every configuration
on one block of prompts (one prompt, or one batch) before the next block, in a rotated order, and (on the CPU EP)
the configurations of a block take turns one decode step each (evaluate/timing.py `_turns`), so a configuration's
steps and the baseline's steps on the same prompts lie milliseconds apart. Each (repetition, block) gives one ratio,
baseline seconds per token over the configuration's; the estimate is the median of those ratios (robust to a burst
of other work that hits a few blocks), its 95% interval a bootstrap over blocks (each block with all its
repetitions: the prompts are the unit that varies). A burst that lands on one configuration's run shifts one ratio
out of many instead of a whole repetition's total. `noise_verdict` reads the A/A control's interval against a band
and says whether the run can resolve a speedup at all; the interval bench reports for every other configuration is
its bootstrap interval widened by the A/A control's reach from 1 (`widened`), the one `speed_reading` reads.

The pooled statistic (`seconds_per_token`, `speed_ratio`: total decode seconds over total decode tokens, every
prompt and repetition pooled) describes the absolute ms/token column and the threshold sweep. The block orders are
a Williams design (`balanced_orders`): over a cycle of blocks each configuration runs once in every position and
right after every other configuration once, so what a position or a predecessor (torch's threads after `hf`) costs
falls on every configuration alike; the baseline `full` is pooled per block with its A/A copy (`pooled`).

What this module does not do: run or time anything (evaluate/bench.py), or format (evaluate/report.py).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

BOOTSTRAP = 1000


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a binomial proportion (sensible at 0 and n, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def interval(samples: np.ndarray) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [0.025, 0.975])
    return (float(lo), float(hi))


def per_prompt_totals(reps: list[list[tuple[float, int]]]) -> np.ndarray:
    """Per repetition, per prompt (decode seconds, decode tokens) -> [P, 2]: each prompt summed over repetitions."""
    return np.array(reps, dtype=np.float64).sum(axis=0).reshape(-1, 2)


def seconds_per_token(totals: np.ndarray) -> float:
    """[P, 2] (seconds, tokens) -> the run's seconds per decode token (all prompts pooled); nan without tokens."""
    seconds, tokens = totals.sum(axis=0)
    return float(seconds / tokens) if tokens > 0 else math.nan


def speed_ratio(base: np.ndarray, other: np.ndarray) -> float:
    """How many times faster `other` decodes than `base`: base's seconds per token over other's, each pooled over
    prompts and repetitions ([P, 2] totals). nan when either has no decode time."""
    b, o = seconds_per_token(base), seconds_per_token(other)
    return b / o if o > 0 and math.isfinite(b) else math.nan


def speed_ratio_ci(base: np.ndarray, other: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap interval over prompts of `speed_ratio(base, other)`: the same prompts resampled for
    both configurations, the statistic recomputed on each resample."""
    if len(base) != len(other) or len(base) == 0:
        raise ValueError("a paired interval needs the same prompts in both configurations")
    idx = np.random.default_rng(seed).integers(0, len(base), (BOOTSTRAP, len(base)))
    bs, os_ = base[idx].sum(1), other[idx].sum(1)  # [B, 2]
    ok = (bs[:, 1] > 0) & (os_[:, 1] > 0) & (os_[:, 0] > 0)
    if not ok.any():
        return (math.nan, math.nan)
    return interval((bs[ok, 0] / bs[ok, 1]) / (os_[ok, 0] / os_[ok, 1]))


def agreement(gens: list[list[int]], ref: list[list[int]]) -> tuple[float, float, float]:
    """Position-wise token agreement (over the longer of each pair), exact-match share, mean first divergence."""
    agree = total = exact = 0
    firsts = []
    for g, r in zip(gens, ref, strict=True):
        n = max(len(g), len(r))
        same = sum(1 for a, b in zip(g, r, strict=False) if a == b)
        agree += same
        total += n
        exact += int(g == r)
        firsts.append(next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r))))
    return (agree / total if total else 1.0), exact / len(ref), float(np.mean(firsts))


def prefix_agreement(gens: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """How long each generation holds to its reference: the mean index of the first differing token (the shorter
    one's length when none differs), and the share of the reference's tokens generated before it (pooled over
    prompts; 1.0 where every generation equals its reference)."""
    firsts = [_first_difference(g, r) for g, r in zip(gens, ref, strict=True)]
    total = sum(len(r) for r in ref)
    return float(np.mean(firsts)) if firsts else 0.0, (sum(firsts) / total if total else 1.0)


def _first_difference(g: list[int], r: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))


def agreement_ci(gens: list[list[int]], ref: list[list[int]], seed: int = 0) -> tuple[float, float]:
    """Bootstrap over prompts of the position-wise token agreement."""
    same = np.array([sum(1 for a, b in zip(g, r, strict=False) if a == b) for g, r in zip(gens, ref, strict=True)])
    total = np.array([max(len(g), len(r)) for g, r in zip(gens, ref, strict=True)])
    return share_ci(same, total, seed)


def share_ci(same: np.ndarray, total: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """Bootstrap over prompts of a pooled share: sum(same) / sum(total), one (same, total) per prompt."""
    idx = np.random.default_rng(seed).integers(0, len(same), (BOOTSTRAP, len(same)))
    t = total[idx].sum(1)
    return interval(np.where(t > 0, same[idx].sum(1) / np.maximum(t, 1), 1.0))


def balanced_orders(names: list[str]) -> list[list[str]]:
    """A Williams design over `names`: n orders for even n (2n for odd: each order and its reverse) in which every
    name sits in every position equally often and directly follows every other name equally often (first-order
    carryover balanced). Order 0 starts with names[0]."""
    n = len(names)
    if n < 2:
        return [list(names)]
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(j + i) % n for j in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[j] for j in row] for row in rows]


def rep_orders(names: list[str], reps: int) -> list[list[str]]:
    """The order of each repetition: the Williams design's orders in turn (balanced when reps is a multiple of
    their number)."""
    orders = balanced_orders(names)
    return [orders[r % len(orders)] for r in range(reps)]


def pooled(*runs: np.ndarray) -> np.ndarray:
    """[P, 2] totals of several copies of one configuration, summed per prompt (the pooled baseline)."""
    return np.sum(runs, axis=0)


AA_BAND = (0.97, 1.03)  # the A/A interval must lie inside this for a bench's speedups to be conclusive
MIN_BLOCKS = 4  # fewer (repetition, block) ratios than this give no interval worth the name


def block_ratios(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """[R, B, 2] (seconds, tokens) per repetition and block of two configurations -> [R, B] ratios: base's seconds
    per token over other's in the same repetition and block (nan where either decoded nothing)."""
    b = np.asarray(base, np.float64)
    o = np.asarray(other, np.float64)
    if b.shape != o.shape:
        raise ValueError(f"paired ratios need the same repetitions and blocks, got {b.shape} and {o.shape}")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (b[..., 0] / b[..., 1]) / (o[..., 0] / o[..., 1])
    return np.where(np.isfinite(r) & (r > 0), r, np.nan)


def ratio_estimate(ratios: np.ndarray, instances: np.ndarray | None = None) -> float:
    """The median of the finite (repetition, block) ratios; nan when there are none. With `instances` ([R, B]: the
    runtime instance every configuration of that block ran on, bench --compare), the median within each instance,
    combined by their geometric mean (`_strata_median`), so a difference between the instances cancels."""
    r = np.asarray(ratios, np.float64)
    if instances is None:
        flat = r.ravel()
        flat = flat[np.isfinite(flat)]
        return float(np.median(flat)) if flat.size else math.nan
    return float(_strata_median(r[None], np.asarray(instances)[None])[0])


def _strata_median(draws: np.ndarray, instances: np.ndarray) -> np.ndarray:
    """[D, ...] ratios and their [D, ...] instance indices -> [D]: per draw, the geometric mean of the medians of
    each instance's finite ratios; nan for a draw in which an instance has none (it would estimate one instance's
    position alone).

    Why not one median of all: under --compare each instance of an artifact sits at a different creation position,
    so its ratios form two clusters (measured: 1.05x apart); the median of the pooled clusters falls in the gap or
    on either side of it, depending on how the blocks split, and only the per-instance medians cancel."""
    d = draws.reshape(len(draws), -1)
    inst = instances.reshape(len(instances), -1)
    logs = []
    for i in np.unique(inst):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a draw without this instance: an all-nan median
            logs.append(np.log(np.nanmedian(np.where(inst == i, d, np.nan), axis=1)))
    return np.exp(np.mean(logs, axis=0))


def ratio_ci(ratios: np.ndarray, seed: int = 0, instances: np.ndarray | None = None) -> tuple[float, float]:
    """95% bootstrap interval of `ratio_estimate` over blocks: blocks drawn with replacement, each with all its
    repetitions (and, under --compare, the instance each ran on), the estimate recomputed on each draw."""
    r = np.asarray(ratios, np.float64)
    if r.ndim != 2 or r.shape[1] == 0:
        raise ValueError("ratio_ci takes [repetitions, blocks] ratios")
    idx = np.random.default_rng(seed).integers(0, r.shape[1], (BOOTSTRAP, r.shape[1]))
    draws = np.moveaxis(r[:, idx], 1, 0).reshape(BOOTSTRAP, -1)  # [BOOTSTRAP, R * B]
    if instances is None:
        meds = np.nanmedian(draws, axis=1)
    else:
        inst = np.moveaxis(np.asarray(instances)[:, idx], 1, 0).reshape(BOOTSTRAP, -1)
        meds = _strata_median(draws, inst)
    meds = meds[np.isfinite(meds)]
    return interval(meds) if meds.size else (math.nan, math.nan)


def noise_verdict(aa_ci: tuple[float, float] | None, n_ratios: int, band: tuple[float, float] = AA_BAND) -> str:
    """`conclusive`, or `inconclusive: <reason>`: whether a run whose A/A control has this interval (over n_ratios
    paired ratios) can tell a speedup from noise."""
    if n_ratios < MIN_BLOCKS:
        return f"inconclusive: {n_ratios} prompt-repetitions are too few for an interval (need {MIN_BLOCKS})"
    if aa_ci is None or not all(math.isfinite(x) for x in aa_ci):
        return "inconclusive: the A/A control has no interval"
    if aa_ci[0] < band[0] or aa_ci[1] > band[1]:
        return (
            f"inconclusive: the A/A control reads [{aa_ci[0]:.3f}, {aa_ci[1]:.3f}], outside [{band[0]:.2f}, "
            f"{band[1]:.2f}]: this run's noise exceeds the speedups it could resolve"
        )
    return "conclusive"


def widened(ci: tuple[float, float] | None, resolution: float | None) -> tuple[float, float] | None:
    """The interval bench reports for a configuration's speed (all but the A/A control's): the paired bootstrap
    interval widened on both sides by the run's A/A reach, [lo - resolution, hi + resolution]; the bootstrap's own
    interval when there is no finite resolution. It excludes 1.0 exactly when `speed_reading` says faster or slower.

    Why: a bootstrap of a median over 5 blocks undercovers (measured on the main job's budget under load: 3 of 14
    intervals of configurations identical to full depth excluded 1.0, all within their run's A/A reach); the A/A
    control measured in the same run says how far from 1 an identical configuration's interval reaches by chance."""
    if ci is None or resolution is None or not math.isfinite(resolution):
        return ci
    return (ci[0] - resolution, ci[1] + resolution)


def speed_reading(ci: tuple[float, float] | None, resolution: float | None) -> str:
    """What a conclusive run says of one configuration's speed (`ci`: its bootstrap interval): `faster` or `slower`
    only when its whole interval lies beyond the run's own noise (the A/A control's reach from 1, `resolution`), i.e.
    when the `widened` interval excludes 1.0; else `no difference beyond +-X%`."""
    wide = widened(ci, resolution)
    if wide is None or resolution is None or not all(math.isfinite(x) for x in wide):
        return ""
    if wide[0] > 1.0:
        return "faster"
    if wide[1] < 1.0:
        return "slower"
    return f"no difference beyond +-{resolution:.1%}"
