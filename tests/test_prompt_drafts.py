"""Drafts from the context (prompt lookup, runtime/drafts.py) checked by verify's deep pass: the proposals, the
back-off, and on every tiny family the output equal to full depth (alone, with exit drafts, rolled back in the
middle of a run of drafts, in a batch, on the bound one-row chain, at stop tokens and the length limit)."""

from __future__ import annotations

import numpy as np
import pytest

from eectl.contracts.plan import LOOKUP, MIN_GAIN, Choice, Costs, LookupChoice, LookupStats, Plan, Prediction
from eectl.errors import UsageError
from eectl.plan.choose import plan_manifest
from eectl.plan.lookup import choose_lookup, predict_lookup, wide_ms
from eectl.run.generate import RunOptions, resolve_config
from eectl.runtime.drafts import LONGEST_RUNS, PromptLookup, lookup_stats, replay
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import make_calibration
from tests.tiny import random_ids as _ids

K = 8


@pytest.fixture(scope="module")
def artifacts(exported):
    return {fam: ArtifactRuntime(art, provider="cpu") for fam, (_, art) in exported.items()}


def _repetitive(seed: int, vocab: int) -> list[int]:
    """A prompt whose n-grams repeat (a phrase three times, then new tokens): lookups find matches from the start."""
    phrase = _ids(seed, 6, vocab)
    return phrase * 3 + _ids(seed + 100, 4, vocab)


def _config(drafts=0, policy="verify", exits=(), thresholds=0.0, new=40, stop=(), shortest=1) -> RunConfig:
    return RunConfig(
        exits=list(exits),
        thresholds={e: {"prob": thresholds} for e in exits},
        policy=policy,
        top_k=K,
        max_new_tokens=new,
        prompt_drafts=drafts,
        stop_ids=tuple(stop),
        draft_min=shortest,
    )


def _gen(rt, prompts, drafts=0, policy="verify", exits=(), thresholds=0.0, new=40, slots=None, stop=(), shortest=1):
    cfg = _config(drafts, policy, exits, thresholds, new, stop, shortest)
    return Runner(rt, cfg).generate(prompts, slots=slots)


@pytest.fixture
def attempts(monkeypatch):
    """Every drafting attempt's (drafted, accepted), as the runner settles it."""
    seen: list[tuple[int, int]] = []
    settle = PromptLookup.settle

    def spy(self, ls, drafted, accepted, length):
        seen.append((drafted, accepted))
        return settle(self, ls, drafted, accepted, length)

    monkeypatch.setattr(PromptLookup, "settle", spy)
    return seen


# --- the proposals -------------------------------------------------------------------------------------------------
def test_propose_takes_the_longest_suffix_at_its_latest_earlier_occurrence():
    look = PromptLookup(4, max_ngram=3, min_ngram=1)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 6, 7]
    # the 3-gram [2, 6, 7] never occurred before; the 2-gram [6, 7] did, last at 5..6: what followed it
    assert look.propose(tokens, 4) == [2, 6, 7]
    assert look.propose(tokens, 2) == [2, 6]  # at most `limit`
    assert look.propose([*tokens[:7], 9, 5, 6, 7], 3) == [9, 5, 6]  # [5, 6, 7] last seen at 4..6, followed by 9 ...
    assert look.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert look.propose(tokens, 0) == []


def test_propose_respects_the_minimum_match_and_stops_before_a_stop_token():
    tokens = [8, 1, 2, 3, 9, 4, 5, 1, 2]
    assert PromptLookup(4, max_ngram=3, min_ngram=3).propose(tokens, 4) == []  # only a 2-gram repeats
    assert PromptLookup(4, max_ngram=3, min_ngram=2).propose(tokens, 4) == [3, 9, 4, 5]
    assert PromptLookup(4, max_ngram=3, min_ngram=2).propose(tokens, 4, stop_ids=(9,)) == [3]
    assert PromptLookup(4, max_ngram=3, min_ngram=2).propose(tokens, 4, stop_ids=(3,)) == []


def test_draft_length_adapts_and_a_row_that_keeps_missing_backs_off():
    look = PromptLookup(8, patience=2, backoff=5)
    ls = look.new_state()
    look.settle(ls, 8, 3, 100)  # wrong at the fourth: draft what was accepted, plus one
    assert ls.span == 4
    look.settle(ls, 4, 4, 105)  # all accepted: twice as many next time (at most max_draft)
    assert ls.span == 8
    look.settle(ls, 8, 0, 106)
    assert ls.span == 1 and ls.resume_at == 0
    look.settle(ls, 1, 0, 107)  # the second miss in a row: no attempt for `backoff` tokens
    assert ls.resume_at == 112
    repeat = [1, 2, 3, 1, 2]
    assert look.drafts_for(ls, repeat * 20, 8, ()) == []  # 100 tokens < 112: backing off
    assert look.drafts_for(ls, repeat * 23, 8, ()) != []


def test_bad_draft_options_are_refused(artifacts):
    rt = artifacts["llama"]
    with pytest.raises(UsageError, match="prompt-drafts must be in 1..64"):
        PromptLookup(65)
    with pytest.raises(UsageError, match="needs a policy that checks drafts"):
        _gen(rt, [[5, 6, 7]], drafts=4, policy="defer")
    with pytest.raises(UsageError, match="prompt-drafts must be in 0..64"):
        resolve_config(rt, RunOptions(exits="none", prompt_drafts=-1), ())
    with pytest.raises(UsageError, match="needs the verify policy"):
        resolve_config(rt, RunOptions(exits="2", thresholds="0.5", policy="defer", prompt_drafts=4), ())
    # no exit active: full depth, checked by verify's pass whatever policy was named
    cfg = resolve_config(rt, RunOptions(exits="none", policy="defer", prompt_drafts=4), ())
    assert cfg.policy == "verify" and cfg.prompt_drafts == 4 and cfg.exits == []


# --- output equal to full depth ------------------------------------------------------------------------------------
def test_prompt_drafts_equal_full_depth_with_accepted_runs_and_rollbacks_inside_them(artifacts, family, attempts):
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompts = [_repetitive(s, V) for s in (1, 2, 3)]
    full = [g.token_ids for g in _gen(rt, prompts, new=40)]
    for p, want in zip(prompts, full, strict=True):
        got = _gen(rt, [p], drafts=6, new=40)[0]
        assert got.token_ids == want
        assert len(got.exit_layers) == len(got.latencies_s) == len(want) == 40
    assert attempts, "no drafts were proposed"
    assert any(a < d for d, a in attempts), attempts  # some drafts were wrong


def test_a_wrong_draft_inside_a_run_rolls_back_to_full_depth(artifacts, family, attempts, monkeypatch):
    """Drafts that are full depth's next tokens but for the third (a wrong token there): every attempt keeps the
    two before it, rolls back the rest, and the answer is full depth's."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _ids(9, 12, V)
    want = _gen(rt, [prompt], new=40)[0].token_ids

    def propose(self, tokens, limit, stop_ids=()):
        truth = want[len(tokens) - len(prompt) : len(tokens) - len(prompt) + limit]
        return truth[:2] + [(truth[2] + 1) % V] + truth[3:] if len(truth) > 3 else truth

    monkeypatch.setattr(PromptLookup, "propose", propose)
    got = _gen(rt, [prompt], drafts=6, new=40)[0]
    assert got.token_ids == want
    assert (6, 2) in attempts and all(a == 2 or a == d for d, a in attempts), attempts
    assert got.prompt_accepted == sum(a for _, a in attempts)


def test_prompt_drafts_beside_exit_drafts_equal_full_depth(artifacts, family, attempts):
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompt = _repetitive(4, V)
    want = _gen(rt, [prompt], new=30)[0].token_ids
    for thr in (0.0, 0.3):  # every token an exit draft; some
        got = _gen(rt, [prompt], drafts=4, exits=[2, 4], thresholds=thr, new=30)[0]
        assert got.token_ids == want, thr
        assert got.drafted > 0 or thr > 0
    assert attempts


def _same_kv(kv, r: int, other, slots: range | None = None) -> bool:
    """Row r of `kv` and row 0 of `other` hold the same K/V (within 1e-4) at `slots` (all by default), each up to
    the shorter of their lengths there."""
    for slot in slots or range(kv.filled.shape[1]):
        n = int(min(kv.filled[r, slot], other.filled[0, slot]))
        for mine, want in ((kv.keys, other.keys), (kv.values, other.values)):
            a, b = np.asarray(mine[r][slot])[0, :, :n], np.asarray(want[0][slot])[0, :, :n]
            if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
                return False
    return True


def _full_depth_rows(kv, alone) -> None:
    """Each row of a batch's cache that holds positions holds the K/V of one prompt's full-depth run alone (`alone`:
    their caches, row 0 each; the prompt found by the first layer's), every layer's, each prompt in one row at
    most."""
    held = []
    for r in range(kv.filled.shape[0]):
        if kv.filled[r, 0] == 0:
            continue
        match = [i for i, other in enumerate(alone) if _same_kv(kv, r, other, range(1))]
        assert len(match) == 1, (r, match)
        assert _same_kv(kv, r, alone[match[0]]), r
        held += match
    assert held and len(held) == len(set(held)), held


def _drafting(g) -> tuple:
    return g.exit_layers, g.drafted, g.rejected_drafts, g.prompt_drafted, g.prompt_accepted


def test_rows_draft_independently_in_a_batch(artifacts, family, attempts):
    """Three prompts on two slots: rows with and without drafts in one step (their wide calls beside the batched
    one: runtime/chain_rows.py), each row's tokens those of its prompt at full depth alone, its drafts (from the
    context and from exits) and exits those of the same run of its prompt alone, and the cache's rows the K/V of the
    prompts' full-depth runs."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompts = [_repetitive(5, V), _ids(6, 9, V), _repetitive(7, V)[:14]]
    full = []
    for p in prompts:
        runner = Runner(rt, _config(new=24))
        full.append((runner.generate([p])[0].token_ids, runner.last_kv))
    for exits in ((), (2, 4)):  # drafts from the context; beside exit drafts (many, most rolled back)
        cfg = _config(drafts=4, exits=exits, thresholds=0.1, new=24)
        runner = Runner(rt, cfg)
        got = runner.generate(prompts, slots=2)
        assert [g.token_ids for g in got] == [f for f, _ in full], exits
        assert sum(g.prompt_accepted for g in got) > 0, exits
        assert exits == () or (sum(g.drafted for g in got) > 0 and sum(g.rejected_drafts for g in got) > 0), exits
        alone = [Runner(rt, cfg).generate([p])[0] for p in prompts]
        assert [_drafting(g) for g in got] == [_drafting(a) for a in alone], exits
        _full_depth_rows(runner.last_kv, [kv for _, kv in full])
    assert attempts


def test_one_row_drafts_run_on_the_bound_chain(artifacts, monkeypatch, attempts):
    """One row, greedy, CPU: the wide passes run on the bound chain (`chain_step` with the drafts embedded, waiting
    at segment 0), one per drafting attempt, as many drafts as proposed, the prompt's positions waiting there too; the
    tokens are full depth's."""
    from eectl.runtime import chain_steps

    rt = artifacts["llama"]
    prompt = _repetitive(1, rt.manifest.dims["vocab_size"])
    want = _gen(rt, [prompt], new=40)[0].token_ids
    steps: list[tuple[int, bool]] = []
    real = chain_steps.chain_step

    def spy(runner, chain, st, kv, drafts=0, prompt=False, **kw):
        steps.append((drafts, prompt))
        return real(runner, chain, st, kv, drafts, prompt, **kw)

    monkeypatch.setattr(chain_steps, "chain_step", spy)
    got = _gen(rt, [prompt], drafts=6, new=40)[0]
    assert got.token_ids == want and got.prompt_accepted > 0
    wide = [d for d, p in steps if d and not p]
    assert wide == [d for d, _ in attempts] and sum(wide) == got.prompt_drafted, (steps, attempts)
    assert steps[0] == (len(prompt) - 1, True)  # the prompt: its positions but the last waiting at segment 0


def test_drafted_steps_are_timed_as_the_runner_takes_them(artifacts, family, monkeypatch):
    """The prices of steps with drafts (plan/step_calls.py `wide_step_calls`) time the runner's own drafted step: the
    drafts proposed from the context by the search (as many as the width names; none for "wide.1"), the step on the
    bound chain with verify's check, at the costs' past, over and over on the same cache."""
    import eectl.plan.step_calls as step_calls
    from eectl.plan.step_calls import WIDE_WIDTHS, wide_step_calls

    rt = artifacts[family]
    seen: list[tuple[int, int, int]] = []
    real = step_calls.chain_step

    def spy(runner, chain, st, kv, drafts=0):
        seen.append((drafts, int(kv.filled[0].min()), len(st.drafts)))
        return real(runner, chain, st, kv, drafts)

    monkeypatch.setattr(step_calls, "chain_step", spy)
    calls = wide_step_calls(rt, past=40)
    assert sorted(calls) == sorted(f"wide.{w}" for w in (1, *WIDE_WIDTHS))
    for _ in range(2):  # a second round starts from the same state
        for w in (1, *WIDE_WIDTHS):
            calls[f"wide.{w}"]()
            assert seen[-1] == (w - 1, 39, w - 1)  # w - 1 drafts proposed, attached, checked; 39 positions before


def test_a_plain_lookup_step_is_priced_as_timed():
    """Costs that time lookup's one-position step (its search finds nothing) price width 1 from it, not from full
    depth's step: the search is step time full depth does not pay."""
    costs = _costs(wide_ms={"1": 10.5, "2": 11.0, "5": 14.0})
    assert wide_ms(costs, 1) == 10.5 and wide_ms(costs, 2) == 11.0
    stats = LookupStats(
        max_draft=4, max_ngram=3, prompts=1, tokens=100, steps={"1": 40, "5": 20}, drafted=80, accepted=40
    )
    pred = predict_lookup(costs, stats)
    assert pred is not None and pred.speedup == pytest.approx(100 * 10.0 / (40 * 10.5 + 20 * 14.0), abs=1e-4)
    # timed below full depth's step (it takes the exit-step path, a little cheaper than the chain's full-depth step
    # the plain step runs): the baseline, never less
    below = predict_lookup(_costs(wide_ms={"1": 9.5, "2": 11.0, "5": 14.0}), stats)
    assert below is not None and below.speedup == pytest.approx(100 * 10.0 / (40 * 10.0 + 20 * 14.0), abs=1e-4)


def test_stop_tokens_and_the_length_limit_are_full_depths(artifacts, family):
    """A stop token inside what the drafts would copy ends the answer where full depth ends it; the length limit is
    never passed, however many drafts a pass accepts."""
    rt = artifacts[family]
    prompt = _repetitive(2, rt.manifest.dims["vocab_size"])
    full = _gen(rt, [prompt], new=40)[0].token_ids
    stop = full[12]
    want = full[: full.index(stop) + 1]
    assert _gen(rt, [prompt], new=40, stop=(stop,))[0].token_ids == want
    assert _gen(rt, [prompt], drafts=8, new=40, stop=(stop,))[0].token_ids == want
    for new in (1, 2, 7):
        assert _gen(rt, [prompt], drafts=8, new=new)[0].token_ids == full[:new]


# --- the price: calibration's replay, export's wide passes, the plan ----------------------------------------------
def test_replay_makes_the_runners_attempts_exactly(artifacts, family, attempts):
    """What calibration replays on a greedy answer (no model run) is what the runner does generating it: the same
    attempts, drafts and accepted tokens, in order."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    long_runs = 0  # attempts with runs of 3+ drafts (the prompts below make some on every family)
    for seed, shortest in ((1, 1), (8, 1), (1, 3), (8, 3), (3, 3), (5, 3)):
        prompt = _repetitive(seed, V)
        if shortest > 1:  # runs of 3+ drafts: the prompt holds its own answer, then itself again (the answers of
            # these models repeat one token: runs of one draft otherwise)
            prompt = prompt + _gen(rt, [prompt], new=20)[0].token_ids + prompt
        answer = _gen(rt, [prompt], new=40)[0].token_ids
        attempts.clear()
        got = _gen(rt, [prompt], drafts=6, new=40, shortest=shortest)[0]
        assert got.token_ids == answer
        ran = list(attempts)
        attempts.clear()
        widths = replay(PromptLookup(6, min_draft=shortest), prompt, answer)
        assert attempts == ran and all(d >= shortest for d, _ in ran)
        assert ran or shortest > 1
        long_runs += len(ran) if shortest > 1 else 0
        assert len(widths) == len(answer) - 1 - got.prompt_accepted  # every step emits one token and its accepted
        assert sum(w - 1 for w in widths) == got.prompt_drafted
        assert all(w == 1 or w > shortest for w in widths)  # no run shorter than the shortest proposed
    assert long_runs > 0
    stats = lookup_stats([(prompt, answer)], max_draft=6)
    assert stats.tokens == len(answer) - 1 and stats.tokens == sum(stats.steps.values()) + stats.accepted


def _costs(**kw) -> Costs:
    base = dict(
        provider="cpu", threads=1, past=128, repeats=5, embed_ms=0.0, segment_ms=[4.0, 4.0],
        segment_extra_ms=[0.5, 0.5], kv_ms=[1.0, 1.0], final_head_ms=2.0, final_head_extra_ms=0.2, candidates_ms={},
        local_ms={}, full_step_ms=10.0,
    )  # fmt: skip
    base.update(kw)
    return Costs(**base)


def test_lookup_is_priced_from_the_replayed_steps_and_the_wide_passes():
    costs = _costs(wide_ms={"2": 11.0, "5": 14.0, "9": 16.0})
    assert wide_ms(costs, 1) == 10.0 and wide_ms(costs, 3) == pytest.approx(12.0)  # linear between 2 and 5
    assert wide_ms(costs, 17) == pytest.approx(20.0)  # beyond 9: the last slope, 0.5 ms a position
    # 100 tokens: 40 one-position steps, 20 steps of width 5 each accepting 2 of 4 drafts (20 x 3 = 60 tokens)
    stats = LookupStats(
        max_draft=4, max_ngram=3, prompts=2, tokens=100, steps={"1": 40, "5": 20}, drafted=80, accepted=40
    )
    pred = predict_lookup(costs, stats)
    assert pred is not None and pred.speedup == pytest.approx(100 * 10.0 / (40 * 10.0 + 20 * 14.0), abs=1e-4)
    assert predict_lookup(_costs(), stats) is None  # costs timed before wide passes: no price
    choice = choose_lookup(costs, stats)
    assert (
        choice is not None
        and choice.on
        and choice.drafts == 4
        and choice.tokens_per_step == pytest.approx(100 / 60, abs=1e-4)
    )
    # drafts that never pay: every step of width 9 accepting nothing
    never = LookupStats(max_draft=8, max_ngram=3, prompts=1, tokens=50, steps={"9": 50}, drafted=400, accepted=0)
    off = choose_lookup(costs, never)
    assert off is not None and not off.on and off.prediction.speedup == pytest.approx(10.0 / 16.0, abs=1e-4)
    # with timing rounds: an interval over them, and a gain the rounds cannot tell from the line is not switched on
    rounds = {"chain_step_ms": [10.0, 10.0, 10.0, 10.0], "wide_ms.5": [13.0, 15.5, 12.5, 16.0]}
    noisy = _costs(wide_ms={"5": 14.0}, chain_step_ms=10.0, samples_ms=rounds)
    edge = LookupStats(max_draft=4, max_ngram=3, prompts=1, tokens=40, steps={"5": 28}, drafted=112, accepted=12)
    pick = choose_lookup(noisy, edge)
    assert pick is not None and pick.prediction.interval is not None
    lo, hi = pick.prediction.interval
    assert lo < pick.prediction.speedup < hi and lo < 1.0 + MIN_GAIN and not pick.on


def test_the_plan_keeps_the_shortest_run_its_costs_price_fastest():
    """Calibration replays the drafts again with longer shortest runs (`LookupStats.shortest`); the plan prices each
    and keeps the fastest: where a pass over two positions costs two steps (int4 segments), runs of one draft go."""
    ones = LookupStats(max_draft=4, max_ngram=3, prompts=1, tokens=100, steps={"1": 40, "2": 30}, drafted=30,
                       accepted=30, per_prompt=[(100, {"1": 40, "2": 30})])  # fmt: skip
    # the same answers with runs of 2+ only: the one-draft runs become plain steps, one longer run stays
    twos = LookupStats(max_draft=4, max_ngram=3, prompts=1, tokens=100, steps={"1": 94, "3": 2}, drafted=4,
                       accepted=4, per_prompt=[(100, {"1": 94, "3": 2})], min_draft=2)  # fmt: skip
    both = ones.model_copy(update={"shortest": [twos]})
    cheap = _costs(wide_ms={"2": 11.0, "3": 12.0})  # full depth 10 ms a step
    dear = _costs(wide_ms={"2": 22.0, "3": 24.0})
    on_cheap, on_dear = choose_lookup(cheap, both), choose_lookup(dear, both)
    assert on_cheap is not None and on_cheap.min_draft == 1
    assert on_cheap.prediction.speedup == pytest.approx(1000 / (40 * 10 + 30 * 11), abs=1e-3)
    assert on_dear is not None and on_dear.min_draft == 2
    assert on_dear.prediction.speedup == pytest.approx(1000 / (94 * 10 + 2 * 24), abs=1e-3)
    assert choose_lookup(dear, ones).min_draft == 1  # calibrations written before: the one replay there is


def test_the_plan_keeps_the_longest_run_its_costs_price_fastest():
    """Calibration also replays the drafts with shorter longest runs (runtime/drafts.py LONGEST_RUNS, in
    `LookupStats.shortest`): where each drafted position costs much, runs of 4 that keep what runs of 12 mostly keep
    price faster, and the plan's drafts per step (what a run proposes) are the kept replay's."""
    # runs of up to 12: 10 passes over 13 positions keep 50 drafts; runs of up to 4: 20 passes over 5 keep 40
    twelve = LookupStats(max_draft=12, max_ngram=3, prompts=1, tokens=100, steps={"1": 40, "13": 10}, drafted=120,
                         accepted=50, per_prompt=[(100, {"1": 40, "13": 10})])  # fmt: skip
    four = LookupStats(max_draft=4, max_ngram=3, prompts=1, tokens=100, steps={"1": 40, "5": 20}, drafted=80,
                       accepted=40, per_prompt=[(100, {"1": 40, "5": 20})])  # fmt: skip
    both = twelve.model_copy(update={"shortest": [four]})
    cheap = _costs(wide_ms={"5": 11.0, "13": 12.0})  # full depth 10 ms a step
    dear = _costs(wide_ms={"5": 18.0, "13": 44.0})
    on_cheap, on_dear = choose_lookup(cheap, both), choose_lookup(dear, both)
    assert on_cheap is not None and on_cheap.drafts == 12
    assert on_cheap.prediction.speedup == pytest.approx(1000 / (40 * 10 + 10 * 12), abs=1e-3)
    assert on_dear is not None and on_dear.drafts == 4
    assert on_dear.prediction.speedup == pytest.approx(1000 / (40 * 10 + 20 * 18), abs=1e-3)
    # calibration replays every length it offers on the same answers: each variant's runs within its bounds
    pairs = [(list(range(3, 40)) * 2, list(range(3, 40)) + [5, 6, 7])]
    variants = [lookup_stats(pairs, max_draft=n) for n in LONGEST_RUNS]
    assert [v.max_draft for v in variants] == list(LONGEST_RUNS)
    assert all(max(int(w) for w in v.steps) <= v.max_draft + 1 for v in variants)
    assert max(int(w) for w in variants[-1].steps) > LONGEST_RUNS[0] + 1  # the longer bound drafted longer runs


def test_the_plans_lookup_default_is_what_run_follows(exported):
    """A plan whose default is lookup: run with no options runs full depth with the plan's drafts (verify's pass);
    --prompt-drafts overrides their number; explicit exits bypass the plan; lookup with exits is refused."""
    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    pred = Prediction(policy=LOOKUP, exits=[], ms_per_token=5.0, full_ms=10.0, speedup=2.0, decision_ms=0.0,
                      exit_rate=0.0, interval=(1.8, 2.2))  # fmt: skip
    choice = Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=pred)
    look = LookupChoice(drafts=5, prediction=pred, on=True, tokens_per_step=2.5, min_draft=2)
    rt.manifest.plan = Plan(default=LOOKUP, choices={"verify": choice}, lookup=look)
    rt.manifest.calibration = make_calibration(exported["llama"][0], {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    cfg = resolve_config(rt, RunOptions(), ())
    assert (cfg.policy, cfg.exits, cfg.prompt_drafts, cfg.draft_min, cfg.planned) == ("verify", [], 5, 2, True)
    assert Runner(rt, cfg).lookup.min_draft == 2  # the runner proposes what the plan priced
    assert "drafts per step from the context" in cfg.note and "2.000x" in cfg.note
    assert resolve_config(rt, RunOptions(prompt_drafts=2), ()).prompt_drafts == 2
    explicit = resolve_config(rt, RunOptions(exits="2", thresholds="0.5", policy="defer"), ())
    assert (explicit.policy, explicit.exits, explicit.prompt_drafts) == ("defer", [2], 0)
    with pytest.raises(UsageError, match="runs at full depth"):
        resolve_config(rt, RunOptions(policy=LOOKUP, exits="2"), ())
    # sampling: the plan's default reproduces greedy full depth, so a sampled run is full depth, said so; asking for
    # the greedy-only policy itself while sampling is refused
    sampled = resolve_config(rt, RunOptions(temperature=0.8), ())
    assert (sampled.policy, sampled.exits, sampled.prompt_drafts, sampled.planned) == ("defer", [], 0, True)
    assert "sampling runs at full depth" in sampled.note
    assert Runner(rt, sampled).generate([[5, 6, 7]])[0].exit_layers == [rt.manifest.num_layers] * sampled.max_new_tokens
    for policy in (LOOKUP, "verify"):
        with pytest.raises(UsageError, match="greedy only"):
            Runner(rt, resolve_config(rt, RunOptions(temperature=0.8, policy=policy), ()))
    # a batch: the plan prices one row, so its default gives way to full depth, said so; a policy asked for runs
    batched = resolve_config(rt, RunOptions(batch_size=4), ())
    assert (batched.policy, batched.exits, batched.prompt_drafts, batched.planned) == ("defer", [], 0, True)
    assert "priced for one row; a batch of 4 runs full depth" in batched.note
    asked = resolve_config(rt, RunOptions(batch_size=4, policy=LOOKUP), ())
    assert (asked.policy, asked.prompt_drafts) == ("verify", 5)
    # ... and says that the plan's one-row prices do not hold for it (measured: verify [8] at 4 rows 0.81x full depth)
    assert (
        "priced for one row; in a batch of 4" in asked.note
        and "priced for one row" not in resolve_config(rt, RunOptions(batch_size=1, policy=LOOKUP), ()).note
    )
    assert resolve_config(rt, RunOptions(batch_size=1), ()).prompt_drafts == 5
    # bench labels as the default what run does at its batch size
    from eectl.evaluate.predicted import run_default

    assert run_default(rt.manifest.plan, 1)[0] == LOOKUP and run_default(rt.manifest.plan, 4)[0] == "full"
    assert "a batch of 4 runs full depth" in run_default(rt.manifest.plan, 4)[1] and run_default(None, 4) == ("", "")

    # bench's lookup configurations draft as run does: the plan's drafts per step (and shortest run), unless
    # --prompt-drafts says otherwise
    from eectl.evaluate.configs import Configs
    from eectl.evaluate.results import BenchOptions

    for asked_drafts, drafts in ((None, 5), (3, 3)):
        bench = object.__new__(Configs)  # its configurations resolved alone, no runtime made for them
        bench.opts = BenchOptions(configs=["full", LOOKUP, "verify+lookup"], prompt_drafts=asked_drafts)
        bench.stop, bench.exits, bench.thresholds, bench.signal, bench.priced = (), [], {}, "", {}
        got = bench._resolve(rt)
        assert (got[LOOKUP].prompt_drafts, got[LOOKUP].draft_min) == (drafts, 2)
        assert got["verify+lookup"].prompt_drafts == drafts


def test_run_hands_its_batch_size_to_the_plans_resolution(monkeypatch):
    """`eectl run --batch-size N` (the run stage) resolves its configuration knowing N: what makes the plan's default
    give way to full depth in a batch."""
    from eectl.contracts.recipe import Recipe
    from eectl.output import Output
    from eectl.run.stage import RunRequest, run

    seen: list[RunOptions] = []

    class _Stop(Exception):
        pass

    def opened(artifact, opts, note):  # the options the stage opens the artifact and its engine's runners with
        seen.append(opts)
        raise _Stop

    monkeypatch.setattr("eectl.run.generate.open_artifact", opened)
    for n in (1, 3):
        with pytest.raises(_Stop):
            run(Recipe(name="r"), RunRequest("art", ["hi"], batch_size=n), Output(quiet=True))
    assert [o.batch_size for o in seen] == [1, 3]


def test_plan_manifest_makes_lookup_the_default_only_when_it_pays(exported):
    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    m = rt.manifest
    costs = _costs(segment_ms=[4.0] * len(m.segments), segment_extra_ms=[0.5] * len(m.segments),
                   kv_ms=[1.0] * len(m.segments), wide_ms={"5": 12.0, "9": 14.0})  # fmt: skip
    cal = make_calibration(exported["llama"][0], {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    for steps, default in (({"5": 20}, LOOKUP), ({"9": 60}, "full")):  # 3 tokens a step; every draft wrong
        tokens = sum((int(w) - 1) * n for w, n in steps.items()) // 4 * 3 if default == LOOKUP else 60
        cal.lookup = LookupStats(max_draft=8, max_ngram=5, prompts=2, tokens=tokens, steps=steps, drafted=0, accepted=0)
        plan = plan_manifest(m.model_copy(update={"calibration": cal}), costs)
        assert plan.default == default and plan.lookup is not None and plan.lookup.on == (default == LOOKUP)


def test_bench_runs_drafts_from_the_context_side_by_side(exported):
    """bench's lookup and verify+lookup beside verify: identical tokens to full depth, drafts by source, and the
    cost model's figure for lookup on the run's own answers."""
    import json

    from typer.testing import CliRunner

    from eectl.cli import app
    from tests.tiny import GSM8K

    art = exported["llama"][1]
    args = ["bench", str(art), "--data", str(GSM8K), "--prompts", "2", "--max-new-tokens", "16", "--reps", "1"]
    args += ["--policies", "full,verify,lookup,verify+lookup", "--thresholds", "0.3", "--sweep", "", "--raw"]
    res = CliRunner().invoke(app, [*args, "--ppl-tokens", "0", "--prompt-drafts", "4", "--json", "--threads", "1"])
    assert res.exit_code == 0, res.output
    by = {c["name"]: c for c in json.loads(res.stdout)["configs"]}
    for name in ("verify", "lookup", "verify+lookup"):
        assert by[name]["exact_match"] == 1.0, name
    assert by["lookup"]["prompt_drafted"] >= by["lookup"]["prompt_accepted"] and by["lookup"]["drafted"] == 0
    assert by["verify"]["prompt_drafted"] == 0
    has_costs = json.loads((art / "manifest.json").read_text()).get("costs") is not None
    assert (by["lookup"]["model_speedup"] is not None) == has_costs


def test_lookup_stats_keep_each_prompts_steps():
    """`lookup_stats` keeps each prompt's own tokens and steps by width (what the plan's interval resamples); they
    add up to the totals, and a resample of them is priced as those prompts' own replay."""
    pairs = [([5, 6, 7, 8, 5, 6, 7], [8, 5, 6, 7, 8, 5, 6, 7, 8, 9]), ([1, 2, 3], [4, 9, 11, 12, 13])]
    stats = lookup_stats(pairs, 4)
    assert len(stats.per_prompt) == 2 and stats.tokens == sum(n for n, _ in stats.per_prompt) == 9 + 4
    for w in stats.steps:
        assert stats.steps[w] == sum(own.get(w, 0) for _, own in stats.per_prompt)
    alone = lookup_stats(pairs[:1], 4)
    first = stats.of_prompts([0])
    assert (first.tokens, first.steps) == (alone.tokens, alone.steps)
    assert stats.per_prompt[0][1] != stats.per_prompt[1][1]  # the repeating prompt drafts, the other cannot


def test_lookup_interval_covers_how_much_the_pay_varies_between_prompts():
    """Drafts that pay on a few prompts and cost on the rest: the pooled point clears the line, but the interval
    over calibration's prompts reaches below it, so lookup is not switched on (the costs alone, timed without
    rounds, give no interval: the old rule switched it on); the same pooled steps from identical prompts are."""
    costs = _costs(wide_ms={"2": 11.0, "5": 14.0, "9": 16.0})  # full depth 10 ms a token
    pays = (20, {"5": 5})  # 4 tokens a step: 70 ms for 20 tokens
    costs_only = (20, {"1": 10, "5": 10})  # every draft wrong: 240 ms for 20 tokens
    mixed = [pays] * 3 + [costs_only] * 5

    def stats(per_prompt):
        steps: dict[str, int] = {}
        for _, own in per_prompt:
            for w, n in own.items():
                steps[w] = steps.get(w, 0) + n
        tokens = sum(n for n, _ in per_prompt)
        return LookupStats(max_draft=4, max_ngram=3, prompts=len(per_prompt), tokens=tokens, steps=steps,
                           drafted=0, accepted=0, per_prompt=per_prompt)  # fmt: skip

    varied = choose_lookup(costs, stats(mixed))
    assert varied is not None and varied.prediction.speedup == pytest.approx(160 * 10.0 / (3 * 70 + 5 * 240), abs=1e-3)
    lo, hi = varied.prediction.interval
    assert lo < 1.0 + MIN_GAIN < varied.prediction.speedup < hi and not varied.on
    assert choose_lookup(costs, stats(mixed).model_copy(update={"per_prompt": []})).on  # without prompts: on
    # every prompt the pool's own mix (65 steps of width 5, 50 of width 1 for 160 tokens): no spread between them
    same = [(160, {"5": 65, "1": 50})] * 8
    steady = choose_lookup(costs, stats(same))
    assert steady is not None and steady.prediction.interval == (steady.prediction.speedup,) * 2 and steady.on
