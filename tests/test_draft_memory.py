"""Drafts from earlier requests (runtime/draft_memory.py `DraftMemory`): what the memory drafts and keeps, that a
row's own context comes first, and on every tiny family that a runner's finished answers become later rows' drafts
with the output still full depth's, forgotten where a bench's repetition starts."""

from __future__ import annotations

import pytest

from eectl.contracts.plan import DRAFT_MEMORY
from eectl.errors import UsageError
from eectl.run.generate import RunOptions, check_options, resolve_config
from eectl.runtime.draft_memory import MEMORY_NGRAM, MIN_SHARE, DraftMemory
from eectl.runtime.drafts import PromptLookup, lookup_stats, replay
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.tiny import random_ids


@pytest.fixture(scope="module")
def artifacts(exported):
    return {fam: ArtifactRuntime(art, provider="cpu") for fam, (_, art) in exported.items()}


# --- the memory ----------------------------------------------------------------------------------------------------
def test_memory_drafts_the_most_frequent_follower_while_it_is_the_majority():
    mem = DraftMemory(1000)
    for tail in ([5, 6, 7], [8, 8, 8], [8, 8, 8]):
        mem.remember([1, 2, 3, 4, *tail])
    assert mem.find([0, 2, 3, 4], 1) == [8]  # [2, 3, 4] followed by 5 once, by 8 twice
    assert mem.find([0, 2, 3, 4], 9) == [8, 8, 8]  # chained; nothing followed the requests' ends
    assert mem.find([0, 2, 3, 4], 2) == [8, 8]  # at most `limit`
    assert mem.find([1, 2, 3, 4, 5], 9) == [6, 7]  # the longest held run decides: [2, 3, 4, 5] was followed by 6
    assert mem.find([0, 0, 0], 4) == [] and mem.find([3, 4], 4) == []  # no run held; two tokens: below MEMORY_NGRAM
    assert MEMORY_NGRAM == 3 and MIN_SHARE == 0.5
    assert mem.find([0, 2, 3, 4], 0) == []
    assert mem.find([0, 2, 3, 4], 3, stop_ids=(8,)) == []  # a stop token first: nothing before it
    mem.remember([1, 2, 3, 4, 9, 9, 9])
    mem.remember([1, 2, 3, 4, 10, 10, 10])
    assert mem.find([0, 2, 3, 4], 3) == []  # 8 twice of five: no majority, no draft
    mem.remember([1, 2, 3, 4, 8, 8, 8])
    assert mem.find([0, 2, 3, 4], 3) == [8, 8, 8]  # three of six: half, drafted


def test_memory_keeps_the_latest_tokens_within_its_capacity_and_clears():
    mem = DraftMemory(12)
    mem.remember([1, 2, 3, 4, 5])
    mem.remember([6, 7, 8, 9, 10])
    assert len(mem) == 10 and mem.find([1, 2, 3], 1) == [4]
    mem.remember([1, 2, 3, 7, 7])  # 15 tokens held > 12: the oldest request goes, its counts with it
    assert len(mem) == 10
    assert mem.find([1, 2, 3], 2) == [7, 7]  # [1, 2, 3] -> 4 forgotten: 7 alone, not a tie
    assert mem.find([6, 7, 8], 1) == [9] and mem.find([2, 3, 4], 1) == []
    mem.remember(list(range(100, 130)))  # longer than the whole memory: its last 12 tokens
    assert len(mem) == 12 and mem.find([118, 119, 120], 2) == [121, 122] and mem.find([6, 7, 8], 1) == []
    assert mem.find([105, 106, 107], 1) == []
    mem.clear()
    assert len(mem) == 0 and mem.find([118, 119, 120], 2) == []
    off = DraftMemory(0)
    off.remember([1, 2, 3, 4, 5])
    assert len(off) == 0 and off.find([1, 2, 3], 2) == []
    with pytest.raises(UsageError, match="draft-memory must be >= 0"):
        DraftMemory(-1)


def test_the_rows_own_context_comes_before_the_memory():
    mem = DraftMemory(100)
    mem.remember([5, 6, 7, 40, 41, 42])
    look = PromptLookup(3, memory=mem)
    ls = look.new_state()
    assert look.drafts_for(ls, [5, 6, 7, 1, 2, 5, 6, 7], 3, ()) == [1, 2, 5]  # the context's own match
    ls = look.new_state()
    assert look.drafts_for(ls, [9, 9, 8, 5, 6, 7], 3, ()) == [40, 41, 42]  # none in the context: the memory's
    assert PromptLookup(3).drafts_for(PromptLookup(3).new_state(), [9, 9, 8, 5, 6, 7], 3, ()) == []


def test_replay_with_the_memory_drafts_a_repeated_answer_whole():
    prompt, answer = [7, 3, 9, 4, 11], [20, 21, 22, 23, 24, 25, 26, 27]
    mem = DraftMemory(100)
    look = PromptLookup(8, memory=mem)
    assert replay(look, prompt, answer) == [1] * (len(answer) - 1)  # nothing repeats: one token a step
    mem.remember(prompt + answer)
    # the prompt's end and the first answer token (the prefill's) occur in the memory: the other 7 in one step, 6 of
    # them drafts, accepted
    assert replay(look, prompt, answer) == [len(answer) - 1]


def test_the_option_is_checked_and_reaches_the_runner(artifacts):
    with pytest.raises(UsageError, match="draft-memory must be >= 0 tokens, got -1"):
        check_options(RunOptions(draft_memory=-1))
    rt = artifacts["llama"]
    cfg = resolve_config(rt, RunOptions(exits="none", prompt_drafts=4), ())
    assert cfg.draft_memory == DRAFT_MEMORY
    look = Runner(rt, cfg).lookup
    assert look is not None and look.memory is not None and look.memory.capacity == DRAFT_MEMORY
    look = Runner(rt, resolve_config(rt, RunOptions(exits="none", prompt_drafts=4, draft_memory=0), ())).lookup
    assert look is not None and look.memory is None


# --- the runner ----------------------------------------------------------------------------------------------------
def _config(drafts: int, memory: int, new: int = 24) -> RunConfig:
    return RunConfig(exits=[], thresholds={}, policy="verify", top_k=8, max_new_tokens=new, prompt_drafts=drafts,
                     draft_memory=memory)  # fmt: skip


def test_finished_answers_become_later_rows_drafts_and_the_output_stays_full_depth(artifacts, family):
    """Prompts of random tokens (little for the context to copy): answered once, a prompt asked again drafts its
    answer from the memory, accepted; every answer full depth's; `forget_prompts` empties the memory."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    prompts = [random_ids(s, 9, V) for s in (11, 12)]
    full = [Runner(rt, _config(0, 0)).generate([p])[0].token_ids for p in prompts]
    alone = Runner(rt, _config(6, 0))
    runner = Runner(rt, _config(6, 4096))
    for p, want in zip(prompts, full, strict=True):
        assert alone.generate([p])[0].token_ids == want
        assert runner.generate([p])[0].token_ids == want
    assert runner.lookup is not None and runner.lookup.memory is not None
    assert len(runner.lookup.memory) == sum(len(p) + len(f) for p, f in zip(prompts, full, strict=True))
    again = runner.generate(prompts, slots=2)  # a batch: each row finds its earlier answer
    assert [g.token_ids for g in again] == full
    first = [alone.generate([p])[0] for p in prompts]
    assert sum(g.prompt_accepted for g in again) > sum(g.prompt_accepted for g in first)
    assert all(g.prompt_accepted >= len(g.token_ids) // 2 for g in again), [g.prompt_accepted for g in again]
    runner.forget_prompts()
    assert len(runner.lookup.memory) == 0
    runner.forget_prompts(memory=False)  # the cache's prompts only: what the rows finish stays remembered
    runner.generate(prompts[:1])
    runner.forget_prompts(memory=False)
    assert len(runner.lookup.memory) == len(prompts[0]) + len(full[0])


def test_bench_takes_the_option_for_its_lookup_configurations(exported, monkeypatch):
    """`eectl bench --draft-memory`: the lookup configuration's runner remembers the prompts it finished (0: none;
    a repetition starts with an empty memory: tests/test_draft_memory.py above); a negative value is refused before
    anything runs."""
    from typer.testing import CliRunner

    from eectl.cli import app
    from eectl.evaluate.bench import _check_options
    from eectl.evaluate.results import BenchOptions
    from tests.tiny import GSM8K

    with pytest.raises(UsageError, match="draft-memory must be >= 0 tokens, got -2"):
        _check_options(BenchOptions(draft_memory=-2), ["a prompt"])
    remembered: list[int] = []
    remember = DraftMemory.remember
    monkeypatch.setattr(DraftMemory, "remember", lambda self, t: (remembered.append(len(t)), remember(self, t)))
    art = exported["llama"][1]
    args = ["bench", str(art), "--data", str(GSM8K), "--prompts", "3", "--max-new-tokens", "8", "--reps", "1"]
    args += ["--policies", "full,lookup", "--sweep", "", "--raw", "--ppl-tokens", "0", "--threads", "1"]
    for memory in ("0", "4096"):
        remembered.clear()
        res = CliRunner().invoke(app, [*args, "--draft-memory", memory])
        assert res.exit_code == 0, res.output
        assert bool(remembered) == (memory != "0"), (memory, remembered)  # the timed prompts and the untimed runs


def test_the_replay_with_the_memory_makes_the_runners_attempts_exactly(artifacts, family, monkeypatch):
    """A run of prompts one after the other with the memory drafts as `lookup_stats(..., memory=N)` replays them in
    that order (bench's predicted figure for lookup): the same attempts, drafts and accepted tokens; the memory's
    drafts are accepted on a prompt asked again."""
    rt = artifacts[family]
    V = rt.manifest.dims["vocab_size"]
    seen: list[tuple[int, int]] = []
    settle = PromptLookup.settle
    monkeypatch.setattr(
        PromptLookup, "settle", lambda self, ls, d, a, n: (seen.append((d, a)), settle(self, ls, d, a, n))[1]
    )
    prompts = [random_ids(21, 9, V), random_ids(22, 9, V)]
    prompts.append(prompts[0])  # asked again
    runner = Runner(rt, _config(6, 4096))
    answers = [runner.generate([p])[0].token_ids for p in prompts]
    ran = list(seen)
    seen.clear()
    stats = lookup_stats(list(zip(prompts, answers, strict=True)), max_draft=6, memory=4096)
    assert seen[: len(ran)] == ran and any(a > 0 for _, a in ran)  # then the replays of the answers' cuts
    alone = lookup_stats(list(zip(prompts, answers, strict=True)), max_draft=6)
    assert sum(stats.steps.values()) < sum(alone.steps.values())  # fewer steps: the third prompt's answer drafted
    assert stats.per_prompt[2][1] != stats.per_prompt[0][1]
