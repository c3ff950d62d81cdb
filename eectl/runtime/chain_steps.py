"""The runner's steps on the bound chain (runtime/chain.py): which chain a generate call binds (`chain_for`: its
buffers where the run's states live), which steps it takes (`chain_tokens`: prompts each in a one-row chain of its
slot within a batch, or padded into one call per segment: `padded_prompts`), and one row's step on it with the KV
policy's hooks (`chain_step`; under teacher forcing, the fed token scored where the step decided it).

What this module does not do: bind or run graphs (chain.py), or a step with exits or drafts (chain_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from eectl.runtime import buffers
from eectl.runtime.batch import BatchKV, prefill_runs, run_prefill
from eectl.runtime.blocks import run_block
from eectl.runtime.buffers import view
from eectl.runtime.chain import DecodeChain
from eectl.runtime.chain_parts import Pick
from eectl.runtime.chain_rows import rows_step
from eectl.runtime.kv import KVBuffers
from eectl.runtime.slots import Kept, shared
from eectl.runtime.state import RowState
from eectl.runtime.stepping import Runner


def chain_for(runner: Runner, kv: KVBuffers, rows: int, row: int = 0, host: bool = False) -> DecodeChain:
    """The bound call chain for decode from `row` over `rows` rows, greedy or sampled, with a final head that has the
    in-graph argmax, full depth or with active exits under every policy (decided in the exit graphs, or on the host; a
    batch's rows through chain_rows.py). Its buffers are where the run's states live: on a device where it keeps them
    there (greedy with exits or drafts: `Runner._on_device`; device memory on the CPU EP too), in host memory where the
    run reads them (the CPU EP; sampling or scoring with exits off it; `host`), and on the device for full depth there
    (only the tokens are read). The runner refuses artifacts whose graphs lack what the chain binds
    (`Runner.__init__`)."""
    rt, cfg, exits = runner.rt, runner.cfg, runner.exits
    if any(g.session is None for g in rt.segments):
        raise RuntimeError("a runtime holding one segment at a time (lazy_segments, export validation) cannot decode")
    device: bool | None = None  # full depth: the provider's own
    if host or (exits and not runner._on_device()):
        device = False
    elif runner._on_device():
        device = True
    thresholds = {e: cfg.thresholds[e] for e in exits}
    certified = cfg.certified_head and runner.heads.get(rows, True)  # where it is the faster at this many rows
    return DecodeChain(rt, kv, row, thresholds, runner.signal, cfg.top_k, runner.gates, rows, certified, device)


def chain_step(
    runner: Runner,
    chain: DecodeChain,
    st: RowState,
    kv: KVBuffers,
    drafts: int = 0,
    prompt: bool = False,
    force_full: bool = False,
    sampler: Pick | None = None,
) -> int:
    """One decode step of the chain's row with active exits or drafts on the bound chain (chain_rows.py `rows_step`
    over its one row; full depth: `DecodeChain.step`); the policy's hooks: the pending states the step carried
    along (defer's flush, verify's drafts: its wide calls) are the policy's no more, an exited token's states go to
    `on_exit`, and the final segment's wide output to `on_final` (verify's check, which may roll back and return the
    full model's token). With `drafts` from the context (the
    row's last tokens), the positions before the last draft wait at segment 0 as embeddings: the step runs every
    segment wide, exits do not decide, and the final check covers them. `prompt`: the row's first step, its prompt
    (`chain_prompt`). `force_full`: no exit decides (verify's closing pass over its unchecked drafts,
    `Runner._settled`). `sampler`: picks in the runner's stead where the run samples (a batch's prompts)."""
    assert chain.kv is kv and chain.rows == 1
    row = chain.row
    live, drafted = {row: st}, {row: drafts}
    got = rows_step(runner, chain, lambda r: chain, live, drafted, prompt=prompt, force_full=force_full, pick=sampler)
    return got[row]


def chain_prompt(
    runner: Runner,
    chain: DecodeChain,
    st: RowState,
    kv: KVBuffers,
    sampler: Pick | None = None,
    force_full: bool = False,
) -> int:
    """The chain's row's prompt on the bound chain (CPU): its tokens after the `st.reused` its cache rows hold (the
    whole prompt, or what follows a prefix: runtime/slots.py `reused`, `shared`), the positions before the last
    waiting at segment 0 as embeddings, run through every layer in one wide call per segment (bound for this prompt
    only), the last one's token from the final head (a prompt of one token may exit there, as a decode step, unless
    `force_full`: a step where no exit decides)."""
    n = len(st.tokens) - st.reused - 1
    return chain_step(runner, chain, st, kv, n, prompt=True, force_full=force_full, sampler=sampler)


def chain_tokens(
    runner: Runner,
    chain: DecodeChain,
    kv: KVBuffers,
    live: dict[int, tuple[RowState, list[int]]],
    fresh: set[int],
    drafted: dict[int, int],
    kept: Kept,
    force_full: bool = False,
) -> dict[int, int]:
    """One step on the bound chain: slot -> token. One row: its prompt
    (CPU), a full-depth step, or a step with exits or drafts (wide: CPU). A batch: each new prompt on a one-row chain
    of its slot (CPU, prompts not padded into one call: `_pad`), fed after the longest beginning of it another row
    holds (`kept`'s prompts: slots.py `shared`), then the other rows' step over the batch's chain: at full depth its
    `step`, with exits or drafts (CPU) chain_rows.py's, each segment run for every row (the drafted and deferred
    rows' wide calls beside the batched one: a segment's weights read once a step, where rows stepping one after the
    other on their own chains read them once a row, 1.4% slower: docs/results/2026-12-05-one-row-chain.md). Each row
    picks as it samples (`Runner.row_pick`: its own setting, else the run's): the logits of the sampled rows reaching
    the final head are kept and picked in row order afterwards, greedy rows beside them take the head's argmax.
    `force_full`: no exit decides in the step, prompts included (a batch switching to full depth: slots.py
    `Switch`)."""
    # a chain's buffers are where the run's states live (chain_for): every step is the chain's, save prompts padded
    # into one call (off the CPU EP where the run's states are on the host: `_pad`)
    wide = any(drafted.values())
    if chain.rows == 1:
        st = live[0][0]
        if fresh:
            return {0: chain_prompt(runner, chain, st, kv, force_full=force_full)}
        if not wide and not runner.exits:
            one = chain.step({0: st.tokens[-1]}, place=runner.place, pick=runner.row_pick(st))
            st.exit_layers.append(runner.L)
            return one
        return {0: chain_step(runner, chain, st, kv, drafted.get(0, 0), force_full=force_full)}
    picks = {s: runner.row_pick(st) for s, (st, _) in live.items()}  # None: a greedy row
    sampled = any(p is not None for p in picks.values())
    tokens: dict[int, int] = {}
    logits: dict[int, np.ndarray] = {}  # the sampled rows' final logits, picked in row order at the end
    held = [s for s in live if s not in fresh]  # rows whose prompts are in the cache
    alone = fresh  # the new prompts each on its slot's chain
    if fresh and runner._pad() and not runner.place.device:  # padded into one call per segment where they can
        new = {s: live[s][0] for s in fresh}
        slot_of = lambda s: slot_chain(runner, kept, s)  # noqa: E731
        tokens.update(padded_prompts(runner, chain, slot_of, new, logits if sampled else None, force_full))
        alone = set()
    for s in sorted(alone):
        st, pick = live[s][0], picks[s]
        st.reused = shared(runner.rt, kept, s, st.tokens, held)  # another row's copy of its beginning, if longer
        keep = None if pick is None else _keeping(logits, s, pick)
        tokens[s] = chain_prompt(runner, slot_chain(runner, kept, s), st, kv, keep, force_full)
        held.append(s)
    decode = {s: ids[-1] for s, (_, ids) in live.items() if s not in fresh}
    if decode and (wide or runner.exits):  # per segment, every row: chain_rows.py
        rows = {s: live[s][0] for s in decode}
        kept_logits = logits if sampled else None
        of = lambda s: slot_chain(runner, kept, s)  # noqa: E731
        tokens.update(rows_step(runner, chain, of, rows, drafted, kept_logits, force_full=force_full))
    elif decode:
        each = {s: None if picks[s] is None else _keeping(logits, s) for s in decode} if sampled else None
        stepped = chain.step(decode, place=runner.place, pick=each)
        for s in stepped:
            live[s][0].exit_layers.append(runner.L)
        tokens.update(stepped)
    for s in sorted(logits):  # the sampled rows that reached the final head, in row order (exits picked at once)
        pick = picks[s]
        assert pick is not None
        tokens[s] = pick(logits[s], None)
    return tokens


def padded_prompts(
    runner: Runner,
    chain: DecodeChain,
    one: Callable[[int], DecodeChain],
    live: dict[int, RowState],
    logits: dict[int, np.ndarray] | None = None,
    force_full: bool = False,
) -> dict[int, int]:
    """A batch's new prompts (slot -> its state, each fed after the `reused` tokens its rows hold) where the run pads
    them into one call (`Runner._pad`: off the CPU EP where the run's states are on the host): the runs of two or
    more consecutive rows that hold nothing yet and feed several positions share one padded call per segment
    (batch.run_prefill: each row attends to its own positions) and a block exit head's call per row after its
    segment; the last position of each goes to its row of the chain's final head, one call for them all. Every other
    prompt steps on its slot's chain (`one(slot)`, chain_steps.chain_prompt: a prompt of one token may exit there).
    Returns slot -> token; `logits` (a step with sampled rows): each sampled prompt's final logits kept there (its
    token -1), to be picked in row order with the other rows'. `force_full`: no prompt's token exits."""
    rt, kv, first, L = runner.rt, chain.kv, chain.row, runner.L
    assert isinstance(kv, BatchKV)
    several = [r for r, st in live.items() if len(st.tokens) - st.reused > 1 and not kv.filled[r].any()]
    padded = [r for run in prefill_runs(kv, several, 0, L) if len(run) > 1 for r in run]
    tokens = {}
    picks = {r: runner.row_pick(st) for r, st in live.items()}
    for r in sorted(set(live) - set(padded)):
        pick = picks[r]
        keep = None if logits is None or pick is None else _keeping(logits, r, pick)
        tokens[r] = chain_prompt(runner, one(r), live[r], kv, keep, force_full)
    if not padded:
        return tokens
    xs = {r: rt.embed(np.array([live[r].tokens[live[r].reused :]], dtype=np.int64)) for r in padded}
    for s in range(len(runner.m.segments)):
        for run in prefill_runs(kv, padded, *rt.manifest.segments[s].layers):
            xs.update({r: out for r, (out, _) in run_prefill(rt, s, {r: xs[r] for r in run}, kv).items()})
        if s in chain.blocks:  # the active exit's block head over every position, its own K/V written
            for r in padded:
                run_block(rt, chain.exit_at[s], xs[r], kv, r)
    for r in padded:
        buffers.put(rt, view(chain.hops[-1])[r - first : r - first + 1], xs[r][0, -1:])
        live[r].exit_layers.append(L)
    if logits is not None and any(picks[r] is not None for r in padded):  # greedy rows: the same call's argmax
        z = chain._sample_head(runner.place, greedy=any(picks[r] is None for r in padded))
        logits.update({r: np.array(z[r - first], copy=True) for r in padded if picks[r] is not None})
        return tokens | {r: -1 if picks[r] is not None else int(chain.token[r - first]) for r in padded}
    chain._head(runner.place, np.array(padded) - first)
    return tokens | {r: int(chain.token[r - first]) for r in padded}


def slot_chain(runner: Runner, kept: Kept, slot: int) -> DecodeChain:
    """A one-row chain of a batch's slot (kept for the generate call), with the run's exits where the batch has
    them: its prompts, its wide calls in a batch's step (chain_rows.py), verify's closing pass over its drafts."""
    if slot not in kept.prompt_chains:
        chain = chain_for(runner, kept.kv, 1, slot)
        assert chain is not None, "a batch on a bound chain has one-row chains for its slots"
        kept.prompt_chains[slot] = chain
    return kept.prompt_chains[slot]


def _keeping(logits: dict[int, np.ndarray], slot: int, sampler: Pick | None = None) -> Pick:
    """A pick that keeps the final logits [V] it is given (a copy: the chain's buffer is the next call's) in
    `logits[slot]`, to be picked later; the token it returns (-1) is replaced. An exiting token's K candidates (a
    prompt of one token may exit) are picked at once by `sampler`."""

    def pick(z: np.ndarray, ids: np.ndarray | None) -> int:
        if ids is not None:
            assert sampler is not None
            return sampler(z, ids)
        logits[slot] = np.array(z, copy=True)
        return -1

    return pick
