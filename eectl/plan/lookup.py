"""Drafts from the context priced: full depth with drafts (runtime/drafts.py) against full depth, from calibration's
replay of them on its greedy continuations (`LookupStats`: how many decode steps of each width verify with them
takes, exactly) and export's timing of decode steps of those widths as the runner takes them (`Costs.wide_ms`:
the drafts' search, the wide pass on the bound chain, verify's check; interpolated between the widths timed):

    lookup:       sum over steps of wide(width) / (tokens x the full-depth step)

Its interval combines the costs' timing (plan/intervals.py) and which prompts a workload holds (a bootstrap over
calibration's prompts). plan/choose.py makes it the default when that interval clears the line and it beats the exit
configurations' prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from eectl.contracts.plan import (
    LEVEL,
    LOOKUP,
    MIN_GAIN,
    Costs,
    LookupChoice,
    LookupStats,
    Plan,
    Prediction,
    piecewise,
)
from eectl.plan.intervals import Replicates, bootstrap, combined


def wide_ms(costs: Costs, width: int) -> float | None:
    """A decode step with drafts from the context over `width` positions (a token and width - 1 drafts), as the
    runner takes it (plan/step_calls.py `wide_step_calls`: the drafts' search, the wide pass, the check): linear between
    the widths timed (beyond the widest: its last slope). Width 1 is a step whose search found nothing (costs timed
    before "1" was: the baseline step). None without wide timings."""
    got = wide_steps(costs, [width])
    return None if got is None else got[0]


def wide_steps(costs: Costs, widths: Sequence[int]) -> list[float] | None:
    """`wide_ms` at each of `widths` (the timings sorted and interpolated once). None without wide timings where a
    width above 1 is asked for."""
    timed = {int(w): v - costs.wide_head_ms(int(w)) for w, v in costs.wide_ms.items()}  # decode's greedy head
    one = timed.get(1, costs.baseline_ms())
    if not costs.wide_ms:
        return None if any(w > 1 for w in widths) else [one] * len(widths)
    return piecewise({1: one, **timed}, widths)


def predict_lookup(costs: Costs, stats: LookupStats) -> Prediction | None:
    """Full depth with drafts from the context, on calibration's replayed steps. None: no wide timings or tokens.

    A step whose search found nothing runs the chain's full-depth step after the search: priced at its timing, and
    never below the baseline step (the timed one-position step takes the exit-step path, which read 0.2 ms under
    the chain's full-depth step on the default model: priced as it, plain steps made lookup look 1.5% faster)."""
    full = costs.baseline_ms()
    if stats.tokens <= 0 or full <= 0:
        return None
    widths = [int(w) for w in stats.steps]
    steps = wide_steps(costs, widths)
    if steps is None:
        return None
    steps = [max(ms, full) if w <= 1 else ms for w, ms in zip(widths, steps, strict=True)]
    per_token = sum(n * ms for n, ms in zip(stats.steps.values(), steps, strict=True)) / stats.tokens
    return Prediction(
        policy=LOOKUP,
        exits=[],
        ms_per_token=round(per_token, 4),
        full_ms=round(full, 4),
        speedup=round(full / per_token, 4),
        decision_ms=0.0,
        exit_rate=0.0,
    )


LOOKUP_RESAMPLES = 1000  # bootstrap resamples of calibration's prompts for the lookup prediction's interval


def prompt_interval(
    costs: Costs, stats: LookupStats, level: float = LEVEL, resamples: int = LOOKUP_RESAMPLES
) -> tuple[float, float] | None:
    """The `level` bootstrap interval of the lookup speedup over calibration's prompts (resampled with replacement,
    a fixed seed): how much the drafts' pay depends on which prompts a workload holds. None with fewer than two."""
    n = len(stats.per_prompt)
    if n < 2:
        return None

    def speedup(picks: list[int]) -> float | None:
        pred = predict_lookup(costs, stats.of_prompts(picks))
        return None if pred is None else pred.speedup

    values = bootstrap(n, speedup, resamples)
    if not values:
        return None
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return float(lo), float(hi)


def choose_lookup(
    costs: Costs,
    stats: LookupStats,
    min_gain: float = MIN_GAIN,
    level: float = LEVEL,
    resamples: int = LOOKUP_RESAMPLES,
) -> LookupChoice | None:
    """The lookup prediction with its interval over the costs' timing and calibration's prompts (the drafts' pay
    varies from prompt to prompt far more than the costs' timing); on when its low end clears the line. Of the
    replays calibration made with other run lengths (`LookupStats.shortest`), the one these costs price fastest:
    where a wide pass costs about what a step does, runs of one draft cannot pay; where each drafted position costs
    much and the drafts hold for a few tokens, long runs cost more than they keep. Its drafts per step and shortest
    run are what a run then proposes."""
    priced = [(p, v) for v in [stats, *stats.shortest] if (p := predict_lookup(costs, v)) is not None]
    if not priced:
        return None
    pred, stats = max(priced, key=lambda pv: pv[0].speedup)
    timing = Replicates.of(costs).interval(
        pred.speedup, lambda c: None if (p := predict_lookup(c, stats)) is None else p.speedup, level
    )
    prompts = prompt_interval(costs, stats, level, resamples)
    span = combined(pred.speedup, timing, prompts)
    if span is not None:  # the timing's own interval kept apart where the prompts widen it: what more timing narrows
        kept = (timing or (pred.speedup, pred.speedup)) if prompts is not None else None
        pred = pred.model_copy(update={"interval": span, "timing": kept})
    return LookupChoice(
        drafts=stats.max_draft,
        prediction=pred,
        on=pred.low() >= 1.0 + min_gain,
        tokens_per_step=round(stats.per_token(), 4),
        min_draft=stats.min_draft,
    )


RUN_RESAMPLES = 200  # a run's re-pricing at its own length: ~0.1 s on the default model's calibration (80 prompts)


def lookup_at_length(plan: Plan, costs: Costs, stats: LookupStats, tokens: int) -> LookupChoice | None:
    """The plan's lookup entry priced on calibration's replay cut at `tokens` (`LookupStats.at_length`); the plan's
    own where the length cuts nothing."""
    cut = stats.at_length(tokens)
    if cut is stats:
        return plan.lookup
    return choose_lookup(costs, cut, plan.min_gain, plan.level, RUN_RESAMPLES)
