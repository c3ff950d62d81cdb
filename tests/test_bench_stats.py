"""bench's speed statistic on synthetic timings: no clocks, known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eectl.bench_stats import per_prompt_totals, speed_ratio, speed_ratio_ci


def _prompts(rng, n):
    """Prompts of different lengths and per-token cost (a long context is slower in every configuration)."""
    return rng.integers(16, 65, n), rng.uniform(0.8, 1.3, n)


def _config(rng, prompts, ms_per_token, reps, noise):
    """One configuration's timings: per repetition, per prompt (seconds, tokens), multiplicative noise."""
    tokens, workload = prompts
    one = [(int(n), float(w)) for n, w in zip(tokens, workload, strict=True)]
    return [[(n * ms_per_token * w * rng.lognormal(0, noise) / 1000, n) for n, w in one] for _ in range(reps)]


def test_known_ratio_recovered_and_inside_its_interval():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        prompts = _prompts(rng, 12)
        b = per_prompt_totals(_config(rng, prompts, 30.0, 3, 0.05))
        o = per_prompt_totals(_config(rng, prompts, 24.0, 3, 0.05))  # the same prompts 1.25x faster
        ratio = speed_ratio(b, o)
        lo, hi = speed_ratio_ci(b, o, seed=seed)
        assert ratio == pytest.approx(1.25, rel=0.03)
        assert lo <= ratio <= hi  # one statistic: the point estimate sits inside its own interval
        assert lo <= 1.25 <= hi and hi - lo < 0.1


def test_aa_interval_contains_one():
    hits = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        prompts = _prompts(rng, 10)
        b = per_prompt_totals(_config(rng, prompts, 30.0, 3, 0.08))
        again = per_prompt_totals(_config(rng, prompts, 30.0, 3, 0.08))
        lo, hi = speed_ratio_ci(b, again, seed=seed)
        hits += lo <= 1.0 <= hi
    assert hits >= 17  # a 95% interval: at most a few of 20 A/A runs may miss 1 (binomial: P(>3 misses) ~ 1.6%)


def test_pooled_statistic_is_total_time_over_total_tokens():
    base = [[(0.3, 10), (0.9, 30)], [(0.5, 10), (0.7, 30)]]  # 2 reps x 2 prompts: 2.4 s over 80 tokens
    other = [[(0.2, 10), (0.4, 20)], [(0.2, 10), (0.4, 20)]]  # 1.2 s over 60 tokens
    b, o = per_prompt_totals(base), per_prompt_totals(other)
    assert b.tolist() == [[0.8, 20], [1.6, 60]]
    assert speed_ratio(b, o) == pytest.approx((2.4 / 80) / (1.2 / 60))
    assert math.isnan(speed_ratio(b, np.zeros((2, 2))))
    with pytest.raises(ValueError):
        speed_ratio_ci(b, o[:1])
