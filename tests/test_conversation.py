"""Conversations on one cache row (runtime/conversation.py, `eectl run --chat`): a continued turn equals the whole
conversation generated from scratch (full depth and verify: their outputs do not depend on how the cache was
filled), feeds only what is new, falls back to a fresh prefill when the cache is not a prefix, and survives a reply
stopped halfway (verify's unchecked drafts checked first). Under defer and copy, turn after turn equals the
simulation (tests/simulation.py) carrying its row's cache over the turns."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eectl.runtime.conversation import Conversation
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K
from tests.simulation import Simulation

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runtime(exported):
    _, art = exported["llama"]
    return ArtifactRuntime(art, provider="cpu")


def _ids(seed: int, n: int, vocab: int = 100) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _runner(rt, policy="defer", exits=(), new=8, stop=()):
    thr = {e: {"prob": 0.0} for e in exits}
    cfg = RunConfig(exits=list(exits), thresholds=thr, policy=policy, top_k=EXPORT_TOP_K, max_new_tokens=new)
    cfg.stop_ids = tuple(stop)
    return Runner(rt, cfg)


@pytest.mark.parametrize("policy,exits", [("defer", ()), ("verify", tuple(EXPORT_EXITS))])
def test_a_continued_turn_equals_the_conversation_from_scratch(runtime, policy, exits):
    first = _ids(1, 9)
    conv = Conversation(_runner(runtime, policy, exits), 128)
    reply = conv.turn(first).token_ids
    assert conv.reused == 0 and len(reply) == 8
    second = first + reply + _ids(2, 5)  # the next user turn after the reply (the reply's last token included)
    got = conv.turn(second)
    assert conv.reused >= len(first) + len(reply) - 1  # only the new tokens were fed
    fresh = _runner(runtime, policy, exits).generate([second])[0]
    assert got.token_ids == fresh.token_ids
    held = int(conv.kv.filled[0, 0])
    assert held in (len(second) + len(got.token_ids) - 1, len(second) + len(got.token_ids))


def test_every_policy_continues_on_its_own_cache(runtime):
    for policy in runtime.manifest.kv_policies:
        conv = Conversation(_runner(runtime, policy, EXPORT_EXITS), 128)
        a = _ids(3, 7)
        r1 = conv.turn(a).token_ids
        b = a + r1 + _ids(4, 4)
        r2 = conv.turn(b)
        assert conv.reused > 0 and len(r2.token_ids) == 8, policy
        assert conv.kv.filled[0, 0] <= len(b) + len(r2.token_ids)  # the cache holds what the tokens say


def test_a_conversation_that_is_not_a_prefix_is_fed_again(runtime):
    conv = Conversation(_runner(runtime), 128)
    conv.turn(_ids(5, 6))
    other = _ids(6, 10)
    got = conv.turn(other)
    assert conv.reused == 0
    assert got.token_ids == _runner(runtime).generate([other])[0].token_ids


def test_a_reply_stopped_halfway_leaves_a_cache_the_next_turn_continues(runtime):
    conv = Conversation(_runner(runtime, "verify", EXPORT_EXITS, new=12), 128)
    steps = []
    a = _ids(7, 8)
    r1 = conv.turn(a, on_step=steps.append, stop=lambda: len(steps) >= 3)
    assert len(r1.token_ids) < 12  # stopped early
    b = a + r1.token_ids + _ids(8, 4)
    got = conv.turn(b)
    assert got.token_ids == _runner(runtime, "verify", EXPORT_EXITS, new=12).generate([b])[0].token_ids


def test_cli_chat_through_a_terminal(runtime):
    """`eectl run ART --chat` on a pty: a prompt marker, a reply per line, Ctrl-D ends with exit 0."""
    master, slave = pty.openpty()
    cmd = [sys.executable, "-m", "eectl.cli", "run", str(runtime.folder), "--chat", "--raw", "-n", "4"]
    proc = subprocess.Popen(
        [*cmd, "--exits", "none", "-t", "1", "--json"],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    os.close(slave)
    try:
        for line in (b"12 clips\n", b"and 7 more\n"):
            os.write(master, line)
            time.sleep(0.2)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            select.select([], [], [], 0.5)
            os.write(master, b"\x04")  # Ctrl-D at the prompt: end of the conversation
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == 0, err.decode()
    doc = json.loads(out)
    assert [t["prompt"] for t in doc["turns"]] == ["12 clips", "and 7 more"]
    assert all(len(t["token_ids"]) == 4 for t in doc["turns"])
    assert doc["turns"][1]["cached_input_tokens"] > 0  # the second turn continued on the first one's cache
    assert b"> " in err


@pytest.mark.parametrize("policy", ["defer", "verify", "copy"])
def test_turns_step_on_the_chain_as_in_the_simulation(exported, runtime, policy):
    """Each turn (its new tokens after what the cache holds, then the reply) on the bound chain, defer's pending
    positions and verify's drafts carried across turns. defer and copy: the replies, exit layers, decisions and cache
    of the simulation carrying its row's cache over the turns (under defer that cache is the full model's: the second
    turn is also the whole conversation's from scratch); verify: full depth's replies to the whole conversation,
    drafts proposed, and the full model's cache."""
    from tests.test_chain_host_decisions import _same_kv

    loaded = exported["llama"][0]
    a = _ids(5, 7)
    never = {e: {"prob": float("inf")} for e in EXPORT_EXITS}
    seen = Simulation(loaded.adapter, EXPORT_EXITS, never, top_k=EXPORT_TOP_K).generate([a], 20)[0].values
    thr = {e: {"prob": float(np.quantile(v, 0.6))} for e, v in seen.items()}  # some tokens exit, some do not
    cfg = RunConfig(exits=list(EXPORT_EXITS), thresholds=thr, policy=policy, top_k=EXPORT_TOP_K, max_new_tokens=10)
    conv = Conversation(Runner(runtime, cfg), 128)
    got = [conv.turn(a)]
    b = a + got[0].token_ids + _ids(6, 4)
    got.append(conv.turn(b))
    assert conv.reused >= len(a) + len(got[0].token_ids) - 1  # the second turn fed only what was new
    L = runtime.manifest.num_layers
    if policy == "verify":
        full = [_runner(runtime, new=10).generate([ids])[0].token_ids for ids in (a, b)]
        assert [g.token_ids for g in got] == full
        assert sum(g.drafted for g in got) > 0  # the exits proposed drafts
        exact = Simulation(loaded.adapter, EXPORT_EXITS, never, top_k=EXPORT_TOP_K).generate([b], 11)
        assert exact[0].tokens[:10] == full[1]
        _same_kv(runtime, conv.kv, exact, spare=1)  # the cache may hold the last token: verify's check fed it
        return
    sim = Simulation(loaded.adapter, EXPORT_EXITS, thr, policy=policy, top_k=EXPORT_TOP_K)
    first = sim.generate([a], 10)[0]
    want = [first, sim.turn(first, b, 10)]
    assert [(g.token_ids, g.exit_layers, g.decided) for g in got] == [(w.tokens, w.layers, w.decided) for w in want]
    assert all(any(e < L for e in w.layers[1:]) and L in w.layers[1:] for w in want), [w.layers for w in want]
    _same_kv(runtime, conv.kv, want[1:])
    if policy == "defer":  # the full model's cache: the conversation from scratch is the same
        fresh = sim.generate([b], 10)[0]
        assert (fresh.tokens, fresh.layers) == (want[1].tokens, want[1].layers)
        _same_kv(runtime, conv.kv, [fresh])
