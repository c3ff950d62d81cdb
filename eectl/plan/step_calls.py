"""Decode steps as the runner takes them, for plan/costs.py to time: full depth on the bound chain, steps with drafts
from the context at each width, and the final heads over a wide pass's rows.

What this module does not do: time anything (plan/costs.py's rounds do) or price (plan/choose.py, plan/lookup.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from eectl.contracts.plan import MAX_NGRAM
from eectl.runtime.chain import DecodeChain
from eectl.runtime.chain_steps import chain_for, chain_step
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig

FULL_STEPS = 16  # room kept in the cache beyond `past`
# widths (positions) of the full-depth passes timed for drafts from the context (one token and its drafts); the
# cost model interpolates between them
WIDE_WIDTHS = (2, 3, 5, 9, 17)


def _chainable(rt: ArtifactRuntime) -> bool:
    """Whether the artifact's decode can run on the bound chain: a final head with the in-graph argmax, every
    segment's session loaded."""
    final = rt.full_graphs[rt.manifest.num_layers]
    return "token" in final.io.outputs and all(g.session is not None for g in rt.segments)


def certified_call(rt: ArtifactRuntime, rows: np.ndarray) -> Callable[[], object]:
    """The certified head on rows [n, H], bound once (its cost; whether it passes these states does not matter)."""
    from eectl.runtime.certified_head import CertifiedHead
    from eectl.runtime.placement import HOST

    state = np.ascontiguousarray(rows)  # bound by address: held by the call below
    head = CertifiedHead.bind(rt, state, state.shape[0])
    assert head is not None
    return lambda: (state, head.run(HOST))


def head_rows_calls(rt: ArtifactRuntime, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """The greedy final head over each wide pass's rows (WIDE_WIDTHS): the full head as verify's check runs it
    ("greedy.w": `greedy_token`, the table packed for several rows) and the certified head ("certified.w"), on random
    states. A row's cost is not linear in the rows: ORT's int8 and int4 kernels take two rows for about one and step
    up at the third (default model: the certified head 0.87 / 0.93 / 1.26 / 2.16 ms at 1 / 2 / 3 / 9 rows)."""
    L, H = rt.manifest.num_layers, rt.manifest.dims["hidden_size"]
    states = rng.standard_normal((max(WIDE_WIDTHS), H)).astype(rt.np_dtype)
    calls: dict[str, Callable[[], object]] = {}
    for w in WIDE_WIDTHS:
        rows = np.ascontiguousarray(states[:w])

        def greedy(rows: np.ndarray = rows) -> object:
            return rt.greedy_token(L, rows)

        calls[f"greedy.{w}"] = greedy
        if rt.certified_head is not None:
            calls[f"certified.{w}"] = certified_call(rt, rows)
    return calls


def chain_step_call(rt: ArtifactRuntime, past: int) -> Callable[[], object]:
    """One full-depth greedy step through the bound decode chain (runtime/chain.py), the path `eectl run` takes for
    one row with no exit active, on top of `past` cached positions."""
    m = rt.manifest
    kv = rt.new_kv(1, past + 4)
    chain = DecodeChain(rt, kv, 0, certified_head=False)  # the full head, as full_step_ms (Costs.baseline_ms)

    def call() -> object:
        kv.seek(0, past, 0, m.num_layers)  # rewind: every call decodes the same position
        return chain.step({0: 1})

    return call


def wide_step_calls(rt: ArtifactRuntime, past: int, seed: int = 0) -> dict[str, Callable[[], object]]:
    """Decode steps with drafts from the context as the runner takes them (runtime/runner.py `_loop`): the row's
    drafts proposed from its context (`PromptLookup.attach`: the n-gram search over `past` tokens), the step on the
    bound chain with the policy's check (`chain_steps.chain_step`: the drafts embedded, every segment wide, verify's
    final head over every position, the rollback of a wrong draft) and the drafts settled (`close`). One call per
    width in WIDE_WIDTHS (a token and width - 1 drafts), and "wide.1": a step whose context offers no draft (the
    search finds nothing, one position): what lookup's plain steps cost beside full depth's. {} for an artifact
    without verify or a chain."""
    m = rt.manifest
    if "verify" not in m.kv_policies or not _chainable(rt) or rt.device != "cpu":
        return {}
    most = max(WIDE_WIDTHS) - 1
    # the full head every step (Costs.wide_full_head): the contexts are random ids, whose flat predictions the
    # certified head may or may not pass where decode's would (default model, int4: every step of width 9 and 17 and
    # a third of the one-position ones missed, each running the full head too; widths 2-5 passed), so its timing
    # here says little about decode's; the plan swaps decode's greedy head in (`Costs.wide_head_ms`)
    cfg = RunConfig(
        exits=[],
        thresholds={},
        policy="verify",
        prompt_drafts=most,
        max_new_tokens=4 * most,
        stop_ids=(),
        certified_head=False,
    )
    runner = Runner(rt, cfg)
    lookup = runner.lookup
    assert lookup is not None
    kv = rt.new_kv(1, max(past, 2 * MAX_NGRAM + most + 1) + most + 4)
    chain = chain_for(runner, kv, 1)
    assert chain is not None
    # contexts of `n` tokens: distinct ids (no suffix occurs earlier: no draft), or, for w - 1 drafts, distinct ids
    # whose last MAX_NGRAM also occur earlier, followed there by w - 1 others (the search proposes those, its draft
    # length set to w - 1). Distinct ids need a vocabulary of n + MAX_NGRAM + the most drafts (a smaller one: shorter)
    V = m.dims["vocab_size"]
    n = max(most + 2 * MAX_NGRAM + 1, min(past, V - most - MAX_NGRAM))
    ids = np.random.default_rng(seed).permutation(V)[: n + most + MAX_NGRAM].tolist()
    suffix = ids[n : n + MAX_NGRAM]
    contexts = {1: ids[:n]}
    for w in WIDE_WIDTHS:
        contexts[w] = ids[: n - w + 1 - 2 * MAX_NGRAM] + suffix + ids[n + MAX_NGRAM : n + MAX_NGRAM + w - 1] + suffix
    calls: dict[str, Callable[[], object]] = {}
    for w, context in contexts.items():

        def call(w: int = w, context: list[int] = context) -> object:
            kv.seek(0, len(context) - 1)  # the step feeds the context's last token after the others
            st = RowState(list(context), len(context), [None] * len(m.segments), lookup=lookup.new_state())
            assert st.lookup is not None
            st.lookup.span = max(1, w - 1)
            drafts = lookup.attach(st, m.num_layers, cfg.max_new_tokens, ())
            token = chain_step(runner, chain, st, kv, drafts)
            if drafts:
                lookup.close(st)
            return token

        calls[f"wide.{w}"] = call
    return calls
