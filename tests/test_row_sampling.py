"""Per-row sampling (runtime/sampling.py `RowSampling`, run/engine.py): each row samples with its own temperature,
top-p and seeded generator, so a batch mixes greedy and sampled requests and every request gets the tokens it gets
alone (greedy ones full depth's or the configuration's own; a sampled one those of its seed); the engine seats jobs
first come, first served whatever their setting; where the greedy configuration switches, a step holding a sampled
row runs full depth (after a step with no exit deciding); the API and the server pass a request's `seed`."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from eectl.contracts.plan import LOOKUP
from eectl.errors import UsageError
from eectl.plan.batch import BatchPrices
from eectl.run import engine as engine_module
from eectl.run.engine import Engine, Job, Sampling
from eectl.run.generate import RunOptions
from eectl.runtime.feed import Prompts
from eectl.runtime.runner import Runner
from eectl.runtime.sampling import RowSampling
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import DRAIN, FULL, PLAN, Switch
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K, make_calibration
from tests.test_batch_switch import STATS, _config, _costs, _lookup_plan
from tests.test_feed import PROMPTS, Scripted

HOT = Sampling(1.3, 0.95, seed=7)  # sampled: a flat distribution over the tiny model's tokens
WARM = Sampling(0.8, 1.0, seed=11)


@pytest.fixture(scope="module")
def runtime(exported):
    return ArtifactRuntime(exported["llama"][1], provider="cpu")


def _run(engine: Engine, jobs: list[tuple[list[int], int, Sampling]], hold: threading.Event | None = None) -> dict:
    """Submit the jobs at once (none seated before all queued) and wait: per job its tokens, the engine's step count
    at its first token and at its end. `hold`: the first job's first step waits for it (jobs queued meanwhile)."""
    done = threading.Semaphore(0)
    got: dict[int, dict] = {i: {} for i in range(len(jobs))}

    def step(i: int, confirmed: list[int]) -> None:
        if "first" not in got[i]:
            got[i]["first"] = engine.steps
            if hold is not None and i == 0:
                hold.wait(60)

    def end(i: int, gen, error) -> None:
        assert error is None, error
        got[i].update(tokens=gen.token_ids, last=engine.steps)
        done.release()

    made = [
        Job(p, n, s, on_step=lambda c, i=i: step(i, c), on_done=lambda g, e, i=i: end(i, g, e))
        for i, (p, n, s) in enumerate(jobs)
    ]
    with engine._cond:  # the worker waits for this lock before it seats anyone
        for job in made:
            engine.submit(job)
    for _ in made:
        done.acquire()
    return got


def _lookup_engine(rt: ArtifactRuntime, monkeypatch, slots: int = 4) -> Engine:
    """An engine on an artifact whose plan's default is lookup, priced to pay at up to 2 rows (given)."""
    rt.manifest.plan = _lookup_plan(_costs(), STATS)
    rt.manifest.costs = _costs()
    given = BatchPrices(LOOKUP, 1.03, {1: 1.6, 2: 1.1, 3: 0.9, 4: 0.8})
    monkeypatch.setattr(engine_module, "batch_prices", lambda *args: given)
    return Engine(rt, RunOptions(), slots=slots)


def _engine(exported, kind: str, monkeypatch, slots: int = 4) -> Engine:
    """An engine on its own runtime of the tiny Llama (its manifest given a calibration, and for lookup a plan)."""
    rt = ArtifactRuntime(exported["llama"][1], provider="cpu")
    rt.manifest.calibration = make_calibration(exported["llama"][0], {e: {"prob": 0.9} for e in EXPORT_EXITS})
    if kind == "lookup":
        return _lookup_engine(rt, monkeypatch, slots)
    if kind == "defer":  # exits that fire on some tokens: sampled rows pick those from their exits' candidates
        return Engine(rt, RunOptions(policy="defer", exits="2,4", thresholds="0.3"), slots=slots)
    return Engine(rt, RunOptions(exits="none"), slots=slots)


@pytest.mark.parametrize("kind", ["full", "defer", "lookup"])
def test_a_greedy_and_a_sampled_row_in_one_batch_each_get_their_tokens_alone(exported, kind, monkeypatch):
    engine = _engine(exported, kind, monkeypatch)
    try:
        greedy, hot = (PROMPTS[0], 12, Sampling()), (PROMPTS[1], 6, HOT)
        alone = [_run(engine, [job])[0]["tokens"] for job in (greedy, hot)]
        again = _run(engine, [hot])[0]["tokens"]
        assert again == alone[1] and alone[1] != _run(engine, [(PROMPTS[1], 6, Sampling())])[0]["tokens"]
        switch = engine._runners[False][1].switch
        before = len(switch.ran) if switch is not None else 0
        got = _run(engine, [greedy, hot])
        assert got[0]["first"] == got[1]["first"]  # one batch
        assert [got[0]["tokens"], got[1]["tokens"]] == alone
        if kind != "lookup":
            assert switch is None and engine._runners[False][1] is engine._home(HOT)
            return
        ran = list(switch.ran)[before:]  # full depth while the sampled row was seated, lookup before and after
        assert ran[0] == (2, FULL) and all(mode == FULL for rows, mode in ran if rows == 2)
        assert ran[-1] == (1, PLAN) and (1, PLAN) in list(switch.ran)[:before]
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", ["full", "defer"])
def test_two_sampled_rows_with_their_own_settings_in_one_batch_each_get_their_tokens_alone(exported, kind, monkeypatch):
    engine = _engine(exported, kind, monkeypatch)
    try:
        jobs = [(PROMPTS[2], 8, HOT), (PROMPTS[3], 10, WARM), (PROMPTS[2], 8, Sampling(1.3, 0.95, seed=8))]
        alone = [_run(engine, [job])[0]["tokens"] for job in jobs]
        assert alone[0] != alone[2]  # the seed decides, not the prompt
        got = _run(engine, jobs)
        assert got[0]["first"] == got[1]["first"] == got[2]["first"]
        assert [got[i]["tokens"] for i in range(3)] == alone
    finally:
        engine.stop()


def test_a_job_of_another_setting_no_longer_waits_for_the_batch_to_drain(exported, monkeypatch):
    """A greedy job runs; a sampled job and a greedy one queued behind it during its first step are seated at the
    next step (before, they waited until the running batch drained), and each gets its tokens alone."""
    engine = _engine(exported, "full", monkeypatch)
    try:
        jobs = [(PROMPTS[0], 24, Sampling()), (PROMPTS[1], 6, HOT), (PROMPTS[4], 5, Sampling())]
        alone = [_run(engine, [job])[0]["tokens"] for job in jobs]
        hold = threading.Event()
        out: dict = {}
        first = threading.Thread(target=lambda: out.update(_run(engine, jobs[:1], hold)))
        first.start()
        while engine.running == 0:  # the first job is seated: its first step's callback waits for `hold`
            threading.Event().wait(0.01)
        late: dict = {}
        behind = threading.Thread(target=lambda: late.update(_run(engine, jobs[1:])))
        behind.start()
        while engine.waiting < 2:
            threading.Event().wait(0.01)
        hold.set()
        first.join(120)
        behind.join(120)
        seated = out[0]["first"] + 1  # the step after the first job's first
        assert late[0]["first"] == late[1]["first"] == seated < out[0]["last"]
        assert [out[0]["tokens"], late[0]["tokens"], late[1]["tokens"]] == alone
    finally:
        engine.stop()


def test_a_sampled_row_joining_verify_exits_drains_them_then_runs_full_depth(runtime):
    """The runner's switch (runtime/slots.py): greedy rows on verify's exits (the plan's configuration at every
    size here) and a sampled row arriving while their drafts are pending: a step with no exit deciding first (the
    sampled row's prompt in it too), then full depth while the sampled row is seated, verify again after; every
    row's tokens its own alone (greedy: full depth's; sampled: its seed's at full depth)."""
    budget = {0: 14, 1: 6, 2: 9}
    full = _config("full", 128)

    def sampling() -> RowSampling:
        return RowSampling(1.3, 0.95, np.random.default_rng(5))

    def alone(k: int, own: RowSampling | None) -> list[int]:
        runner = Runner(runtime, full)
        row = runner.new_row(PROMPTS[k], budget[k], own)
        runner.run_feed(Prompts([row]), 1, 64)
        return row.tokens[row.prompt_len :]

    want = {0: alone(0, None), 1: alone(1, sampling()), 2: alone(2, None)}
    runner = Runner(runtime, _config("exits", 128))
    runner.switch = switch = Switch(Runner(runtime, full), lambda rows: True)
    feed = Scripted(runner, arrive={0: 0, 1: 3, 2: 4}, drop={}, budget=budget)
    feed.rows[1].sampling = sampling()
    runner.run_feed(feed, 4, 64)
    assert {k: st.tokens[st.prompt_len :] for k, st in feed.rows.items()} == want
    modes = [mode for _, mode in switch.ran]
    assert modes[:3] == [PLAN] * 3 and modes[3] == DRAIN  # row 0's exit drafts settled as row 1 is seated
    seated = 3 + len(want[1])  # the steps row 1 is seated in: its drain step, then full depth
    assert set(modes[4:seated]) == {FULL} and modes[-1] == PLAN
    assert feed.rows[0].generation().drafted > 0  # verify's exits drafted for the greedy rows


def test_the_engine_mixes_settings_only_where_one_configuration_serves_both(exported, monkeypatch):
    """One slot under a greedy-only plan default (lookup): sampling runs full depth, a configuration of its own, so
    a sampled job steps on the sampling runner (its own batch, in turn); with four slots the greedy runner switches
    and takes sampled rows in. A policy asked for is one configuration for both."""
    one, four, asked = (
        _engine(exported, kind, monkeypatch, n) for kind, n in (("lookup", 1), ("lookup", 4), ("defer", 2))
    )
    try:
        for engine, shared in ((one, False), (four, True), (asked, True)):
            assert (engine._home(Sampling()) is engine._home(HOT)) == shared
        for engine in (one, four):  # lookup for greedy rows, full depth for sampled ones
            assert (engine.config().policy, engine.config().prompt_drafts > 0) == ("verify", True)
            assert (engine.config(HOT).exits, engine.config(HOT).prompt_drafts) == ([], 0)
        assert four._runners[False][1].switch is not None and one._runners[False][1].switch is None
        assert asked.config(HOT).exits == asked.config().exits == EXPORT_EXITS
        got = _run(one, [(PROMPTS[0], 6, Sampling()), (PROMPTS[1], 6, HOT), (PROMPTS[2], 6, Sampling())])
        assert got[0]["last"] < got[1]["first"] and got[1]["last"] < got[2]["first"]  # one slot: in order
    finally:
        for engine in (one, four, asked):
            engine.stop()


def test_the_api_takes_a_seed(exported):
    import eectl

    with eectl.load(exported["llama"][1], exits="none", max_batch=3, max_new_tokens=8) as model:
        alone = model.generate("the cat sat", temperature=1.3, seed=3).tokens
        other = model.generate("the cat sat", temperature=1.3, seed=4).tokens
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            got[i] = model.generate("the cat sat", temperature=1.3 if i == 0 else 0.0, seed=3).tokens

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got[0] == alone != other and got[1] == got[2] == model.generate("the cat sat").tokens
        with pytest.raises(UsageError, match="seed"):
            model.generate("the cat sat", temperature=1.0, seed=-1)


def test_the_server_honours_a_requests_seed(exported):
    from tests.test_serve import Server

    server = Server(exported["llama"][1], "--max-batch", "4", "-n", "12")
    try:

        def ask(seed: int | None = 21, temperature: float = 1.3) -> list[int]:
            messages = [{"role": "user", "content": "one two three"}]
            kw = {} if seed is None else {"seed": seed}
            reply = server.client.chat.completions.create(
                model="art", messages=messages, max_tokens=10, temperature=temperature, **kw
            )
            return reply.model_extra["eectl"]["tokens"]

        first = ask()
        beside: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: beside.update({i: ask(21, 1.3 if i else 0.0)})) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(first) == 10 and first == ask() == beside[1]
        import openai

        with pytest.raises(openai.BadRequestError) as bad:
            ask(-1)
        assert bad.value.body["param"] == "seed"
    finally:
        server.stop()


def test_a_row_without_its_own_sampling_follows_the_run(runtime):
    """`Runner.generate`'s rows have no sampling of their own: the run's setting and the runner's one generator, in
    row order, as before; a row's own sampling overrides the run's."""
    cfg = RunConfig(exits=[], thresholds={}, top_k=EXPORT_TOP_K, max_new_tokens=8, temperature=1.3, top_p=0.95, seed=7)
    runner = Runner(runtime, cfg)
    shared = runner.generate([PROMPTS[0]])[0].token_ids
    own = Runner(runtime, RunConfig(exits=[], thresholds={}, top_k=EXPORT_TOP_K, max_new_tokens=8))
    row = own.new_row(PROMPTS[0], 8, RowSampling(1.3, 0.95, np.random.default_rng(7)))
    own.run_feed(Prompts([row]), 1, 64)
    assert row.tokens[row.prompt_len :] == shared  # one generator seeded alike: the same draws
    assert Runner(runtime, cfg).samples(row) and not own.samples(own.new_row(PROMPTS[0]))
