"""Exit gates (eectl.exits.gates): the fit, the threshold, the gated replay calibrate fits options on (candidates
picked at
the first exit whose gate opens), thresholds that never pass a decision a gate skipped, the cost model's decision
shares, and gated options in a calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model
from eectl.calibrate.fit import OPTION_FOLDS, fit_gates, fit_options, options_judge, unit_folds
from eectl.contracts.calibration import Calibration
from eectl.contracts.gates import GATE, Gate
from eectl.contracts.options import Option
from eectl.contracts.plan import Costs
from eectl.data import token_chunks
from eectl.errors import UsageError
from eectl.exits.base import TorchExitLogits
from eectl.exits.candidates import Shortlist
from eectl.exits.gates import active_gates, fit_gate, gate_logits, gate_open, gate_threshold
from eectl.exits.measure import ExitScorer, Measurements, measure_text_all
from eectl.exits.signals import ExitScoring
from eectl.exits.thresholds import assign_exits, fit_thresholds
from eectl.plan.choose import predict, predict_option

K = 8


def test_fit_gate_separates_and_folds_the_standardisation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 16, generator=g) * torch.linspace(0.1, 10, 16) + 3.0  # scales and offsets differ
    direction = torch.randn(16, generator=g)
    y = (x - 3.0) / torch.linspace(0.1, 10, 16) @ direction > 1.0
    gate = fit_gate(x, y)
    logits = gate_logits(x, *gate.arrays())
    # on raw states: positives ranked above negatives (AUC), without the fit's mean and scale
    pos, neg = logits[y], logits[~y]
    auc = float((pos[:, None] > neg[None, :]).double().mean())
    assert auc > 0.99, auc
    # numpy (the runner, one state at a time) and torch (calibrate, a batch) agree within float32 rounding
    one = np.array([gate_logits(row, *gate.arrays()) for row in x.numpy()])
    np.testing.assert_allclose(one, logits.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(gate_logits(x.numpy(), *gate.arrays()), logits.numpy(), rtol=1e-5, atol=1e-4)
    # one class only: nothing to separate, a gate that passes every state (weights 0, bias 0)
    flat = fit_gate(x, torch.ones(2000, dtype=torch.bool))
    assert all(w == 0.0 for w in flat.weight) and flat.bias == 0.0


@pytest.mark.parametrize("keep", [0.9, 0.99, 1.0])
def test_gate_threshold_keeps_at_least_the_share(keep):
    logits = torch.tensor([5.0, 1.0, 3.0, 3.0, 2.0, 4.0, 0.5, 6.0, 7.0, 8.0])
    t = gate_threshold(logits, keep)
    kept = float((logits >= t).double().mean())
    assert kept >= keep
    # and drops what it may: the next value up would keep fewer than `keep`
    higher = logits[logits > t]
    if higher.numel():
        assert float((logits >= higher.min()).double().mean()) < keep
    assert gate_threshold(torch.zeros(0), keep) == float("-inf")


def test_gate_open_and_active_gates():
    gate = Gate(weight=[1.0, -2.0], bias=0.5)
    w, b = gate.arrays()
    assert gate_open(None, np.zeros(2))  # no gate: the decision runs
    assert gate_open((w, b, 0.5), np.zeros((1, 1, 2)))  # logit 0.5 >= 0.5
    assert not gate_open((w, b, 0.6), np.zeros(2))
    got = active_gates({"4": gate}, {2: {"prob": 0.5}, 4: {"prob": 0.5, GATE: 1.5}})
    assert list(got) == [4] and got[4][2] == 1.5
    with pytest.raises(UsageError, match="no gate there"):
        active_gates({}, {4: {"prob": 0.5, GATE: 1.5}})


def _measurements(n: int = 400, seed: int = 0) -> Measurements:
    """Three exits, one criterion, with pair values that differ by picker (value = 100 * picker + exit + noise)."""
    g = torch.Generator().manual_seed(seed)
    pv = torch.zeros(3, 3, n)
    pc = torch.zeros(3, 3, n, dtype=torch.bool)
    for f in range(3):
        for e in range(f, 3):
            pv[f, e] = 100 * f + e + torch.rand(n, generator=g)
            pc[f, e] = torch.rand(n, generator=g) < 0.5
    return Measurements(
        exits=[2, 4, 6],
        num_layers=8,
        values={"prob": pv[0].clone()},
        correct=pc[0].clone(),
        source=torch.zeros(n, dtype=torch.long),
        unit=torch.arange(n) // 20,
        pair_values={"prob": pv},
        pair_correct=pc,
    )


def test_gated_replay_picks_at_the_first_open_gate():
    meas = _measurements()
    g = torch.Generator().manual_seed(1)
    ok = torch.rand(2, meas.n, generator=g) < 0.5  # gates of exits 4 and 6
    sub = meas.restrict([4, 6], ok)
    v = sub.values["prob"]
    for t in range(meas.n):
        for i, e in enumerate((1, 2)):
            if not ok[i, t]:
                assert v[i, t] == float("-inf")
                continue
            picker = 1 if ok[0, t] else 2  # exit 4 picks when its gate opens, else exit 6 picks its own
            assert v[i, t] == meas.pair_values["prob"][picker, e, t]  # type: ignore[index]
            assert sub.correct[i, t] == meas.pair_correct[picker, e, t]  # type: ignore[index]
    # every gate open: the ungated replay (candidates at the subset's first exit)
    plain, every = meas.restrict([4, 6]), meas.restrict([4, 6], torch.ones(2, meas.n, dtype=torch.bool))
    assert torch.equal(plain.values["prob"], every.values["prob"]) and torch.equal(plain.correct, every.correct)


def test_thresholds_never_pass_a_skipped_decision():
    """-inf marks a decision a gate skipped: searched without those tokens, and never passed, at any target."""
    meas = _measurements()
    ok = torch.rand(2, meas.n, generator=torch.Generator().manual_seed(2)) < 0.5
    sub = meas.restrict([4, 6], ok)
    for target in (0.0, 0.3, 0.5):
        thr = fit_thresholds(sub.values, sub.correct, target)
        for i, t in enumerate(thr):
            assert t["prob"] > float("-inf")
            assert not bool(((sub.values["prob"][i] >= t["prob"]) & ~ok[i]).any())


@torch.no_grad()
def test_gated_replay_is_what_exit_scoring_computes(llama, gsm8k):
    """The replay calibrate fits gated options on == scoring each token at the exits whose gates open, the first of
    them picking the candidates (ExitScoring: what calibrate measures and the runner scores on the host), on the same
    states."""
    adapter = llama.adapter
    source = Shortlist(torch.arange(0, 200))
    exits = [1, 3, 5]
    scorer = ExitScorer(adapter, exits, "topk-prob+margin", K, source=source)
    chunks = token_chunks(llama.tokenizer, gsm8k, 300, 100)
    meas = measure_text_all([scorer], chunks, 1, None, pairs=True, keep_states=True)[0]
    assert meas is not None and meas.hidden is not None and meas.hidden.shape[:2] == (3, meas.n)
    gates, fitted = fit_gates(meas, 0.5, None, 0.2)
    assert fitted.hidden is None and fitted.gate_logits is not None
    ok = torch.stack([fitted.gate_logits[i] >= fitted.gate_logits[i].median() for i in range(3)])
    sub = meas.restrict(exits, ok)
    scoring_heads = scorer.heads
    for t in range(0, meas.n, 7):
        scoring = ExitScoring(scorer.signal, TorchExitLogits(scoring_heads), K, source)
        for i, layer in enumerate(exits):
            h = meas.hidden[i, t : t + 1]
            logit = float(gate_logits(h[0], *gates[layer].arrays()))
            assert (logit >= float(fitted.gate_logits[i].median())) == bool(ok[i, t])
            if not ok[i, t]:
                continue
            s = scoring.score(layer, h)
            for c in ("prob", "margin"):
                assert math.isclose(float(s.values[c][0]), float(sub.values[c][i, t]), abs_tol=1e-5)


def _costs() -> Costs:
    return Costs(
        provider="cpu",
        threads=1,
        past=64,
        repeats=3,
        embed_ms=0.1,
        segment_ms=[1.0, 1.0, 1.0, 1.0],
        segment_extra_ms=[0.2] * 4,
        kv_ms=[0.5] * 4,
        final_head_ms=1.0,
        final_head_extra_ms=0.1,
        candidates_ms={"2": 0.4, "4": 0.5, "6": 0.6},
        local_ms={"2": 0.1, "4": 0.2, "6": 0.3},
        full_step_ms=5.2,
    )


def test_cost_model_charges_the_decisions_made():
    costs, bounds = _costs(), [2, 4, 6, 8]
    per_exit = [(2, 0.2, 0.99), (4, 0.3, 0.99)]
    plain = predict(costs, bounds, "defer", per_exit)
    # the ungated shares spelled out: every token decides at 2 (picking), 80% reach 4 (scoring 2's candidates)
    same = predict(costs, bounds, "defer", per_exit, runs=[(1.0, 1.0), (0.8, 0.0)])
    assert same.ms_per_token == pytest.approx(plain.ms_per_token) and same.decision_ms == pytest.approx(0.4 + 0.8 * 0.2)
    # gated: 30% decide at 2 (picking); at 4, 50% decide, 35% of them picking (their gate at 2 was shut); every
    # token reaching a gated exit pays its gate's test (100% at 2, 80% at 4)
    costs = costs.model_copy(update={"gate_ms": {"2": 0.05, "4": 0.07}})
    gated = predict(costs, bounds, "defer", per_exit, runs=[(0.3, 0.3), (0.5, 0.35)])
    assert gated.decision_ms == pytest.approx(0.3 * 0.4 + 0.15 * 0.2 + 0.35 * 0.5 + 0.05 + 0.8 * 0.07)
    assert gated.ms_per_token == pytest.approx(plain.ms_per_token - plain.decision_ms + gated.decision_ms)
    assert predict(costs, bounds, "defer", per_exit).ms_per_token == plain.ms_per_token  # ungated: no gate paid


@pytest.fixture(scope="module")
def gated_calibration(llama, gsm8k) -> Calibration:
    opts = CalibrateOptions(exits=[2, 3, 4], target=0.5, tokens=1500, top_k=K, shortlist=64, confidence=None)
    return calibrate_model(llama, gsm8k, opts)


def test_calibration_menu_holds_gated_options(gated_calibration, llama):
    cal = gated_calibration
    assert sorted(cal.gates) == ["2", "3", "4"] and cal.gate_keep == 0.99
    assert all(len(g.weight) == llama.adapter.dims.hidden_size for g in cal.gates.values())
    gated = [o for o in cal.options if o.gated]
    plain = [o for o in cal.options if not o.gated]
    assert gated and plain
    for o in gated:
        assert all(GATE in x.thresholds and math.isfinite(x.thresholds[GATE]) for x in o.per_exit)
        first = o.per_exit[0]
        assert first.decided == first.picked  # nothing before the first exit can have picked
        for x in o.per_exit:
            assert x.decided is not None and x.picked is not None
            assert 0.0 <= x.picked <= x.decided <= 1.0 and x.coverage <= x.decided + 1e-12
        # a token decides at an exit only if it reached it: it exited at no earlier exit of the option
        exited = 0.0
        for x in o.per_exit:
            assert x.decided is not None and x.decided <= 1.0 - exited + 1e-9, (o.exits, x)
            exited += x.coverage
    skipped = [o for o in gated if o.per_exit[0].decided is not None and o.per_exit[0].decided < 1.0]
    assert skipped, "no gate skipped a decision"
    # the document round-trips with its gates, and a gate threshold without its gate is rejected
    doc = Calibration.model_validate_json(cal.model_dump_json())
    assert doc.gates == cal.gates and doc.options == cal.options
    with pytest.raises(ValueError, match="without its gate"):
        Calibration.model_validate({**cal.model_dump(), "gates": {}})
    # the cost model charges a gated option's decisions at its shares: scoring where an earlier exit picked
    costs = _costs().model_copy(
        update={"candidates_ms": {"2": 0.4, "3": 0.5, "4": 0.6}, "local_ms": {"2": 0.1, "3": 0.2, "4": 0.3}}
    )
    for o in gated:
        want = sum(
            ((x.decided or 0) - (x.picked or 0)) * costs.local_ms[str(x.layer)]
            + (x.picked or 0) * costs.candidates_ms[str(x.layer)]
            for x in o.per_exit
        )
        assert predict_option(costs, [2, 3, 4, 6], "defer", o).decision_ms == pytest.approx(want)


def test_no_gates_when_switched_off(llama, gsm8k):
    opts = CalibrateOptions(exits=[2, 4], target=0.5, tokens=800, top_k=K, shortlist=64, confidence=None, gate_keep=0.0)
    cal = calibrate_model(llama, gsm8k, opts)
    assert cal.gates == {} and cal.gate_keep is None and not any(o.gated for o in cal.options)


def test_fit_options_gated_are_refitted_on_the_gated_run():
    """A gated option: each gate threshold keeps >= `keep` of the calibration tokens the ungated option passes at
    that exit, and the criteria's thresholds are those fitted on the gated replay."""
    meas = _measurements(600)
    meas.gate_logits = torch.randn(3, meas.n, generator=torch.Generator().manual_seed(3))
    calib = ~meas.heldout_mask(0.2)
    options = fit_options(meas, 0.4, None, 0.2, max_subset=2, gate_keep=0.9)
    gated = [o for o in options if o.gated]
    assert {o.kind for o in gated} == {"target", "verify"}
    for o in gated:
        idx = [meas.exits.index(e) for e in o.exits]
        logits = meas.gate_logits[idx]
        ungated = next(u for u in options if not u.gated and u.exits == o.exits and u.target == o.target)
        plain = meas.restrict(o.exits)
        taken = assign_exits(plain.values, [dict(x.thresholds) for x in ungated.per_exit])
        gammas = [x.thresholds[GATE] for x in o.per_exit]
        for i, gamma in enumerate(gammas):
            passing = calib & (taken == i)
            assert float((logits[i][passing] >= gamma).double().mean()) >= 0.9
        ok = torch.stack([logits[i] >= g for i, g in enumerate(gammas)])
        sub = meas.restrict(o.exits, ok)
        refit = fit_thresholds(sub.values, sub.correct, o.target, o.confidence, calib)
        assert [{"prob": x.thresholds["prob"]} for x in o.per_exit] == refit


def test_options_record_their_units_and_resample_to_themselves():
    """Each option keeps its judged tokens' counts per unit (what the plan's interval over the calibration sample
    resamples): all units taken once give back the option's own coverage, precision and gated shares exactly."""
    meas = _measurements(600)
    meas.gate_logits = torch.randn(3, meas.n, generator=torch.Generator().manual_seed(3))
    options = fit_options(meas, 0.4, None, 0.2, max_subset=2, gate_keep=0.9)
    judged = options_judge(meas)
    units = torch.unique(meas.unit[judged])
    assert any(o.gated for o in options) and any(not o.gated for o in options)
    for o in options:
        rows = o.unit_rows()
        assert len(rows) == units.numel() and all(len(r) == 1 + 4 * len(o.exits) for r in rows)
        assert sum(r[0] for r in rows) == int(judged.sum())
        assert Option.units_text(rows) == o.units and "\n" not in o.units  # one line in a file, read back exactly
        whole = o.resampled(range(len(rows)))
        for mine, theirs in zip(whole.per_exit, o.per_exit, strict=True):
            assert mine.coverage == pytest.approx(theirs.coverage, abs=1e-12)
            assert (mine.precision is None) == (theirs.precision is None)
            if mine.precision is not None:
                assert mine.precision == pytest.approx(theirs.precision, abs=1e-12)
            assert (mine.decided, mine.picked) == pytest.approx((theirs.decided, theirs.picked), abs=1e-12)


def test_the_menu_is_judged_out_of_fold():
    """The menu's numbers: every unit judged on thresholds fitted without its fold (folds of whole units dealt in a
    seeded shuffle, not in the data's order), while the thresholds a run uses are the calibration split's."""
    meas = _measurements(600)
    folds = unit_folds(meas)
    assert torch.equal(folds, unit_folds(meas))  # seeded
    per_unit = {int(u): set(folds[meas.unit == u].tolist()) for u in torch.unique(meas.unit)}
    assert all(len(f) == 1 for f in per_unit.values())  # a unit is never split
    sizes = torch.bincount(torch.tensor([next(iter(f)) for f in per_unit.values()]))
    assert sizes.numel() == OPTION_FOLDS and int(sizes.max() - sizes.min()) <= 1
    assert [next(iter(per_unit[u])) for u in sorted(per_unit)] != [u % OPTION_FOLDS for u in sorted(per_unit)]
    calib = ~meas.heldout_mask(0.2)
    options = fit_options(meas, 0.4, None, 0.2, max_subset=1)
    o = next(o for o in options if o.exits == [4] and o.kind == "target")
    sub = meas.restrict([4])
    assert [dict(x.thresholds) for x in o.per_exit] == fit_thresholds(sub.values, sub.correct, 0.4, None, calib)
    want = torch.zeros(meas.n, dtype=torch.long)
    for f in range(OPTION_FOLDS):
        mine = folds == f
        thr = fit_thresholds(sub.values, sub.correct, 0.4, None, ~mine)
        want[mine] = assign_exits(sub.values, thr)[mine]
    for row, u in zip(o.unit_rows(), torch.unique(meas.unit), strict=True):
        own = meas.unit == u
        here = own & (want == 0)
        assert row == [int(own.sum()), int(here.sum()), int((here & sub.correct[0]).sum()), 0, 0]
