"""Drafts that run ahead priced (plan/ahead.py): the replay of the runtime's rule on traces, the price per cycle,
the choice of exit and bound, and the pick beside the plan's lossless default; checked against hand computations."""

from __future__ import annotations

from pathlib import Path

import pytest

from eectl.contracts.plan import Choice, Plan, Prediction
from eectl.plan.ahead import AHEAD, BOUNDS, Cycle, ahead_choice, choose_ahead, price, replay_ahead
from eectl.plan.choose import lossless_pick
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
    # at 3 the exit is unsure (no draft); at 4 one draft, the trace's last, right: it ends the answer (1 token)
    assert replay_ahead(probs, right, 0.5) == [(3, 2, 3), (0, 0, 1), (1, 1, 1)]
    assert replay_ahead(probs, right, 0.75) == [(2, 2, 3), (0, 0, 1), (1, 1, 1)]  # 0.729 < 0.75: runs of two
    assert replay_ahead([0.9] * 5, [True] * 5, 0.0, block=2) == [(2, 2, 3), (2, 2, 2)]  # the block ends a run


def test_drafts_right_to_the_end_emit_no_check_token():
    """A run of n tokens stops at its n-th (runtime/runner.py `_finished`); where that is a draft, its closing pass
    checks the drafts and emits nothing (`_settled`). Worked by hand on an answer a0..a6 (max_new_tokens 7: a0 from
    the prompt's pass, a trace of 6 positions; position j feeds a_j, its draft is a_{j+1}), bound 0.5, block 8:

        pass 1 feeds a0: 0.9 >= 0.5, drafts a1       pass 4 feeds a3: 0.0729, checks a1 a2 a3 (all right), emits a4
        pass 2 feeds a1: 0.81, drafts a2             pass 5 feeds a4: 0.9, drafts a5
        pass 3 feeds a2: 0.729, drafts a3            pass 6 feeds a5: 0.81, drafts a6: the 7th token, the run stops
                                                     pass 7 (closing) feeds a6: checks a5 a6 (right), emits nothing

    7 passes and 6 decode tokens (a1..a6): cycles (3 drafts, 3 kept, 4 tokens) and (2, 2, 2), not (2, 2, 3) (the
    check token a7 a run of 7 tokens never emits). With a6's draft wrong the closing pass rolls it back and emits
    the full model's a6 in its place: (2, 1, 2), the same passes and tokens."""
    probs = [0.9, 0.9, 0.9, 0.1, 0.9, 0.9]
    cycles = replay_ahead(probs, [True] * 6, 0.5)
    assert cycles == [(3, 3, 4), (2, 2, 2)]
    assert sum(c.drafts + 1 for c in cycles) == 7 and sum(c.tokens for c in cycles) == 6
    assert replay_ahead(probs, [True] * 5 + [False], 0.5) == [(3, 3, 4), (2, 1, 2)]
    # priced per the 6 tokens: 5 drafts at 5.5 ms, two checks at 15.3 (toy costs: no excess; the closing pass
    # priced as a check, its decision included)
    pred = price(_costs(), BOUNDARIES, 4, [cycles], block=8)
    assert pred.ms_per_token == pytest.approx((5 * 5.5 + 2 * 15.3) / 6)
    assert pred.lost_per_step == pytest.approx(1 / 7)


def test_a_cycle_is_priced_as_its_drafts_and_its_check():
    # a draft at exit 4: segment 0 (4) + one more position in segments 1, 2 (0.5 each) + a head row (0.2) + its
    # decision (0.3) = 5.5; a check: the full step (15) + its decision (0.3) unless the block forced it
    # (the replays of the test above: 5 tokens, the last cycle's one draft ending the answer)
    cycles = [[Cycle(3, 2, 3), Cycle(0, 0, 1), Cycle(1, 1, 1)]]
    ms = (3 * 5.5 + 15.3) + 15.3 + (5.5 + 15.3)
    pred = price(_costs(), BOUNDARIES, 4, cycles, block=8)
    assert pred.ms_per_token == pytest.approx(ms / 5)
    assert pred.speedup == pytest.approx(15.0 / (ms / 5))
    forced = price(_costs(), BOUNDARIES, 4, [[Cycle(2, 2, 3), Cycle(2, 2, 2)]], block=2)
    assert forced.ms_per_token == pytest.approx(2 * (2 * 5.5 + 15.0) / 5)


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
    assert got.drafts == pytest.approx(sum(c.drafts for c in cycles) / len(cycles))
    assert got.accepted == pytest.approx(sum(c.kept for c in cycles) / len(cycles))
    assert got.by_position[0] == pytest.approx(
        sum(1 for c in cycles if c.kept >= 1) / sum(1 for c in cycles if c.drafts >= 1)
    )


# --- the plan's entry: traced at calibration, chosen at export, validated at load, run by default ------------------


def _signed(probs: list[float], right: list[bool]) -> list[float]:
    return [p if ok else -p for p, ok in zip(probs, right, strict=True)]


def test_calibration_traces_are_the_runtimes(exported):
    """Calibration's traces (calibrate/ahead.py, on the states its greedy generation kept, in torch) are what the
    artifact's own graphs read on the same continuations (runtime/ahead.py `traces`): the same right drafts, the same
    top-1 probabilities; a block head's exit is not traced."""
    from eectl.calibrate.ahead import ahead_traces
    from eectl.exits.generation import generate_continuations
    from eectl.exits.measure import ExitScorer, generation_keep
    from eectl.runtime.ahead import traces
    from eectl.runtime.sessions import ArtifactRuntime
    from tests.tiny import random_ids

    loaded, art = exported["llama"]
    rt = ArtifactRuntime(art, provider="cpu")
    scorer = ExitScorer(loaded.adapter, [2, 4], "topk-prob", rt.manifest.top_k)
    prompts = [random_ids(s, 9, rt.manifest.dims["vocab_size"]) for s in (11, 12, 13)]
    conts, _ = generate_continuations(loaded.adapter, prompts, 36, 12, None, 4, keep=generation_keep(scorer))
    got = ahead_traces(scorer, conts)
    assert set(got.signed) == {"2", "4"} and got.top_k == rt.manifest.top_k
    pairs = [(c.prompt, c.generated) for c in conts]
    for layer in (2, 4):
        want = traces(rt, layer, pairs, rt.manifest.top_k)
        assert [len(t) for t in got.signed[str(layer)]] == [len(c.generated) - 1 for c in conts]
        for (probs, right), (wp, wr) in zip(got.traces(layer), want, strict=True):
            assert right == wr
            assert probs == pytest.approx(wp, abs=1e-3)
    scorer.sequence_heads = {4: object()}
    assert set(ahead_traces(scorer, conts).signed) == {"2"}


def test_calibrate_model_records_the_traces(llama, gsm8k):
    """The calibration file holds the drafter's traces: per exit, per continuation, one signed probability a
    generated token but the last."""
    from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model

    opts = CalibrateOptions(exits=[2, 4], signal="topk-prob", target=0.5, top_k=8, tokens=400, gen_tokens=10)
    cal = calibrate_model(llama, gsm8k, opts)
    assert cal.ahead is not None and set(cal.ahead.signed) == {"2", "4"}
    for per in cal.ahead.signed.values():
        assert sum(len(t) for t in per) == cal.data.generated_tokens - cal.data.prompts_used
        assert all(0.0 < abs(x) <= 1.0 for t in per for x in t)


def _artifact_costs(**kw):
    """toy costs for the tiny artifacts (exits 2 and 4, three segments)."""
    return _costs(candidates_ms={"2": 0.3, "4": 0.3}, local_ms={"2": 0.05, "4": 0.05}, **kw)


SURE = ([0.97, 0.95, 0.6, 0.99, 0.9] * 8, [True, True, False, True, True] * 8)  # pays at exit 2 (toy costs)
WRONG = ([0.95] * 40, [False] * 40)  # every draft rolled back


def _calibrated(exported, trace):
    from eectl.contracts.calibration import AheadTraces
    from tests.conftest import make_calibration

    cal = make_calibration(exported["llama"][0], {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    cal.ahead = AheadTraces(top_k=8, signed={"2": [_signed(*trace)] * 4, "4": [_signed(*trace)] * 4})
    return cal


def test_plan_manifest_makes_the_drafter_the_default_only_where_it_pays(exported):
    from eectl.plan.choose import plan_manifest
    from eectl.runtime.sessions import ArtifactRuntime

    m = ArtifactRuntime(exported["llama"][1], provider="cpu").manifest
    plan = plan_manifest(m.model_copy(update={"calibration": _calibrated(exported, SURE)}), _artifact_costs())
    assert plan.default == AHEAD and plan.ahead is not None and plan.ahead.on and plan.ahead.exit == 2
    assert plan.ahead.bound in BOUNDS and plan.ahead.prediction.low() >= 1.03
    assert "verify drafting ahead at exit 2" in plan.summary() and plan.ahead.prediction.describe() in plan.summary()
    # every draft wrong: the entry is recorded, off, and the default stays full depth
    wrong = plan_manifest(m.model_copy(update={"calibration": _calibrated(exported, WRONG)}), _artifact_costs())
    assert wrong.ahead is not None and not wrong.ahead.on and wrong.default == "full"
    # no traces (calibrations before them): no entry, the plan as before
    bare = plan_manifest(m.model_copy(update={"calibration": _calibrated(exported, SURE).model_copy(
        update={"ahead": None})}), _artifact_costs())  # fmt: skip
    assert bare.ahead is None and bare.default == "full"
    # an artifact whose wide passes are not exact: no drafts by default, the drafter's entry kept for bench
    from eectl.plan import choose

    original = choose.wide_inexact
    try:
        choose.wide_inexact = lambda manifest: "int4 wide passes differ"
        inexact = plan_manifest(m.model_copy(update={"calibration": _calibrated(exported, SURE)}), _artifact_costs())
    finally:
        choose.wide_inexact = original
    assert inexact.default == "full" and inexact.ahead is not None and inexact.ahead.on


def test_a_block_head_exit_is_not_priced(exported):
    """The plan prices only exits that can draft: a block head's exit is left out of the choice."""
    from eectl.plan.ahead import plan_ahead
    from eectl.runtime.sessions import ArtifactRuntime

    m = ArtifactRuntime(exported["llama"][1], provider="cpu").manifest
    traced = _calibrated(exported, SURE).ahead
    assert traced is not None
    only4 = traced.model_copy(update={"signed": {"4": traced.signed["4"]}})
    got = plan_ahead(m, _artifact_costs(), only4)
    assert got is not None and got.exit == 4
    blocked = m.model_copy(update={"exits": [e.model_copy(update={"block": object()}) if e.layer == 4 else e
                                             for e in m.exits]})  # fmt: skip
    assert plan_ahead(blocked, _artifact_costs(), only4) is None


def _entry(exit: int, bound: float, on: bool = True):
    from eectl.contracts.plan import AheadChoice

    pred = Prediction(policy="verify", exits=[exit], ms_per_token=8.0, full_ms=10.0, speedup=1.25, decision_ms=0.3,
                      exit_rate=0.4, interval=(1.15, 1.35))  # fmt: skip
    return AheadChoice(exit=exit, bound=bound, prediction=pred, on=on, drafts=1.5, accepted=1.2)


def _ahead_plan(exit: int, bound: float) -> Plan:
    full = Prediction(policy="verify", exits=[], ms_per_token=10.0, full_ms=10.0, speedup=1.0, decision_ms=0.0,
                      exit_rate=0.0)  # fmt: skip
    choice = Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=full)
    return Plan(default=AHEAD, choices={"verify": choice}, ahead=_entry(exit, bound))


def test_run_follows_the_plans_drafter_and_equals_full_depth(exported):
    """A plan whose default is the drafter: `eectl run` with no policy options drafts ahead at the plan's exit and
    bound, says so in its note, and its tokens are full depth's; explicit options bypass the plan."""
    from eectl.run.generate import RunOptions, resolve_config, runner_for
    from eectl.runtime.ahead import traces
    from eectl.runtime.runner import Runner
    from eectl.runtime.sessions import ArtifactRuntime
    from tests.conftest import make_calibration
    from tests.tiny import random_ids

    loaded, art = exported["llama"]
    rt = ArtifactRuntime(art, provider="cpu")
    V = rt.manifest.dims["vocab_size"]
    prompts = [random_ids(s, 10, V) for s in (21, 22)]
    full = resolve_config(rt, RunOptions(exits="none", max_new_tokens=40), ())
    want = [g.token_ids for g in Runner(rt, full).generate(prompts)]
    (probs, _), *_ = traces(rt, 2, [(prompts[0], want[0])], rt.manifest.top_k)
    bound = round(float(sorted(probs)[len(probs) // 2]), 4)  # the median: some tokens draft, some do not
    rt.manifest.plan = _ahead_plan(2, bound)
    rt.manifest.calibration = make_calibration(loaded, {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    notes: list[str] = []
    cfg, runner = runner_for(rt, RunOptions(max_new_tokens=40), note=notes.append)
    assert (cfg.policy, cfg.exits, cfg.draft_ahead, cfg.planned) == ("verify", [2], bound, True)
    assert notes and "verify drafting ahead at exit 2" in notes[0] and f">= {bound}" in notes[0]
    got = runner.generate(prompts)
    assert [g.token_ids for g in got] == want
    assert got[0].drafted > 0
    explicit = resolve_config(rt, RunOptions(exits="none", max_new_tokens=8), ())
    assert (explicit.exits, explicit.draft_ahead) == ([], 0.0)


def test_bench_runs_the_plans_drafter_as_its_default(exported):
    """bench adds the plan's default (the drafter) to its rows, and its `ahead` row is the plan's entry, priced as
    the plan priced it; without an entry the row is replayed as before (tests/test_drafts_ahead.py)."""
    from eectl.evaluate.ahead import ahead_config
    from eectl.evaluate.bench import add_artifact_configs
    from eectl.evaluate.results import BenchOptions
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    rt.manifest.plan = _ahead_plan(4, 0.25)
    rt.manifest.costs = _artifact_costs()
    opts = BenchOptions(configs=["full", "verify"], max_new_tokens=8)
    add_artifact_configs(opts, rt.manifest)
    assert AHEAD in opts.configs
    cfg, pred, choice = ahead_config(rt, opts, ())
    assert (cfg.exits, cfg.draft_ahead, cfg.policy) == ([4], 0.25, "verify") and choice == rt.manifest.plan.ahead
    assert pred == rt.manifest.plan.ahead.prediction and "the plan's drafts ahead at exit 4" in cfg.note
    rt.manifest.plan.ahead = _entry(4, 0.25, on=False)
    off, _, _ = ahead_config(rt, opts, ())
    assert off.exits == [] and off.draft_ahead == 0.0 and "full depth" in off.note


def _with_plan(exported, tmp_path, edit) -> Path:
    """A copy of the tiny Llama artifact whose manifest holds a plan (and the calibration it needs), `edit`ed."""
    import json
    import shutil

    from tests.conftest import make_calibration

    loaded, art = exported["llama"]
    dest = tmp_path / "art"
    shutil.copytree(art, dest)
    doc = json.loads((dest / "manifest.json").read_text())
    doc["calibration"] = make_calibration(loaded, {2: {"prob": 0.9}, 4: {"prob": 0.9}}).model_dump(mode="json")
    doc["plan"] = _ahead_plan(2, 0.5).model_dump(mode="json")
    edit(doc)
    (dest / "manifest.json").write_text(json.dumps(doc))
    return dest


def _set(**fields):
    def edit(doc):
        doc["plan"]["ahead"].update(fields)

    return edit


def _block_at_2(doc):
    seg = doc["segments"][0]
    exit2 = next(e for e in doc["exits"] if e["layer"] == 2)
    exit2["block"] = {"graph": seg["graph"], "kv_graph": seg["kv_graph"], "kv_slot": doc["dims"]["num_layers"],
                      "init_layer": 1, "cost_layers": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(bound=0.0), r"plan\.ahead\.bound: Input should be greater than 0"),
        (_set(bound=1.5), r"plan\.ahead\.bound: Input should be less than or equal to 1"),
        (_set(exit=3), r"plan\.ahead\.exit 3 is no exit ending a segment before the final layer \[2, 4\]"),
        (_set(exit=6), r"plan\.ahead\.exit 6 is no exit ending a segment"),
        (_block_at_2, r"plan\.ahead\.exit 2 has a block head"),
        (lambda doc: doc["plan"].pop("ahead"), r"plan\.default is ahead, but plan\.ahead holds no entry"),
    ],
)
def test_a_bad_plan_entry_is_refused_at_load_in_one_line(exported, tmp_path, edit, message):
    from eectl.contracts.manifest import read_manifest
    from eectl.errors import ArtifactError

    with pytest.raises(ArtifactError, match=message) as err:
        read_manifest(_with_plan(exported, tmp_path, edit))
    assert "\n" not in err.value.message


def test_a_plan_without_the_entry_still_loads(exported, tmp_path):
    """Plans and calibration files written before the drafter's entry load as they did: no entry, no traces."""
    from eectl.contracts.calibration import read_calibration, write_calibration
    from eectl.contracts.manifest import read_manifest
    from tests.conftest import make_calibration

    def old(doc):
        doc["plan"].pop("ahead")
        doc["plan"]["default"] = "full"
        doc["calibration"].pop("ahead")

    m = read_manifest(_with_plan(exported, tmp_path, old))
    assert m.plan is not None and m.plan.ahead is None and m.plan.default == "full"
    assert m.calibration is not None and m.calibration.ahead is None
    good = read_manifest(_with_plan(exported, tmp_path / "new", lambda doc: None))
    assert good.plan is not None and good.plan.ahead == _entry(2, 0.5)
    path = write_calibration(make_calibration(exported["llama"][0], {2: {"prob": 0.9}}), tmp_path / "c.json")
    assert read_calibration(path).ahead is None


def test_a_server_prices_the_drafter_at_one_row_as_the_plan_did():
    """plan/batch.py: the drafter's default at one row is the plan's prediction; above one row it has no batch model
    (full depth's there)."""
    from eectl.plan.batch import price as batch_price

    plan = _ahead_plan(2, 0.5)
    got = batch_price(plan, _artifact_costs(), [2, 4, 6], {1: 15.0, 4: 20.0}, 3, None, [2])
    assert got == {1: plan.ahead.prediction.speedup, 2: 0.0, 3: 0.0}
