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
    m = read_manifest(art)
    assert m.certificate is not None
    assert m.certificate.describe().startswith("defer at exits [2, 4] (topk-prob >= 0.9)")
    run = CliRunner().invoke(app, ["run", str(art), "hello", "--policy", "certified", "--max-new-tokens", "4"])
    assert run.exit_code == 0 and "certified: defer at exits [2, 4]" in run.output, run.output
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
