"""A prompt that begins with tokens its slot's cache already holds from the slot's last prompt (a chat template's
header) is fed only from where they differ (runtime/slots.py `reused`), and generates exactly what it generates
fed whole: tokens, exit layers, for every policy, at batch 1 across calls and in slots."""

from __future__ import annotations

import numpy as np
import pytest

from eectl.runtime import slots, wide_check
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from eectl.runtime.wide_check import MIN_REST, check_prefix


@pytest.fixture(scope="module")
def runtimes(exported):
    return {fam: ArtifactRuntime(art, provider="cpu") for fam, (_, art) in exported.items()}


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing a 10-token header (one of them ending one token after it), and one that shares nothing."""
    rng = np.random.default_rng(7)
    header = rng.integers(3, vocab, 10).tolist()
    tails = [rng.integers(3, vocab, n).tolist() for n in (4, 7, 1, 3, 9)]
    other = rng.integers(3, vocab, 6).tolist()
    return [header + tails[0], header + tails[1], header + tails[2], other, header + tails[3], header + tails[4]]


def _runner(rt: ArtifactRuntime, policy: str) -> Runner:
    exits = [] if policy == "full" else [2, 4]  # full depth: no exit active (under any policy)
    thresholds = {e: {"prob": 0.3} for e in exits}
    name = "defer" if policy == "full" else policy
    return Runner(rt, RunConfig(exits=exits, thresholds=thresholds, policy=name, top_k=8, max_new_tokens=10))


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b) - MIN_REST) and a[n] == b[n]:
        n += 1
    return n


def test_prompts_sharing_a_header_reuse_its_cache_and_generate_what_they_generate_fed_whole(runtimes, family):
    rt = runtimes[family]
    prompts = _prompts(rt.manifest.dims["vocab_size"])
    assert wide_check.prefix_refused(rt) is None  # this machine computes the rest after a prefix bit for bit
    for policy in ("full", *[p for p in rt.manifest.kv_policies if p != "river"]):
        alone = [_runner(rt, policy).generate([p])[0] for p in prompts]  # a fresh runner each: nothing to reuse
        assert all(g.reused == 0 for g in alone)
        one = _runner(rt, policy)  # batch 1 across calls: slot 0 holds the last call's prompt
        got = [one.generate([p])[0] for p in prompts]
        assert [g.token_ids for g in got] == [g.token_ids for g in alone], policy
        assert [g.exit_layers for g in got] == [g.exit_layers for g in alone], policy
        want = [0] + [_shared(a, b) for a, b in zip(prompts, prompts[1:], strict=False)]
        assert [g.reused for g in got] == want and sum(want) > 0, ([g.reused for g in got], want)
        batch = _runner(rt, policy).generate(prompts, slots=2)  # slots: each prompt after its slot's last one
        assert [g.token_ids for g in batch] == [g.token_ids for g in alone], policy
        assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone], policy
        assert any(g.reused for g in batch)


def test_no_prefix_is_reused_where_this_machine_computes_the_rest_otherwise(runtimes, monkeypatch):
    """Where the check finds a prompt fed after its prefix differing from it fed whole, every prompt is fed whole."""
    rt = runtimes["llama"]
    monkeypatch.setattr(slots, "prefix_refused", lambda rt: "a prompt fed after a cached prefix differs")
    runner = _runner(rt, "full")
    got = [runner.generate([p])[0] for p in _prompts(rt.manifest.dims["vocab_size"])]
    assert [g.reused for g in got] == [0] * len(got)


def test_the_prefix_check_compares_every_state_and_kv_bit_for_bit(runtimes, monkeypatch):
    """`check_prefix` is exact on the tiny artifact, and finds a difference of one ulp in the rest's call."""
    rt = runtimes["llama"]
    ids = list(range(3, 3 + 24))
    assert check_prefix(rt, ids, 16)["exact"]
    real = ArtifactRuntime.run_segment

    def nudged(self, index, hidden, kv, row, *a, **k):  # the second call on a row (the rest) comes out one ulp off
        out = real(self, index, hidden, kv, row, *a, **k)
        if int(kv.filled[row, 0]) > hidden.shape[1] and hidden.shape[1] < 16:
            out = (np.nextafter(out[0], np.inf), *out[1:])
        return out

    monkeypatch.setattr(ArtifactRuntime, "run_segment", nudged)
    got = check_prefix(rt, ids, 16)
    assert not got["exact"] and 0 < got["max_abs_diff"] < 1e-3


def test_run_json_reports_the_prompt_tokens_reused(exported, tmp_path):
    """`eectl run --prompt-file` at batch size 1: the second prompt, which begins like the first, reuses its
    beginning, and `--json` says how many tokens (the same answer as the first prompt's run alone)."""
    import json

    from typer.testing import CliRunner

    from eectl.cli import app

    art = exported["llama"][1]
    opening = "the same long opening sentence of every prompt in this file, word for word, and then"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{opening} one question\n{opening} another question entirely\n", encoding="utf-8")
    args = ["run", str(art), "--prompt-file", str(prompts), "--raw", "--json", "-n", "4", "--exits", "none"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    first, second = json.loads(res.stdout)["results"]
    assert first["prompt_reused"] == 0 and second["prompt_reused"] > 0
    shared = next(i for i, (a, b) in enumerate(zip(first["prompt_ids"], second["prompt_ids"], strict=False)) if a != b)
    assert second["prompt_reused"] == shared


def test_a_runtime_reading_a_slow_tier_feeds_prompts_whole(runtimes, monkeypatch):
    """Under --memory-budget / --mmap-weights the check's own calls would read the slow tier inside a run's measured
    bytes per token (bench's memory section): no prefix is reused there."""
    rt = runtimes["llama"]
    monkeypatch.setattr(rt, "tiers", object())  # any tiers: the runtime reads some segments from their files
    assert "slow tier" in (wide_check.prefix_refused(rt) or "")
    runner = _runner(rt, "full")
    assert [runner.generate([p])[0].reused for p in _prompts(rt.manifest.dims["vocab_size"])] == [0] * 6


def test_a_batchs_new_prompts_copy_a_header_another_row_holds(runtimes, family):
    """A batch's first prompts are all new at once: each is fed after the longest beginning of it that a row
    prefilled before it holds (its K/V copied: slots.py `shared`), and generates what it generates alone."""
    rt = runtimes[family]
    prompts = _prompts(rt.manifest.dims["vocab_size"])
    alone = [_runner(rt, "full").generate([p])[0].token_ids for p in prompts]
    got = _runner(rt, "full").generate(prompts)  # a fresh runner: no slot held anything before
    assert [g.token_ids for g in got] == alone
    header = [0, 10, 9, 0, 10, 10]  # the 10-token header; 9 of the 11-token prompt (2 left to feed); `other`: 0
    assert [g.reused for g in got] == header


def test_a_runner_told_to_forget_its_prompts_feeds_the_next_one_whole(runtimes):
    """`Runner.forget_prompts` (a bench's repetition starts so): the cache's rows keep no prompt to reuse."""
    rt = runtimes["llama"]
    first, second = _prompts(rt.manifest.dims["vocab_size"])[:2]
    runner = _runner(rt, "full")
    runner.generate([first])
    assert runner.generate([second])[0].reused == 10  # the header
    runner.forget_prompts()
    assert runner.generate([first])[0].reused == 0


def test_a_cache_whose_rounded_room_does_not_fit_gets_exactly_what_the_call_needs(runtimes, monkeypatch):
    """New caches get room rounded up (slots.py ROOM); where memory refuses that, the call gets its own need."""
    from eectl.errors import UsageError
    from eectl.runtime import batch
    from eectl.runtime.slots import ROOM

    rt = runtimes["llama"]
    real = batch.check_kv

    def tight(m, rows, max_len, capacity, itemsize, host):  # memory for 40 positions, not for ROOM
        if max_len > 40:
            raise UsageError(f"the KV cache of {rows} row(s) x {capacity} positions needs more than is available")
        return real(m, rows, max_len, capacity, itemsize, host)

    monkeypatch.setattr(batch, "check_kv", tight)
    prompt = _prompts(rt.manifest.dims["vocab_size"])[0]  # 14 tokens + 10 new + 1
    runner = _runner(rt, "full")
    runner.generate([prompt])
    assert runner.last_kv is not None and runner.last_kv.max_len == len(prompt) + 10 + 1 < ROOM
    with pytest.raises(UsageError, match="needs more"):
        _runner(rt, "full").generate([prompt * 3])  # 42 + 10 + 1 positions: not even the need fits
