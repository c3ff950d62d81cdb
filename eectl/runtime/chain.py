"""Full-depth greedy decode as a chain of graph calls bound once: nothing is rebound or copied per token.

When no exit is active, a decode step is always the same calls on the same shapes: embed one id, every segment in
order, the final head's in-graph argmax. The chain binds them once per row and cache: each graph's output buffer
is the next graph's input (the hidden state never leaves its buffer between segments: on a GPU it stays on the
device), the KV buffers are bound as in `ArtifactRuntime.run_segment`, and the inputs that change per token (the
token id, `seqlens_k`, `total_sequence_length`) are small host arrays written in place. A step is then the graph
calls and two scalar writes, about what onnxruntime-genai's one-graph decode costs outside its kernels. A greedy
token comes from the artifact's certified head where it has one (runtime/certified_head.py), else the full head
(for several rows on the CPU EP, a session of it whose LM-head table ORT packed once: tables.PackedHeads).

Steps with active exits (runtime/chain_rows.py `rows_step`, one row or a batch) run the same calls; one row's exits have
their decisions bound after their segments (`_decision`): the exit graph reads the segment's output buffer, decides
inside the graph (exits.decision_nodes: the thresholds bound once as an input) and writes two scalars, whether the token
passes and its token; the first exit's candidates land in a buffer the later exits' local graphs read. A gated exit
(eectl.exits.gates) first tests its gate on the segment's output (H multiply-adds on the host buffer): shut, its
decision does not run, and the first exit whose gate opens picks the candidates (each (exit, picker) pair bound up
front). Where the exit graphs do not compute the run's signal (the full-vocabulary softmax and margin, the cosine,
artifacts exported before in-graph decisions), the host decides instead, the runner's exit test on the token's state,
its last layer's input and (for cosine-min) its segment's block boundaries, all in the chain's buffers. A token that
exits stops there; one that passes every exit reaches the final head as in `step`. A segment that holds pending
positions (defer's and verify's deferred states, P of them) runs a **wide** call instead: the same segment bound for P +
1 positions (bound once per segment and width, on first use), its input the pending states then the token's state, its
output what the next segment continues from (after that segment's own pending states, where it has some); the last
position is copied to where the exit after it, or the final head, reads (`_segment`). The policy keeps the wide output
at an exit, checks drafts in it at the final layer (verify), and its flushed positions are its no more, as the general
path's hooks do.

    token ─ embed ─ hops[0] ─ seg 0 ─ hops[1] ─ exit? ─ seg 1 ─ ...                    one position per call
    pending[s] ─┐
    hops[s] ────┴─ wide[s, P + 1] ─ out [1, P + 1, H] ─(last)→ hops[s + 1] ─ exit?      (and on to s + 1)

The full-depth step (`step`) binds its calls over the span of rows it decodes (one row, or the rows of a batch:
each at its own length, `seqlens_k` per row, as runtime/batch.py's batched calls do): one form for one row and a
batch alike, on the CPU EP and on a device.

Sampling (temperature > 0) runs the same calls: the step reads the final head's logits, or an exiting token's K
candidates and their logits, and each sampled row's pick (`pick`: its own setting, else the run's) picks, a greedy row
beside it taking the same head call's argmax; teacher forcing
(scoring a text token by token) is a pick that returns the fed token (runtime/chain_steps.py). A prompt (one row,
CPU) is a step whose positions before the last wait at segment 0 as embeddings, as drafts do; its wide calls are
bound for that step only (`_wide(..., keep=False)`).

A block exit head (runtime/blocks.py) runs after its segment on the segment's output (wide where the segment ran
wide: its own K/V advance with the segment's last layer's), and its output is what the exit reads (`exit_input`).

A batch's steps with exits or drafts (CPU): a chain over its rows with the run's exits beside one-row chains of its
slots (runtime/chain_rows.py). On a device (`device`) the pending states, wide calls' buffers and the states handed
to the policy are device memory, moved between calls by runtime/buffers.py (nothing passes through the host). What it
does not do: prompts padded into one call (chain_steps.py `padded_prompts` runs them, then the chain's head).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.errors import UsageError
from eectl.exits.signals import Signal
from eectl.runtime import buffers
from eectl.runtime.batch import _past
from eectl.runtime.certified_head import CertifiedHead
from eectl.runtime.chain_exits import bind_exit
from eectl.runtime.chain_parts import BlockCall, BoundExit, Pick, WideCall
from eectl.runtime.graph_decide import decides_in_graph
from eectl.runtime.kv import KVBuffers
from eectl.runtime.ort import Graph, _ort, buffer_shape
from eectl.runtime.placement import HOST, Placement, Read
from eectl.runtime.sessions import ArtifactRuntime


def chain_exits_supported(rt: ArtifactRuntime, exits: list[int], signal: Signal) -> bool:
    """Whether the chain's steps can run these active exits: a signal the exit graphs decide (graph_decide.py) or
    the host decides on the states the chain's calls output (the cosine over a segment's block boundaries where its
    graph outputs them)."""
    if not exits or decides_in_graph(rt, exits, signal):
        return True
    segments = {rt.segment_of_layer[e] for e in exits}
    return not signal.needs_blocks or all("layer_states" in rt.segments[s].io.outputs for s in segments)


class DecodeChain:
    """Greedy decode of `rows` rows of `kv` from `row` on, one position per step, its graph calls bound once: full
    depth for one row or the rows of a batch (`step`: one call per graph for all of them, each row at its own
    length), or with active exits (runtime/chain_rows.py steps them, on these bindings). On a device provider the hidden
    states stay in device buffers between the graphs; only the tokens are read on the host. Each step records what
    it read on the host in the run's placement (`place`, runtime/placement.py)."""

    def __init__(
        self,
        rt: ArtifactRuntime,
        kv: KVBuffers,
        row: int,
        exits: dict[int, dict[str, float]] | None = None,
        signal: Signal | None = None,
        top_k: int = 0,
        gates: dict[int, tuple[np.ndarray, float, float]] | None = None,
        rows: int = 1,
        certified_head: bool = True,
        device: bool | None = None,
    ) -> None:
        """`rows`: the span of rows bound (row .. row + rows - 1; with exits, several rows step through
        runtime/chain_rows.py, which decides them). `exits`: active exit layer -> its thresholds, decided by `signal`
        over `top_k` candidates (`chain_exits_supported`); none: full depth only (`step`). `gates`: exit layer -> its
        gate (eectl.exits.gates: weight, bias, threshold), tested on the exit's input state first. `certified_head`
        False: the full head every step (`_head`). Exits whose graphs do not decide `signal`: the host decides them
        (chain_rows.py). `device`: the states in device buffers (default: off the CPU EP; on it, its device
        memory is host memory: device-resident runs there, runtime/buffers.py)."""
        m = rt.manifest
        final = rt.full_graphs[m.num_layers]
        if "token" not in final.io.outputs:  # an artifact exported before the in-graph argmax
            raise UsageError("this artifact's final head has no token output", hint="re-export it")
        if rows < 1:
            raise UsageError(f"a bound chain spans at least one row, not {rows}")
        self.rt, self.kv, self.row, self.rows = rt, kv, row, rows
        self.device = rt.device != "cpu" if device is None else device
        H, dtype, n = m.dims["hidden_size"], rt.np_dtype, rows
        self.ids = np.zeros((n, 1), np.int64)  # host inputs, written in place before each step
        self.seqlens_k = np.zeros(n, np.int32)
        self.total = np.zeros((), np.int32)
        self.token = np.zeros(n, np.int64)  # the one output read on the host (recorded by each step: `_head`)
        self._token_read: Read = ("exit_full", m.num_layers, "token")
        self.calls: list[tuple[Any, Any]] = []  # (session, io binding), in call order
        self._keep: list[Any] = []  # every buffer bound by address must live as long as the bindings
        # one buffer per hop [n, 1, H]: embed -> segment 0 -> ... -> last segment -> final head (viewed as [n, H])
        hops = [self._buffer((n, 1, H), dtype) for _ in range(len(m.segments) + 1)]
        io = self._bind(rt.embedding)
        rt._bind_array(io, rt.embedding.name("input_ids"), self.ids)
        rt.bind_weights(io, rt.embedding, "embed")
        rt._bind_array(io, rt.embedding.name("hidden"), hops[0], output=True)
        layers = sorted(exits or {})
        self.exit_at = {rt.segment_of_layer[e]: e for e in layers}  # segment -> the active exit after it
        # segments whose exit reads their block boundaries (cosine-min, on the host): an output bound
        self._wants_blocks = set(self.exit_at) if signal is not None and signal.needs_blocks else set()
        # per segment: its last layer's input [n, 1, H] (the cosine's), its block boundaries [1, n + 1, H] or None
        self.layer_in: list[tuple[Any, Any]] = []
        self._layer_in: tuple[Any, Any] = (None, None)  # what the last segment call wrote them to
        for s in range(len(m.segments)):
            io = self._bind(rt.segments[s])
            self.layer_in.append(self._bind_segment(io, s, hops[s], hops[s + 1], self.seqlens_k, self.total))
        self.segment_calls, self.hops = self.calls[1:], hops  # (session, io) of segment s at index s; its buffers
        self.wide: dict[tuple[int, int], WideCall] = {}  # (segment, positions) -> its wide call, bound on first use
        self.spans: dict[tuple[int, int, int], Any] = {}  # chain_rows.py: (segment, first, last) -> a part's call
        self.blocks = self._bind_blocks(hops)  # segment -> its active exit's block head (runtime/blocks.py)
        self.in_graph = bool(layers) and signal is not None and decides_in_graph(rt, layers, signal)  # else: the host
        self.exits: dict[int, BoundExit] = {}  # segment -> the active exit after it (later ones on the first's picks)
        # exit layer -> the candidates [1, K] it picked and their exact LM-head rows [1, K, H] (None where its graph
        # does not output them): what the later exits score
        self.picked: dict[int, tuple[Any, Any]] = {}
        self.gates = {rt.segment_of_layer[e]: g for e, g in (gates or {}).items()}  # segment -> the gate after it
        self._decisions: dict[tuple[int, int | None], BoundExit] = {}  # (layer, picker) -> bound
        self._signal, self._thresholds, self._k = signal, exits or {}, top_k
        if self.in_graph and rows == 1:  # several rows: decided in chain_rows.py
            self._bind_decisions(layers)
        self._bind_final(hops, certified_head)

    def _bind_final(self, hops: list[Any], certified_head: bool) -> None:
        """The final head on the last hop [n, H]: its greedy token read on the host (`token`), its logits kept where
        the run samples, and the certified head beside it."""
        rt, m, n, dtype = self.rt, self.rt.manifest, self.rows, self.rt.np_dtype
        final, H = rt.full_graphs[m.num_layers], m.dims["hidden_size"]
        # several rows on the CPU EP: the head whose table ORT packed once (tables.PackedHeads), not per call
        packed = rt.packed_head(m.num_layers) if n > 1 else None
        io = self._bind(final, packed)
        rt._bind_array(io, final.name("hidden"), self._view(hops[-1], (n, H), dtype))
        if packed is None:
            rt.bind_weights(io, final)
        rt._bind_array(io, final.name("top_k"), self._host(np.ones(1, np.int64)))
        rt._bind_array(io, final.name("token"), self.token, output=True)
        V = m.dims["vocab_size"]  # the logits and a Top-1 land in scratch buffers (on the device where there is one)
        self.logits = self._buffer((n, V), dtype)  # read where the run samples (`step`'s `pick`)
        self._logits_read: Read = ("exit_full", m.num_layers, "logits")
        rt._bind_array(io, final.name("logits"), self.logits, output=True)
        rt._bind_array(io, final.name("candidates"), self._buffer((n, 1), np.int64), output=True)
        rt._bind_array(io, final.name("candidate_logits"), self._buffer((n, 1), dtype), output=True)
        # the certified head (runtime/certified_head.py), where the artifact has one and the run asks for it
        self.certified = CertifiedHead.bind(rt, self._view(hops[-1], (n, H), dtype), n) if certified_head else None

    def _bind_decisions(self, layers: list[int]) -> None:
        """Each exit's decision (later ones scoring the first's picks); gated, every (exit, picker) pair, bound now."""
        for i, layer in enumerate(layers):
            self.exits[self.rt.segment_of_layer[layer]] = self._decision(layer, layers[0] if i else None)
            for picker in [None, *layers[:i]] if self.gates else []:
                self._decision(layer, picker)

    def _bind_segment(
        self, io: Any, s: int, x: Any, out: Any, seqlens_k: np.ndarray, total: np.ndarray
    ) -> tuple[Any, Any]:
        """Bind segment s: the row's KV buffers as past and present (written in place), input x, output out
        [1, n, H], the length scalars; returns the buffers its last layer's input lands in (shaped as out) and, where
        its exit reads them, its block boundaries ([1, (layers + 1) * n, H]), else None."""
        rt, g = self.rt, self.rt.segments[s]
        lo, hi = rt.manifest.segments[s].layers
        rt.bind_kv(io, g, self.kv, range(lo, hi), self.row, self.row + self.rows)
        rt._bind_array(io, g.name("seqlens_k"), seqlens_k)
        rt._bind_array(io, g.name("total_sequence_length"), total)
        rt._bind_array(io, g.name("hidden"), x)
        rt._bind_array(io, g.name("hidden_out"), out, output=True)
        # the last layer's input: read by a host-decided cosine signal only, else scratch
        layer_in = self._buffer(buffer_shape(out), self.rt.np_dtype)
        rt._bind_array(io, g.name("layer_input"), layer_in, output=True)
        if s not in self._wants_blocks:
            return layer_in, None
        n, positions, H = buffer_shape(out)
        blocks = self._buffer((n, (hi - lo + 1) * positions, H), self.rt.np_dtype)
        rt._bind_array(io, g.name("layer_states"), blocks, output=True)
        return layer_in, blocks

    def _bind_blocks(self, hops: list[Any]) -> dict[int, BlockCall]:
        """The block exit head of each active exit that has one, bound after its segment: its input the segment's
        output (`hops[s + 1]`), its own K/V slot (as long as its segment's last layer, so the segment's length
        scalars), its output what the exit reads (`exit_input`)."""
        H, dtype = self.rt.manifest.dims["hidden_size"], self.rt.np_dtype
        out = {}
        for s, layer in self.exit_at.items():
            if layer in self.rt.block_graphs:
                x, o = hops[s + 1], self._buffer((self.rows, 1, H), dtype)
                out[s] = self._bind_block(layer, x, o, self.seqlens_k, self.total)
        return out

    def _bind_block(self, layer: int, x: Any, out: Any, seqlens_k: np.ndarray, total: np.ndarray) -> BlockCall:
        return BlockCall.bind(self.rt, self.kv, (self.row, self.row + self.rows), layer, x, out, (seqlens_k, total))

    def exit_input(self, s: int) -> Any:
        """The buffer [1, 1, H] the exit after segment s reads: its block head's output, else the segment's."""
        return self.blocks[s].out if s in self.blocks else self.hops[s + 1]

    def _wide(self, s: int, n: int, keep: bool = True) -> WideCall:
        """Segment s bound for n positions (the chain's kind of buffers), on first use; `keep` False: for this call
        only, its buffers held by the returned call alone (a prompt's width: prompts come in any length, and a chain
        stepping many of them would keep a binding per length)."""
        if (s, n) in self.wide:
            return self.wide[(s, n)]
        kept, self._keep = self._keep, self._keep if keep else []
        try:
            H, dtype = self.rt.manifest.dims["hidden_size"], self.rt.np_dtype
            x, out = self._buffer((1, n, H), dtype), self._buffer((1, n, H), dtype)
            seqlens_k, total = self._host(np.zeros(1, np.int32)), self._host(np.zeros((), np.int32))
            g = self.rt.segments[s]
            io = g.session.io_binding()
            layer_in, blocks = self._bind_segment(io, s, x, out, seqlens_k, total)
            block = None
            if s in self.blocks:  # its block head over the same positions
                layer = self.exit_at[s]
                block = self._bind_block(layer, out, self._buffer((1, n, H), dtype), seqlens_k, total)
            bound = WideCall(g.session, io, x, out, seqlens_k, total, layer_in, blocks, block, held=self._keep)
        finally:
            self._keep = kept
        if keep:
            self.wide[(s, n)] = bound
        return bound

    def _decision(self, layer: int, picker: int | None) -> BoundExit:
        """The decision at `layer` (bound once): picking candidates (`picker` None) or scoring those exit `picker`
        picked."""
        key = (layer, picker)
        if key not in self._decisions:
            assert self._signal is not None
            self._decisions[key] = bind_exit(self, layer, picker, self._signal, self._thresholds[layer], self._k)
        return self._decisions[key]

    def _bind(self, g: Graph, session: Any = None) -> Any:
        io = (session or g.session).io_binding()
        self.calls.append((session or g.session, io))
        return io

    def _host(self, arr: np.ndarray) -> np.ndarray:
        self._keep.append(arr)
        return arr

    def _buffer(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A buffer where the graphs run: host memory on the CPU, an OrtValue on the EP's device otherwise."""
        if not self.device:
            buf: Any = np.zeros(shape, dtype)
        else:
            buf = _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.rt.device, 0)
        self._keep.append(buf)
        return buf

    def _view(self, buf: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """The same memory under another shape (the last segment's [1, 1, H] output as the head's [1, H] input)."""
        if isinstance(buf, np.ndarray):
            return buf.reshape(shape)
        from eectl.runtime.ort import DeviceView

        return DeviceView(buf.device_name(), buf.data_ptr(), shape, np.dtype(dtype))

    def _feed(self, token: int, past: int) -> int:
        """Write the step's host inputs in place (the token at position `past`); return the new total length."""
        total = past + 1
        if total > self.kv.max_len:
            raise UsageError(f"the sequence reached {total} tokens, beyond the KV buffer of {self.kv.max_len}")
        self.ids[0, 0] = token
        self.seqlens_k[0] = past
        self.total[()] = total
        return total

    def _head(self, place: Placement, rows: Any = slice(None)) -> None:
        """The final head's greedy token for each row of the span, into `self.token`: the certified head's where the
        artifact has one and every row that needs a token (`rows`, positions in the span) passes; in a batch on host
        buffers, the rows it did not prove take the full head's argmax over those rows alone (`_missed`); else the
        full head's in-graph argmax over the span. What the step reads is recorded."""
        if self.certified is not None and self.certified.run(place, rows):
            self.token[:] = self.certified.token
            return
        if self.certified is not None and self.rows > 1 and isinstance(self.hops[-1], np.ndarray):
            self._missed(place, rows)
            return
        session, io = self.calls[-1]
        session.run_with_iobinding(io)
        place.read(self._token_read)

    def _missed(self, place: Placement, rows: Any) -> None:
        """A batch's tokens where the certified head did not prove some of `rows`: its own for the rows it proved, the
        full head's argmax for the others, over those rows alone (one row: the one-row head a row alone runs; several:
        the packed head over them). A miss is a few percent of rows, and the full head over 16 rows costs ~2.7x its one
        row (docs/results/2026-12-07-int4-batched-step.md): one miss no longer runs it over the whole batch."""
        certified, n = self.certified, self.rows
        assert certified is not None
        at = np.arange(n)[rows]
        missed = at[~certified.passed[at]]
        place.read(("head_certified", certified.layer, "token"))
        self.token[:] = certified.token
        hidden = self.hops[-1].reshape(n, -1)[missed]  # [k, H] copies of the rows it missed
        self.token[missed] = self.rt.greedy_token(certified.layer, hidden, place=place)

    def step(
        self, tokens: dict[int, int], *, place: Placement = HOST, pick: Pick | dict[int, Pick | None] | None = None
    ) -> dict[int, int]:
        """The full-depth decode step, for one row or the rows of a batch alike: feed each row's token (row -> token,
        rows of the span) at its own next position through every layer, all rows in one call per graph; return each
        one's greedy next token. Rows of the span not in `tokens` ride along on their next free position (written,
        never counted: the batched calls' scratch slot). Its host read (the tokens) is recorded in the run's `place`,
        as every step's here. `pick` (sampling): each row's token is picked from the final head's logits [V] instead,
        row by row in row order, and the logits are what the step reads; a mapping row -> pick gives each row its
        own, None for a greedy row (the full head's in-graph argmax, from the same call)."""
        kv, L, first = self.kv, self.rt.manifest.num_layers, self.row
        span = slice(first, first + self.rows)
        past = _past(kv, np.arange(span.start, span.stop), 0, L)
        active = np.zeros(kv.filled.shape[0], dtype=bool)
        active[list(tokens)] = True
        longest = int(past[active[span]].max()) + 1
        if longest > kv.max_len:
            raise UsageError(f"the sequence reached {longest} tokens, beyond the KV buffer of {kv.max_len}")
        self.ids[:, 0] = 0
        for r, t in tokens.items():
            self.ids[r - first, 0] = t
        self.seqlens_k[:] = past
        self.total[()] = int(past.max()) + 1
        for session, io in self.calls[:-1]:
            session.run_with_iobinding(io)
        picks = pick if isinstance(pick, dict) else dict.fromkeys(tokens, pick)
        if any(p is not None for p in picks.values()):
            logits = self._sample_head(place, greedy=any(picks.get(r) is None for r in tokens))
            kv.advance(active, 0, L)
            return {r: self._picked(picks.get(r), logits, r) for r in sorted(tokens)}
        rows = slice(None) if len(tokens) == self.rows else np.array(sorted(tokens)) - first  # rows needing a token
        self._head(place, rows)  # one read for every row of the span
        kv.advance(active, 0, L)
        return {r: int(self.token[r - first]) for r in tokens}

    def _picked(self, pick: Pick | None, logits: np.ndarray, r: int) -> int:
        """Row r's token after `_sample_head`: picked from its logits, or (no pick: a greedy row beside sampled ones)
        the full head's in-graph argmax the same call wrote (the certified head proves that same token)."""
        if pick is None:
            return int(self.token[r - self.row])
        return pick(logits[r - self.row], None)

    def _sample_head(self, place: Placement, greedy: bool = False) -> np.ndarray:
        """The final head run for sampling: its logits [rows, V] read on the host (a copy off a device); `greedy`: its
        in-graph argmax is read too (`token`: greedy rows beside sampled ones)."""
        self.calls[-1][0].run_with_iobinding(self.calls[-1][1])
        place.read(self._logits_read)
        if greedy:
            place.read(self._token_read)
        return self.logits if isinstance(self.logits, np.ndarray) else self.logits.numpy()

    def _segment(
        self, s: int, pend: np.ndarray | None, flow: np.ndarray | None, total: int, keep: bool = True
    ) -> np.ndarray | None:
        """Segment s of an exit step: its one-position call, or, with positions waiting here (`pend`) or arriving
        from a wide call before (`flow`), its wide call over them and the token's; returns the wide output (what the
        next segment continues from), else `flow` (None). The token's state is in `hops[s + 1]` either way."""
        kv, row = self.kv, self.row
        lo, hi = self.rt.manifest.segments[s].layers
        if pend is None and flow is None:
            parts = []  # one position: the chain's own call
        else:  # wide: the positions waiting here, then what arrives (the token's state, or the last wide output)
            parts = ([] if pend is None else [pend]) + [self.hops[s] if flow is None else flow]
        n = sum(buffer_shape(p)[1] for p in parts) if parts else 1  # positions this call appends
        if kv.span(row, lo, hi, n)[1] != total:
            raise RuntimeError(
                f"layers {lo}..{hi - 1} of row {row} hold {kv.filled[row, lo:hi]}: {n} positions arrive, to {total}"
            )
        if not parts:
            session, io = self.segment_calls[s]
            session.run_with_iobinding(io)
            self._layer_in = self.layer_in[s]
            if s in self.blocks:
                self.blocks[s].session.run_with_iobinding(self.blocks[s].io)
        else:
            wide = self._wide(s, n, keep)
            buffers.join_into(self.rt, parts, wide.x)
            wide.seqlens_k[0], wide.total[()] = total - 1, total
            wide.session.run_with_iobinding(wide.io)
            flow, self._layer_in = wide.out, (wide.layer_in, wide.blocks)
            # the token's state, where the exit and the next call read it
            buffers.put(self.rt, self.hops[s + 1], buffers.view(flow)[0, -1:])
            if wide.block is not None:  # the block head over every position; the token's where the exit reads
                wide.block.session.run_with_iobinding(wide.block.io)
                buffers.put(self.rt, self.blocks[s].out, buffers.view(wide.block.out)[0, -1:])
        kv.advance(row, lo, hi, n)
        if s in self.blocks:
            kv.advance(row, self.blocks[s].slot, self.blocks[s].slot + 1, n)
        return flow
