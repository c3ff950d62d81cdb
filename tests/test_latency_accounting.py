"""A row's latencies add up to its decode time: steps whose tokens a rollback discards (verify's wrong drafts and
the drafts after them) and verify's closing check are decode time too. Timed on a clock that advances one second per
decode step, so the sum is exact: the bench's speed of verify is read from these latencies (evaluate/configs.py)."""

from __future__ import annotations

import time

import pytest
import torch

from eectl.runtime import runner as runner_module
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K


@pytest.fixture(scope="module")
def llama(exported):
    loaded, art = exported["llama"]
    return loaded, ArtifactRuntime(art, provider="cpu")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture
def step_clock(monkeypatch):
    """time.perf_counter frozen except that every decode step on the bound chain (a step of the generate loop,
    `chain_tokens`, and verify's closing check, `chain_step`) advances it by 1 s; returns the list whose first item
    counts the steps."""
    now = [0.0]
    steps = [0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def counted(fn):
        def wrapper(*args, **kwargs):
            now[0] += 1.0
            steps[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(runner_module, "chain_tokens", counted(runner_module.chain_tokens))
    monkeypatch.setattr(runner_module, "chain_step", counted(runner_module.chain_step))
    return steps


@pytest.mark.parametrize("policy", ["verify", "defer"])
def test_latencies_add_up_to_every_decode_step(llama, step_clock, policy):
    loaded, rt = llama
    thresholds = {e: {"prob": 0.0} for e in EXPORT_EXITS}  # every token exits: verify's drafts are mostly wrong
    cfg = RunConfig(exits=EXPORT_EXITS, thresholds=thresholds, policy=policy, top_k=EXPORT_TOP_K, max_new_tokens=20)
    gen = Runner(rt, cfg).generate([_prompt(3, 10, loaded.adapter.dims.vocab_size)])[0]
    if policy == "verify":
        assert gen.rejected_drafts > 0  # the case in question: steps were rolled back
    assert len(gen.latencies_s) == len(gen.token_ids)
    assert step_clock[0] >= len(gen.token_ids) + gen.rejected_drafts  # every token's step and every discarded one
    assert sum(gen.latencies_s) == pytest.approx(step_clock[0])  # every step's second is in some token's latency


def test_a_rollback_carries_the_discarded_steps_time_to_the_next_token():
    st = RowState(tokens=[1, 2, 10, 11, 12, 13], prompt_len=2, pending=[None])
    st.exit_layers = [6, 2, 2, 2]
    st.latencies = [0.5, 1.0, 2.0, 3.0]
    st.discard(4)  # tokens 12 and 13 (positions 4, 5) were wrong
    assert st.tokens == [1, 2, 10, 11] and st.exit_layers == [6, 2] and st.latencies == [0.5, 1.0]
    st.emit(7, 0.25)
    assert st.tokens[-1] == 7 and st.latencies == [0.5, 1.0, 5.25] and st.carried_s == 0.0


def test_proposing_and_settling_drafts_from_the_context_is_step_time(llama, monkeypatch):
    """Drafts from the context are proposed before their step and settled after it: both are in the step's latency.
    On a clock that only proposing and settling advance (a second each), the latencies add up to those seconds."""
    from eectl.runtime.drafts import PromptLookup

    loaded, rt = llama
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    for name in ("attach", "close"):

        def ticking(self, *a, _real=getattr(PromptLookup, name), **k):
            now[0] += 1.0
            return _real(self, *a, **k)

        monkeypatch.setattr(PromptLookup, name, ticking)
    prompt = _prompt(5, 12, loaded.adapter.dims.vocab_size)
    cfg = RunConfig(exits=[], thresholds={}, policy="verify", max_new_tokens=16, prompt_drafts=4)
    gen = Runner(rt, cfg).generate([prompt + prompt])[0]  # a repeated prompt: its continuation may be drafted
    assert now[0] > 0 and sum(gen.latencies_s) == pytest.approx(now[0])
