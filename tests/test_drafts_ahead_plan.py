"""Drafts that run ahead priced (plan/ahead.py): the replay of the runtime's rule on traces, the price per cycle,
the choice of exit and bound, and the pick beside the plan's lossless default; checked against hand computations."""

from __future__ import annotations

import pytest

from eectl.contracts.plan import Choice, Plan, Prediction
from eectl.plan.ahead import AHEAD, BOUNDS, ahead_choice, choose_ahead, lossless_pick, price, replay_ahead
from tests.tiny import toy_costs as _costs

BOUNDARIES = [4, 8, 12]  # three segments (L = 12): the drafter can sit at 4 or 8


def _plan(default: str = "full", verify_low: float | None = None) -> Plan:
    choices = {}
    if verify_low is not None:
        pred = Prediction(
            policy="verify",
            exits=[8],
            ms_per_token=10.0,
            full_ms=15.0,
            speedup=1.5,
            decision_ms=0.0,
            exit_rate=0.3,
            interval=(verify_low, 1.6),
        )
        choices["verify"] = Choice(policy="verify", exits=[8], thresholds={}, option=None, prediction=pred)
    return Plan(default=default, min_gain=0.03, choices=choices)


def test_the_replay_drafts_while_the_product_holds_and_keeps_the_leading_right_drafts():
    probs = [0.9, 0.9, 0.9, 0.1, 0.9]
    right = [True, True, False, True, True]
    # 0.9, 0.81, 0.729 >= 0.5, then 0.0729: three drafts, the third wrong (two kept, the full model's token third);
    # at 3 the exit is unsure (no draft); at 4 one draft, the trace's last
    assert replay_ahead(probs, right, 0.5) == [(3, 2), (0, 0), (1, 1)]
    assert replay_ahead(probs, right, 0.75) == [(2, 2), (0, 0), (1, 1)]  # 0.729 < 0.75: runs of two
    assert replay_ahead([0.9] * 5, [True] * 5, 0.0, block=2) == [(2, 2), (2, 2)]  # the block ends a run


def test_a_cycle_is_priced_as_its_drafts_and_its_check():
    # a draft at exit 4: segment 0 (4) + one more position in segments 1, 2 (0.5 each) + a head row (0.2) + its
    # decision (0.3) = 5.5; a check: the full step (15) + its decision (0.3) unless the block forced it
    cycles = [[(3, 2), (0, 0), (1, 1)]]
    ms = (3 * 5.5 + 15.3) + 15.3 + (5.5 + 15.3)
    pred = price(_costs(), BOUNDARIES, 4, cycles, block=8)
    assert pred.ms_per_token == pytest.approx(ms / 6)
    assert pred.speedup == pytest.approx(15.0 / (ms / 6))
    forced = price(_costs(), BOUNDARIES, 4, [[(2, 2), (2, 2)]], block=2)
    assert forced.ms_per_token == pytest.approx(2 * (2 * 5.5 + 15.0) / 6)


def test_drafts_that_cannot_pay_leave_full_depth():
    wrong = {4: [([0.95] * 40, [False] * 40)] * 3, 8: [([0.95] * 40, [False] * 40)] * 3}
    choice = choose_ahead(_costs(), BOUNDARIES, wrong)
    assert choice is not None and not choice.on and choice.prediction.speedup < 1.0
    assert lossless_pick(_plan(), choice) == "full"
    unsure = {4: [([0.01] * 40, [True] * 40)] * 3}  # never confident: no drafts, only the decisions' cost
    choice = choose_ahead(_costs(), BOUNDARIES, unsure)
    assert choice is not None and not choice.on and choice.drafts == 0.0
    assert lossless_pick(_plan(), choice) == "full"


def test_sure_right_drafts_pay_and_are_picked_where_their_low_end_is_highest():
    probs = [0.97, 0.95, 0.6, 0.99, 0.9] * 8
    right = [True, True, False, True, True] * 8
    traces = {4: [(probs, right)] * 4, 8: [(probs, right)] * 4}
    choice = choose_ahead(_costs(), BOUNDARIES, traces)
    assert choice is not None and choice.on and choice.prediction.speedup > 1.03
    assert choice.exit == 4 and choice.bound in BOUNDS  # the shallower exit drafts cheaper at the same acceptance
    best = max(
        price(_costs(), BOUNDARIES, e, [replay_ahead(probs, right, b)] * 4, 8).speedup for e in (4, 8) for b in BOUNDS
    )
    assert choice.prediction.speedup == pytest.approx(best)
    assert choice.by_position and all(0.0 <= x <= 1.0 for x in choice.by_position)
    assert lossless_pick(_plan(), choice) == AHEAD
    assert lossless_pick(_plan("verify", verify_low=choice.prediction.low() + 0.1), choice) == "verify"
    assert lossless_pick(_plan("certified"), choice) == "certified"  # a lossy setting at the user's risk stays


def test_no_exit_the_costs_price_is_no_choice():
    assert choose_ahead(_costs(candidates_ms={}), BOUNDARIES, {4: [([0.9], [True])]}) is None


def test_a_pinned_bound_is_priced_and_described_at_that_bound():
    probs = [0.97, 0.95, 0.6, 0.99, 0.9] * 8
    right = [True, True, False, True, True] * 8
    cycles = replay_ahead(probs, right, 0.05)
    got = ahead_choice(_costs(), BOUNDARIES, 8, [(probs, right)] * 3, 0.05)
    assert got.bound == 0.05 and got.exit == 8
    assert got.prediction.speedup == pytest.approx(price(_costs(), BOUNDARIES, 8, [cycles] * 3, 8).speedup)
    assert got.drafts == pytest.approx(sum(k for k, _ in cycles) / len(cycles))
    assert got.accepted == pytest.approx(sum(a for _, a in cycles) / len(cycles))
    assert got.by_position[0] == pytest.approx(
        sum(1 for k, a in cycles if a >= 1) / sum(1 for k, _ in cycles if k >= 1)
    )
