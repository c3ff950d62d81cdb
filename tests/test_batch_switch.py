"""A batch that switches configurations as rows join and leave (runtime/slots.py `Switch`, plan/batch.py, the
engine): the plan's lossless configuration (drafts from the context; verify's exits) while the batch holds few rows,
full depth while it holds more. Every row gets the tokens it gets alone; each step ran the configuration the switch
chose (the runner a step was given, its drafts and exits, not only the output); a switch away from verify's exits
waits for a step with no exit deciding; the pricing chooses full depth where the batch is priced slower and the
plan's configuration where it is not, from the timings, with no batch size written in."""

from __future__ import annotations

import pytest

from eectl.contracts.plan import LOOKUP, Choice, Costs, LookupChoice, LookupStats, Plan, Prediction
from eectl.plan.batch import BatchPrices, price, widths
from eectl.runtime import runner as runner_module
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import DRAIN, FULL, PLAN, Switch
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K
from tests.test_feed import PROMPTS, Scripted  # Scripted's rows are these prompts

SMALL = 2  # the switch below runs the plan's configuration at up to this many rows


@pytest.fixture(scope="module")
def runtime(exported):
    return ArtifactRuntime(exported["llama"][1], provider="cpu")


def _config(kind: str, new: int) -> RunConfig:
    if kind == "full":
        return RunConfig(exits=[], thresholds={}, policy="defer", top_k=EXPORT_TOP_K, max_new_tokens=new)
    if kind == "lookup":
        return RunConfig(exits=[], thresholds={}, policy="verify", prompt_drafts=4, top_k=EXPORT_TOP_K,
                         max_new_tokens=new)  # fmt: skip
    thr = {e: {"prob": 0.1} for e in EXPORT_EXITS}  # below 1/K: the tiny model's exits fire always
    return RunConfig(exits=list(EXPORT_EXITS), thresholds=thr, policy="verify", top_k=EXPORT_TOP_K, max_new_tokens=new)


@pytest.mark.parametrize("kind", ["lookup", "exits"])
def test_a_growing_and_shrinking_batch_switches_and_gives_every_row_its_tokens_alone(runtime, kind, monkeypatch):
    budget = {0: 14, 1: 4, 2: 12, 3: 9, 4: 10}
    alone = {k: Runner(runtime, _config("full", n)).generate([PROMPTS[k]])[0].token_ids for k, n in budget.items()}
    runner = Runner(runtime, _config(kind, 128))
    full = Runner(runtime, _config("full", 128))
    runner.switch = switch = Switch(full, lambda rows: rows <= SMALL)
    # what each step was given: the runner, whether exits were held back, the rows drafting, the rows, and whether
    # every row was at a cycle boundary (no unchecked draft, no deferred state)
    given: list[tuple[Runner, bool, int, int, bool]] = []
    real = runner_module.chain_tokens

    def spy(run, chain, kv, live, fresh, drafted, kept, force_full=False):
        settled = all(not st.drafts and all(p is None for p in st.pending) for st, _ in live.values())
        given.append((run, force_full, sum(1 for n in drafted.values() if n), len(live), settled))
        return real(run, chain, kv, live, fresh, drafted, kept, force_full=force_full)

    monkeypatch.setattr(runner_module, "chain_tokens", spy)
    # one row, then four (2 and 3 join), then fewer as they finish, 4 joining late, 3 dropped halfway
    feed = Scripted(runner, arrive={0: 0, 1: 3, 2: 3, 3: 4, 4: 11}, drop={3: 7}, budget=budget)
    runner.run_feed(feed, 4, 64)
    for k in (0, 1, 2, 4):
        st = feed.rows[k]
        assert st.done and st.tokens[st.prompt_len :] == alone[k], k
    three = feed.rows[3]
    got = three.tokens[three.prompt_len :]
    assert 0 < len(got) < budget[3] and got == alone[3][: len(got)]
    ran = list(switch.ran)
    assert len(ran) == len(given)
    for (rows, mode), (run, forced, drafting, live, settled) in zip(ran, given, strict=True):
        assert rows == live and (mode == PLAN) == (rows <= SMALL)
        assert run is (full if mode == FULL else runner) and forced == (mode == DRAIN)
        assert drafting == 0 or mode == PLAN  # drafts from the context only where the plan's configuration ran
        assert settled or mode != FULL  # full depth only steps rows with nothing pending
    modes = [mode for _, mode in ran]
    assert PLAN in modes and FULL in modes and modes.index(FULL) > modes.index(PLAN)  # grew, then shrank back
    assert modes[-1] == PLAN and switch.counts[PLAN] == modes.count(PLAN)
    made = sum(feed.rows[k].generation().drafted + feed.rows[k].generation().prompt_drafted for k in feed.rows)
    assert made > 0  # the plan's steps drafted (exits or the context) and their drafts were checked
    if kind == "exits":  # a row's exit drafts were pending when the batch grew: a step with no exit first
        assert DRAIN in modes and all(not given[i][4] for i, m in enumerate(modes) if m == DRAIN)


def test_full_depth_only_steps_change_no_state_a_switch_needs(runtime):
    """A switch that never pays runs full depth throughout, on the same buffers, the same tokens."""
    runner = Runner(runtime, _config("lookup", 6))
    runner.switch = Switch(Runner(runtime, _config("full", 6)), lambda rows: False)
    got = [g.token_ids for g in runner.generate(PROMPTS[:3], slots=2)]
    alone = [Runner(runtime, _config("full", 6)).generate([p])[0].token_ids for p in PROMPTS[:3]]
    assert got == alone and {m for _, m in runner.switch.ran} == {FULL}
    assert runner._kept is not None and runner.switch.full._kept.kv is runner._kept.kv  # one cache, two chains


def _costs() -> Costs:
    return Costs(
        provider="cpu", threads=2, past=128, repeats=5, embed_ms=0.2, segment_ms=[4.0, 4.0],
        segment_extra_ms=[0.5, 0.5], kv_ms=[1.0, 1.0], final_head_ms=1.5, final_head_extra_ms=0.2, candidates_ms={},
        local_ms={}, full_step_ms=10.0, wide_ms={"1": 10.0, "2": 11.0, "5": 14.0, "9": 18.0},
    )  # fmt: skip


def _lookup_plan(costs: Costs, stats: LookupStats) -> Plan:
    tokens_per_step = stats.tokens / sum(stats.steps.values())
    pred = Prediction(policy=LOOKUP, exits=[], ms_per_token=6.0, full_ms=10.0, speedup=1.6, decision_ms=0.0,
                      exit_rate=0.0)  # fmt: skip
    choice = Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=pred)
    look = LookupChoice(drafts=8, prediction=pred, on=True, tokens_per_step=tokens_per_step)
    return Plan(default=LOOKUP, choices={"verify": choice}, lookup=look)


STATS = LookupStats(max_draft=8, max_ngram=3, prompts=1, tokens=200, steps={"1": 40, "5": 40}, drafted=160,
                    accepted=120)  # fmt: skip


def test_pricing_runs_full_depth_where_the_batch_is_priced_slower():
    """Batched full depth that costs little more per step with more rows (weights read once a step): drafts pay at
    one row and not at eight; the one-row price is the plan's own."""
    costs = _costs()
    plan = _lookup_plan(costs, STATS)
    cheap = {1: 10.0, 2: 10.5, 4: 11.5, 8: 14.0}
    got = price(plan, costs, [2, 4], cheap, 8, STATS)
    prices = BatchPrices(LOOKUP, 1.03, got, cheap)
    assert got[1] == pytest.approx(1.6) and prices.pays(1)
    assert not prices.pays(8) and got[8] < 1.0
    assert all(got[b] >= got[b + 1] for b in range(1, 8))  # the more rows share a call, the less drafts buy
    assert prices.rows() == [b for b in range(1, 9) if got[b] >= 1.03] and "full depth otherwise" in prices.describe()


def test_pricing_keeps_the_plans_configuration_where_batching_saves_nothing():
    """Where a batched step costs as much per row as one-row steps (no batch size is written in: the timings
    decide), the drafts pay at every size."""
    costs = _costs()
    plan = _lookup_plan(costs, STATS)
    linear = {b: 10.0 * b for b in (1, 2, 4, 8)}
    got = price(plan, costs, [2, 4], linear, 8, STATS)
    assert all(got[b] > 1.03 for b in range(1, 9))


def test_pricing_without_a_batch_model_keeps_one_row_only():
    """A default the batch model cannot price (no replay of drafts) runs only where the plan priced it: one row."""
    costs = _costs()
    plan = _lookup_plan(costs, STATS)
    got = price(plan, costs, [2, 4], {1: 10.0, 4: 12.0}, 4, None)
    assert got[1] == pytest.approx(1.6) and all(got[b] == 0.0 for b in (2, 3, 4))


def test_the_batch_sizes_timed():
    assert widths(1) == [1] and widths(4) == [1, 2, 4] and widths(16) == [1, 2, 4, 8, 16] and widths(6) == [1, 2, 4, 6]


def test_the_engine_switches_its_plans_default_by_the_rows_a_step_holds(exported, monkeypatch):
    """An engine with 4 slots on an artifact whose plan's default is lookup (lossless): it prices the batch sizes
    (here given: drafts pay at up to 2 rows), says so, runs lookup while 1-2 requests are seated and full depth
    while more are, and every request gets the tokens the one-slot engine (the plan's default alone) gives it."""
    import threading

    from eectl.run import engine as engine_module
    from eectl.run.engine import Engine, Job
    from eectl.run.generate import RunOptions
    from tests.conftest import make_calibration

    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    rt.manifest.plan = _lookup_plan(_costs(), STATS)
    rt.manifest.costs = _costs()
    rt.manifest.calibration = make_calibration(exported["llama"][0], {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    given = BatchPrices(LOOKUP, 1.03, {1: 1.6, 2: 1.1, 3: 0.9, 4: 0.8})
    monkeypatch.setattr(engine_module, "batch_prices", lambda *args: given)
    budgets = [14, 3, 5, 9]
    one = Engine(rt, RunOptions(), slots=1)
    alone = [[g.token_ids for g in one.generate([p], n)][0] for p, n in zip(PROMPTS, budgets, strict=False)]
    one.stop()
    engine = Engine(rt, RunOptions(), slots=4)
    try:
        config = engine.config()
        assert (config.policy, config.prompt_drafts) == ("verify", 8) and "lookup configuration runs at 1-2 rows" in (
            config.note
        )
        done = threading.Semaphore(0)
        got: dict[int, list[int]] = {}

        def end(i, gen, error):
            got[i] = gen.token_ids
            done.release()

        for i, (p, n) in enumerate(zip(PROMPTS, budgets, strict=False)):
            engine.submit(Job(p, n, on_done=lambda g, e, i=i: end(i, g, e)))
        for _ in budgets:
            done.acquire()
        assert [got[i] for i in range(len(budgets))] == alone
        batching = engine.batching()
        assert batching is not None and batching["plan_rows"] == [1, 2]
        assert batching["steps"]["plan"] > 0 and batching["steps"]["full"] > 0
        ran = list(engine._runner(engine.default)[1].switch.ran)
        assert all((mode == PLAN) == (rows <= 2) for rows, mode in ran)
    finally:
        engine.stop()


def test_a_batchs_chains_take_the_certified_head_only_where_it_was_timed_faster(exported, monkeypatch):
    """The engine times full depth's batched steps with the certified head and the full head alone at each batch size
    it runs (plan/batch.py `time_full`) and binds each chain with the faster (here given: the certified head at one
    row, the full head at 2 and 4); the tokens are the same either way (the certified head proves the full head's
    argmax or defers to it)."""
    from eectl.run import engine as engine_module
    from eectl.run.engine import Engine
    from eectl.run.generate import RunOptions

    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    assert rt.certified_head is not None
    timed = {1: 1.0, 2: 1.5, 4: 2.0}, {1: True, 2: False, 4: False}
    monkeypatch.setattr(engine_module, "time_full", lambda *args, **kw: timed)
    prompts = [list(p) for p in PROMPTS[:3]]
    one = Engine(rt, RunOptions(exits="none"), slots=1)
    four = Engine(rt, RunOptions(exits="none"), slots=4)
    try:
        alone = [g.token_ids for g in one.generate(prompts, 8)]
        assert [g.token_ids for g in four.generate(prompts, 8)] == alone
        runner = four._runner(four.default)[1]
        assert runner.heads == {1: True, 2: False, 4: False} and one._runner(one.default)[1].heads == {}
        kept = runner._kept
        assert kept is not None and kept.chain.rows == 4 and kept.chain.certified is None
        assert kept.prompt_chains and all(c.certified is not None for c in kept.prompt_chains.values())
        assert all((c.certified is not None) == timed[1][n] for n, c in kept.narrow.items())
    finally:
        one.stop()
        four.stop()
