"""Verify priced: its cycles of drafts closed by the full-depth pass that checks them (`verify_cycle`), and what that
pass costs at its width beyond the linear model's charge per draft (`check_excess`, from export's wide-pass timings).
plan/choose.py's `predict` calls both; the cycle's formula is in `verify_cycle`.

What this module does not do: price the exit steps themselves or choose (plan/choose.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from eectl.contracts.plan import VERIFY_BLOCK, Costs
from eectl.plan.lookup import wide_steps


def segment_of(boundaries: Sequence[int], layer: int) -> int:
    """Index of the segment that ends at `layer` (boundaries: each segment's end layer, in order)."""
    return list(boundaries).index(layer)


def verify_cycle(
    rate: float,
    precision: float,
    draft_ms: float,
    decision_ms: float,
    full_ms: float,
    block: int = VERIFY_BLOCK,
    check: Callable[[int], float] | None = None,
) -> tuple[float, float]:
    """Verify's ms per emitted token and tokens lost per step, from its cycles.

    A cycle is K drafts (each step's token exits with probability `rate`, a draft step costing `draft_ms` plus the
    decision) closed by a full-depth pass that checks them: a token that does not exit (its decisions and the full
    step), or, once `block` drafts wait, a forced pass (no decisions). The pass emits the full model's token after
    the drafts it accepts: the leading correct ones, each correct with probability `precision`, so a cycle emits
    1 + sum_{m=1..K} precision^m tokens. P(K >= m) = rate^m (m <= block), hence

        tokens per cycle = 1 + sum_{m=1..block} (rate * precision)^m
        ms per cycle     = E[K] (draft_ms + decision_ms) + full_ms + (1 - rate^block) decision_ms

    with E[K] = sum_{m=1..block} rate^m. Exact for drafts whose correctness is independent from step to step; it
    holds at every exit rate, 1 included (every token exits: cycles of `block` drafts). `check(k)`: what the pass
    checking k drafts costs beyond k drafts' share of it in `draft_ms` (`check_excess`), added at its expectation
    over K (`expected_check`)."""
    m = np.arange(1, block + 1)
    drafts = float(np.sum(rate**m))
    tokens = 1.0 + float(np.sum((rate * precision) ** m))
    ms = drafts * (draft_ms + decision_ms) + full_ms + (1.0 - rate**block) * decision_ms
    ms += expected_check(rate, check, block)
    steps = drafts + 1.0
    return ms / tokens, (steps - tokens) / steps


def expected_check(rate: float, check: Callable[[int], float] | None, block: int = VERIFY_BLOCK) -> float:
    """E[check(K)] over a cycle's drafts K: P(K = k) = rate^k (1 - rate) below `block`, rate^block at it."""
    if check is None or rate <= 0.0:
        return 0.0
    p = [rate**k * (1.0 - rate) for k in range(block)] + [rate**block]
    return float(sum(pk * check(k) for k, pk in enumerate(p) if k > 0))


def check_excess(
    costs: Costs, boundaries: Sequence[int], per_exit: Sequence[tuple[int, float, float | None]]
) -> Callable[[int], float] | None:
    """What the pass checking k drafts costs beyond what the linear model charges them (k drafts' one more position
    in each later segment and one more head row, in plan/paid.py `exit_paid`), from the wide passes export timed
    (`Costs.wide_ms`: a step over 1 + k positions on the bound chain): their extra over a one-position step, the later
    segments' share of it (the segments after the exits, weighted by coverage). A pass's width is not linear in cost:
    ORT's one-row attention can cost what two rows do (then the second position is free) while the third and later
    are not.
    None without wide timings."""
    if not costs.wide_ms or not per_exit:
        return None
    total = sum(costs.segment_ms)
    rate = sum(cov for _, cov, _ in per_exit)
    if total <= 0 or rate <= 0:
        return None
    share = sum(cov * sum(costs.segment_ms[segment_of(boundaries, layer) + 1 :]) for layer, cov, _ in per_exit)
    share /= rate * total
    # the linear model's charge per draft (plan/paid.py `exit_paid`): one more position in each later segment, one
    # more head row
    later = [sum(costs.segment_extra_ms[segment_of(boundaries, layer) + 1 :]) for layer, _, _ in per_exit]
    linear = sum(cov * x for (_, cov, _), x in zip(per_exit, later, strict=True)) + rate * costs.final_head_extra_ms
    # the steps over 1 .. VERIFY_BLOCK + 1 positions, interpolated once: `predict` prices hundreds of options and
    # their resamples
    steps = wide_steps(costs, range(1, VERIFY_BLOCK + 2))
    if steps is None:
        return None
    table = [max(0.0, (wide - steps[0]) * share - k * linear / rate) for k, wide in enumerate(steps)]
    return lambda k: table[min(k, VERIFY_BLOCK)]
