"""Verify drafting ahead priced at a run's own length (plan/length.py `plan_for_run`, plan/ahead.py
`ahead_at_length`): the plan's entry keeps its exit and bound, is priced again on calibration's traces cut at the
run's --max-new-tokens (`AheadTraces.at_length`), its interval and `on` recomputed as export computed them, and the
lossless default is chosen again; calibration files without traces leave the entry as exported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eectl.contracts.calibration import AheadTraces
from eectl.contracts.plan import AHEAD, AheadChoice, Choice, Plan, Prediction
from eectl.plan.ahead import ahead_choice, choose_ahead
from eectl.plan.choose import lossless_default
from eectl.plan.length import plan_for_run
from tests.tiny import toy_costs

BOUNDARIES = [4, 8, 12]  # three segments (L = 12): the drafter can sit at 4 or 8
LENGTH = 64  # calibration's continuations: 63 traced positions each (a generated token but the last)
REL = 1e-9  # the same arithmetic on the same cycles: speedups equal to rounding (intervals are rounded to 4 places)

SURE_RIGHT, SURE_WRONG = (0.99, True), (0.99, False)  # drafted at every bound; kept, or rolled back
UNSURE_WRONG = (0.95, False)  # drafted below 0.95 only


def _signed(steps: list[tuple[float, bool]]) -> list[float]:
    return [p if ok else -p for p, ok in steps]


def _traced(early: tuple[float, bool], late: tuple[float, bool]) -> AheadTraces:
    """Four continuations, each `early` for its first 12-18 positions (a prompt apiece) and `late` for the rest."""
    per = [_signed([early] * n + [late] * (LENGTH - 1 - n)) for n in (12, 14, 16, 18)]
    return AheadTraces(top_k=8, signed={"4": per, "8": per})


def _verify(low: float | None) -> dict[str, Choice]:
    """Verify's choice: exits at 8 whose interval's low end is `low` (None: full depth, nothing cleared)."""
    if low is None:
        pred = Prediction(policy="verify", exits=[], ms_per_token=15.0, full_ms=15.0, speedup=1.0, decision_ms=0.0,
                          exit_rate=0.0)  # fmt: skip
        return {"verify": Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=pred)}
    pred = Prediction(policy="verify", exits=[8], ms_per_token=14.0, full_ms=15.0, speedup=low + 0.02,
                      decision_ms=0.3, exit_rate=0.3, interval=(low, low + 0.04))  # fmt: skip
    return {"verify": Choice(policy="verify", exits=[8], thresholds={}, option=None, prediction=pred, best=pred)}


def _exported(traced: AheadTraces, verify_low: float | None) -> Plan:
    """The plan as export makes it (plan/choose.py `plan_manifest`): the drafter chosen on the traces, the default
    by `lossless_default`."""
    ahead = choose_ahead(toy_costs(), BOUNDARIES, {e: traced.traces(e) for e in (4, 8)})
    assert ahead is not None
    plan = Plan(default="full", choices=_verify(verify_low), ahead=ahead)
    plan.default = lossless_default(plan)
    return plan


def _manifest(plan: Plan, traced: AheadTraces | None) -> SimpleNamespace:
    segments = [SimpleNamespace(layers=(lo, hi)) for lo, hi in zip([0, *BOUNDARIES], BOUNDARIES, strict=False)]
    return SimpleNamespace(plan=plan, costs=toy_costs(), calibration=SimpleNamespace(lookup=None, ahead=traced),
                           segments=segments)  # fmt: skip


def test_the_traces_of_a_run_are_its_first_tokens_minus_one_positions():
    traced = _traced(SURE_WRONG, SURE_RIGHT)
    cut = traced.at_length(16)
    assert all(len(t) == 15 for per in cut.signed.values() for t in per)
    assert cut.signed["4"][0] == traced.signed["4"][0][:15]
    assert traced.at_length(LENGTH) is traced and traced.at_length(500) is traced  # nothing cut
    assert all(t == [] for t in traced.at_length(1).signed["8"])


def test_a_drafter_that_pays_late_only_gives_way_in_a_short_run():
    """Confident wrong drafts early, right ones late: on 64-token answers the drafter is on and the default (its low
    end above verify's); in a 16-token run it is off at the same exit and bound, and verify is the default again."""
    traced = _traced(UNSURE_WRONG, SURE_RIGHT)
    plan = _exported(traced, verify_low=1.05)
    assert plan.ahead is not None and plan.ahead.on and plan.default == AHEAD
    assert plan.ahead.prediction.low() > 1.05
    short = plan_for_run(_manifest(plan, traced), 16)
    assert short is not None and short.ahead is not None and short.tokens == 16
    assert (short.ahead.exit, short.ahead.bound) == (plan.ahead.exit, plan.ahead.bound)
    assert not short.ahead.on and short.ahead.prediction.speedup < 1.0 and short.default == "verify"
    assert short.choices == plan.choices and plan.default == AHEAD and plan.tokens is None  # the manifest's untouched
    # without verify's choice the short run falls back to full depth
    bare = plan_for_run(_manifest(_exported(traced, verify_low=None), traced), 16)
    assert bare is not None and bare.default == "full"


def test_a_drafter_that_pays_early_only_takes_the_default_in_a_short_run():
    """Right drafts early, confident wrong ones late: off on 64-token answers (full depth the default); a 16-token
    run prices its exit and bound on the early positions, where it pays, and makes it the default."""
    traced = _traced(SURE_RIGHT, SURE_WRONG)
    plan = _exported(traced, verify_low=None)
    assert plan.ahead is not None and not plan.ahead.on and plan.default == "full"
    short = plan_for_run(_manifest(plan, traced), 16)
    assert short is not None and short.ahead is not None
    assert (short.ahead.exit, short.ahead.bound) == (plan.ahead.exit, plan.ahead.bound)
    assert short.ahead.on and short.ahead.prediction.low() >= 1.0 + plan.min_gain and short.default == AHEAD
    line = short.summary()  # run's and bench's plan line
    assert f"verify drafting ahead at exit {short.ahead.exit}" in line and short.ahead.prediction.describe() in line
    assert line.endswith("priced for answers of up to 16 tokens")


def test_without_traces_the_entry_stays_as_exported():
    """Calibration files written before the traces (or none at the entry's exit): the entry as exported, and a plan
    nothing else moves is returned as it is."""
    traced = _traced(SURE_RIGHT, SURE_WRONG)
    plan = _exported(traced, verify_low=None)
    assert plan_for_run(_manifest(plan, None), 16) is plan
    other = traced.model_copy(update={"signed": {"12": traced.signed["4"]}})  # traced elsewhere only
    assert plan_for_run(_manifest(plan, other), 16) is plan
    no_cal = SimpleNamespace(**{**vars(_manifest(plan, None)), "calibration": None})
    assert plan_for_run(no_cal, 16) is plan


def test_the_price_at_a_length_is_exports_on_answers_of_that_length():
    """At calibration's own length the entry is export's, exactly; at 16 tokens it is what export prices (at the
    same exit and bound) from a calibration whose continuations were 16 tokens long, to REL."""
    traced = _traced(SURE_RIGHT, SURE_WRONG)
    plan = _exported(traced, verify_low=None)
    assert plan_for_run(_manifest(plan, traced), LENGTH) is plan
    assert plan.ahead is not None
    short = plan_for_run(_manifest(plan, traced), 16)
    assert short is not None and short.ahead is not None
    cut = [(p[:15], r[:15]) for p, r in traced.traces(plan.ahead.exit)]
    want: AheadChoice = ahead_choice(toy_costs(), BOUNDARIES, plan.ahead.exit, cut, plan.ahead.bound)
    got = short.ahead.prediction
    assert got.speedup == pytest.approx(want.prediction.speedup, rel=REL)
    assert got.ms_per_token == pytest.approx(want.prediction.ms_per_token, rel=REL)
    assert got.interval == pytest.approx(want.prediction.interval, abs=1e-4)
    assert (short.ahead.drafts, short.ahead.accepted, short.ahead.by_position) == (
        want.drafts,
        want.accepted,
        want.by_position,
    )
