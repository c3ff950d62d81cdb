"""Drafts from the context priced at a run's own length: calibration replays its continuations cut at shorter
lengths too (`LookupStats.cuts`), a run of --max-new-tokens N is priced on the longest cut that fits
(`LookupStats.at_length`), and run and bench choose the plan's default again at that length (plan/lookup.py
`plan_for_run`). Measured on the default model (24 GSM8K prompts): 1.08 tokens a step over 16 generated tokens,
1.19 over 32, 1.28 over 64, 1.42 over 128, so a price made on 64-token continuations overstates a 32-token run."""

from __future__ import annotations

import pytest

from eectl.contracts.plan import LOOKUP, Choice, Costs, LookupChoice, LookupStats, Plan, Prediction
from eectl.plan.length import plan_for_run
from eectl.plan.lookup import choose_lookup
from eectl.runtime.drafts import CUT_LENGTHS, lookup_stats
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.tiny import random_ids as _ids


def _pairs(answer_len: int) -> list[tuple[list[int], list[int]]]:
    """Prompts whose phrase the answers repeat, with a wrong token now and then (drafts accepted and rejected)."""
    pairs = []
    for seed in range(4):
        phrase = _ids(seed, 5 + seed, 40)
        answer = (phrase * 30)[:answer_len]
        answer = [t if i % (7 + seed) else (t + 1) % 40 + 3 for i, t in enumerate(answer)]
        pairs.append((phrase * 2 + _ids(seed + 10, 3, 40), answer))
    return pairs


def test_cuts_are_the_replay_of_answers_cut_there():
    pairs = _pairs(70)
    stats = lookup_stats(pairs, max_draft=6)
    assert [c.length for c in stats.cuts] == [n for n in CUT_LENGTHS if n < 70] == [8, 16, 24, 32, 48, 64]
    for cut in stats.cuts:
        alone = lookup_stats([(p, a[: cut.length]) for p, a in pairs], max_draft=6)
        assert (cut.tokens, cut.steps, cut.accepted, cut.per_prompt) == (
            alone.tokens,
            alone.steps,
            alone.accepted,
            alone.per_prompt,
        )
        assert cut.tokens == len(pairs) * (cut.length - 1) and not cut.cuts


def test_a_run_is_priced_on_the_longest_cut_that_fits():
    pairs = _pairs(70)
    stats = lookup_stats(pairs, max_draft=6)
    stats.shortest = [lookup_stats(pairs, max_draft=6, min_draft=2)]
    assert stats.at_length(40).length == 32 and stats.at_length(32).length == 32
    assert stats.at_length(40).shortest[0].length == 32 and stats.at_length(40).shortest[0].min_draft == 2
    assert stats.at_length(3).length == 8  # shorter than every cut: the shortest
    assert stats.at_length(70) is stats and stats.at_length(500) is stats  # as long as the continuations: as is
    old = stats.model_copy(update={"cuts": []})  # a calibration file written before cuts
    assert old.at_length(16) is old


def test_a_shorter_run_takes_exactly_the_steps_of_its_cut(exported):
    """The runner generating N tokens with drafts from the context takes the steps `at_length(N)` counts."""
    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    V = rt.manifest.dims["vocab_size"]
    phrase = _ids(1, 6, V)
    prompt = phrase * 3 + _ids(2, 4, V)

    def run(new: int, drafts: int = 0):
        cfg = RunConfig(exits=[], thresholds={}, policy="verify", top_k=8, max_new_tokens=new, prompt_drafts=drafts)
        return Runner(rt, cfg).generate([prompt])[0]

    answer = run(70).token_ids
    stats = lookup_stats([(prompt, answer)], max_draft=6)
    for n in (16, 32, 48):
        got = run(n, drafts=6)
        cut = stats.at_length(n)
        assert got.token_ids == answer[:n] and cut.length == n
        steps = n - 1 - got.prompt_accepted  # each decode step emits one token and the drafts it accepted
        assert (cut.tokens, sum(cut.steps.values())) == (n - 1, steps)
        assert (cut.drafted, cut.accepted) == (got.prompt_drafted, got.prompt_accepted)


def _costs(**kw) -> Costs:
    base = dict(
        provider="cpu", threads=1, past=128, repeats=5, embed_ms=0.0, segment_ms=[4.0, 4.0],
        segment_extra_ms=[0.5, 0.5], kv_ms=[1.0, 1.0], final_head_ms=2.0, final_head_extra_ms=0.2, candidates_ms={},
        local_ms={}, full_step_ms=10.0, wide_ms={"2": 11.0, "5": 14.0, "9": 16.0},
    )  # fmt: skip
    base.update(kw)
    return Costs(**base)


def _pred(policy: str, speedup: float) -> Prediction:
    return Prediction(
        policy=policy, exits=[], ms_per_token=10.0 / speedup, full_ms=10.0, speedup=speedup, decision_ms=0.0,
        exit_rate=0.0,
    )  # fmt: skip


def _stats() -> LookupStats:
    """64-token continuations whose drafts pay (4 tokens a step of width 5), but not in their first 16 tokens."""
    pays = LookupStats(max_draft=4, max_ngram=3, prompts=2, tokens=126, steps={"1": 6, "5": 30}, drafted=120,
                       accepted=90, per_prompt=[(63, {"1": 3, "5": 15})] * 2)  # fmt: skip
    early = LookupStats(max_draft=4, max_ngram=3, prompts=2, tokens=30, steps={"1": 30}, drafted=0, accepted=0,
                        per_prompt=[(15, {"1": 15})] * 2, length=16)  # fmt: skip
    return pays.model_copy(update={"cuts": [early]})


def _plan(default: str, verify: float | None) -> Plan:
    costs, stats = _costs(), _stats()
    choices = {
        "verify": Choice(
            policy="verify",
            exits=[8] if verify else [],
            thresholds={},
            option=None,
            prediction=_pred("verify", verify or 1.0),
        )  # fmt: skip
    }
    lookup = choose_lookup(costs, stats)
    assert isinstance(lookup, LookupChoice) and lookup.on and lookup.prediction.speedup > 1.5
    return Plan(default=default, choices=choices, lookup=lookup)


def _manifest(plan, costs, stats):
    from types import SimpleNamespace

    segments = [SimpleNamespace(layers=(0, 8)), SimpleNamespace(layers=(8, 16))]
    return SimpleNamespace(plan=plan, costs=costs, calibration=SimpleNamespace(lookup=stats), segments=segments)


@pytest.mark.parametrize(("verify", "base"), [(1.2, "verify"), (None, "full")])
def test_the_default_is_chosen_again_at_the_runs_length(verify, base):
    """Lookup, the plan's default on 64-token continuations, gives way at 16 tokens to what the plan runs without
    it (verify's choice, or full depth); a run as long as the continuations keeps the plan as it is."""
    costs, stats, plan = _costs(), _stats(), _plan(LOOKUP, verify)
    short = plan_for_run(_manifest(plan, costs, stats), 16)
    assert short is not None and short.default == base and short.lookup is not None and not short.lookup.on
    assert short.lookup.prediction.speedup == pytest.approx(1.0)  # every step a plain one
    assert plan_for_run(_manifest(plan, costs, stats), 64) is plan
    assert plan_for_run(_manifest(plan, costs, stats), 200) is plan
    assert plan.default == LOOKUP  # the manifest's plan is not changed
    assert plan_for_run(_manifest(plan, None, stats), 16) is plan
    assert plan_for_run(_manifest(plan, costs, None), 16) is plan


def test_what_stays_undecided_is_the_plan_at_the_runs_length():
    """Lookup straddling the line on 64-token continuations (as if the timing budget ran out there) is clearly below
    it at 16 tokens: the run's plan no longer names it undecided; a policy's own undecided choice stays so."""
    costs, stats, plan = _costs(), _stats(), _plan(LOOKUP, 1.2)
    assert plan.lookup is not None
    straddling = plan.lookup.prediction.model_copy(update={"interval": (0.99, 1.9), "timing": (0.99, 1.9)})
    verify = plan.choices["verify"].model_copy(update={"undecided": True})
    plan = plan.model_copy(
        update={"lookup": plan.lookup.model_copy(update={"prediction": straddling}), "choices": {"verify": verify}}
    )
    plan.unresolved = plan.undecided()
    assert plan.unresolved == ["verify", LOOKUP]
    short = plan_for_run(_manifest(plan, costs, stats), 16)
    assert short is not None and short.lookup is not None and short.lookup.prediction.high() < 1.0 + short.min_gain
    assert short.unresolved == ["verify"]
    assert "undecided at the line" in short.summary() and LOOKUP not in short.summary().split("undecided")[1]
    assert plan.unresolved == ["verify", LOOKUP]  # the manifest's plan is not changed


def test_a_certified_or_inexact_default_stays_at_any_length():
    costs, stats = _costs(), _stats()
    assert plan_for_run(_manifest(_plan("certified", 1.2), costs, stats), 16).default == "certified"
    inexact = _plan("full", 1.2).model_copy(update={"inexact": "int4 at level 4"})
    assert plan_for_run(_manifest(inexact, costs, stats), 16).default == "full"


def test_lookup_takes_the_default_from_verify_only_with_the_higher_low_end():
    """Between verify's choice and drafts from the context the default is the one whose interval's low end is
    higher: a point ahead inside a wider interval (a near tie) does not take it, a low end above does."""
    from eectl.plan.choose import lossless_default

    def plan(verify: tuple[float, float, float], lookup: tuple[float, float, float]) -> Plan:
        base = _plan(LOOKUP, verify[0])
        v = base.choices["verify"].model_copy(update={"prediction": _pred("verify", verify[0])})
        v.prediction.interval = verify[1:]
        assert base.lookup is not None
        drafts = base.lookup.prediction.model_copy(update={"speedup": lookup[0], "interval": lookup[1:]})
        return base.model_copy(
            update={"choices": {"verify": v}, "lookup": base.lookup.model_copy(update={"prediction": drafts})}
        )

    assert lossless_default(plan((1.154, 1.141, 1.167), (1.159, 1.132, 1.188))) == "verify"  # ahead by its point only
    assert lossless_default(plan((1.154, 1.141, 1.167), (1.170, 1.145, 1.195))) == LOOKUP  # its low end above
    assert lossless_default(plan((1.02, 1.01, 1.03), (1.159, 1.132, 1.188))) == LOOKUP  # verify below the line
