"""Intervals of predicted speedups: over the costs' timing batches (or bootstrap replicates of their rounds), and
independent sources of spread combined. Pure arithmetic on `Costs` (plan/costs.py measures them); plan/choose.py
and plan/lookup.py attach them to their predictions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eectl.contracts.plan import LEVEL, Costs


@dataclass(frozen=True)
class Replicates:
    """What a predicted speedup's interval is taken over: each timing batch's costs (`batched`: `Costs.batches`,
    two or more), else bootstrap replicates of the rounds (`Costs.resamples`; [] without samples)."""

    costs: list[Costs]
    batched: bool

    @classmethod
    def of(cls, costs: Costs) -> Replicates:
        batches = costs.batches()
        return cls(batches, True) if batches else cls(costs.resamples(), False)

    def interval(
        self, point: float, speedup: Callable[[Costs], float | None], level: float = LEVEL
    ) -> tuple[float, float] | None:
        """The `level` interval of a speedup predicted as `point`, `speedup` predicting it from one replicate:
        batch means (point +- t standard errors of the batch predictions), or the replicates' percentiles."""
        values = [v for c in self.costs if (v := speedup(c)) is not None]
        if self.batched and len(values) >= 2:
            from scipy.stats import t as student  # imported only for batched costs (a manifest read never needs it)

            b = len(values)
            half = float(student.ppf(0.5 + level / 2, b - 1)) * float(np.std(values, ddof=1)) / b**0.5
            return round(point - half, 4), round(point + half, 4)
        if not values:
            return None
        tail = (1.0 - level) / 2
        lo, hi = np.quantile(values, [tail, 1.0 - tail])
        return round(float(lo), 4), round(float(hi), 4)


def combined(point: float, *spans: tuple[float, float] | None) -> tuple[float, float] | None:
    """Independent sources of spread around one point estimate (each an interval at the same level): their
    half-widths added in quadrature, on each side."""
    known = [s for s in spans if s is not None]
    if not known:
        return None
    low = sum(max(0.0, point - lo) ** 2 for lo, _ in known) ** 0.5
    high = sum(max(0.0, hi - point) ** 2 for _, hi in known) ** 0.5
    return round(point - low, 4), round(point + high, 4)


def bootstrap(units: int, estimate: Callable[[list[int]], float | None], resamples: int) -> list[float]:
    """`estimate` on `resamples` bootstrap resamples of `units` units (indices 0..units - 1 drawn with replacement,
    a fixed seed: the same inputs give the same interval); the resamples it has no value for are left out."""
    rng = np.random.default_rng(0)
    draws = (rng.integers(0, units, size=units).tolist() for _ in range(resamples))
    return [v for picks in draws if (v := estimate(picks)) is not None]


UNIT_RESAMPLES = 400  # bootstrap resamples of a calibration sample's units for an option's interval


def unit_interval(
    point: float, units: int, speedup: Callable[[list[int]], float | None], level: float = LEVEL
) -> tuple[float, float] | None:
    """The `level` interval of a speedup predicted as `point` over which units a calibration sample holds: `speedup`
    predicts it from a resample of the units (indices 0..units - 1, drawn with replacement, a fixed seed: the same
    menu and costs give the same interval); percentiles of UNIT_RESAMPLES of them, shifted so that the point sits
    where the resamples' median does (the resampled ratio's skew kept, its bias not). None with fewer than two."""
    if units < 2:
        return None
    values = bootstrap(units, speedup, UNIT_RESAMPLES)
    if len(values) < 2:
        return None
    tail = (1.0 - level) / 2
    lo, mid, hi = np.quantile(values, [tail, 0.5, 1.0 - tail])
    return round(point - float(mid - lo), 4), round(point + float(hi - mid), 4)
