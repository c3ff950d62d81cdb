"""Learn-then-Test (calibrate/guarantee.py) on synthetic exchangeable prompts with a known risk curve: over many
calibration draws the certified setting's true risk exceeds delta in at most epsilon of the draws (within the
Monte-Carlo error), while the naive choice (the most aggressive setting whose empirical risk <= delta) exceeds it
far more often; the p-values are valid; the sample-size helpers agree with the test itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from eectl.calibrate import guarantee as g

DELTA, EPSILON = 0.1, 0.05
RISKS = np.linspace(0.0, 0.3, 31)  # settings from the most conservative (risk 0) to the most aggressive (0.3)


def _violations(n: int, draws: int, bound: str | None, seed: int = 0) -> tuple[float, float, float]:
    """Share of draws whose certified (LTT) / naive setting has true risk > delta, and LTT's mean certified risk."""
    rng = np.random.default_rng(seed)
    ltt = naive = 0
    certified_risk = []
    for _ in range(draws):
        u = rng.random(n)
        losses = g.monotone_losses(u, RISKS)
        if bound == g.HOEFFDING_BENTKUS:  # losses in [0, 1], not 0/1: a prompt's failure weighs w ~ U(0.5, 1)
            losses = losses * rng.uniform(0.5, 1.0, (n, 1))  # true risk RISKS * 0.75 (w independent of u)
        res = g.fixed_sequence(losses, DELTA, EPSILON, bound)
        true = RISKS if bound != g.HOEFFDING_BENTKUS else RISKS * 0.75
        if res.certified is not None:
            ltt += true[res.certified] > DELTA
            certified_risk.append(true[res.certified])
        pick = g.naive_choice(losses, DELTA)
        naive += pick is not None and true[pick] > DELTA
    return ltt / draws, naive / draws, float(np.mean(certified_risk)) if certified_risk else 0.0


@pytest.mark.parametrize("bound", [g.BINOMIAL, g.HOEFFDING_BENTKUS])
def test_certified_risk_exceeds_delta_in_at_most_epsilon_of_draws(bound):
    draws = 2000
    ltt, naive, mean_risk = _violations(200, draws, bound)
    mc = 3 * math.sqrt(EPSILON * (1 - EPSILON) / draws)  # three Monte-Carlo standard errors
    assert ltt <= EPSILON + mc, (ltt, naive)
    assert naive > 3 * max(ltt, 0.01), (ltt, naive)  # the naive choice violates far more often (here ~40-60%)
    assert mean_risk > 0.02  # and LTT still certifies useful settings, not only the risk-0 one


def test_binomial_p_value_is_valid_at_the_boundary():
    # at true risk exactly delta, P(p <= a) <= a for every a (the exact tail: equality up to discreteness)
    n = 150
    k = np.arange(n + 1)
    p = stats.binom.cdf(k, n, DELTA)
    for a in (0.01, 0.05, 0.2):
        assert stats.binom.pmf(k, n, DELTA)[p <= a].sum() <= a + 1e-12
    assert g.p_value(0.0, n, DELTA, g.BINOMIAL) == pytest.approx((1 - DELTA) ** n)
    assert g.p_value(0.5, n, DELTA, g.HOEFFDING_BENTKUS) == 1.0


def test_fixed_sequence_stops_at_the_first_failure():
    losses = np.zeros((100, 4))
    losses[:30, 1] = 1  # setting 1 fails; setting 2 would pass but the sequence stopped
    res = g.fixed_sequence(losses, DELTA, EPSILON)
    assert res.bound == g.BINOMIAL and res.certified == 0
    assert [t.index for t in res.tested] == [0, 1] and not res.tested[1].rejected
    assert g.fixed_sequence(np.ones((100, 2)), DELTA, EPSILON).certified is None
    with pytest.raises(ValueError):
        g.fixed_sequence(np.full((5, 2), 2.0), DELTA, EPSILON)


def test_sample_size_helpers_agree_with_the_test():
    n0 = g.minimum_prompts(DELTA, EPSILON)
    assert g.fixed_sequence(np.zeros((n0, 1)), DELTA, EPSILON).certified == 0
    assert g.fixed_sequence(np.zeros((n0 - 1, 1)), DELTA, EPSILON).certified is None
    need = g.prompts_needed(0.05, DELTA, EPSILON, g.BINOMIAL)
    assert need is not None
    assert g.p_value(0.05, need, DELTA, g.BINOMIAL) <= EPSILON < g.p_value(0.05, need // 2, DELTA, g.BINOMIAL)
    assert g.prompts_needed(0.2, DELTA, EPSILON, g.BINOMIAL) is None
    ub = g.upper_bound(0.05, 400, EPSILON, g.BINOMIAL)
    assert 0.05 < ub < DELTA
    assert g.p_value(0.05, 400, ub + 1e-6, g.BINOMIAL) <= EPSILON < g.p_value(0.05, 400, ub - 1e-3, g.BINOMIAL)


def test_calibrate_sequence_certifies_an_artifact_and_run_and_bench_use_it(exported, tmp_path):
    """The CLI end to end on a tiny artifact: the conservative setting (nothing exits) is certified, the aggressive
    one fails; the certificate lands in the manifest, `run --policy certified` runs it, bench checks it."""
    import json
    import shutil

    from typer.testing import CliRunner

    from eectl.cli import app
    from eectl.contracts.manifest import read_manifest

    _, folder = exported["llama"]
    art = tmp_path / "art"
    shutil.copytree(folder, art)
    data = tmp_path / "prompts.txt"
    data.write_text("\n\n".join(f"prompt number {i} about caches and layers" for i in range(40)))
    base = [
        "calibrate",
        "--guarantee",
        "sequence",
        "--artifact",
        str(art),
        "--data",
        str(data),
        "--signal",
        "topk-prob",
        "--exits",
        "2,4",
        "--risk",
        "first:4",
        "--grid",
        "0.9,0.05",
    ]
    few = CliRunner().invoke(app, [*base, "--prompts", "20"])
    assert few.exit_code == 2 and "needs at least 29 prompts" in few.stderr
    res = CliRunner().invoke(app, [*base, "--prompts", "40", "--json"])
    assert res.exit_code == 0, res.output
    cert = json.loads(res.stdout)
    assert cert["threshold"] == 0.9 and cert["empirical_risk"] == 0.0 and cert["bound"] == "binomial"
    assert [t["rejected"] for t in cert["tested"]] == [True, False]  # K = 8: 0.05 lets every token exit at 2
    assert cert["tested"][1]["risk"] > 0.1 and cert["tested"][1]["mean_layers"] < cert["tested"][0]["mean_layers"]
    aggressive = cert["tested"][1]["exit_shares"]  # the shares the plan prices the setting with
    assert set(aggressive) == {"2", "4"} and aggressive["2"] > 0.5 and sum(aggressive.values()) <= 1.0
    bad = CliRunner().invoke(app, ["run", str(art), "hello", "--max-risk", "1.5"])
    assert bad.exit_code == 2 and "--max-risk must be in [0, 1)" in bad.stderr
    m = read_manifest(art)
    assert m.certificate is not None
    assert m.certificate.describe().startswith("defer at exits [2, 4] (topk-prob >= 0.9)")
    run = CliRunner().invoke(app, ["run", str(art), "hello", "--policy", "certified", "--max-new-tokens", "4"])
    assert run.exit_code == 0 and "certified: defer at exits [2, 4]" in run.output, run.output
    js = CliRunner().invoke(app, ["run", str(art), "hi", "--policy", "certified", "--max-new-tokens", "2", "--json"])
    assert js.exit_code == 0 and json.loads(js.stdout)["certificate"].startswith("defer at exits [2, 4]")
    bench = CliRunner().invoke(
        app,
        [
            "bench",
            str(art),
            "--data",
            str(data),
            "--prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--reps",
            "1",
            "--policies",
            "full",
            "--ppl-tokens",
            "0",
            "--sweep",
            "",
        ],
    )
    assert bench.exit_code == 0, bench.output
    assert "certificate check: realized risk 0.000 on 2 prompts of this run: inside" in bench.output


def _certificate(shares: dict[str, float] | None, delta: float = 0.1, threshold: float | None = 0.9):
    from eectl.contracts.certificate import Certificate, SettingTest

    rejected = threshold is not None
    tested = [
        SettingTest(threshold=0.9, risk=0.02, p_value=1e-4, rejected=rejected, mean_layers=4.0, exit_shares=shares)
    ]
    return Certificate(
        policy="defer",
        exits=[2, 4],
        signal="topk-prob",
        criteria=["prob"],
        top_k=8,
        threshold=threshold,
        risk="first:32",
        delta=delta,
        epsilon=0.05,
        bound="binomial",
        prompts=400,
        max_new_tokens=32,
        empirical_risk=0.02 if threshold is not None else None,
        upper_bound=0.04 if threshold is not None else None,
        prompts_needed=None,
        prompts_for_half_delta=None,
        tested=tested,
        data="test",
        wall_s=1.0,
        threads=1,
    )


def _tier_costs():
    from tests.test_plan import _costs

    # segments ending at 2, 4, 6 (the tiny artifact's), 4 ms each, 3 ms of final head: test_plan's costs at exits 2, 4
    return _costs(candidates_ms={"2": 0.3, "4": 0.3}, local_ms={"2": 0.05, "4": 0.05})


def test_the_plan_takes_a_lossy_setting_only_with_a_certificate_at_the_users_risk(exported):
    """#33 item 4: defer (lossy) is never the plan's default by per-token calibration alone; the certificate's
    setting is, priced with the exit shares its certification measured, when it covers the user's risk and pays."""
    from eectl.contracts.certificate import CERTIFIED
    from eectl.contracts.manifest import read_manifest
    from eectl.plan.choose import plan_manifest, predict
    from tests.test_plan import _option

    _, folder = exported["llama"]
    m = read_manifest(folder)
    boundaries = [s.layers[1] for s in m.segments]
    assert boundaries == [2, 4, 6] and "defer" in m.kv_policies
    costs = _tier_costs()
    fast_defer = m.model_copy(update={"calibration": None})
    plan = plan_manifest(fast_defer, costs)
    assert plan.default == "full" and plan.certified is None
    # a per-token menu where defer pays a lot: still not the default (it is what --policy defer runs)
    from eectl.plan.choose import choose

    menu = choose(costs, boundaries, [_option([2], [0.6])])
    assert menu.choices["defer"].exits == [2] and menu.choices["defer"].prediction.speedup > 1.5
    assert menu.default == "full"
    # with a certificate whose setting pays: the default, at the predicted speed of its measured shares
    good = m.model_copy(update={"certificate": _certificate({"2": 0.4, "4": 0.2})})
    plan = plan_manifest(good, costs)
    want = predict(costs, boundaries, "defer", [(2, 0.4, None), (4, 0.2, None)])
    assert want.speedup > 1.3
    assert plan.default == CERTIFIED and plan.certified is not None
    assert plan.certified.prediction.speedup == pytest.approx(want.speedup)
    assert plan.certified.thresholds == {"2": {"prob": 0.9}, "4": {"prob": 0.9}}
    assert "defer at exits [2, 4] as certified" in plan.summary()
    # the user's risk decides: a 0.1 certificate is no default for a user accepting 0.05, nor for lossless only
    assert plan_manifest(good, costs, max_risk=0.2).default == CERTIFIED
    for strict in (0.05, 0.0):
        stricter = plan_manifest(good, costs, max_risk=strict)
        assert stricter.default == "full" and stricter.certified is None
    # a certified setting that does not clear the line stays off; one without measured shares is not priced;
    # a certificate that certified nothing is never a default
    slow = plan_manifest(m.model_copy(update={"certificate": _certificate({"2": 0.0, "4": 0.01})}), costs)
    assert slow.default == "full" and slow.certified is not None and slow.certified.prediction.speedup < 1.03
    unpriced = plan_manifest(m.model_copy(update={"certificate": _certificate(None)}), costs)
    assert unpriced.default == "full" and unpriced.certified is None
    none = plan_manifest(m.model_copy(update={"certificate": _certificate({"2": 0.4}, threshold=None)}), costs)
    assert none.default == "full" and none.certified is None


def test_run_follows_a_certified_default_and_names_the_certificate_however_it_is_reached(exported):
    from eectl.contracts.certificate import CERTIFIED
    from eectl.plan.choose import plan_manifest
    from eectl.run.generate import RunOptions, calibration_warning, resolve_config
    from eectl.runtime.sessions import ArtifactRuntime
    from tests.conftest import make_calibration

    loaded, folder = exported["llama"]
    rt = ArtifactRuntime(folder, provider="cpu", threads=1)
    m = rt.manifest
    m.calibration = make_calibration(loaded, {2: {"prob": 0.5}, 4: {"prob": 0.5}})
    m.certificate = _certificate({"2": 0.4, "4": 0.2})
    m.costs = _tier_costs()
    m.plan = plan_manifest(m, m.costs)
    assert m.plan.default == CERTIFIED
    cfg = resolve_config(rt, RunOptions(), ())
    assert cfg.certified and cfg.policy == "defer" and cfg.exits == [2, 4]
    assert cfg.thresholds == {2: {"prob": 0.9}, 4: {"prob": 0.9}} and cfg.top_k == 8
    assert "(the default)" in cfg.note and "certified: defer at exits [2, 4]" in cfg.note
    # the same setting reached by explicit options is certified too, and says so
    explicit = RunOptions(policy="defer", exits="2,4", thresholds="0.9", signal="topk-prob")
    cfg = resolve_config(rt, explicit, ())
    assert cfg.certified and not cfg.planned and "certified: defer at exits [2, 4]" in cfg.note
    assert calibration_warning(rt, cfg) is None
    # another threshold is not the certified setting
    cfg = resolve_config(rt, RunOptions(policy="defer", exits="2,4", thresholds="0.8", signal="topk-prob"), ())
    assert not cfg.certified and "certified" not in cfg.note
    # lossless only: the plan falls back, and the explicit --policy defer still runs the per-token choice
    m.plan = plan_manifest(m, m.costs, max_risk=0.0)
    cfg = resolve_config(rt, RunOptions(), ())
    assert not cfg.certified and cfg.exits == []
