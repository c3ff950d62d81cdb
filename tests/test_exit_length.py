"""Exits priced at a run's own length: calibration keeps each option's counts per block of positions in the answer
(`Option.blocks`), and a run of --max-new-tokens N is priced on the first N positions (`Option.at_length`), beyond
the positions judged on the second half of them. Measured on the default model (verify [8], 24 GSM8K answers of 64
tokens): 51% of positions 0-15 exit, 27.6% of 16-31, 26.3% of 32-47, 25.3% of 48-63."""

from __future__ import annotations

import pytest
import torch

from eectl.calibrate.fit import fit_options
from eectl.contracts.options import POSITION_BLOCK, ExitOption, Option
from eectl.exits.measure import SOURCES, Measurements


def test_positions_count_each_units_tokens_in_order():
    """Rows of two sources and three units, interleaved: each row's rank among its own unit's rows."""
    source = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0])
    unit = torch.tensor([0, 0, 1, 0, 0, 1, 1, 1])
    meas = Measurements(exits=[2], num_layers=4, values={"prob": torch.zeros(1, 8)},
                        correct=torch.zeros(1, 8, dtype=torch.bool), source=source, unit=unit)  # fmt: skip
    assert meas.positions().tolist() == [0, 0, 0, 1, 1, 1, 2, 0]


def _option(blocks: list[list[int]]) -> Option:
    n = sum(r[0] for r in blocks)
    exited, right = sum(r[1] for r in blocks), sum(r[2] for r in blocks)
    x = ExitOption(layer=8, thresholds={"prob": 0.9}, coverage=exited / n, precision=right / exited)
    return Option(exits=[8], kind="verify", target=0.9, confidence=None, per_exit=[x], agreement=0.99,
                  blocks=Option.units_text(blocks))  # fmt: skip


def test_an_option_at_a_length_counts_its_first_positions():
    # 10 answers of 32 positions: half of the first block exits, a quarter of the later ones
    blocks = [[80, 40, 40, 0, 0], [80, 20, 19, 0, 0], [80, 20, 18, 0, 0], [80, 20, 20, 0, 0]]
    opt = _option(blocks)
    assert opt.exit_rate == pytest.approx(100 / 320)
    assert opt.at_length(8).exit_rate == pytest.approx(0.5) and opt.at_length(8).per_exit[0].precision == 1.0
    assert opt.at_length(16).exit_rate == pytest.approx(60 / 160)
    assert opt.at_length(9).exit_rate == pytest.approx(60 / 160)  # a block begun counts whole
    assert opt.at_length(32).exit_rate == pytest.approx(100 / 320)
    # 64 positions: 32 more per answer (320 tokens) at the second half's rates (40 of 160 exit, 38 of them right)
    long = opt.at_length(64)
    assert long.exit_rate == pytest.approx((100 + 80) / (320 + 320))
    assert long.per_exit[0].precision == pytest.approx((97 + 76) / 180)
    assert long.per_exit[0].thresholds == {"prob": 0.9} and long.exits == [8]
    plain = opt.model_copy(update={"blocks": ""})  # a calibration file written before blocks
    assert plain.at_length(8) is plain


def test_calibrate_keeps_each_options_counts_by_position():
    """The menu's options carry blocks of POSITION_BLOCK positions whose counts add up to the option's own."""
    g = torch.Generator().manual_seed(0)
    units, length = 30, 24
    n = units * length
    pos = torch.arange(n) % length
    values = torch.rand(2, n, generator=g) + (pos < 8).float() * 0.5  # early positions more confident
    correct = torch.rand(2, n, generator=g) < 0.5 + 0.4 * values.clamp(max=1.0)
    generated = torch.full((n,), SOURCES.index("generated"))
    meas = Measurements(exits=[2, 4], num_layers=6, values={"prob": values}, correct=correct, source=generated,
                        unit=torch.arange(n) // length)  # fmt: skip
    menu = fit_options(meas, target=0.6, confidence=None, holdout=0.2)
    assert menu
    for opt in menu:
        rows = opt.block_rows()
        assert len(rows) == length // POSITION_BLOCK and all(r[0] == units * POSITION_BLOCK for r in rows)
        whole = opt.at_length(length)
        for a, b in zip(whole.per_exit, opt.per_exit, strict=True):
            assert a.coverage == pytest.approx(b.coverage) and a.precision == pytest.approx(b.precision)
    early = [o for o in menu if o.exit_rate > 0]
    assert any(o.at_length(8).exit_rate > o.exit_rate for o in early)  # the confident first block exits more


def test_a_run_prices_the_plans_exits_at_its_length():
    """plan/length.py: the plan's verify choice priced on its option's first N positions (the exits stay), its
    interval moved by the same ratio; the default follows (verify while its low end clears the line)."""
    from types import SimpleNamespace

    from eectl.contracts.plan import Choice, Costs, Plan
    from eectl.plan.choose import predict_option
    from eectl.plan.length import plan_for_run

    costs = Costs(
        provider="cpu", threads=1, past=128, repeats=5, embed_ms=0.0, segment_ms=[4.0, 16.0],
        segment_extra_ms=[0.5, 0.5], kv_ms=[1.0, 1.0], final_head_ms=2.0, final_head_extra_ms=0.2,
        candidates_ms={"8": 0.2}, local_ms={"8": 0.3}, full_step_ms=22.0,
    )  # fmt: skip
    boundaries = [8, 30]
    # exits at 8: 60% of the first 8 positions, 10% later; precision 0.9 throughout
    blocks = [[80, 48, 43, 0, 0]] + [[80, 8, 7, 0, 0]] * 7
    opt = _option(blocks)
    pred = predict_option(costs, boundaries, "verify", opt)
    pred = pred.model_copy(update={"interval": (pred.speedup * 0.98, pred.speedup * 1.02)})
    choice = Choice(policy="verify", exits=[8], thresholds={}, option=opt, prediction=pred, best=pred)
    plan = Plan(default="verify", choices={"verify": choice})
    m = SimpleNamespace(plan=plan, costs=costs, calibration=None, segments=[SimpleNamespace(layers=(0, 8)),
                        SimpleNamespace(layers=(8, 30))])  # fmt: skip
    short = plan_for_run(m, 8)
    got = short.choices["verify"].prediction
    want = predict_option(costs, boundaries, "verify", opt.at_length(8))
    assert got.speedup == pytest.approx(want.speedup) and got.speedup > pred.speedup
    assert got.interval == pytest.approx((got.speedup * 0.98, got.speedup * 1.02))
    assert short.choices["verify"].exits == [8] and short.default == "verify"
    assert short.summary().endswith("priced for answers of up to 8 tokens") and plan.tokens is None
    assert plan_for_run(m, 64) is not plan and plan.choices["verify"].prediction == pred  # the manifest's untouched
    # 400 tokens: the late rate almost alone, 1.068x with a low end (x 0.98) of 1.046: verify still clears the line;
    # a plan whose line is 1.05 runs full depth there
    assert plan_for_run(m, 400).default == "verify"
    stricter = SimpleNamespace(**{**vars(m), "plan": plan.model_copy(update={"min_gain": 0.05})})
    assert plan_for_run(stricter, 400).default == "full" and plan_for_run(stricter, 8).default == "verify"
