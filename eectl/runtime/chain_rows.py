"""A decode step with exits or drafts on bound calls, for one row or a batch: `rows_step`.

Per segment, every row that reaches it: the rows feeding one position share the chain's bound call (runtime/chain.py:
one call over the span of rows from the first active one to the last, each at its own length; the others write only
their scratch slot), then each row carrying more positions (its prompt, defer's pending states, verify's drafts,
drafts from the context) runs its wide call, bound once per (segment, width) on its slot's one-row chain (the chain
itself for one row). So a segment's weights are read once a step, and nothing is rebound or gathered into fresh
arrays between calls. After a segment with an active exit, the rows that may exit and whose gate opens are tested:
one row on the exit graphs bound on its chain's buffers (`DecodeChain.exits`: two scalars read), several rows in one
decision (runtime/decide.py); a row that exits gets its token and the policy's hooks at once, and its deferred state
rides along in the deeper calls other rows run anyway (`RunConfig.ride_along`). The rows reaching
the final layer share one final head call (a wide row's last position copied to its row of the head's input),
except where verify checks drafts over a wide row's every position (`KVPolicy.on_final`). Sampling picks from an
exit's K candidates or the head's logits; teacher forcing scores the fed token (an exited one on its exit's full
vocabulary) and returns it.

The chains' buffers are host memory or device memory alike (a device-resident run's), moved between calls by
runtime/buffers.py. Its reference is tests/simulation.py (PyTorch): tests/test_runner.py,
tests/test_chain_host_decisions.py, tests/test_resident.py, tests/test_scoring.py.
What this module does not do: bind graphs (chain.py), choose which steps a run takes (chain_steps.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.exits.gates import gate_open
from eectl.runtime import buffers
from eectl.runtime.batch import BatchKV, _past
from eectl.runtime.buffers import view
from eectl.runtime.chain import DecodeChain
from eectl.runtime.chain_parts import BlockCall, Pick
from eectl.runtime.device_ops import concat
from eectl.runtime.exit_logits import Decide
from eectl.runtime.ort import buffer_shape
from eectl.runtime.resident import last_positions
from eectl.runtime.state import RowState
from eectl.runtime.stepping import Runner


@dataclass
class _Step:
    """One batch step's rows: each row's state, the row's token total after this step's positions, the wide output
    each wide row continues from, the candidates an exit picked, and the rows riding (row -> the next segment)."""

    live: dict[int, RowState]
    may: dict[int, bool]
    total: dict[int, int]
    alive: set[int]
    flow: dict[int, Any] = field(default_factory=dict)  # host arrays or device buffers
    cands: dict[int, Any] = field(default_factory=dict)
    decided: set[int] = field(default_factory=set)
    riders: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    picks: dict[int, Pick | None] = field(default_factory=dict)  # how each row's token is picked (None: greedy)
    picker: dict[int, int] = field(default_factory=dict)  # the exit that picked each row's candidates
    keep_wide: bool = True  # wide calls kept bound (False: a prompt's widths)


def rows_step(
    runner: Runner,
    chain: DecodeChain,
    one: Callable[[int], DecodeChain],
    live: dict[int, RowState],
    drafted: dict[int, int],
    keep: dict[int, np.ndarray] | None = None,
    *,
    prompt: bool = False,
    force_full: bool = False,
    pick: Pick | None = None,
) -> dict[int, int]:
    """One decode step of the rows `live` (row of the cache -> its state, each feeding its last token, and the
    `drafted[row]` tokens before it, waiting at segment 0 as embeddings: drafts from the context, or a prompt) on
    `chain` (its rows, with the run's exits); `one(row)`: the row's one-row chain (its wide calls; the chain itself for
    one row). Returns row -> token. `prompt`: the waiting positions are a prompt's (any length: its wide calls bound
    for this step only). `force_full`: no exit decides (verify's closing pass). `pick`: how tokens are picked in the
    row's stead (sampling; default each row's own, `Runner.row_pick`: None for a greedy row). `keep` (a batch with
    sampled rows): the final head's logits [V] (copies) of each sampled row reaching it go there, to be picked by the
    caller in row order with other rows' (their tokens here are -1); an exiting row's token is picked from its exit's
    candidates at once. A greedy-only policy's exits (verify) never decide a sampled row's token."""
    rt, policy = runner.rt, runner.policy
    kv, first = chain.kv, chain.row
    chain.ids[:, 0] = 0
    step = _Step(live, {}, {}, set(live), keep_wide=not prompt)
    for r, st in live.items():
        base = pick if pick is not None else runner.row_pick(st)
        n = drafted.get(r, 0)
        if n:  # the row's tokens before its last as embeddings waiting at segment 0
            st.pending[0] = rt.embed(np.array([st.tokens[-n - 1 : -1]], dtype=np.int64), place=runner.place)
        chain.ids[r - first, 0] = st.tokens[-1]
        sampled = base is not None and st.forced is None
        step.may[r] = policy.may_exit(st) and not n and not force_full and not (sampled and policy.greedy_only)
        step.total[r] = int(kv.filled[r, 0]) + (0 if st.pending[0] is None else buffer_shape(st.pending[0])[1]) + 1
        if step.total[r] > kv.max_len:
            raise UsageError(f"the sequence reached {step.total[r]} tokens, beyond the KV buffer of {kv.max_len}")
        # an exited token that is not the exit's (forced, the policy's own): nothing drawn for it at the exit
        elsewhere = st.forced is not None or policy.predicts()
        forced_or_sampled = st.forced is not None or base is not None
        step.picks[r] = _final_only(runner, st, base) if elsewhere and forced_or_sampled else base
    session, io = chain.calls[0]
    session.run_with_iobinding(io)  # embed every row's token
    for s in range(len(chain.segment_calls)):
        _segment(runner, chain, one, step, s)
        layer = chain.exit_at.get(s)
        if layer is not None:
            _decide(runner, chain, one, step, s, layer)
    _final(runner, chain, step, keep)
    return step.tokens


def _final_only(runner: Runner, st: RowState, sampler: Pick | None) -> Pick:
    """A row's pick where an exited token is not picked from its exit's K candidates: under teacher forcing (the
    final head's logits [V] score and return the fed token) or where the policy predicts an exited token itself
    (`KVPolicy.predicts`, sampled: the final head's logits sampled). At an exit, a stand-in that draws nothing,
    replaced by `_exited` (the token scored on the exit's full vocabulary, or picked from the policy's own)."""

    def pick(logits: np.ndarray, ids: np.ndarray | None) -> int:
        if ids is not None:
            return -1
        if st.forced is not None:
            return runner._forced(st, logits)
        assert sampler is not None
        return sampler(logits, None)

    return pick


def _segment(runner: Runner, chain: DecodeChain, one: Callable[[int], DecodeChain], step: _Step, s: int) -> None:
    """Segment s for the rows that reach it: the batched call for the one-position rows and the riders (where any
    row runs the segment), then each wide row's call."""
    rt, kv, first, live = runner.rt, chain.kv, chain.row, step.live
    lo, hi = runner.rt.manifest.segments[s].layers
    ones = [r for r in sorted(step.alive) if r not in step.flow and live[r].pending[s] is None]
    wides = [r for r in sorted(step.alive) if r not in ones]
    riders = _riders(runner, step, s) if ones or wides else []
    batched = ones + riders
    if batched:
        for r in riders:  # the rider's deferred state, where this segment's input is
            waiting = live[r].pending[s]
            assert waiting is not None
            buffers.put(rt, view(chain.hops[s])[r - first : r - first + 1], waiting)
        rows = np.arange(first, first + chain.rows)
        past = _past(kv, rows, lo, hi)
        a, b = min(batched) - first, max(batched) + 1 - first  # the rows from the first active to the last
        if b - a > len(batched):  # idle rows ride along on their scratch slot: a batch's buffers have one
            assert isinstance(kv, BatchKV)
            if int(past[a:b].max()) + 1 > kv.capacity:  # an idle row already at its maximum has none
                raise RuntimeError(f"row lengths {past} leave no scratch slot in a buffer of {kv.capacity}")
        for r in ones:  # the one check that a row's layers here hold the positions before its token
            if int(past[r - first]) + 1 != step.total[r]:
                raise RuntimeError(f"layers {lo}..{hi - 1} of row {r} hold {past[r - first]}, not {step.total[r] - 1}")
        chain.seqlens_k[:] = past
        call = _part(runner, chain, s, a, b)
        call.total[()] = int(past[a:b].max()) + 1
        active = np.zeros(kv.filled.shape[0], dtype=bool)
        active[batched] = True
        call.session.run_with_iobinding(call.io)
        kv.advance(active, lo, hi)
        if call.block is not None:  # the active exit's block head, on the same rows
            call.block.session.run_with_iobinding(call.block.io)
            kv.advance(active, call.block.slot, call.block.slot + 1)
        for r in riders:
            _rode(runner, chain, step, r, s)
    for r in wides:
        st, c = live[r], one(r)
        if r not in step.flow and c is not chain:  # the token's state arrives from the batch's call before
            buffers.put(rt, c.hops[s], view(chain.hops[s])[r - first : r - first + 1])
        step.flow[r] = c._segment(s, st.pending[s], step.flow.get(r), step.total[r], keep=step.keep_wide)
        st.pending[s] = None  # flushed: its positions are in the cache now


@dataclass
class _Part:
    """Segment s bound over rows [a, b) of a batch chain (positions in its span): views of the chain's buffers."""

    session: Any
    io: Any
    total: np.ndarray
    block: BlockCall | None


def _part(runner: Runner, chain: DecodeChain, s: int, a: int, b: int) -> _Part:
    """Segment s's call over rows [a, b) of the chain, bound on first use (`DecodeChain.spans`): its input and outputs
    the rows' parts of the chain's buffers, its lengths the chain's `seqlens_k` for them and a total of its own; the
    whole span is the chain's own call. Rows past the last active one need not ride along (a batch whose last
    slots are free, or whose last rows exited, runs a narrower call)."""
    key = (s, a, b)
    if key in chain.spans:
        return chain.spans[key]
    if (a, b) == (0, chain.rows):  # the chain's own call
        session, io = chain.segment_calls[s]
        chain.spans[key] = whole = _Part(session, io, chain.total, chain.blocks.get(s))
        return whole
    rt, first = runner.rt, chain.row
    g, (lo, hi) = rt.segments[s], rt.manifest.segments[s].layers
    total = np.zeros((), np.int32)
    io = g.session.io_binding()
    rt.bind_kv(io, g, chain.kv, range(lo, hi), first + a, first + b)
    rt._bind_array(io, g.name("seqlens_k"), chain.seqlens_k[a:b])
    rt._bind_array(io, g.name("total_sequence_length"), total)
    rt._bind_array(io, g.name("hidden"), view(chain.hops[s])[a:b])
    rt._bind_array(io, g.name("hidden_out"), view(chain.hops[s + 1])[a:b], output=True)
    layer_in, blocks = chain.layer_in[s]
    rt._bind_array(io, g.name("layer_input"), view(layer_in)[a:b], output=True)
    if blocks is not None:
        rt._bind_array(io, g.name("layer_states"), view(blocks)[a:b], output=True)
    block = None
    if s in chain.blocks:
        layer, lengths = chain.exit_at[s], (chain.seqlens_k[a:b], total)
        x, out = view(chain.hops[s + 1])[a:b], view(chain.blocks[s].out)[a:b]
        block = BlockCall.bind(rt, chain.kv, (first + a, first + b), layer, x, out, lengths)
    chain.spans[key] = part = _Part(g.session, io, total, block)
    return part


def _riders(runner: Runner, step: _Step, s: int) -> list[int]:
    """The exited rows whose deferred state rides along in segment s (one position waiting there), computing its K/V
    in a call other rows need anyway (a batched call costs about the same whatever rows are active in it) instead of
    a later wide call: riding stops at the first segment where the state is not one position, and before the final
    segment where the policy checks states there (verify)."""
    final = len(runner.m.segments) - 1
    end = final if runner.policy.checks_at_final else final + 1
    out = []
    for r, t in list(step.riders.items()):
        x = step.live[r].pending[s] if t == s and s < end else None
        if x is None or x.shape[1] != 1:
            del step.riders[r]
        else:
            out.append(r)
    return out


def _rode(runner: Runner, chain: DecodeChain, step: _Step, r: int, s: int) -> None:
    """The rider's state went through segment s: it waits at the next segment's input, behind earlier positions."""
    st = step.live[r]
    st.pending[s] = None
    step.riders[r] = s + 1
    if s < len(runner.m.segments) - 1:
        out = buffers.copy(runner.rt, view(chain.hops[s + 1])[r - chain.row : r - chain.row + 1])
        prev = st.pending[s + 1]
        st.pending[s + 1] = out if prev is None else concat(runner.rt, [prev, out], 1)


def _exit_input(chain: DecodeChain, one: Callable[[int], DecodeChain], step: _Step, r: int, s: int) -> Any:
    """Row r's state after segment s as its exit reads it [1, 1, H] (a block head's output where it has one): in its
    slot's chain after a wide call, else in the chain's buffers."""
    if r in step.flow:
        return view(one(r).exit_input(s))
    i = r - chain.row
    return view(chain.exit_input(s))[i : i + 1]


def _layer_inputs(
    chain: DecodeChain, one: Callable[[int], DecodeChain], step: _Step, r: int, s: int
) -> tuple[Any, Any]:
    """What a host-decided signal reads of row r's segment s: its last layer's input [H] and its block boundaries
    [layers + 1, H] (or None where no exit reads them)."""
    if r in step.flow:
        c = one(r)
        layer_in, blocks = view(c._layer_in[0]), c._layer_in[1]
        if blocks is not None:  # [1, (layers + 1) * P, H]: each boundary's last position
            blocks = view(blocks)
            blocks = last_positions(chain.rt, blocks.reshape(-1, layer_in.shape[1], blocks.shape[-1]))
        return layer_in[0, -1], blocks
    i = r - chain.row
    layer_in, blocks = view(chain.layer_in[s][0]), chain.layer_in[s][1]
    return layer_in[i, -1], None if blocks is None else view(blocks)[i]


def _decide(
    runner: Runner, chain: DecodeChain, one: Callable[[int], DecodeChain], step: _Step, s: int, layer: int
) -> None:
    """The exit after segment s for the rows that may exit and whose gate opens: one row on its chain's bound exit
    graphs, several in one decision; each row that exits gets its token and the policy's hooks (`_exited`)."""
    place = runner.place
    asks: dict[int, Decide] = {}
    for r in sorted(step.alive):
        st = step.live[r]
        if not step.may[r]:
            continue
        at = _exit_input(chain, one, step, r, s)
        t0 = time.perf_counter()
        if runner.policy.ahead(layer):  # verify drafting ahead: its own rule, no gate (runtime/ahead.py)
            token = runner.policy.ahead_token(st, layer, buffers.host_state(runner.rt, at)[None])
            st.decide_s += time.perf_counter() - t0
            st.count_decisions([layer], layer)
            if token is not None:
                _exited(runner, chain, one, step, r, s, layer, partial(int, token))
            continue
        gate = runner.gates.get(layer)
        if gate is not None:  # gated: the decision runs only when the gate opens; the first to run picks
            place.read(("gate", layer, "hidden"))
            if not gate_open(gate, buffers.host_state(runner.rt, at)):
                st.decide_s += time.perf_counter() - t0
                continue
        st.count_decisions([layer], None if r in step.picker else layer)
        picker = step.picker.setdefault(r, layer)
        if chain.rows == 1 and chain.in_graph:  # the exit graphs bound on the row's own buffers
            ex = chain._decision(layer, None if picker == layer else picker)
            ex.session.run_with_iobinding(ex.io)
            passed = ex.passes(place)
            p = step.picks[r]
            token = (ex.exit_token(place) if p is None else ex.sampled(p, place)) if passed else -1
            st.decide_s += time.perf_counter() - t0
            if passed:
                _exited(runner, chain, one, step, r, s, layer, partial(int, token))
            continue
        st.decide_s += time.perf_counter() - t0
        layer_in, blocks = _layer_inputs(chain, one, step, r, s)
        asks[r] = Decide(at[0, -1], layer_in, step.cands.get(r), blocks)
    if not asks:
        return
    t0 = time.perf_counter()
    answers = runner._decide_rows(layer, asks)
    took = time.perf_counter() - t0
    for r in asks:  # every row waited for the whole decision
        step.live[r].decide_s += took
    for r, (score, i, cands) in answers.items():
        step.cands[r] = cands
        if score is not None:
            _exited(runner, chain, one, step, r, s, layer, partial(runner._pick_score, score, i, step.live[r]))


def _exited(
    runner: Runner,
    chain: DecodeChain,
    one: Callable[[int], DecodeChain],
    step: _Step,
    r: int,
    s: int,
    layer: int,
    exit_pick: Callable[[], int],
) -> None:
    """Row r's token exits at `layer`: the policy's own prediction where it has one (the
    river's), a fed token scored on the exit's full vocabulary (teacher forcing), else the exit's (`exit_pick`, not
    called where the token is not the exit's); the policy's hook on the exit state (a copy: the buffers are the next
    call's); its deferred state rides along from the next segment."""
    policy, st, rt = runner.policy, step.live[r], runner.rt
    i = r - chain.row
    state = buffers.copy(rt, step.flow[r] if r in step.flow else view(chain.hops[s + 1])[i : i + 1])
    own = policy.predict(r, st, chain.kv, s, state, place=runner.place)
    st.exit_layers.append(layer)
    if st.forced is not None:  # scored on the policy's own, else on the exit's full vocabulary
        if own is None:
            at = _exit_input(chain, one, step, r, s)[0, -1:]  # what the exit read: a block head's output
            own = (rt.exit_full(layer, at, runner.cfg.top_k, place=runner.place)[0][0], None)
        token = runner._forced(st, own[0])
    elif own is not None:
        token = runner._pick(*own, st=st)
    else:
        token = exit_pick()
    policy.on_exit(r, st, chain.kv, s, state, token)
    step.alive.discard(r)
    step.flow.pop(r, None)
    step.tokens[r] = token
    if runner.cfg.ride_along and policy.pending_states and st.forced is None:
        step.riders[r] = s + 1


def _final(runner: Runner, chain: DecodeChain, step: _Step, keep: dict[int, np.ndarray] | None) -> None:
    """The rows that passed every exit: verify's check over a wide row's every position where it has drafts
    (`on_final`), else one final head call for all of them (a wide row's last position copied to its row of the
    head's input); where rows sample, their logits kept in `keep` (`rows_step`)."""
    policy, kv, first, L = runner.policy, chain.kv, chain.row, runner.L
    need = []
    for r in sorted(step.alive):
        st = step.live[r]
        if r in step.flow:  # the final segment ran wide: the positions it carried, then this token's
            out = step.flow[r]
            corrected = policy.on_final(r, st, kv, buffers.copy(runner.rt, out), place=runner.place)  # verify's
            if corrected is not None:
                step.tokens[r] = corrected
                continue
            buffers.put(runner.rt, view(chain.hops[-1])[r - first : r - first + 1], view(out)[0, -1:])
        else:
            assert not st.drafts, "drafts are pending states: their row runs wide"
        st.exit_layers.append(L)
        need.append(r)
    if not need:
        return
    picks = {r: step.picks[r] for r in need}
    if any(p is not None for p in picks.values()):  # sampled or teacher-forced: the logits, rows in order
        logits = chain._sample_head(runner.place, greedy=None in picks.values())
        for r, p in picks.items():
            if keep is not None and p is not None:  # picked by the caller, in row order with other rows'
                keep[r] = np.array(logits[r - first], copy=True)
                step.tokens[r] = -1
            else:  # greedy rows beside sampled ones: the same call's argmax
                step.tokens[r] = chain._picked(p, logits, r)
        return
    rows = np.array(need) - first
    chain._head(runner.place, slice(None) if len(need) == chain.rows else rows)
    step.tokens.update({r: int(chain.token[r - first]) for r in need})
