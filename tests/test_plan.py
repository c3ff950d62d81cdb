"""The cost model and the choice of exits (plan/choose.py): pure arithmetic, checked against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from eectl.contracts.options import ExitOption, Option
from eectl.contracts.plan import MIN_GAIN, Costs
from eectl.plan.choose import choose, predict
from eectl.plan.verify import verify_cycle
from tests.tiny import toy_costs as _costs

# three segments ending at layers 4, 8 and 12 (L = 12): exits can sit at 4 and 8
BOUNDARIES = [4, 8, 12]


def _option(exits, coverage, precision=None, kind="target", target=0.99) -> Option:
    precision = precision or [1.0] * len(exits)
    return Option(
        exits=exits,
        kind=kind,
        target=target,
        confidence=None,
        per_exit=[
            ExitOption(layer=e, thresholds={"prob": 0.9}, coverage=c, precision=p)
            for e, c, p in zip(exits, coverage, precision, strict=True)
        ],
        agreement=1.0,
    )


def test_no_exits_is_the_measured_full_step():
    p = predict(_costs(), BOUNDARIES, "defer", [])
    assert p.ms_per_token == 15.0 and p.speedup == 1.0 and p.decision_ms == 0.0


def test_defer_by_hand():
    # 40% exit at 4: they pay segment 0 (4) + the candidate source (0.3) + one more position in segments 1, 2 (1.0)
    # the rest pay the full step (15) + the decision (0.3)
    p = predict(_costs(), BOUNDARIES, "defer", [(4, 0.4, 1.0)])
    want = 0.4 * (4 + 0.3 + 1.0) + 0.6 * (15 + 0.3)
    assert p.ms_per_token == pytest.approx(want)
    assert p.speedup == pytest.approx(15 / want) and p.decision_ms == pytest.approx(0.3)
    assert p.exit_rate == pytest.approx(0.4)


def test_two_exits_pay_the_decisions_they_pass():
    # exit 8 pays the candidates at 4 and the local exit at 8; tokens that exit at 4 never see exit 8
    p = predict(_costs(), BOUNDARIES, "defer", [(4, 0.1, 1.0), (8, 0.3, 1.0)])
    at4 = 4 + 0.3 + 1.0
    at8 = 8 + 0.35 + 0.5
    rest = 15 + 0.35
    assert p.ms_per_token == pytest.approx(0.1 * at4 + 0.3 * at8 + 0.6 * rest)
    assert p.decision_ms == pytest.approx(0.1 * 0.3 + 0.9 * 0.35)


def test_block_heads_are_paid_by_every_token_reaching_their_exit():
    # a block head at 8 (2 ms): tokens exiting at 4 never run it; those exiting at 8 and those going on pay it
    p = predict(_costs(block_ms={"8": 2.0}), BOUNDARIES, "defer", [(4, 0.1, 1.0), (8, 0.3, 1.0)])
    at4 = 4 + 0.3 + 1.0
    at8 = 8 + 0.35 + 2.0 + 0.5
    rest = 15 + 0.35 + 2.0
    assert p.ms_per_token == pytest.approx(0.1 * at4 + 0.3 * at8 + 0.6 * rest)
    assert _costs(block_ms={"8": 2.0}).block_layers(12) == {"8": 2.0}  # 1 ms per decoder layer here


def test_copy_pays_the_kv_graphs_of_skipped_segments():
    p = predict(_costs(), BOUNDARIES, "copy", [(4, 0.4, 1.0)])
    assert p.ms_per_token == pytest.approx(0.4 * (4 + 0.3 + 2 * 1.0) + 0.6 * 15.3)


def _simulate_verify(rate, precision, draft_ms, decision_ms, full_ms, block, steps=200_000, seed=0, check=None):
    """Verify as the runner runs it (policies.Verify): a step whose token may exit pays its decisions, then a draft
    (probability `rate`) or the full-depth pass that checks the waiting drafts; once `block` drafts wait, a forced
    pass without decisions checks them. The check emits the full model's token after the leading correct drafts."""
    rng = np.random.default_rng(seed)
    ms = tokens = 0.0
    drafts: list[bool] = []
    for _ in range(steps):
        if len(drafts) < block:
            ms += decision_ms
            if rng.random() < rate:
                ms += draft_ms
                drafts.append(bool(rng.random() < precision))
                continue
        ms += full_ms + (check(len(drafts)) if check is not None and drafts else 0.0)
        leading = next((i for i, ok in enumerate(drafts) if not ok), len(drafts))
        tokens += leading + 1
        drafts = []
    return ms / tokens


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("precision", [1.0, 0.9, 0.6])
def test_verify_cycle_is_verify_as_the_runner_runs_it(rate, precision):
    """Golden numbers from a simulation of the runner's verify (200k steps, seeded): within 1.5%."""
    ms, _ = verify_cycle(rate, precision, draft_ms=6.0, decision_ms=0.5, full_ms=20.0, block=8)
    assert ms == pytest.approx(_simulate_verify(rate, precision, 6.0, 0.5, 20.0, 8), rel=0.015)


@pytest.mark.parametrize("rate", [0.3, 0.7, 1.0])
def test_a_check_pass_costing_more_the_more_drafts_it_checks_is_priced_at_its_expectation(rate):
    """The check pass of k drafts costing check(k) on top (a convex width cost): golden numbers from the same seeded
    simulation, within 1.5%; and more than without it."""
    check = lambda k: 0.4 * k * k  # noqa: E731
    ms, _ = verify_cycle(rate, 0.9, draft_ms=6.0, decision_ms=0.5, full_ms=20.0, block=8, check=check)
    assert ms == pytest.approx(_simulate_verify(rate, 0.9, 6.0, 0.5, 20.0, 8, check=check), rel=0.015)
    assert ms > verify_cycle(rate, 0.9, draft_ms=6.0, decision_ms=0.5, full_ms=20.0, block=8)[0] * 1.01


def test_verify_pays_wide_passes_beyond_what_one_more_position_costs():
    """Export's wide passes (`Costs.wide_ms`) price the check of several drafts where they cost more than the linear
    model's one more position per draft: the third position and later, when ORT's one-row attention makes the second
    free. Where they cost no more than it, the prediction is the linear model's."""
    option = [(4, 0.6, 1.0)]
    linear = predict(_costs(), BOUNDARIES, "verify", option)
    cheap = predict(_costs(wide_ms={"1": 15.0, "2": 15.5, "3": 16.0, "5": 17.0}), BOUNDARIES, "verify", option)
    assert cheap.ms_per_token == pytest.approx(linear.ms_per_token, rel=1e-9)
    steep = predict(_costs(wide_ms={"1": 15.0, "2": 15.2, "3": 19.0, "5": 27.0}), BOUNDARIES, "verify", option)
    assert steep.ms_per_token > linear.ms_per_token * 1.02
    # the bench's model at realized exits (a measured loss rate) pays them too
    measured = predict(_costs(wide_ms={"1": 15.0, "2": 15.2, "3": 19.0, "5": 27.0}), BOUNDARIES, "verify", option, 0.0)
    assert measured.ms_per_token > predict(_costs(), BOUNDARIES, "verify", option, 0.0).ms_per_token * 1.02


def test_verify_prediction_has_no_jump_where_every_token_exits():
    """At an exit rate of 1 every step drafts until the block is full: the old chain formula, r / (1 - r) drafts
    after a wrong one, jumped from its cap (r -> 1) to a single draft (r = 1) and priced a losing option as a win."""
    near = predict(_costs(), BOUNDARIES, "verify", [(4, 0.999, 0.6)])
    every = predict(_costs(), BOUNDARIES, "verify", [(4, 1.0, 0.6)])
    assert near.ms_per_token == pytest.approx(every.ms_per_token, rel=0.01)
    assert every.speedup < 1.0  # 8 drafts at 60%: about 2.5 tokens for 8 draft steps and a check


def test_verify_loses_rejected_drafts_and_the_chain_after_them():
    exact = predict(_costs(), BOUNDARIES, "verify", [(4, 0.4, 1.0)])
    step = 0.4 * (4 + 0.3 + 1.0 + 0.2) + 0.6 * 15.3
    assert exact.ms_per_token == pytest.approx(step, rel=0.001) and exact.lost_per_step == 0.0
    wrong = predict(_costs(), BOUNDARIES, "verify", [(4, 0.4, 0.75)])
    assert wrong.lost_per_step > 0.0 and wrong.ms_per_token > exact.ms_per_token
    measured = predict(_costs(), BOUNDARIES, "verify", [(4, 0.4, None)], lost_rate=0.1)
    assert measured.ms_per_token == pytest.approx(step / 0.9)


def test_unexplained_step_time_is_spread_over_segment_calls():
    c = _costs(full_step_ms=18.0)  # 3 ms outside the timed graphs: 1 ms per segment call
    assert c.overhead_per_segment() == pytest.approx(1.0)
    p = predict(c, BOUNDARIES, "defer", [(4, 1.0, 1.0)])
    assert p.ms_per_token == pytest.approx(4 + 1 + 0.3 + 1.0)


def test_choose_the_fastest_and_fall_back_to_full_depth():
    options = [
        _option([4], [0.05]),  # pays too little
        _option([8], [0.5]),
        _option([4, 8], [0.02, 0.45]),  # exit 4 adds a decision to most tokens for 2% exits
        _option([4], [0.6], [0.9], kind="verify", target=0.9),
    ]
    plan = choose(_costs(), BOUNDARIES, options)
    assert plan.choices["defer"].exits == [8] and plan.choices["copy"].exits == [8]
    want = predict(_costs(), BOUNDARIES, "defer", [(8, 0.5, 1.0)]).speedup
    assert plan.choices["defer"].prediction.speedup == pytest.approx(want)
    assert plan.choices["verify"].exits == [4]  # only verify options are verify's
    # the default is lossless: verify's choice, though defer is predicted faster (a lossy default needs a sequence
    # certificate: tests/test_guarantee.py)
    assert plan.default == "verify"
    lossy = choose(_costs(), BOUNDARIES, [_option([4], [0.9]), _option([4], [0.2], [0.9], kind="verify", target=0.9)])
    assert lossy.choices["defer"].prediction.speedup > lossy.choices["verify"].prediction.speedup > 1 + MIN_GAIN
    assert lossy.default == "verify"
    # nothing is predicted MIN_GAIN faster: full depth, with the best option kept for the one-line explanation
    slow = choose(_costs(), BOUNDARIES, [_option([8], [0.02])])
    assert slow.default == "full" and slow.choices["defer"].exits == []
    assert slow.choices["defer"].prediction.speedup == 1.0 and slow.choices["defer"].best is not None
    assert slow.choices["defer"].best.speedup < 1 + MIN_GAIN
    assert "full depth" in slow.summary() and "defer at exits [8]" in slow.summary()
    # copy is never the default, even when it is the fastest
    only_copy = choose(_costs(kv_ms=[0.0, 0.0, 0.0], segment_extra_ms=[3.0] * 3), BOUNDARIES, [_option([4], [0.5])])
    assert only_copy.choices["copy"].exits == [4] and only_copy.default != "copy"


def test_options_at_exits_the_artifact_lacks_are_skipped():
    plan = choose(_costs(), BOUNDARIES, [_option([6], [0.9])])
    assert plan.default == "full" and plan.choices["defer"].best is None


def test_river_pays_the_int4_copies_after_its_exit_and_the_final_head_at_its_end():
    c = _costs(river_ms=[None, 1.5, 1.5])
    end = predict(c, BOUNDARIES, "river", [(4, 0.4, 1.0)])
    # exit at 4: segment 0 (4) + the candidates (0.3) + the int4 copies of segments 1, 2 (3.0) + the final head (3)
    assert end.ms_per_token == pytest.approx(0.4 * (4 + 0.3 + 3.0 + 3.0) + 0.6 * 15.3)
    at_exit = predict(c, BOUNDARIES, "river-exit", [(4, 0.4, 1.0)])  # the exit's own prediction: no final head
    assert at_exit.ms_per_token == pytest.approx(0.4 * (4 + 0.3 + 3.0) + 0.6 * 15.3)
    quantized_head = predict(_costs(river_ms=[None, 1.5, 1.5], river_head_ms=1.0), BOUNDARIES, "river", [(8, 1.0, 1.0)])
    assert quantized_head.ms_per_token == pytest.approx(8 + 0.3 + 1.5 + 1.0)  # exit 8 alone: its candidates
    with pytest.raises(ValueError, match="river"):
        predict(_costs(), BOUNDARIES, "river", [(4, 0.4, 1.0)])  # costs without river timings


def test_a_state_only_signal_pays_the_exit_head_only_for_tokens_that_take_their_own_prediction():
    # cosine: deciding reads block states (0.02 ms); an exiting token's own token costs the exit's LM head (3 ms)
    c = _costs(
        candidates_ms={"4": 0.02, "8": 0.02}, local_ms={"4": 0.02, "8": 0.02}, exit_predict_ms={"4": 3.0, "8": 3.0}
    )
    defer = predict(c, BOUNDARIES, "defer", [(4, 0.4, 1.0)])
    assert defer.ms_per_token == pytest.approx(0.4 * (4 + 0.02 + 3.0 + 1.0) + 0.6 * 15.02)
    river = predict(c.model_copy(update={"river_ms": [None, 1.5, 1.5]}), BOUNDARIES, "river", [(4, 0.4, 1.0)])
    assert river.ms_per_token == pytest.approx(
        0.4 * (4 + 0.02 + 3.0 + 3.0) + 0.6 * 15.02
    )  # the final head, not the exit's


def test_speedups_are_against_the_chained_full_depth_step_where_the_runner_has_one():
    # costs timed before exit steps ran on the chain (an older manifest: per-call binding 18 ms, the bound chain 15):
    # exiting tokens and the tokens that pass every exit priced at the per-call step, full depth with no exit at the
    # chain's, so that is the baseline
    general = _costs(full_step_ms=18.0)
    chained = _costs(full_step_ms=18.0, chain_step_ms=15.0)
    assert chained.baseline_ms() == 15.0 and general.baseline_ms() == 18.0
    a = predict(general, BOUNDARIES, "defer", [(4, 0.4, 1.0)])
    b = predict(chained, BOUNDARIES, "defer", [(4, 0.4, 1.0)])
    assert b.ms_per_token == pytest.approx(a.ms_per_token)  # the same work per token
    assert b.full_ms == 15.0 and b.speedup == pytest.approx(15.0 / a.ms_per_token)
    assert b.speedup == pytest.approx(a.speedup * 15.0 / 18.0)
    none = predict(chained, BOUNDARIES, "defer", [])
    assert none.ms_per_token == 15.0 and none.speedup == 1.0


def test_bound_exit_steps_pay_the_chain():
    # per-call step 18 ms (2 ms of overhead over 3 segments), chain 15 (none): with bound exits, an exiting token
    # pays no overhead, and a passing token the chain's step, pending positions or not (the chain's wide calls:
    # the extra position is charged to the token that exited, in its later segments)
    costs = _costs(full_step_ms=18.0, chain_step_ms=15.0, bound_exits=True)
    assert costs.overhead_per_segment(bound=True) == 0.0 and costs.overhead_per_segment() == pytest.approx(1.0)
    p = predict(costs, BOUNDARIES, "defer", [(4, 0.4, 1.0)])
    assert p.ms_per_token == pytest.approx(0.4 * (4 + 0.3 + 1.0) + 0.6 * (15.0 + 0.3))
    c = predict(costs, BOUNDARIES, "copy", [(4, 0.4, 1.0)])
    assert c.ms_per_token == pytest.approx(0.4 * (4 + 0.3 + 2.0) + 0.6 * (15.0 + 0.3))
    # the river's steps run on the chain too (its int4 copies called from the policy's hook): a passing token pays
    # the chain's step, an exiting one no overhead beside its int4 calls and the head at the river's end
    r = _costs(full_step_ms=18.0, chain_step_ms=15.0, river_ms=[1.0, 1.0, 1.0])
    rb = r.model_copy(update={"bound_exits": True})
    river = [(4, 0.4, 1.0)]
    general, bound = (predict(x, BOUNDARIES, "river", river).ms_per_token for x in (r, rb))
    assert bound == pytest.approx(0.4 * (4 + 0.3 + 2 * 1.0 + 3.0) + 0.6 * (15.0 + 0.3)) and bound < general


# --- intervals: the plan's choice under cost noise ---------------------------------------------------------------


def _noisy(seed: int, noise: float = 0.2, rounds: int = 15, base: Costs | None = None) -> Costs:
    """`base` (default `_costs()`) as a measurement would see it: each graph's time per round is its true value
    times the round's load (shared by every graph timed in it, 3%) times its own noise (`noise`, lognormal);
    each figure is the median of its rounds, as plan/costs.py computes it."""
    c = base or _costs()
    rng = np.random.default_rng(seed)
    true = {"full_step_ms": c.full_step_ms, "final_head_ms": c.final_head_ms, "final_head_extra_ms": 0.2}
    for i in range(3):
        true |= {f"segment_ms.{i}": c.segment_ms[i], f"segment_extra_ms.{i}": c.segment_extra_ms[i]}
        true[f"kv_ms.{i}"] = c.kv_ms[i]
    for e in ("4", "8"):
        true |= {f"candidates_ms.{e}": c.candidates_ms[e], f"local_ms.{e}": c.local_ms[e]}
    load = rng.lognormal(0.0, 0.03, rounds)
    samples = {p: (v * load * rng.lognormal(0.0, noise, rounds)).tolist() for p, v in true.items()}
    return c.model_copy(update={"samples_ms": samples}).with_values(
        {p: float(np.median(v)) for p, v in samples.items()}
    )


def test_a_configuration_at_the_line_runs_at_full_depth_whatever_the_noise():
    # defer at exit 8 with 11.3% coverage is truly 1.0298x (the line is 1.03): under 20% per-sample noise over 15
    # rounds its point estimate lands on either side of the line (the point rule flips from seed to seed), while the
    # low end of its 90% interval stays below it (simulated over 300 seeds: activated in 2, 0.7%; the point rule
    # in 82). Fixed seeds: this checks those 20, not a rate
    option = _option([8], [0.113])
    assert predict(_costs(), BOUNDARIES, "defer", [(8, 0.113, 1.0)]).speedup == pytest.approx(1.0298, abs=1e-4)
    plans = [choose(_noisy(seed), BOUNDARIES, [option]) for seed in range(20)]
    points = [p.choices["defer"].best.speedup for p in plans]
    assert min(points) < 1 + MIN_GAIN <= max(points)  # the noise does reach across the line
    assert all(p.default == "full" and p.choices["defer"].exits == [] for p in plans)
    for p in plans:
        best = p.choices["defer"].best
        assert best.interval is not None and best.low() < 1 + MIN_GAIN and best.low() <= best.speedup <= best.high()
    assert "[" in plans[0].summary() and "90% interval" in plans[0].summary()
    assert "full depth" in plans[0].summary()


def test_a_clear_winner_still_wins_under_the_same_noise():
    option = _option([8], [0.3])  # truly 1.124x
    plans = [choose(_noisy(seed), BOUNDARIES, [option]) for seed in range(20)]
    assert all(p.default == "full" and p.choices["defer"].exits == [8] for p in plans)  # chosen, not the default
    assert all(p.choices["defer"].prediction.low() >= 1 + MIN_GAIN for p in plans)
    assert plans[0].undecided() == [] and "defer at exits [8]" in plans[0].summary()


def test_among_options_that_clear_the_line_the_fastest_point_estimate_is_chosen():
    plan = choose(_noisy(0), BOUNDARIES, [_option([8], [0.3]), _option([8], [0.5]), _option([8], [0.113])])
    assert plan.choices["defer"].option is not None and plan.choices["defer"].option.per_exit[0].coverage == 0.5


def test_costs_without_samples_plan_on_their_point_estimates():
    # an artifact exported before the intervals: its medians are taken as exact, so the choice is the point rule's
    # (what that artifact's plan was), and the one line says the figure is a point estimate
    c = _costs()
    assert c.samples_ms is None and c.resamples() == []
    above = choose(c, BOUNDARIES, [_option([8], [0.12])])  # 1.032x
    assert above.choices["defer"].exits == [8] and above.choices["defer"].prediction.interval is None
    below = choose(c, BOUNDARIES, [_option([8], [0.11])])  # 1.029x
    assert below.default == "full" and "point estimate" in below.summary() and below.undecided() == []


def test_resampling_keeps_rounds_together_and_is_deterministic():
    c = _noisy(3, rounds=9)
    assert c.rounds() == 9 and c.segment_ms[1] == pytest.approx(np.median(c.samples_ms["segment_ms.1"]))
    a, b = c.resamples(5), c.resamples(5)
    assert [x.segment_ms for x in a] == [x.segment_ms for x in b]  # fixed seed: the same costs, the same plan
    # a graph timed at the same value in every round never moves, whatever the rounds drawn
    flat = c.model_copy(update={"samples_ms": {**c.samples_ms, "final_head_ms": [3.0] * 9}})
    assert {x.final_head_ms for x in flat.resamples(20)} == {3.0}
    # whole rounds are drawn: two graphs timed identically in every round stay identical in every replicate
    same = dict(c.samples_ms)
    same["segment_ms.2"] = list(same["segment_ms.0"])
    assert all(x.segment_ms[0] == x.segment_ms[2] for x in c.model_copy(update={"samples_ms": same}).resamples(20))
    assert c.with_values({"candidates_ms.8": 9.0}).candidates_ms == {"4": c.candidates_ms["4"], "8": 9.0}
    assert c.candidates_ms["8"] != 9.0  # a copy: the original is untouched


def test_undecided_when_the_best_interval_straddles_the_line():
    plan = choose(_noisy(0), BOUNDARIES, [_option([8], [0.113])])
    best = plan.choices["defer"].best
    assert best is not None and best.low() < 1 + MIN_GAIN
    assert ("defer" in plan.undecided()) == (best.high() >= 1 + MIN_GAIN)
    slow = choose(_noisy(0), BOUNDARIES, [_option([8], [0.02])])  # clearly below the line: decided
    assert slow.undecided() == []


def _with_units(option: Option, exits_per_unit: list[int], tokens: int = 100) -> Option:
    """`option` (one exit, always right) judged on units of `tokens` tokens exiting that many times each."""
    units = Option.units_text([[tokens, k, k, 0, 0] for k in exits_per_unit])
    share = sum(exits_per_unit) / (tokens * len(exits_per_unit))
    per_exit = [option.per_exit[0].model_copy(update={"coverage": share})]
    return option.model_copy(update={"units": units, "per_exit": per_exit})


def test_the_calibration_samples_spread_widens_the_interval_and_is_not_retimed():
    """An option whose exits vary from unit to unit of the calibration sample gets an interval that spans that
    spread (a bootstrap over its units) besides the timing's: it is not activated when only the timing clears the
    line, and the plan is not undecided for it (more timing cannot narrow which units calibration held)."""
    costs = _noisy(0)
    steady = _with_units(_option([8], [0.3]), [30] * 8)  # 1.124x at every unit
    spread = _with_units(_option([8], [0.3]), [0] * 6 + [120] * 2)  # the same mean: 2 units of 8 exit, 6 never
    a = choose(costs, BOUNDARIES, [steady]).choices["defer"]
    b = choose(costs, BOUNDARIES, [spread]).choices["defer"]
    assert a.exits == [8] and b.exits == []
    pa, pb = a.prediction, b.best
    assert pb is not None and pa.speedup == pytest.approx(pb.speedup)
    assert pb.timing == pytest.approx(pa.timing) and pb.low() < 1 + MIN_GAIN < pa.low()
    assert pb.high() - pb.low() > 3 * (pa.high() - pa.low())  # the sample's spread dominates
    lo, hi = pb.timing
    assert lo >= 1 + MIN_GAIN  # the timing alone clears the line: nothing for more timing to decide
    plan = choose(costs, BOUNDARIES, [spread])
    assert plan.undecided() == []
    # an option written before units were recorded: the timing's interval alone, as before
    plain = choose(costs, BOUNDARIES, [_option([8], [0.3])]).choices["defer"].prediction
    assert plain.timing is None and plain.interval == pytest.approx(pa.timing)


# --- fidelity: per-token disagreement compounded over a continuation ------------------------------------------


def test_sequence_agreement_is_the_mean_survival_and_matches_a_simulation():
    from eectl.plan.choose import sequence_agreement

    assert sequence_agreement(0.0, 48) == 1.0 and sequence_agreement(0.01, 0) == 1.0
    assert sequence_agreement(1.0, 48) == 0.0
    for h, n in ((0.003, 48), (0.01, 64), (0.2, 5)):
        direct = sum((1 - h) ** i for i in range(1, n + 1)) / n  # position i agrees iff no disagreement at 1..i
        assert sequence_agreement(h, n) == pytest.approx(direct, rel=1e-12)
    # independent disagreements, the first one parting the continuation for good: a seeded simulation
    rng = np.random.default_rng(0)
    h, n = 0.01, 64
    wrong = rng.random((20000, n)) < h
    parted = np.cumsum(wrong, axis=1) > 0
    assert sequence_agreement(h, n) == pytest.approx(1 - parted.mean(), abs=0.003)  # 20,000 sequences: se ~0.001
    assert sequence_agreement(0.003, 48) < 1 - 0.003  # a sequence agrees less than a token does


def test_bench_predicts_agreement_for_planned_copy_and_defer_only():
    from types import SimpleNamespace

    from eectl.evaluate.predicted import predictions as _predictions
    from eectl.evaluate.results import ConfigResult
    from eectl.plan.choose import sequence_agreement
    from eectl.runtime.state import RunConfig

    target = _option([4], [0.5], precision=[0.99])
    target.agreement = 0.995  # held-out, over all generated tokens: half exit, 1% of those wrong
    verify = _option([4], [0.6], precision=[0.9], kind="verify", target=0.9)
    plan = choose(_costs(), BOUNDARIES, [target, verify])
    m = SimpleNamespace(plan=plan, costs=None)

    def predicted(policy: str, planned: bool = True, exits=(4,)) -> float | None:
        res = ConfigResult(name=policy, ms_per_token=1.0, ms_per_token_spread=(1.0, 1.0), tokens_per_s=1.0,
                           throughput=1.0, ttft_ms=1.0, rss_mb=1.0)  # fmt: skip
        cfg = RunConfig(exits=list(exits), thresholds={}, policy=policy, max_new_tokens=48, planned=planned)
        _predictions(res, cfg, m, [])
        return res.predicted_agreement

    assert plan.choices["defer"].exits == [4] and plan.choices["verify"].exits == [4]
    assert predicted("defer") == pytest.approx(sequence_agreement(0.005, 48))  # 0.89: 0.5% per token, 48 tokens
    assert predicted("copy") == pytest.approx(sequence_agreement(0.005, 48))
    assert predicted("verify") is None  # lossless: nothing to predict
    assert predicted("defer", planned=False) is None  # forced exits/thresholds: no calibrated option behind them
    assert predicted("defer", exits=()) is None  # the plan ran full depth


def test_the_greedy_head_is_priced_as_the_chain_runs_it():
    """Both timed steps run the full head; where the artifact has a certified head, the baseline swaps it in: its
    own time plus the full head's for the share of validation's states it did not pass (all of them when unknown)."""
    plain = _costs(chain_step_ms=20.0, final_head_ms=4.0)
    assert plain.head_ms() == 4.0 and plain.baseline_ms() == 20.0
    cert = _costs(chain_step_ms=20.0, final_head_ms=4.0, certified_head_ms=1.0, certified_miss=0.1)
    assert cert.head_ms() == pytest.approx(1.4) and cert.baseline_ms() == pytest.approx(17.4)
    unknown = _costs(chain_step_ms=20.0, final_head_ms=4.0, certified_head_ms=1.0)
    assert unknown.head_ms() == pytest.approx(5.0) and unknown.baseline_ms() == pytest.approx(21.0)


def test_wide_passes_timed_with_the_full_head_get_decodes_greedy_head():
    """Wide passes timed with the full head (`Costs.wide_full_head`) are priced with the head decode runs over their
    rows: the certified head, plus the full head over every row where any row misses, each at its timed row counts
    (interpolated; without them, one more row's extra each); timed the old way (with the certified head), as timed."""
    from eectl.plan.lookup import wide_steps

    kw = dict(chain_step_ms=20.0, final_head_ms=4.0, final_head_extra_ms=0.5, certified_head_ms=1.0)
    kw |= dict(certified_miss=0.1, wide_ms={"1": 20.0, "2": 21.0, "3": 23.0, "5": 26.0})
    assert wide_steps(_costs(**kw), [1, 2, 3]) == [20.0, 21.0, 23.0]
    untimed = _costs(wide_full_head=True, **kw)
    assert untimed.greedy_head_ms(1) == pytest.approx(untimed.head_ms()) == pytest.approx(1.4)
    # two rows: the certified head as one row; both pass with 0.9^2, else the full head over both (4.0 + 0.5)
    assert untimed.greedy_head_ms(2) == pytest.approx(1.0 + 0.19 * 4.5)
    rows = dict(head_rows_ms={"2": 4.1, "3": 5.0}, certified_rows_ms={"2": 1.05, "3": 1.5})
    timed = _costs(wide_full_head=True, **rows, **kw)
    assert timed.full_head_ms(2) == 4.1 and timed.full_head_ms(5) == pytest.approx(5.0 + 2 * 0.9)  # its last slope
    assert timed.greedy_head_ms(3) == pytest.approx(1.5 + 0.271 * 5.0)
    got = wide_steps(timed, [1, 2, 3, 4])
    want = [20.0 - 4.0 + 1.4, 21.0 - 4.1 + 1.05 + 0.19 * 4.1, 23.0 - 5.0 + 1.5 + 0.271 * 5.0]
    five = 26.0 - 6.8 + 2.4 + 0.40951 * 6.8  # five rows: both heads at their last slope
    assert got[:3] == pytest.approx(want) and got[3] == pytest.approx((want[2] + five) / 2)
    assert got[0] == pytest.approx(timed.baseline_ms())  # a step that drafts nothing is the chain's full-depth step
    plain = _costs(**{**kw, "certified_head_ms": None}, wide_full_head=True)  # no certified head: the full head
    assert wide_steps(plain, [1, 2, 3]) == [20.0, 21.0, 23.0]
