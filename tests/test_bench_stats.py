"""bench's speed statistic on synthetic timings: no clocks, known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eectl.evaluate.stats import balanced_orders, per_prompt_totals, pooled, rep_orders, speed_ratio, speed_ratio_ci


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


def _orders_timed(orders, names, effect, prompts, rng, noise=0.0):
    """Synthetic timings where every configuration is full depth (30 ms/token) and the run order costs: `effect`
    (position, predecessor) -> factor. Returns name -> per-repetition [(seconds, tokens)] per prompt."""
    runs = {n: [] for n in names}
    for order in orders:
        for pos, name in enumerate(order):
            f = effect(pos, order[pos - 1] if pos else None)
            runs[name].append([(s * f, n) for s, n in _config(rng, prompts, 30.0, 1, noise)[0]])
    return runs


def _effect(pos, before):
    # the first configuration after the warm-up pays 9%; the one after `hf` (torch's threads still spinning) 7%
    return (1.09 if pos == 0 else 1.0) * (1.07 if before == "hf" else 1.0)


def test_williams_orders_balance_positions_and_predecessors():
    for n in range(2, 8):
        names = [f"c{i}" for i in range(n)]
        orders = balanced_orders(names)
        assert len(orders) == (n if n % 2 == 0 else 2 * n) and orders[0][0] == "c0"
        for name in names:  # every position equally often
            assert len({o.index(name) for o in orders}) == n
            assert sum(o.index(name) == 0 for o in orders) == len(orders) // n
        pairs = [(o[i - 1], o[i]) for o in orders for i in range(1, n)]
        assert len(set(pairs)) == n * (n - 1) and len(pairs) == len(orders) // n * n * (n - 1)
    assert rep_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]


def test_order_effects_do_not_bias_the_ratio_with_the_balanced_order_and_pooled_baseline():
    """All configurations are the same (true ratio 1). Under the rotation by one, the position and predecessor
    effects bias "vs full" (copy, always after hf, reads slow; full, first after the warm-up, makes others read
    fast); under the Williams design over a whole cycle with full and full-aa pooled, every ratio is exactly 1."""
    names = ["full", "full-aa", "hf", "copy", "defer", "verify"]
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, 6)
    rotation = [names[r:] + names[:r] for r in range(len(names))]
    old = _orders_timed(rotation, names, _effect, prompts, rng)
    old_full = per_prompt_totals(old["full"])
    assert speed_ratio(old_full, per_prompt_totals(old["copy"])) < 0.96  # biased

    new = _orders_timed(balanced_orders(names), names, _effect, prompts, rng)
    base = pooled(per_prompt_totals(new["full"]), per_prompt_totals(new["full-aa"]))
    for name in names:
        ratio = speed_ratio(base, per_prompt_totals(new[name]))
        if name == "hf":  # a configuration never follows itself: the one leaving the carryover escapes it
            assert ratio == pytest.approx((4 + 1.09 + 1.07) / (5 + 1.09))  # per cycle: 6 runs each
        else:
            assert ratio == pytest.approx(1.0, abs=1e-9), name
    assert speed_ratio(per_prompt_totals(new["full"]), per_prompt_totals(new["full-aa"])) == pytest.approx(1.0)
    # with noise, the A/A interval of the balanced order still contains 1
    noisy = _orders_timed(balanced_orders(names), names, _effect, prompts, rng, noise=0.05)
    lo, hi = speed_ratio_ci(per_prompt_totals(noisy["full"]), per_prompt_totals(noisy["full-aa"]))
    assert lo <= 1.0 <= hi
